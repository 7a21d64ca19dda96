"""python -m attnx: every variant on built-in example data, beside a plain
numpy float64 computation of the same formula (attnx.reference, or here
for the systems it does not hold). It checks results, not
speed: timings of calls this small, on one run, would say little (numpy
could even look faster), so speed is left to benchmarks/ (its README)."""
import numpy as np

import attnx
import attnx.reference as reference


def example_data(rng, heads=4, n=256, m=256, d=64, e=64):
    q = rng.standard_normal((1, heads, n, d))
    k = rng.standard_normal((1, heads, m, d))
    v = rng.standard_normal((1, heads, m, e))
    return q, k, v


def cases(q, k, v):
    """(name, attnx call, numpy call) for every variant."""
    n, m, d = q.shape[-2], k.shape[-2], q.shape[-1]
    lower_right = np.tril(np.ones((n, m), dtype=bool), m - n)
    padding = np.ones((1, 1, 1, m), dtype=bool)
    padding[..., m - 40:] = False
    band = np.abs(np.arange(n)[:, None] + (m - n) - np.arange(m)[None, :]) <= 16
    rows = [
        ("softmax", lambda: attnx.softmax_attention(q, k, v),
         lambda: reference.softmax_attention(q, k, v)),
        ("softmax causal", lambda: attnx.softmax_attention(q, k, v, causal=True),
         lambda: reference.softmax_attention(q, k, v, mask=lower_right)),
        ("softmax key padding", lambda: attnx.softmax_attention(q, k, v, mask=padding),
         lambda: reference.softmax_attention(q, k, v, mask=padding)),
        ("softmax window 16", lambda: attnx.softmax_attention(q, k, v, window=16),
         lambda: reference.softmax_attention(q, k, v, mask=band)),
        ("gaussian sigma=8", lambda: attnx.gaussian_attention(q, k, v, 8.0),
         lambda: reference.gaussian_attention(q, k, v, 8.0)),
    ]
    for name in ("elu", "relu", "softmax", "taylor", "focused"):
        for is_causal in (False, True):
            label = f"linear {name}" + (" causal" if is_causal else "")
            rows.append((label,
                         lambda name=name, c=is_causal: attnx.linear_attention(q, k, v, feature_map=name, causal=c),
                         lambda name=name, c=is_causal: reference.linear_attention(q, k, v, name, c)))
    projection = attnx.random_features(256, d, seed=0)
    rows += [
        ("performer (FAVOR+, r=256)",
         lambda: attnx.performer_attention(q, k, v, projection=projection),
         lambda: reference.linear_attention(q, k, v, "favor", projection=projection)),
        ("performer causal",
         lambda: attnx.performer_attention(q, k, v, projection=projection, causal=True),
         lambda: reference.linear_attention(q, k, v, "favor", causal=True, projection=projection)),
        ("cosformer", lambda: attnx.cosformer_attention(q, k, v),
         lambda: reference.cosformer_attention(q, k, v)),
        ("cosformer causal", lambda: attnx.cosformer_attention(q, k, v, causal=True),
         lambda: reference.cosformer_attention(q, k, v, causal=True)),
        ("efficient (Shen et al.)", lambda: attnx.efficient_attention(q, k, v),
         lambda: reference.efficient_attention(q, k, v)),
    ]
    return rows


def numpy_rotary(x):
    """Rotate-half RoPE as complex multiplication: (a + ib) e^(i p theta_i)."""
    half = x.shape[-1] // 2
    theta = np.arange(x.shape[-2])[:, None] * 10000.0 ** (-2.0 * np.arange(half) / x.shape[-1])
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * theta)
    return np.concatenate([z.real, z.imag], axis=-1)


def numpy_pool_mean(x, stride):
    return np.stack([x[..., s:s + stride, :].mean(axis=-2) for s in range(0, x.shape[-2], stride)], axis=-2)


def numpy_multi_head(x, w_q, w_k, w_v, w_o, heads):
    """Head by head: softmax attention of x w_q[:, head], x w_k[:, head], x w_v[:, head]."""
    d = w_q.shape[1] // heads
    outputs = []
    for h in range(heads):
        cols = slice(h * d, (h + 1) * d)
        q, k, v = x @ w_q[:, cols], x @ w_k[:, cols], x @ w_v[:, cols]
        outputs.append(reference.softmax_attention(q, k, v))
    return np.concatenate(outputs, axis=-1) @ w_o


def numpy_lsh_visible(buckets, chunk):
    """Reformer's visibility from the buckets (n_hashes, n) of one head: the
    same bucket and the same chunk of the (bucket, position) order or the
    one before, in some round; not oneself, unless nothing else."""
    n = buckets.shape[-1]
    visible = np.zeros((n, n), dtype=bool)
    for b in buckets:
        place = np.empty(n, dtype=int)
        place[np.lexsort((np.arange(n), b))] = np.arange(n)
        behind = place[:, None] // chunk - place[None, :] // chunk
        visible |= (b[:, None] == b[None, :]) & ((behind == 0) | (behind == 1))
    visible &= ~np.eye(n, dtype=bool)
    alone = ~visible.any(axis=1)
    visible[alone, alone] = True
    return visible


def numpy_lsh(q, v, n_buckets, n_hashes, chunk):
    """Softmax of q against q / |q| under the union of the rounds' visibility."""
    buckets = attnx.lsh_buckets(q, n_buckets, n_hashes)  # the hashing, exposed
    visible = np.stack([numpy_lsh_visible(b, chunk) for b in buckets.reshape(-1, *buckets.shape[-2:])])
    keys = q / np.linalg.norm(q, axis=-1, keepdims=True)
    return reference.softmax_attention(q, keys, v,
                                       mask=visible.reshape(q.shape[:-2] + visible.shape[-2:]))


def systems_cases(q, k, v):
    """(name, attnx call, numpy call) for positions, block-sparse, pooled,
    Linformer, Reformer's LSH and the multi-head layer."""
    n, m = q.shape[-2], k.shape[-2]
    block = 16
    layout = attnx.layouts.bigbird(-(-n // block), 1, 1, 1, seed=0)
    expanded = np.kron(layout, np.ones((block, block), dtype=bool))[:n, :m]
    projection = np.random.default_rng(1).standard_normal((64, m)) / np.sqrt(m)
    x = q[0].transpose(1, 0, 2).reshape(n, -1)  # (n, 256): a sequence of 256 features
    w_q, w_k, w_v, w_o = (np.random.default_rng(i).standard_normal((256, 256)) / 16 for i in range(4))
    beta = np.full(q.shape[:-1], 0.5)
    gate = np.full(q.shape[:-1], -0.05)
    return [
        ("rotary positions (RoPE)", lambda: attnx.rotary(q), lambda: numpy_rotary(q)),
        (f"block-sparse bigbird {layout.mean():.0%}",
         lambda: attnx.block_sparse_attention(q, k, v, layout, block),
         lambda: reference.softmax_attention(q, k, v, mask=expanded)),
        ("pooled keys, stride 4", lambda: attnx.pooled_attention(q, k, v, 4),
         lambda: reference.softmax_attention(q, numpy_pool_mean(k, 4), numpy_pool_mean(v, 4))),
        ("linformer r=64", lambda: attnx.linformer_attention(q, k, v, projection),
         lambda: reference.softmax_attention(q, projection @ k, projection @ v)),
        ("LSH 8 buckets x 2, chunk 32", lambda: attnx.lsh_attention(q, v, 8, 2, 32),
         lambda: numpy_lsh(q, v, 8, 2, 32)),
        ("gated delta rule, chunk 64",
         lambda: attnx.delta_rule_attention(q, k / 8, v, beta, gate),
         lambda: reference.delta_rule(q[0], k[0] / 8, v[0], beta[0], gate[0])[0][None]),
        ("multi-head layer, 4 heads", lambda: attnx.multi_head_attention(x, x, w_q, w_k, w_v, w_o, 4),
         lambda: numpy_multi_head(x, w_q, w_k, w_v, w_o, 4)),
    ]


def main():
    rng = np.random.default_rng(2024)
    attnx.show_config()
    print()
    print("Example data: batch 1, 4 heads, n = m = 256, d = e = 64, float64; each")
    print("variant against a plain numpy float64 computation of its formula.")
    print(f"{'variant':28s} {'max |diff|':>11s}")
    worst = 0.0
    data = example_data(rng)
    for name, run_attnx, run_numpy in cases(*data) + systems_cases(*data):
        diff = float(np.max(np.abs(run_attnx() - run_numpy())))
        worst = max(worst, diff)
        print(f"{name:28s} {diff:11.2e}")
    print()
    print("all variants agree with numpy" if worst < 1e-10 else "MISMATCH against numpy")
    print("Speed: python benchmarks/run.py --quick from a checkout (benchmarks/README.md)")
    return 0 if worst < 1e-10 else 1


if __name__ == "__main__":
    raise SystemExit(main())
