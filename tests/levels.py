"""Run the suite's representative subset once per CPU level this machine can
force, each in a new process with ATTNX_DISABLE_CPU_FEATURES set (the
tables are filled at import, csrc/dispatch.c), so that every family takes
the kernels an AVX2-only, a plain or an AMX machine would take:

    python tests/levels.py [--list] [extra pytest arguments]

The in-process fixtures of tests/conftest.py already run the family tests
on every kernel set; this also runs the tests without a fixture (most of the
linear family's) on each level. A level is run only where its choice
differs from the level below (e.g. no AMX level on a CPU without AMX)."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# level: the features left out, best level first
LEVELS = {
    "amx": "",
    "avx512": "AMX",
    "avx2": "AMX,AVX512F",
    "plain": "AMX,AVX512F,AVX2,FMA3",
}

# a test of every family, about a minute per level on 2 shared cores
SUBSET = [
    ["test_softmax.py", "-k", "matches_reference or fully_masked or window_causal_mask"],
    ["test_softmax_decode.py", "-k", "matches_reference or grouped or same_result or nan"],
    ["test_softmax_grad.py", "-k", "every_backend or dropout_gradients"],
    ["test_bf16_dot.py", "-k", "not torch"],
    ["test_linear_smoke.py"],
    ["test_linear_decode.py"],
    ["test_linear_grad.py", "-k", "not interrupt and not ctrl_c"],
    ["test_lsh.py", "-k", "equals_the_reference or threads_do_not_change"],
    ["test_delta.py", "-k", "matches_reference or chunk_equals_recurrent or gradients"],
    ["test_torch_bf16.py", "-k", "narrow"],
]


def choices(disabled):
    """{family: kernel set} a new process chooses with `disabled` left out."""
    env = dict(os.environ, ATTNX_DISABLE_CPU_FEATURES=disabled)
    code = "import json, attnx; print(json.dumps(attnx.cpu_dispatch()))"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(run.stdout)


def levels_here():
    """[(level, disabled, choices)] of the levels whose choices differ from
    the level below's (where they are the same, this CPU lacks the level:
    the one below is run)."""
    found = []
    for level, disabled in reversed(LEVELS.items()):
        chosen = choices(disabled)
        if not found or chosen != found[-1][2]:
            found.append((level, disabled, chosen))
    return found[::-1]


def main(argv):
    listing = "--list" in argv
    extra = [arg for arg in argv if arg != "--list"]
    failed = []
    for level, disabled, chosen in levels_here():
        print(f"== level {level}: ATTNX_DISABLE_CPU_FEATURES={disabled or '(empty)'}: "
              + ", ".join(f"{family} {kernels}" for family, kernels in chosen.items()), flush=True)
        if listing:
            continue
        env = dict(os.environ, ATTNX_DISABLE_CPU_FEATURES=disabled)
        for part in SUBSET:
            args = [os.path.join(HERE, part[0])] + part[1:]
            run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  *args, *extra], env=env)
            if run.returncode != 0:
                failed.append(f"{level}: {' '.join(part)}")
    if failed:
        print("failed:\n  " + "\n  ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
