"""The delta rule in plain numpy float64, straight from its recurrence (one
token at a time, no chunks): the reference attnx's delta rule kernels are
tested against (tests/test_delta.py)."""
import numpy as np


def l2norm(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def delta_rule(q, k, v, beta, g=None, scale=None, qk_l2norm=False, initial_state=None):
    """q, k (H, n, dk); v (H, n, dv); beta (H, n); g None, (H, n) or
    (H, n, dk); initial_state (H, dk, dv). Returns (out (H, n, dv), S)."""
    q, k, v, beta = (np.asarray(x, np.float64) for x in (q, k, v, beta))
    H, n, dk = q.shape
    dv = v.shape[-1]
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (dk ** -0.5 if scale is None else scale)
    S = np.zeros((H, dk, dv)) if initial_state is None else np.array(initial_state, np.float64)
    out = np.zeros((H, n, dv))
    for h in range(H):
        for t in range(n):
            if g is not None:
                decay = np.exp(np.asarray(g, np.float64)[h, t])
                S[h] = (decay[:, None] if np.ndim(decay) else decay) * S[h]
            u = beta[h, t] * (v[h, t] - S[h].T @ k[h, t])
            S[h] = S[h] + np.outer(k[h, t], u)
            out[h, t] = S[h].T @ q[h, t]
    return out, S
