"""Causal linear attention (elu + 1), forward + backward, in one run:
attnx (linear_attention, then linear_attention_backward) beside pure-torch
formulations under autograd: the chunk-64 loop with a carried state, all
chunks at once (an exclusive cumsum of the chunk states), and the cumsum
form (every prefix state materialised) where its memory fits; and
fast-transformers' CPU causal product when it is importable. Median wall
times of interleaved rounds, the ratios taken in the same rounds, and time
per token against n (linear when the per-token time stays flat).

    python benchmarks/linear_grad.py [--ns 1024,2048,4096,8192,16384] [--rounds 5]
        [--cumsum-max 4096] [--json FILE]

Shapes (1, 8, n, 64), float32, every library on the same threads. attnx's
gradients are checked against torch's (float32, relative 1e-3) before the
timing. Two attnx rows: "attnx" writes into the same out=, dq=, dk=, dv=
arrays every call (the ratios are taken against it), "attnx fresh outputs"
lets every call allocate them, as autograd does for the torch forms: above
glibc's mmap threshold (32 MiB arrays at n = 16384) each call then faults
and zeroes its outputs' pages anew.

fast-transformers (pytorch-fast-transformers) is timed when
`fast_transformers.causal_product` imports, from the environment or from the
directory named by ATTNX_FAST_TRANSFORMERS (a checkout whose CPU causal
product extension was built in place; docs/performance.md says how). Three rows:
"ft causal_dot_product" is its product kernel alone, forward + backward on
precomputed elu + 1 features (the figure its users quote) under autograd;
"ft kernels, buffers" the same two C++ kernels called directly into
preallocated tensors (the counterpart of the "attnx" row); and "ft causal
linear" its whole normalised attention as its CausalLinearAttention computes
it (elu + 1 features, the causal product for the numerator, a cumsum for the
denominator, 1 / (denominator + 1e-6)) under autograd, on the head-major
inputs directly (its module's permute copies left out). Otherwise the run
says it is absent and why.
"""
import argparse
import json
import os
import sys

import numpy as np

import attnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Settings, measure  # noqa: E402

EPS = 1e-6
CHUNK = 64


def torch_forms():
    import torch

    def elu1(x):
        return torch.nn.functional.elu(x) + 1

    def chunk_loop(q, k, v):
        """chunks of 64 in a Python loop, the state carried (no in-place
        updates, so autograd can run through it)"""
        phi_q, phi_k = elu1(q), elu1(k)
        *lead, n, r = phi_q.shape
        state = q.new_zeros(*lead, r, v.shape[-1])
        key_sum = q.new_zeros(*lead, 1, r)
        lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
        outs = []
        for start in range(0, n, CHUNK):
            stop = min(start + CHUNK, n)
            q_c, k_c, v_c = phi_q[..., start:stop, :], phi_k[..., start:stop, :], v[..., start:stop, :]
            size = stop - start
            weights = (q_c @ k_c.transpose(-1, -2)).masked_fill(~lower[:size, :size], 0)
            numer = weights @ v_c + q_c @ state
            denom = weights.sum(-1, keepdim=True) + (q_c * key_sum).sum(-1, keepdim=True)
            outs.append(numer / denom.clamp_min(EPS))
            state = state + k_c.transpose(-1, -2) @ v_c
            key_sum = key_sum + k_c.sum(-2, keepdim=True)
        return torch.cat(outs, -2)

    def chunk_parallel(q, k, v):
        """every chunk at once: incoming states by an exclusive cumsum"""
        phi_q, phi_k = elu1(q), elu1(k)
        *lead, n, r = phi_q.shape
        e = v.shape[-1]
        q_c = phi_q.reshape(*lead, n // CHUNK, CHUNK, r)
        k_c = phi_k.reshape(*lead, n // CHUNK, CHUNK, r)
        v_c = v.reshape(*lead, n // CHUNK, CHUNK, e)
        states = (k_c.transpose(-1, -2) @ v_c).cumsum(-3) - k_c.transpose(-1, -2) @ v_c
        sums = k_c.sum(-2, keepdim=True).cumsum(-3) - k_c.sum(-2, keepdim=True)
        lower = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
        weights = (q_c @ k_c.transpose(-1, -2)).masked_fill(~lower, 0)
        numer = weights @ v_c + q_c @ states
        denom = weights.sum(-1, keepdim=True) + (q_c * sums).sum(-1, keepdim=True)
        return (numer / denom.clamp_min(EPS)).reshape(*lead, n, e)

    def cumsum(q, k, v):
        phi_q, phi_k = elu1(q), elu1(k)
        prefix = torch.einsum("...nr,...ne->...nre", phi_k, v).cumsum(-3)
        numer = torch.einsum("...nr,...nre->...ne", phi_q, prefix)
        denom = (phi_q * phi_k.cumsum(-2)).sum(-1, keepdim=True)
        return numer / denom.clamp_min(EPS)

    return torch, {"torch chunk-64 loop": chunk_loop, "torch chunk-64 parallel": chunk_parallel,
                   "torch cumsum": cumsum}


def fast_transformers_product():
    """(causal_dot_product, where it came from, None) when fast-transformers'
    CPU causal product imports, else (None, None, why not)."""
    built = os.environ.get("ATTNX_FAST_TRANSFORMERS")
    if built:
        if not os.path.isdir(os.path.join(built, "fast_transformers")):
            return None, None, (f"ATTNX_FAST_TRANSFORMERS={built} holds no fast_transformers "
                                f"package")
        sys.path.insert(0, built)
    try:
        from fast_transformers.causal_product import causal_dot_product
    except ImportError as error:
        if built:
            return None, None, (f"fast_transformers.causal_product does not import from "
                                f"ATTNX_FAST_TRANSFORMERS={built}: {error}")
        return None, None, (f"fast_transformers.causal_product is not importable ({error}); its "
                            f"PyPI sdist needs CUDA_HOME to build: build its CPU causal product "
                            f"in place and set ATTNX_FAST_TRANSFORMERS (docs/performance.md)")
    import fast_transformers
    return causal_dot_product, os.path.dirname(os.path.dirname(fast_transformers.__file__)), None


def fast_transformers_linear(causal_dot_product):
    import torch

    def causal_linear(q, k, v):
        """normalised as fast-transformers' CausalLinearAttention: the product
        kernel for the numerator, a cumsum of the keys for the denominator"""
        phi_q, phi_k = (torch.nn.functional.elu(x) + 1 for x in (q, k))
        normaliser = 1 / ((phi_q * phi_k.cumsum(-2)).sum(-1) + EPS)
        return causal_dot_product(phi_q, phi_k, v) * normaliser[..., None]

    return causal_linear


def fast_transformers_kernels(torch, phi_q, phi_k, v, dout):
    """fast-transformers' forward and backward C++ kernels called directly,
    writing into tensors allocated once (its kernels zero what they fill)"""
    from fast_transformers.causal_product import causal_dot_backward_cpu, causal_dot_product_cpu
    inputs = [torch.from_numpy(x) for x in (phi_q, phi_k, v, dout)]
    product, *grads = (torch.empty_like(inputs[0]) for _ in range(4))

    def call():
        causal_dot_product_cpu(*inputs[:3], product)
        causal_dot_backward_cpu(*inputs, *grads)
        return grads
    return call


def torch_call(torch, form, q, k, v, dout):
    leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
    grad_out = torch.from_numpy(dout)

    def call():
        for leaf in leaves:
            leaf.grad = None
        out = form(*leaves)
        out.backward(grad_out)
        return [leaf.grad for leaf in leaves]
    return call


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ns", default="1024,2048,4096,8192,16384")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cumsum-max", type=int, default=4096,
                        help="largest n for the torch cumsum form (n x r x e per head, with grads)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch, forms = torch_forms()
    # fast-transformers' kernel parallelises over heads with OpenMP in torch's
    # own libgomp, so torch's thread count governs it too
    torch.set_num_threads(attnx.get_num_threads())
    ft_product, ft_origin, ft_absent = fast_transformers_product()
    if ft_product is not None:
        ft_causal_linear = fast_transformers_linear(ft_product)
    print(f"causal elu linear attention, forward + backward, (1, 8, n, 64) float32, "
          f"{attnx.get_num_threads()} threads (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads); load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    if ft_absent:
        print(f"fast-transformers: absent: {ft_absent}")
    else:
        print(f"fast-transformers: causal_dot_product from {ft_origin}")
    results = []
    header = f"{'n':>6s} {'form':25s} {'median ms':>10s} {'us/token':>9s} {'vs attnx':>9s}"
    print(header)
    for n in map(int, args.ns.split(",")):
        rng = np.random.default_rng(n)
        q, k, v, dout = (rng.standard_normal((1, 8, n, 64), dtype=np.float32) for _ in range(4))
        dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
        out = np.empty_like(v)

        def attnx_call():
            attnx.linear_attention(q, k, v, causal=True, out=out)
            return attnx.linear_attention_backward(dout, q, k, v, causal=True, dq=dq, dk=dk, dv=dv)

        def attnx_fresh():
            attnx.linear_attention(q, k, v, causal=True)
            return attnx.linear_attention_backward(dout, q, k, v, causal=True)

        calls = {"attnx": attnx_call, "attnx fresh outputs": attnx_fresh}
        for name, form in forms.items():
            if name == "torch cumsum" and n > args.cumsum_max:
                continue
            calls[name] = torch_call(torch, form, q, k, v, dout)
        checked = ["torch chunk-64 loop", "attnx fresh outputs"]
        if ft_product is not None:
            # the product kernel alone: its inputs are the features
            phi_q, phi_k = (np.where(x > 0, x + 1, np.exp(np.minimum(x, 0))) for x in (q, k))
            calls["ft causal_dot_product"] = torch_call(torch, ft_product, phi_q, phi_k, v, dout)
            calls["ft kernels, buffers"] = fast_transformers_kernels(torch, phi_q, phi_k, v, dout)
            calls["ft causal linear"] = torch_call(torch, ft_causal_linear, q, k, v, dout)
            checked.append("ft causal linear")
        # the answers must agree before they are timed
        want = attnx_call()
        for other in checked:
            got = calls[other]()
            for mine, theirs, name in zip(want[:3], got, "qkv"):
                theirs = np.asarray(theirs)
                err = np.abs(mine - theirs).max() / np.abs(theirs).max()
                if err > 1e-3:
                    raise SystemExit(f"n = {n}: d{name} differs from {other}'s by {err:.2g}")
        if ft_product is not None:
            for direct, through_autograd in zip(calls["ft kernels, buffers"](),
                                                calls["ft causal_dot_product"]()):
                if not np.allclose(direct.numpy(), through_autograd.numpy(), rtol=1e-5, atol=1e-5):
                    raise SystemExit(f"n = {n}: fast-transformers' kernels called directly differ "
                                     f"from its autograd function")
        stats, _, failures = measure(calls, Settings(min_rounds=args.rounds, max_rounds=args.rounds,
                                                     budget_s=30.0))
        base = stats["attnx"].median
        for name, s in stats.items():
            print(f"{n:6d} {name:25s} {s.median * 1e3:10.2f} {s.median / n * 1e6:9.3f} "
                  f"{s.median / base:8.2f}x")
            results.append({"n": n, "form": name, **s.as_dict(), "ratio_to_attnx": s.median / base})
        for name, message in failures.items():
            print(f"{n:6d} {name:25s} failed: {message}")
            results.append({"n": n, "form": name, "failed": message})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load_average": os.getloadavg(), "threads": attnx.get_num_threads(),
                       "fast_transformers": {"available": ft_product is not None,
                                             "origin": ft_origin, "absent_because": ft_absent},
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
