#!/usr/bin/env bash
# Build attnx in place with -O0 -g -fsanitize=address,undefined and run the
# test suite under it (or the tests given as arguments: .ci/run runs a
# subset). Python itself is not instrumented, so the ASan runtime
# is preloaded; leak checking is off because CPython keeps its arenas.
set -euo pipefail
cd "$(dirname "$0")/.."
ATTNX_DEBUG=1 python setup.py build_ext --inplace --force -q
export LD_PRELOAD="$(gcc -print-file-name=libasan.so):$(gcc -print-file-name=libubsan.so)"
# allocator_may_return_null: a huge request must fail as MemoryError, as
# it does without ASan, rather than abort
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# the tests given (pytest arguments: files, -k ...), or the whole suite
if [ $# -eq 0 ]; then set -- tests; fi
PYTHONPATH="$PWD" python -m pytest -q -p no:cacheprovider -x "$@"
