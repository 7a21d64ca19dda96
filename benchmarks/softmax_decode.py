"""Softmax attention decoding: one query row per head against a long KV cache
(csrc/softmax_decode.c), attnx beside torch's scaled_dot_product_attention.

    python benchmarks/softmax_decode.py [--quick] [--dtypes float32,bfloat16,float16] [--json FILE]

Cases: 8 heads, 1 query, 4096 keys, d = 64; one head, 32768 keys,
d = 128, on one thread and on two; grouped-query attention, 32 query heads
over 8 kv heads, 8192 keys, d = 128. Competitors: attnx.softmax_attention
on numpy arrays (GQA as q (1, 8, 4, 1, d) against k, v (1, 8, 1, m, d)),
attnx.torch.scaled_dot_product_attention and torch's own (enable_gqa=True
for GQA, q (1, 32, 1, d), k, v (1, 8, m, d)), timed interleaved
(harness.py), one call per sample. Each case runs in float32, and in
bfloat16 and float16 (a model run in half precision: its KV cache of that
type) for the two torch front ends (numpy has no bfloat16). Each figure is the fastest call (on a
shared machine other work only slows a call). The rate is the bytes of K and V read per second
(each read once), beside the read bandwidth of memory measured in the same
run on the same threads (harness.machine_peak); a cache smaller than the
last-level cache is read from it, and may pass that bandwidth.

The targets (docs/performance.md): attnx at least 1.5x torch on each case,
two threads at least 1.7x one on the single head, GQA at least 60% of the
read bandwidth. The load average at the start is printed: the machine may
be shared.
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attnx  # noqa: E402
import attnx.torch as at  # noqa: E402
import harness  # noqa: E402

# name, query heads per kv head, kv heads, keys, d, threads
CASES = [("(1, 8, 1, 4096, 64)", 1, 8, 4096, 64, 2),
         ("(1, 1, 1, 32768, 128) 1 thread", 1, 1, 32768, 128, 1),
         ("(1, 1, 1, 32768, 128) 2 threads", 1, 1, 32768, 128, 2),
         ("GQA (1, 32/8, 1, 8192, 128)", 4, 8, 8192, 128, 2)]


def calls(group, kv_heads, m, d, dtype, seed=0):
    """The competitors (their results as float32 numpy arrays) and the
    bytes of K and V"""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, kv_heads, group, 1, d), dtype=np.float32)
    k = rng.standard_normal((1, kv_heads, 1, m, d), dtype=np.float32)
    v = rng.standard_normal((1, kv_heads, 1, m, d), dtype=np.float32)
    tq = torch.from_numpy(q).reshape(1, kv_heads * group, 1, d).to(dtype)
    tk, tv = (torch.from_numpy(x).reshape(1, kv_heads, m, d).to(dtype) for x in (k, v))
    gqa = group > 1
    competitors = {
        "attnx.torch": lambda: at.scaled_dot_product_attention(tq, tk, tv,
                                                               enable_gqa=gqa).float().numpy(),
        "torch": lambda: F.scaled_dot_product_attention(tq, tk, tv,
                                                        enable_gqa=gqa).float().numpy()}
    if dtype == torch.float32:
        competitors["attnx"] = lambda: attnx.softmax_attention(q, k, v).reshape(1, -1, 1, d)
    return competitors, tk.nbytes + tv.nbytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--dtypes", default="float32,bfloat16,float16",
                        help="comma-separated: float32, bfloat16, float16")
    parser.add_argument("--json", help="write the figures there")
    args = parser.parse_args()
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    # a sample is one call (after an untimed one): the fastest of many
    # single calls, the figure least touched by other work on the machine
    single = dict(min_sample_s=0.0, pause_s=0.02)
    settings = (harness.Settings(min_rounds=20, max_rounds=60, budget_s=3.0, **single)
                if args.quick else
                harness.Settings(min_rounds=50, max_rounds=200, budget_s=10.0, **single))
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; "
          f"attnx softmax_forward {attnx.cpu_dispatch()['softmax_forward']}; torch {torch.__version__}")
    peaks = {}
    for threads in sorted({case[-1] for case in CASES}):
        peaks[threads] = harness.machine_peak(threads)
        if peaks[threads]:
            print(peaks[threads].describe())
    print(f"{'case':<44} {'attnx us':>9} {'a.torch us':>10} {'torch us':>9} {'torch/attnx':>11} "
          f"{'torch/a.torch':>13} {'attnx GB/s':>10} {'%read bw':>8} {'torch GB/s':>10}")
    records = []
    for dtype in dtypes:
        for name, group, kv_heads, m, d, threads in CASES:
            if dtype != torch.float32:
                name = f"{name} {str(dtype).split('.')[-1]}"
            attnx.set_num_threads(threads)
            torch.set_num_threads(threads)
            competitors, cache_bytes = calls(group, kv_heads, m, d, dtype)
            stats, results, failures = harness.measure(competitors, settings)
            if failures:
                print(f"{name:<44} failed: {failures}")
                continue
            # float32: to rounding; half precision: each result rounded once
            # to its type, from sums in float32 (attnx) or however torch sums
            tolerance = (dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32
                         else dict(rtol=2e-2, atol=2e-2))
            np.testing.assert_allclose(results["attnx.torch"], results["torch"], **tolerance)
            best = {key: stats[key].min for key in stats}
            # the figures of the numpy front end, or where it has none (half
            # precision) of attnx.torch
            ours = best.get("attnx", best["attnx.torch"])
            if "attnx" in results:
                np.testing.assert_allclose(results["attnx"], results["torch"], **tolerance)
            rate = cache_bytes / ours
            peak = peaks[threads]
            share = f"{100 * peak.read_fraction(rate):7.0f}%" if peak else f"{'-':>8}"
            numpy_figures = (f"{best['attnx'] * 1e6:9.0f}" if "attnx" in best else f"{'-':>9}",
                             f"{best['torch'] / best['attnx']:11.2f}" if "attnx" in best
                             else f"{'-':>11}")
            print(f"{name:<44} {numpy_figures[0]} {best['attnx.torch'] * 1e6:10.0f} "
                  f"{best['torch'] * 1e6:9.0f} {numpy_figures[1]} "
                  f"{best['torch'] / best['attnx.torch']:13.2f} {rate / 1e9:10.1f} {share} "
                  f"{cache_bytes / best['torch'] / 1e9:10.1f}", flush=True)
            records.append({"case": name, "dtype": str(dtype), "threads": threads,
                            "kv_bytes": cache_bytes, "fastest_s": best,
                            "attnx_read_fraction": peak.read_fraction(rate) if peak else None})
    single = {r["threads"]: r["fastest_s"]["attnx"] for r in records
              if "32768" in r["case"] and "attnx" in r["fastest_s"]}
    if len(single) == 2:
        print(f"single head, 2 threads against 1: {single[1] / single[2]:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": os.getloadavg()[0], "cases": records,
                       "machine_peak": {t: p.__dict__ for t, p in peaks.items() if p}}, f,
                      indent=1)


if __name__ == "__main__":
    main()
