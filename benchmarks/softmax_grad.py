"""Softmax attention forward + backward: attnx beside torch's CPU
scaled_dot_product_attention under autograd, in the same interleaved rounds
(harness.py), with a 2048^3 float32 gemm (numpy's OpenBLAS) as the FLOP
ceiling and the machine's float32 multiply-add peak measured in the same
run (harness.machine_peak); then the extra memory of the backward against n.

    python benchmarks/softmax_grad.py             # (1, 8, n, 64) n = 1024..8192, d = 128 at 2048
    python benchmarks/softmax_grad.py --quick     # n = 1024, 2048 only, fewer rounds
    python benchmarks/softmax_grad.py --out DIR   # JSON and PNG there (default benchmarks/results/)

attnx's figure is the public calls a training step makes:
softmax_attention(..., return_lse=True) then softmax_attention_backward.
torch's is scaled_dot_product_attention(...) then .backward(dout), the
gradients of q, k, v both ways. FLOPs counted: forward 2 products and
backward 5, of 2 n m d each over the visible pairs (causal: about half).
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import Settings, machine_peak, measure  # noqa: E402

PEAK_PROBE = """
import sys, numpy as np, attnx
n, d = int(sys.argv[1]), int(sys.argv[2])
rng = np.random.default_rng(0)
q, k, v, dout = (rng.standard_normal((1, 8, n, d), dtype=np.float32) for _ in range(4))
out, lse = attnx.softmax_attention(q, k, v, return_lse=True)
attnx.softmax_attention_backward(dout[:, :, :64], q[:, :, :64], k[:, :, :64], v[:, :, :64],
                                 out[:, :, :64], lse[:, :, :64])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
before = status("VmRSS")
g = attnx.softmax_attention_backward(dout, q, k, v, out, lse)
print(status("VmHWM") - before)
"""


def cases(quick):
    shapes = [(1024, 64), (2048, 64)] if quick else [(1024, 64), (2048, 64), (4096, 64),
                                                     (8192, 64), (2048, 128)]
    return [(n, d, causal) for n, d in shapes for causal in (False, True)]


def visible_pairs(n, causal):
    return n * (n + 1) // 2 if causal else n * n


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    import attnx
    import torch

    attnx.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    settings = Settings(min_rounds=3, max_rounds=5 if args.quick else 7,
                        budget_s=10 if args.quick else 30)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2048, 2048), dtype=np.float32)
    results = []
    print(f"softmax attention forward + backward, 8 heads, float32, {args.threads} threads; "
          f"{attnx._C.build_info()['simd']}; torch {torch.__version__}")
    peak = machine_peak(args.threads)
    if peak is not None:
        print(peak.describe())
    print(f"{'case':26s} {'attnx ms':>9s} {'torch ms':>9s} {'ratio':>6s} "
          f"{'attnx GF/s':>10s} {'%gemm':>6s} {'attnx %peak':>11s} {'torch %peak':>11s}")
    for n, d, causal in cases(args.quick):
        q, k, v, dout = (rng.standard_normal((1, 8, n, d), dtype=np.float32) for _ in range(4))
        tq, tk, tv = (torch.from_numpy(x).requires_grad_(True) for x in (q, k, v))
        tdout = torch.from_numpy(dout)

        def attnx_step():
            out, lse = attnx.softmax_attention(q, k, v, causal=causal, return_lse=True)
            return attnx.softmax_attention_backward(dout, q, k, v, out, lse, causal=causal)

        def torch_step():
            for x in (tq, tk, tv):
                x.grad = None
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal).backward(tdout)
            return tq.grad

        calls = {"attnx": attnx_step, "torch": torch_step, "gemm": lambda: a @ a}
        stats, first, failures = measure(calls, settings)
        if failures:
            raise SystemExit(f"failed: {failures}")
        np.testing.assert_allclose(first["attnx"].q, first["torch"].numpy(), rtol=1e-3,
                                   atol=1e-3 * float(np.abs(first["attnx"].q).max()))
        flops = 7 * 2 * 8 * visible_pairs(n, causal) * d
        gemm_rate = 2 * 2048**3 / stats["gemm"].median
        rate = flops / stats["attnx"].median
        ratio = stats["torch"].median / stats["attnx"].median
        label = f"(1,8,{n},{d}) {'causal' if causal else 'full'}"
        # the fastest call of each against the peak (interference only slows a call)
        fractions = [f"{100 * peak.flops_fraction(flops / stats[name].min):10.0f}%" if peak
                     else f"{'-':>11s}" for name in ("attnx", "torch")]
        print(f"{label:26s} {stats['attnx'].median * 1e3:9.1f} {stats['torch'].median * 1e3:9.1f} "
              f"{ratio:5.2f}x {rate / 1e9:10.0f} {100 * rate / gemm_rate:5.0f}% "
              f"{fractions[0]} {fractions[1]}", flush=True)
        results.append({"n": n, "d": d, "causal": causal, "attnx": stats["attnx"].as_dict(),
                        "torch": stats["torch"].as_dict(), "gemm": stats["gemm"].as_dict(),
                        "ratio": ratio, "attnx_flops": flops,
                        "attnx_peak_fraction": peak.flops_fraction(flops / stats["attnx"].min)
                        if peak else None,
                        "torch_peak_fraction": peak.flops_fraction(flops / stats["torch"].min)
                        if peak else None})

    memory = []
    for n in ([2048] if args.quick else [2048, 4096, 8192]):
        probe = subprocess.run([sys.executable, "-c", PEAK_PROBE, str(n), "64"], check=True,
                               capture_output=True, text=True)
        extra = int(probe.stdout.split()[-1])
        one_input = 8 * n * 64 * 4
        memory.append({"n": n, "extra_bytes": extra, "inputs": extra / one_input})
        print(f"backward extra memory, (1,8,{n},64): {extra / 2**20:.1f} MiB "
              f"= {extra / one_input:.1f} inputs' size (its gradients dq, dk, dv are 3)")

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "softmax_grad.json"), "w") as f:
        json.dump({"threads": args.threads, "cases": results, "memory": memory,
                   "machine_peak": peak.__dict__ if peak else None}, f, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for causal in (False, True):
        rows = [r for r in results if r["causal"] == causal and r["d"] == 64]
        ns = [r["n"] for r in rows]
        for name, style in (("attnx", "-o"), ("torch", "--s")):
            ax.plot(ns, [r[name]["median_s"] * 1e3 for r in rows], style,
                    label=f"{name} {'causal' if causal else 'full'}")
    ax.set(xscale="log", yscale="log", xlabel="n", ylabel="forward + backward, ms",
           title="softmax attention (1, 8, n, 64) float32")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "softmax_grad.png"), dpi=100)
    print(f"wrote {args.out}/softmax_grad.json and softmax_grad.png")


if __name__ == "__main__":
    main()
