"""One decoding step of causal linear attention, per call through the public
API: ``state.step(q, k, v)`` (in place, with and without ``out=``) and the
functional ``linear_attention(q, k, v, causal=True, initial_state=state,
return_state=True)``, one token of 32 heads of d = 64 (float32, elu
features), beside an empty Python call.

Each figure is the median of many calls timed one by one with
time.perf_counter_ns, in interleaved rounds (one round of every form, then
the next), so that a change in the machine's load hits every form alike;
the spread printed is the median of the rounds' medians and their range.
The targets: step < 3 us, functional < 6 us.

    python benchmarks/decode.py [--heads 32] [--d 64] [--calls 5000] [--rounds 7]
                                [--threads N] [--general-path] [--json FILE]

--general-path adds "step general" and "functional general": the same
calls with the float32 AVX-512 decoding kernels turned off (the general C
path every other shape takes), timed in the same rounds, for an A/B
comparison in one run.

Then "step after softmax": steps that each follow a two-thread
softmax_attention call (8 heads of 128 tokens), the step alone timed. A
run of steps splits its heads over attnx's own helper threads from its
17th step on; an OpenMP region in between sends them to sleep, so this
row shows what a step costs when decoding alternates with other
multi-threaded attnx calls (csrc/team.c).

"state read once" is the time the same threads take to read a buffer the
size of the state (S and z of every head), the fastest of 200 reads of it
(benchmarks/machine_peak.c), from the cache as the step finds its state:
the step's floor, and the ratio step / read its distance from it (target
under 2).

The machine line says how many cores other processes kept busy just before
the run (a shared machine inflates every figure).
"""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from run import busy_cores, cpu_model  # noqa: E402

import attnx  # noqa: E402

TARGETS_US = {"step": 3.0, "functional": 6.0}


def forms(heads, d, dtype, general_path=False):
    """name -> a zero-argument call making one decoding step."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, heads, 1, d)).astype(dtype) for _ in range(3))
    empty = q[..., :0, :]

    def fresh_state():
        return attnx.linear_attention(empty, empty, empty, causal=True, return_state=True)[1]

    stepping, stepping_out = fresh_state(), fresh_state()
    out = np.empty_like(q)
    carried = [fresh_state()]

    def functional():
        result, carried[0] = attnx.linear_attention(q, k, v, causal=True,
                                                    initial_state=carried[0], return_state=True)
        return result

    calls = {
        "step": lambda: stepping.step(q, k, v),
        "step out=": lambda: stepping_out.step(q, k, v, out),
        "functional": functional,
        "empty call": lambda: None,
    }
    if general_path:
        general = fresh_state()
        calls["step general"] = lambda: general.step(q, k, v)
        calls["functional general"] = functional
    return calls


def time_calls(call, calls, kernel=True):
    """The median time of one call, in ns, over `calls` calls timed one by
    one (kernel=False: the decoding family held to its plain C kernels)."""
    times = np.empty(calls, dtype=np.int64)
    clock = time.perf_counter_ns
    disabled = ",".join(attnx._C.build_info()["disabled_cpu_features"])
    before = attnx._C._set_dispatch(disabled, None if kernel else {"decode": "plain"})
    try:
        for i in range(calls):
            start = clock()
            call()
            times[i] = clock() - start
    finally:
        attnx._C._set_dispatch(*before)
    return float(np.median(times))


def step_after_softmax(heads, d, dtype, calls):
    """The median time of a step that follows a softmax_attention call of
    several threads, in us (the step alone timed)."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, heads, 1, d)).astype(dtype) for _ in range(3))
    x = rng.standard_normal((1, 8, 128, d)).astype(dtype)
    empty = q[..., :0, :]
    state = attnx.linear_attention(empty, empty, empty, causal=True, return_state=True)[1]
    times = np.empty(calls, dtype=np.int64)
    clock = time.perf_counter_ns
    for i in range(calls):
        attnx.softmax_attention(x, x, x)
        start = clock()
        state.step(q, k, v)
        times[i] = clock() - start
    return float(np.median(times[calls // 10:])) / 1000


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--calls", type=int, default=5000, help="calls timed per round and form")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="attnx threads (default: all)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--general-path", action="store_true",
                        help="also time the step and the functional call with the AVX-512 "
                        "decoding kernels turned off")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.threads:
        attnx.set_num_threads(args.threads)
    busy = busy_cores()
    print("machine: %s, %d cores, %s cores busy with other work, load average %.2f | "
          "attnx threads %d | %d heads, d = %d, %s" % (
              cpu_model(), os.cpu_count(), "?" if busy is None else "%.2f" % busy,
              os.getloadavg()[0], attnx.get_num_threads(), args.heads, args.d, args.dtype))
    calls = forms(args.heads, args.d, np.dtype(args.dtype), args.general_path)
    for name, call in calls.items():  # warm up: states allocated, caches and threads hot
        time_calls(call, 1000, kernel=not name.endswith(" general"))
    rounds = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            rounds[name].append(time_calls(call, args.calls, kernel=not name.endswith(" general")) / 1000)
    results = {}
    for name, medians in rounds.items():
        results[name] = {"median_us": float(np.median(medians)), "min_us": min(medians),
                         "max_us": max(medians)}
        target = TARGETS_US.get(name)
        verdict = ("" if target is None else
                   "  %s (target < %g us)" % ("PASS" if results[name]["median_us"] < target
                                              else "MISS", target))
        print("%-18s %7.2f us  (rounds %.2f .. %.2f)%s" % (
            name, results[name]["median_us"], min(medians), max(medians), verdict))
    # the state's one read, the step's floor: S (d x d) and z (d) per head
    state_bytes = args.heads * (args.d * args.d + args.d) * np.dtype(args.dtype).itemsize
    read = harness.read_seconds(attnx.get_num_threads(), state_bytes)
    if read is not None:
        step = results["step"]["median_us"]
        results["state read once"] = {"median_us": read * 1e6, "min_us": read * 1e6,
                                      "max_us": read * 1e6}
        print("%-18s %7.2f us  (%d KiB, fastest of 200 reads; step / read %.2f, target < 2)" % (
            "state read once", read * 1e6, state_bytes >> 10, step / (read * 1e6)))
    after = [step_after_softmax(args.heads, args.d, np.dtype(args.dtype), args.calls // 4)
             for _ in range(3)]
    results["step after softmax"] = {"median_us": float(np.median(after)), "min_us": min(after),
                                     "max_us": max(after)}
    print("%-18s %7.2f us  (runs %.2f .. %.2f)" % ("step after softmax", np.median(after),
                                                  min(after), max(after)))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"heads": args.heads, "d": args.d, "dtype": args.dtype,
                       "threads": attnx.get_num_threads(), "busy_cores_at_start": busy,
                       "results": results}, file, indent=1)


if __name__ == "__main__":
    main()
