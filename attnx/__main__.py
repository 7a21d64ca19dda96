"""python -m attnx: every variant on built-in example data, beside a plain
numpy float64 computation of the same formula."""
import time

import numpy as np

import attnx


def numpy_softmax_attention(q, k, v, scale, visible):
    scores = scale * q @ np.swapaxes(k, -1, -2)
    scores = np.where(visible, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(row_max), row_max, 0))
    weights /= np.maximum(weights.sum(axis=-1, keepdims=True), np.finfo(float).tiny)
    return weights @ v


def example_data(rng, heads=4, n=256, m=256, d=64, e=64):
    q = rng.standard_normal((1, heads, n, d))
    k = rng.standard_normal((1, heads, m, d))
    v = rng.standard_normal((1, heads, m, e))
    return q, k, v


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - start) * 1e3


def numpy_gaussian_attention(q, k, v, sigma):
    sq_dist = ((q[..., :, None, :] - k[..., None, :, :]) ** 2).sum(-1)
    log_s = -sq_dist / (2 * sigma**2)
    weights = np.exp(log_s - log_s.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True) @ v


def cases(q, k, v):
    """(name, attnx call, numpy call) for every variant."""
    n, m, d = q.shape[-2], k.shape[-2], q.shape[-1]
    everything = np.ones((n, m), dtype=bool)
    causal = np.tril(everything, m - n)
    padding = np.ones((1, 1, 1, m), dtype=bool)
    padding[..., m - 40:] = False
    band = np.abs(np.arange(n)[:, None] + (m - n) - np.arange(m)[None, :]) <= 16
    scale = 1 / np.sqrt(d)
    return [
        ("softmax", lambda: attnx.softmax_attention(q, k, v),
         lambda: numpy_softmax_attention(q, k, v, scale, everything)),
        ("softmax causal", lambda: attnx.softmax_attention(q, k, v, causal=True),
         lambda: numpy_softmax_attention(q, k, v, scale, causal)),
        ("softmax key padding", lambda: attnx.softmax_attention(q, k, v, mask=padding),
         lambda: numpy_softmax_attention(q, k, v, scale, padding)),
        ("softmax window 16", lambda: attnx.softmax_attention(q, k, v, window=16),
         lambda: numpy_softmax_attention(q, k, v, scale, band)),
        ("gaussian sigma=8", lambda: attnx.gaussian_attention(q, k, v, 8.0),
         lambda: numpy_gaussian_attention(q, k, v, 8.0)),
    ]


def main():
    rng = np.random.default_rng(2024)
    attnx.show_config()
    print()
    print("Example data: batch 1, 4 heads, n = m = 256, d = e = 64, float64;")
    print("each variant against a plain numpy float64 computation of its formula.")
    print(f"{'variant':28s} {'attnx ms':>9s} {'numpy ms':>9s} {'max |diff|':>11s}")
    worst = 0.0
    for name, run_attnx, run_numpy in cases(*example_data(rng)):
        ours, ours_ms = timed(run_attnx)
        theirs, numpy_ms = timed(run_numpy)
        diff = float(np.max(np.abs(ours - theirs)))
        worst = max(worst, diff)
        print(f"{name:28s} {ours_ms:9.2f} {numpy_ms:9.2f} {diff:11.2e}")
    print()
    print("all variants agree with numpy" if worst < 1e-10 else "MISMATCH against numpy")
    return 0 if worst < 1e-10 else 1


if __name__ == "__main__":
    raise SystemExit(main())
