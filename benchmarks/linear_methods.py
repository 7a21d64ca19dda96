"""Causal linear attention by method, in one run: chunk vs recurrent vs
cumsum (median wall times, interleaved rounds), and the peak extra memory
of chunk vs cumsum, each measured in a fresh process; with --chunks, the
chunk method at those chunk sizes too (the fused float32 kernel runs at 16).

    python benchmarks/linear_methods.py [--n 8192] [--rounds 7] [--chunks 16,32,64]
"""
import argparse
import os
import subprocess
import sys

import numpy as np

import attnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Settings, measure  # noqa: E402

METHODS = ("chunk", "recurrent", "cumsum")

PEAK_PROBE = """
import numpy as np, attnx, sys
def hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1])
n, method = int(sys.argv[1]), sys.argv[2]
q, k, v = (np.random.default_rng(i).standard_normal((1, 8, n, 64), dtype=np.float32) for i in range(3))
out = np.empty_like(v)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak to the current resident set
before = hwm_kib()
attnx.linear_attention(q, k, v, causal=True, method=method, out=out)
print((hwm_kib() - before) / 1024)
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chunks", default="", help="chunk sizes to time as well, e.g. 16,32")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, args.n, 64), dtype=np.float32) for _ in range(3))
    calls = {m: (lambda m=m: attnx.linear_attention(q, k, v, causal=True, method=m)) for m in METHODS}
    for size in filter(None, args.chunks.split(",")):
        calls[f"chunk C={int(size)}"] = (lambda c=int(size): attnx.linear_attention(
            q, k, v, causal=True, method="chunk", chunk_size=c))
    stats, _, failures = measure(calls, Settings(min_rounds=args.rounds, max_rounds=args.rounds))
    if failures:
        raise SystemExit(f"failed: {failures}")
    print(f"causal elu linear attention, n = {args.n}, 8 heads, d = e = 64, float32, "
          f"{attnx.get_num_threads()} threads")
    print(f"{'method':11s} {'median ms':>10s} {'min ms':>8s} {'max ms':>8s} {'extra MiB':>10s}")
    for method in calls:
        peak = "-"
        if method in ("chunk", "cumsum"):
            probe = subprocess.run([sys.executable, "-c", PEAK_PROBE, str(args.n), method],
                                   capture_output=True, text=True, check=True)
            peak = f"{float(probe.stdout):.1f}"
        s = stats[method]
        print(f"{method:11s} {s.median * 1e3:10.2f} {s.min * 1e3:8.2f} {s.max * 1e3:8.2f} {peak:>10s}")


if __name__ == "__main__":
    main()
