"""Block-sparse attention with about 10% of its blocks active beside dense
softmax attention, in one run (median wall times of interleaved rounds);
the number of softmax calls each layout takes, and the Python time
block_sparse_attention adds per call.

    python benchmarks/block_sparse.py [--n 4096,8192] [--block-size 128] [--rounds 5] [--out DIR]

Writes DIR/block_sparse.json and DIR/block_sparse.png (time against n for
each layout beside dense; default DIR benchmarks/results).

Layouts at block size bs (nb = n / bs blocks per side):
* random: each query block sees its own key block and round(0.1 nb) - 1
  others drawn at random (a different set per row: keys gathered);
* local: attnx.layouts.local(nb, w) with w chosen for ~10% (a band: keys
  read in place);
* bigbird: attnx.layouts.bigbird(nb, w, 1, r) for ~10%.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

import attnx
from attnx import _systems

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Settings, measure  # noqa: E402


def random_layout(nb, rng, density=0.1):
    per_row = max(1, round(density * nb))
    layout = np.eye(nb, dtype=bool)
    for row in range(nb):
        others = np.delete(np.arange(nb), row)
        layout[row, rng.choice(others, per_row - 1, replace=False)] = True
    return layout


def layouts_for(nb, rng):
    window = max(0, round(0.1 * nb - 1) // 2)
    random_blocks = max(0, round(0.1 * nb) - 4)  # beside 3 window blocks and 1 global
    return {
        "random": random_layout(nb, rng),
        "local": attnx.layouts.local(nb, window),
        "bigbird": attnx.layouts.bigbird(nb, 1, 1, random_blocks, seed=0),
    }


def softmax_calls(layout, block_size, n, lead, d):
    """How many softmax calls block_sparse_attention makes for this layout."""
    plan = _systems._BlockPlan(layout, block_size, lead, n, n, False, None)
    bytes_per_key = int(np.prod(lead)) * 2 * d * 4
    return sum(1 for _, layout2d in plan.slices() for _, columns, _ in plan.groups(layout2d, bytes_per_key)
               if columns is not None)


def overhead_per_call_us(repeats=200):
    """What block_sparse_attention adds to one softmax call: both timed on
    one block of 16 tokens (d = 8), where the kernel's own work is tiny."""
    q, k, v = (np.random.default_rng(i).standard_normal((16, 8)) for i in range(3))
    layout = np.ones((1, 1), dtype=bool)
    times = {}
    for name, call in (("block_sparse", lambda: attnx.block_sparse_attention(q, k, v, layout, 16)),
                       ("softmax", lambda: attnx.softmax_attention(q, k, v))):
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
        times[name] = float(np.median(samples))
    return (times["block_sparse"] - times["softmax"]) * 1e6, times["softmax"] * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="4096,8192")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="directory for block_sparse.json and block_sparse.png")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = []
    print(f"float32, batch 1, {args.heads} heads, d = e = {args.d}, block size {args.block_size}, "
          f"{attnx.get_num_threads()} threads; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'n':>6s} {'layout':8s} {'active':>7s} {'calls':>6s} {'median ms':>10s} {'dense ms':>9s} {'ratio':>6s}")
    for n in map(int, args.n.split(",")):
        q, k, v = (rng.standard_normal((1, args.heads, n, args.d), dtype=np.float32) for _ in range(3))
        nb = -(-n // args.block_size)
        layouts = layouts_for(nb, rng)
        calls = {"dense": lambda: attnx.softmax_attention(q, k, v)}
        for name, layout in layouts.items():
            calls[name] = (lambda layout=layout: attnx.block_sparse_attention(q, k, v, layout, args.block_size))
        stats, first, failures = measure(calls, Settings(min_rounds=args.rounds, max_rounds=args.rounds))
        if failures:
            raise SystemExit(f"failed: {failures}")
        dense = stats["dense"].median
        for name, layout in layouts.items():
            s = stats[name]
            calls_made = softmax_calls(layout, args.block_size, n, (1, args.heads), args.d)
            print(f"{n:6d} {name:8s} {layout.mean():7.1%} {calls_made:6d} {s.median * 1e3:10.1f} "
                  f"{dense * 1e3:9.1f} {s.median / dense:6.3f}")
            results.append(dict(n=n, layout=name, active=float(layout.mean()), softmax_calls=calls_made,
                                median_s=s.median,
                                dense_median_s=dense, ratio=s.median / dense,
                                samples_s=s.samples, dense_samples_s=stats["dense"].samples))
    overhead, softmax_us = overhead_per_call_us()
    print(f"Python time block_sparse_attention adds per softmax call: {overhead:.1f} us "
          f"(a 16 x 16 softmax call alone: {softmax_us:.1f} us)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "block_sparse.json"), "w") as f:
        json.dump(dict(block_size=args.block_size, heads=args.heads, d=args.d, threads=attnx.get_num_threads(),
                       load_average=os.getloadavg()[0], results=results, overhead_per_call_us=overhead), f, indent=1)
    plot(results, os.path.join(args.out, "block_sparse.png"), args)


def plot(results, path, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (times, ratios) = plt.subplots(1, 2, figsize=(10, 4))
    sizes = sorted({r["n"] for r in results})
    dense = [next(r["dense_median_s"] for r in results if r["n"] == n) * 1e3 for n in sizes]
    times.plot(sizes, dense, "k-o", label="dense softmax")
    for name in dict.fromkeys(r["layout"] for r in results):
        rows = [r for r in results if r["layout"] == name]
        times.plot([r["n"] for r in rows], [r["median_s"] * 1e3 for r in rows], "-o", label=f"block-sparse {name}")
        ratios.plot([r["n"] for r in rows], [r["ratio"] for r in rows], "-o", label=name)
    times.set(xscale="log", yscale="log", xlabel="n", ylabel="median ms", title="time")
    ratios.axhline(0.15, color="grey", linestyle=":", label="0.15")
    ratios.set(xscale="log", xlabel="n", ylabel="block-sparse / dense", title="ratio to dense (same rounds)")
    for axes in (times, ratios):
        axes.legend(fontsize=8)
    figure.suptitle(f"float32, {args.heads} heads, d = {args.d}, block size {args.block_size}, "
                    f"{attnx.get_num_threads()} threads")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"wrote {path} and block_sparse.json")


if __name__ == "__main__":
    main()
