"""Peak extra resident memory of one call, each in a fresh process.

    python benchmarks/memory.py --case softmax-full-f32-b1-n8192 --impl attnx

prints one JSON line. The probe allocates the inputs, warms the library up on
a small shape of the same case (thread pools, BLAS buffers: costs that do not
depend on n), resets the kernel's peak-RSS counter (/proc/self/clear_refs,
"5"), makes the one measured call, and reports the peak resident set (VmHWM)
minus the resident set just before the call. VmHWM is used rather than
getrusage's ru_maxrss because ru_maxrss cannot be reset and, in a process
started by vfork+exec, may include the parent's peak; ru_maxrss is the
fallback where /proc is unavailable. Only the library under test is imported.
"""
import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys

import cases

HERE = os.path.dirname(os.path.abspath(__file__))
WARM_UP_N = 256


def probes(quick):
    """(case, implementation) pairs to measure."""
    softmax_sizes = (4096, 8192) if quick else (8192, 16384)
    softmax_impls = ("attnx", "torch-sdpa") if quick else ("attnx", "torch-sdpa", "numpy")
    pairs = [(cases.Case("softmax", n), impl) for n in softmax_sizes for impl in softmax_impls]
    linear_impls = (("attnx", "attnx-cumsum", "torch-cumsum") if quick else
                    ("attnx", "attnx-cumsum", "torch-cumsum", "torch-chunked", "torch-chunked-par",
                     "numpy-chunked"))
    pairs += [(cases.Case("linear", 8192, causal=True), impl) for impl in linear_impls]
    pairs.append((cases.Case("linear", 65536, causal=True), "attnx"))
    return pairs


def known_cases():
    return {case.key: case for quick in (True, False) for case, _ in probes(quick)}


# ------------------------------------------------------------ in the child

def proc_status_bytes(field):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak():
    """Reset VmHWM to the current RSS; False when the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def load_library(impl, threads):
    if impl.startswith("attnx"):
        attnx = cases.load_attnx()
        attnx.set_num_threads(threads)
        return attnx
    if impl.startswith("torch"):
        import peers
        peers.torch_module().set_num_threads(threads)
    return None


def measure_in_this_process(case, impl, threads):
    attnx = load_library(impl, threads)
    small = dataclasses.replace(case, n=WARM_UP_N)
    cases.build_call(small, cases.make_inputs(small), impl, attnx)()
    inputs = cases.make_inputs(case)
    call = cases.build_call(case, inputs, impl, attnx)
    if reset_peak():
        before, method = proc_status_bytes("VmRSS"), "VmHWM"
        out = call()
        peak = proc_status_bytes("VmHWM")
    else:
        before, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "ru_maxrss"
        out = call()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    output_bytes = case.heads_total * case.n * case.d * case.itemsize
    return {"case": case.key, "impl": impl, "n": case.n, "extra_bytes": peak - before,
            "output_bytes": output_bytes, "method": method, "result_shape": list(out.shape)}


# ------------------------------------------------------------ in the parent

def run_probe(case, impl, threads, timeout_s=600):
    """Measure one (case, impl) in a fresh interpreter; returns its dict, or
    one with an "error" entry."""
    command = [sys.executable, os.path.join(HERE, "memory.py"), "--case", case.key,
               "--impl", impl, "--threads", str(threads)]
    skipped = cases.skip_reason(case, impl)
    if skipped:
        return {"case": case.key, "impl": impl, "n": case.n, "skipped": skipped}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"case": case.key, "impl": impl, "n": case.n, "error": "timed out"}
    if done.returncode != 0:
        last_line = (done.stderr.strip().splitlines() or ["exit %d" % done.returncode])[-1]
        return {"case": case.key, "impl": impl, "n": case.n, "error": last_line}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", required=True, help="case key, e.g. softmax-full-f32-b1-n8192")
    parser.add_argument("--impl", required=True, help="competitor name, e.g. attnx, torch-sdpa")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    known = known_cases()
    if args.case not in known:
        parser.error("unknown case %r; known: %s" % (args.case, ", ".join(sorted(known))))
    print(json.dumps(measure_in_this_process(known[args.case], args.impl, args.threads)))


if __name__ == "__main__":
    main()
