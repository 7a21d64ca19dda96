"""The delta rule (attnx.delta_rule_attention, csrc/delta.c) beside
transformers' torch paths (torch_chunk_gated_delta_rule and
torch_recurrent_gated_delta_rule, transformers.models.qwen3_next), side by
side in one run: float32, (1, n, 16 heads, 128), g <= 0, qk l2norm.

    python benchmarks/delta_rule.py [--threads 2] [--lengths 1024 4096] [--repeats 3]
                                    [--torch-backward-max 4096]

Prints, per n, the best of --repeats calls of each: the chunked forward,
forward + backward through attnx.torch (torch's autograd calling attnx's
backward; torch's autograd through its own function, for n up to
--torch-backward-max: it takes seconds beyond), and one decoding step; the
ratios; and attnx's FLOP rates as fractions of the machine's float32
multiply-add peak on those threads (harness.machine_peak, measured at the
start of the run) and of a large float32 GEMM's rate (torch.mm, 2048^3,
measured in the same run). The FLOPs counted are those the chunk form
performs (GEMMs and triangular solves as executed), per token and head at
chunk C = 64, key size K, value size V. Its products with a triangle of
zeros (csrc/delta.c, triangle_product) run 5/8 of their full size there:
forward 6 K V + 5/8 (4 C K + 2 C V) + C V, backward (which recomputes the
chunks' forward products) 16 K V + 5/8 (12 C K + 6 C V) + 2 C V."""
import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attnx  # noqa: E402
import attnx.torch as at  # noqa: E402
import harness  # noqa: E402
from attnx.torch import _delta as _torch_delta  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as qwen  # noqa: E402


def timings(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def best(fn, repeats):
    return min(timings(fn, repeats))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--torch-backward-max", type=int, default=4096,
                        help="longest n at which torch's own autograd is timed")
    parser.add_argument("--layer-length", type=int, default=4096,
                        help="the prefill length of the conv1d share measurement")
    parser.add_argument("--layer-only", action="store_true",
                        help="only the conv1d share measurement")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    attnx.set_num_threads(args.threads)
    if args.layer_only:
        conv_share(args)
        return
    H, d, C = args.heads, args.dim, 64
    rng = np.random.default_rng(0)
    print(f"float32, {args.threads} threads, (1, n, {H} heads, {d}), g <= 0, qk l2norm; "
          f"best of {args.repeats}")
    fma = harness.machine_peak(args.threads)
    if fma is not None:
        print(fma.describe())
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    peak = 2 * 2048 ** 3 / best(lambda: torch.mm(a, b), 5 * args.repeats)
    print(f"float32 GEMM (torch.mm, 2048^3): {peak / 1e9:.1f} GFLOP/s")

    def rates(flops, seconds):
        """attnx's FLOP rate and its fractions of the FMA peak and the GEMM's"""
        rate = flops / seconds
        of_peak = f"{fma.flops_fraction(rate):.0%} of the FMA peak, " if fma else ""
        return f"{rate / 1e9:5.1f} GFLOP/s ({of_peak}{rate / peak:.0%} of the GEMM's)"
    triangle = 5 / 8  # the share of the full products at C = 64
    per_token_fwd = 6 * d * d + triangle * (4 * C * d + 2 * C * d) + C * d
    per_token_bwd = 16 * d * d + triangle * (12 * C * d + 6 * C * d) + 2 * C * d
    for n in args.lengths:
        q, k, v = (torch.from_numpy(rng.standard_normal((1, n, H, d)).astype(np.float32))
                   for _ in range(3))
        beta = torch.from_numpy(rng.uniform(0, 1, (1, n, H)).astype(np.float32))
        g = torch.from_numpy(-rng.uniform(0, 0.2, (1, n, H)).astype(np.float32))
        opts = dict(use_qk_l2norm_in_kernel=True)
        with torch.no_grad():
            t_ours = best(lambda: at.chunk_gated_delta_rule(q, k, v, g, beta, **opts), args.repeats)
            t_theirs = best(lambda: qwen.torch_chunk_gated_delta_rule(q, k, v, g, beta, **opts),
                            args.repeats)
        flops = H * n * per_token_fwd
        print(f"n={n:6d} forward      attnx {t_ours * 1e3:9.1f} ms  torch {t_theirs * 1e3:9.1f} ms"
              f"  ratio {t_theirs / t_ours:5.1f}x  attnx {rates(flops, t_ours)}")

        def train(fn):
            xs = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
            out = fn(*xs, **opts)[0]
            out.backward(torch.ones_like(out))

        t_ours = best(lambda: train(at.chunk_gated_delta_rule), args.repeats)
        flops = H * n * (per_token_fwd + per_token_bwd)
        line = f"n={n:6d} fwd+bwd      attnx {t_ours * 1e3:9.1f} ms  {rates(flops, t_ours)}"
        if n <= args.torch_backward_max:
            t_theirs = best(lambda: train(qwen.torch_chunk_gated_delta_rule), args.repeats)
            line += f"  torch {t_theirs * 1e3:9.1f} ms  ratio {t_theirs / t_ours:5.1f}x"
        print(line)
    # one decoding step: the state of a 1024-token prefix, one new token
    q1, k1, v1 = (torch.from_numpy(rng.standard_normal((1, 1, H, d)).astype(np.float32))
                  for _ in range(3))
    b1 = torch.rand(1, 1, H)
    g1 = -torch.rand(1, 1, H) * 0.2
    S = torch.from_numpy(rng.standard_normal((1, H, d, d)).astype(np.float32) * 0.1)
    opts = dict(initial_state=S, output_final_state=True, use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        step = lambda fn: fn(q1, k1, v1, g1, b1, **opts)  # noqa: E731
        t_ours = best(lambda: step(at.fused_recurrent_gated_delta_rule), 50 * args.repeats)
        t_theirs = best(lambda: step(qwen.torch_recurrent_gated_delta_rule), 50 * args.repeats)
    print(f"decode step  attnx.torch {t_ours * 1e6:8.1f} us  torch {t_theirs * 1e6:8.1f} us"
          f"  ratio {t_theirs / t_ours:5.1f}x")
    # the numpy state's in-place step
    qn, kn, vn = (x.numpy().swapaxes(1, 2) for x in (q1, k1, v1))
    _, state = attnx.delta_rule_attention(qn, kn, vn, b1.numpy().swapaxes(1, 2),
                                          g1.numpy().swapaxes(1, 2), qk_l2norm=True,
                                          return_state=True)
    bn, gn = b1.numpy().swapaxes(1, 2), g1.numpy().swapaxes(1, 2)
    for threads in sorted({args.threads, 1}, reverse=True):
        attnx.set_num_threads(threads)
        steps = timings(lambda: state.step(qn, kn, vn, bn, gn), 50 * args.repeats)
        t_state = min(steps)
        # the median and mean say what a busy machine does to the step (the
        # fastest call is what it costs on a quiet one)
        print(f"decode step  DeltaRuleState.step, {threads} thread(s) {t_state * 1e6:8.1f} us  "
              f"ratio to torch {t_theirs / t_state:5.1f}x  (median "
              f"{np.median(steps) * 1e6:.1f} us, mean {np.mean(steps) * 1e6:.1f} us)")
    attnx.set_num_threads(args.threads)
    conv_share(args)


def conv_share(args):
    """The share of the depthwise causal conv1d in a Qwen3-Next linear
    attention layer's forward on attnx: the layer of Qwen3-Next-80B-A3B's
    shape (hidden 2048, 16 key and 32 value heads of 128, kernel 4), random
    weights, a prefill of --layer-length tokens and one decoding step; the
    module-level functions the layer calls are wrapped to time them."""
    import functools

    from transformers import Qwen3NextConfig

    n = args.layer_length
    config = Qwen3NextConfig(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32,
                             linear_key_head_dim=128, linear_value_head_dim=128,
                             linear_conv_kernel_dim=4, num_hidden_layers=1,
                             layer_types=["linear_attention"])
    layer = qwen.Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    spent = {}

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            start = time.perf_counter()
            result = fn(*a, **kw)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
            return result
        return wrapper

    at.register_delta_rule()
    names = ("causal_conv1d_fn", "chunk_gated_delta_rule")
    originals = {"causal_conv1d_fn": qwen.causal_conv1d_fn,
                 "chunk_gated_delta_rule": qwen.torch_chunk_gated_delta_rule}
    qwen.causal_conv1d_fn = timed("causal_conv1d_fn", originals["causal_conv1d_fn"])
    qwen.torch_chunk_gated_delta_rule = timed("chunk_gated_delta_rule",
                                              originals["chunk_gated_delta_rule"])
    x = torch.randn(1, n, 2048)
    try:
        with torch.no_grad():
            times = []
            for _ in range(args.repeats):
                spent.clear()
                start = time.perf_counter()
                layer(x)
                times.append((time.perf_counter() - start, dict(spent)))
        total, parts = min(times, key=lambda item: item[0])
    finally:
        qwen.causal_conv1d_fn = originals["causal_conv1d_fn"]
        qwen.torch_chunk_gated_delta_rule = originals["chunk_gated_delta_rule"]
        at.unregister_delta_rule()
    print(f"Qwen3-Next linear-attention layer, prefill n={n} on attnx: {total * 1e3:.1f} ms; "
          + ", ".join(f"{name} {parts[name] * 1e3:.1f} ms ({parts[name] / total:.0%})"
                      for name in names))
    # one decoding step: the conv's update and the delta rule's step
    conv_dim = 2 * 16 * 128 + 32 * 128
    conv_state = torch.randn(1, conv_dim, 4)
    token = torch.randn(1, conv_dim, 1)
    weight, bias = layer.conv1d.weight.squeeze(1), layer.conv1d.bias
    q1, k1 = torch.randn(2, 1, 1, 16, 128).unbind(0)
    v1 = torch.randn(1, 1, 32, 128)
    b1, g1 = torch.rand(1, 1, 32), -torch.rand(1, 1, 32) * 0.2
    S = torch.randn(1, 32, 128, 128) * 0.1
    ours = _torch_delta._conv1d_update_for(qwen.causal_conv1d_update)
    with torch.no_grad():
        t_conv = best(lambda: qwen.causal_conv1d_update(token, conv_state, weight, bias, "silu"),
                      50 * args.repeats)
        t_conv_ours = best(lambda: ours(token, conv_state, weight, bias, "silu"),
                           50 * args.repeats)
        t_step = best(lambda: at.fused_recurrent_gated_delta_rule(
            q1, k1, v1, g1, b1, initial_state=S, output_final_state=True,
            use_qk_l2norm_in_kernel=True), 50 * args.repeats)
    print(f"one decoding step of that layer: causal_conv1d_update {t_conv * 1e6:.1f} us "
          f"(transformers'), {t_conv_ours * 1e6:.1f} us (attnx's, as register_delta_rule "
          f"installs it), the delta rule (attnx.torch, 32 value heads) {t_step * 1e6:.1f} us")


if __name__ == "__main__":
    main()
