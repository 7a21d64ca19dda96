"""The delta rule (attnx.delta_rule_attention, csrc/delta.c) beside
transformers' torch paths (torch_chunk_gated_delta_rule and
torch_recurrent_gated_delta_rule, transformers.models.qwen3_next), side by
side in one run: float32, (1, n, 16 heads, 128), g <= 0, qk l2norm.

    python benchmarks/delta_rule.py [--threads 2] [--lengths 1024 4096] [--repeats 3]

Prints, per n, the best of --repeats calls of each: the chunked forward,
forward + backward (attnx's backward function; torch's autograd), and one
decoding step; the ratios; and attnx's forward FLOP rate (the chunk form's
GEMM work, about 4 C K + C V + 6 K V + 2 C V flops per token and head at
chunk C, key size K, value size V)."""
import argparse
import time

import numpy as np
import torch

import attnx
import attnx.torch as at
from transformers.models.qwen3_next import modeling_qwen3_next as qwen


def best(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--no-torch-backward", action="store_true",
                        help="skip torch's autograd (seconds at long n)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    attnx.set_num_threads(args.threads)
    H, d, C = args.heads, args.dim, 64
    rng = np.random.default_rng(0)
    print(f"float32, {args.threads} threads, (1, n, {H} heads, {d}), g <= 0, qk l2norm; "
          f"best of {args.repeats}")
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
        flops = H * n * (4 * C * d + C * d + 6 * d * d + 2 * C * d)
        print(f"n={n:6d} forward      attnx {t_ours * 1e3:9.1f} ms  torch {t_theirs * 1e3:9.1f} ms"
              f"  ratio {t_theirs / t_ours:5.1f}x  attnx {flops / t_ours / 1e9:5.1f} GFLOP/s")

        def train(fn):
            xs = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
            out = fn(*xs, **opts)[0]
            out.backward(torch.ones_like(out))

        t_ours = best(lambda: train(at.chunk_gated_delta_rule), args.repeats)
        line = f"n={n:6d} fwd+bwd      attnx {t_ours * 1e3:9.1f} ms"
        if not args.no_torch_backward:
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
    t_state = best(lambda: state.step(qn, kn, vn, bn, gn), 50 * args.repeats)
    print(f"decode step  DeltaRuleState.step {t_state * 1e6:8.1f} us  ratio to torch "
          f"{t_theirs / t_state:5.1f}x")


if __name__ == "__main__":
    main()
