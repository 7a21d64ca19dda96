"""attnx.torch forward + backward against torch's own
F.scaled_dot_product_attention forward + backward, on CPU tensors.

    python benchmarks/torch_ops.py            # every case
    python benchmarks/torch_ops.py --quick    # fewer rounds, smaller budget

Cases: (1, 8, n, 64) for n = 1024, 2048, 4096 (no mask, and causal), and a
padded encoder batch (4, 12, 256, 32) whose padding mask is given as
transformers gives it (the (B, n) padding expanded to (B, 1, n, n) with
stride 0), in float32 and bfloat16 (attnx computes bfloat16 in float32,
converting each tensor once in C). One call is q, k, v -> out, then the
gradients of sum(dout * out) by torch.autograd.grad. Competitors are timed
interleaved (benchmarks/harness.py); the fastest call of each (on a shared
machine interference only slows a call) and their ratio torch / attnx
(above 1: attnx is faster) are printed, and each one's FLOP rate as a
fraction of the machine's float32 multiply-add peak measured at the start
of the run (harness.machine_peak; FLOPs counted: 7 products of 2 d FLOPs
per visible query-key pair, forward 2 and backward 5). Both use the
machine's threads (attnx's OpenMP pool, torch's intra-op pool) unless
--threads sets both. On a machine shared with other work, every parallel
region waits for its slowest thread; --threads 1 measures without that.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attnx  # noqa: E402
import attnx.torch as at  # noqa: E402
import harness  # noqa: E402


def cases():
    for n in (1024, 2048, 4096):
        for causal in (False, True):
            yield f"(1, 8, {n}, 64){' causal' if causal else ''}", (1, 8, n, 64), causal, None
    lengths = (256, 200, 128, 64)
    yield "padded encoder (4, 12, 256, 32)", (4, 12, 256, 32), False, lengths


def inputs(shape, lengths, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, H, n, d = shape
    q, k, v = (torch.randn(shape, generator=g).to(dtype).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, generator=g).to(dtype)
    mask = None
    if lengths is not None:
        padding = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]
        mask = padding[:, None, None, :].expand(B, 1, n, n)
    return q, k, v, dout, mask


def fwd_bwd_flops(shape, causal, lengths):
    """7 products (forward 2, backward 5) of 2 d FLOPs per visible pair"""
    B, H, n, d = shape
    if lengths is not None:
        pairs = n * sum(lengths)
    else:
        pairs = B * (n * (n + 1) // 2 if causal else n * n)
    return 7 * 2 * H * pairs * d


def fwd_bwd(attention, q, k, v, dout, mask, causal):
    def call():
        out = attention(q, k, v, attn_mask=mask, is_causal=causal)
        return torch.autograd.grad(out, (q, k, v), dout)
    return call


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, 5 s budget per case")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, help="threads for both attnx and torch "
                        "(default: each library's own default, all cores)")
    parser.add_argument("--cases", help="only the cases whose name contains this text")
    args = parser.parse_args()
    if args.threads:
        attnx.set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    settings = harness.Settings(max_rounds=5, budget_s=5.0) if args.quick else harness.Settings()
    print(f"attnx {attnx.__version__}: {attnx.get_num_threads()} threads, bfloat16 conversion "
          f"{attnx.cpu_dispatch()['convert']}; torch {torch.__version__}: "
          f"{torch.get_num_threads()} threads")
    peak = harness.machine_peak(attnx.get_num_threads())
    if peak is not None:
        print(peak.describe())
    print(f"{'case':<34} {'dtype':<9} {'torch ms':>10} {'attnx ms':>10} {'torch/attnx':>12} "
          f"{'torch %peak':>12} {'attnx %peak':>12} {'max |dq| diff':>14}")
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for name, shape, causal, lengths in cases():
            if args.cases and args.cases not in name:
                continue
            q, k, v, dout, mask = inputs(shape, lengths, dtype)
            calls = {"torch": fwd_bwd(F.scaled_dot_product_attention, q, k, v, dout, mask, causal),
                     "attnx": fwd_bwd(at.scaled_dot_product_attention, q, k, v, dout, mask, causal)}
            stats, results, failures = harness.measure(calls, settings)
            if failures:
                print(f"{name:<34} {dtype_name:<9} failed: {failures}")
                continue
            diff = (results["torch"][0].float() - results["attnx"][0].float()).abs()
            if lengths is not None:
                # compare the gradients of the real (unpadded) query rows
                valid = torch.arange(shape[2])[None, :] < torch.tensor(lengths)[:, None]
                diff = diff[valid[:, None, :, None].expand_as(diff)]
            t, a = stats["torch"].min, stats["attnx"].min
            flops = fwd_bwd_flops(shape, causal, lengths)
            # bfloat16 is computed in float32 on both sides: the float32 peak
            fractions = [f"{100 * peak.flops_fraction(flops / x):>11.0f}%" if peak else
                         f"{'-':>12}" for x in (t, a)]
            print(f"{name:<34} {dtype_name:<9} {t * 1e3:>10.2f} {a * 1e3:>10.2f} {t / a:>12.2f} "
                  f"{fractions[0]} {fractions[1]} {diff.max().item():>14.2e}", flush=True)


if __name__ == "__main__":
    main()
