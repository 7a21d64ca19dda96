"""Plain numpy float64 reference implementations of the attnx variants.

Written straight from the formulas of docs/ (conventions.md, softmax.md, linear.md), with
explicit n x m matrices: slow, simple and meant to be obviously correct.
Nothing here imports attnx.

Conventions (docs/conventions.md):

* ``q`` is ``(..., n, d)``, ``k`` is ``(..., m, d)``, ``v`` is ``(..., m, e)``;
  leading axes broadcast like numpy's matmul.
* Every variant is ``o_i = sum_j w_ij v_j`` with ``w_ij = s_ij / sum_j' s_ij'``
  over the visible keys; a row that sees no key gives zeros (lse ``-inf``).
"""

import math

import numpy as np

__all__ = [
    "visibility",
    "softmax_similarity",
    "softmax_weights",
    "softmax_attention",
    "gaussian_similarity",
    "gaussian_weights",
    "gaussian_attention",
    "apply_feature_map",
    "FEATURE_MAPS",
    "linear_similarity",
    "linear_weights",
    "linear_attention",
    "cosformer_similarity",
    "cosformer_weights",
    "cosformer_attention",
    "efficient_weights",
    "efficient_attention",
    "softmax_attention_grads",
    "gaussian_attention_grads",
    "reduce_to",
    "philox4x32_10",
    "dropout_keep",
    "delta_rule",
]


def _f64(x):
    return np.asarray(x, dtype=np.float64)


# --------------------------------------------------------------------------
# Visibility
# --------------------------------------------------------------------------

def visibility(n, m, causal=False, mask=None, window=None):
    """Boolean ``(..., n, m)`` array: may query i see key j?

    docs/conventions.md, "Visibility": all of these must hold

    * ``causal=True`` / ``"lower_right"``: ``j <= i + (m - n)``;
      ``causal="upper_left"``: ``j <= i``;
    * ``mask`` (bool, broadcastable to ``(..., n, m)``) is True;
    * ``window=w`` means ``(w, w)``; ``window=(left, right)`` with None for
      an open side: with ``i' = i + (m - n)``, ``i' - left <= j <= i' + right``.

    Without a mask the result is ``(n, m)``.
    """
    i = np.arange(n)[:, None]
    j = np.arange(m)[None, :]
    vis = np.ones((n, m), dtype=bool)

    if causal is True or causal == "lower_right":
        vis &= j <= i + (m - n)
    elif causal == "upper_left":
        vis &= j <= i
    elif causal is False or causal is None:
        pass
    else:
        raise ValueError("causal: unknown value %r" % (causal,))

    if window is not None:
        if isinstance(window, (tuple, list)):
            left, right = window
        else:
            left = right = window
        ip = i + (m - n)
        if left is not None:
            vis &= ip - left <= j
        if right is not None:
            vis &= j <= ip + right

    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError("mask must be boolean")
        vis = vis & mask  # broadcasts to (..., n, m)
    return vis


def _weighted_sum(w, v):
    """``o_i = sum_j w_ij v_j`` over the keys with ``w_ij != 0`` only, so a
    NaN/inf value of a key a row does not see cannot reach that row (plain
    matmul would give 0 * nan = nan)."""
    v = _f64(v)
    if np.all(np.isfinite(v)):
        return np.matmul(w, v)
    lead = np.broadcast_shapes(w.shape[:-2], v.shape[:-2])
    w = np.broadcast_to(w, lead + w.shape[-2:])
    v = np.broadcast_to(v, lead + v.shape[-2:])
    o = np.empty(lead + (w.shape[-2], v.shape[-1]))
    for i in range(w.shape[-2]):
        wi = w[..., i, :, None]  # (..., m, 1)
        with np.errstate(invalid="ignore"):
            o[..., i, :] = np.where(wi != 0, wi * v, 0.0).sum(axis=-2)
    return o


# --------------------------------------------------------------------------
# Softmax (scaled dot product) attention, docs/softmax.md
# --------------------------------------------------------------------------

def softmax_logits(q, k, scale=None, bias=None):
    """``a_ij = scale * q_i . k_j + b_ij`` (scale defaults to 1/sqrt(d))."""
    q = _f64(q)
    k = _f64(k)
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    a = scale * np.matmul(q, np.swapaxes(k, -1, -2))
    if bias is not None:
        a = a + _f64(bias)
    return a


def _stable_softmax(a, vis):
    """Row softmax of logits ``a`` over the visible entries.

    Returns ``(weights, lse)``. Subtracts the row max of the visible logits
    before exponentiating. A row with no visible key (or whose visible
    logits are all -inf) gives zero weights and lse -inf. NaN logits give
    a NaN row.
    """
    a, vis = np.broadcast_arrays(a, vis)
    masked = np.where(vis, a, -np.inf)
    with np.errstate(invalid="ignore", over="ignore"):
        mx = np.max(masked, axis=-1, keepdims=True) if a.shape[-1] else \
            np.full(a.shape[:-1] + (1,), -np.inf)
        finite_mx = np.where(np.isfinite(mx), mx, 0.0)
        e = np.where(vis, np.exp(masked - finite_mx), 0.0)
        tot = e.sum(axis=-1, keepdims=True)
        w = np.where(tot > 0, e / np.where(tot > 0, tot, 1.0), 0.0)
        lse = np.where(tot > 0, np.log(np.where(tot > 0, tot, 1.0)) + finite_mx,
                       -np.inf)
    # a NaN logit in a visible position poisons exactly its row
    bad = np.any(vis & np.isnan(a), axis=-1, keepdims=True)
    # mx == +inf: overflowed logit; the result is not finite either
    bad |= np.isposinf(mx)
    w = np.where(bad, np.nan, w)
    lse = np.where(bad, np.nan, lse)
    return w, lse[..., 0]


def softmax_similarity(q, k, scale=None, bias=None, causal=False, mask=None,
                       window=None):
    """Unnormalised ``s_ij = exp(scale * q_i . k_j + b_ij)``; 0 where not visible.

    ``scale`` defaults to ``1/sqrt(d)``. Not stabilised (it is the literal
    definition), so it overflows for large logits.
    """
    a = softmax_logits(q, k, scale, bias)
    vis = visibility(a.shape[-2], a.shape[-1], causal, mask, window)
    a, vis = np.broadcast_arrays(a, vis)
    with np.errstate(over="ignore"):
        return np.where(vis, np.exp(np.where(vis, a, 0.0)), 0.0)


def softmax_weights(q, k, scale=None, bias=None, causal=False, mask=None,
                    window=None):
    """``w_ij = s_ij / sum_j' s_ij'`` over visible keys (stable, row max
    subtracted); all-zero rows for queries that see nothing."""
    a = softmax_logits(q, k, scale, bias)
    vis = visibility(a.shape[-2], a.shape[-1], causal, mask, window)
    w, _ = _stable_softmax(a, vis)
    return w


def softmax_attention(q, k, v, scale=None, causal=False, mask=None, bias=None,
                      window=None, return_lse=False):
    """``o_i = sum_j w_ij v_j``, ``w_ij = softmax_j(scale q_i.k_j + b_ij)``.

    With ``return_lse`` also ``lse_i = log sum_j exp(scale q_i.k_j + b_ij)``
    over the visible keys (``-inf`` for a row that sees nothing).
    """
    a = softmax_logits(q, k, scale, bias)
    vis = visibility(a.shape[-2], a.shape[-1], causal, mask, window)
    w, lse = _stable_softmax(a, vis)
    o = _weighted_sum(w, v)
    if return_lse:
        return o, lse
    return o


# --------------------------------------------------------------------------
# Gaussian kernel attention, docs/softmax.md
# --------------------------------------------------------------------------

def _check_sigma(sigma):
    if not (np.isfinite(sigma) and sigma > 0):
        raise ValueError("sigma must be finite and > 0")


def gaussian_logits(q, k, sigma=1.0, bias=None):
    """``a_ij = -|q_i - k_j|^2 / (2 sigma^2) + b_ij`` from the distance itself."""
    _check_sigma(sigma)
    q = _f64(q)
    k = _f64(k)
    n, m = q.shape[-2], k.shape[-2]
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    a = np.empty(lead + (n, m))
    for i in range(n):  # one query row at a time: O(m d) memory per row
        diff = q[..., i:i + 1, :] - k  # (..., m, d)
        a[..., i, :] = -np.sum(diff * diff, axis=-1) / (2.0 * sigma * sigma)
    if bias is not None:
        a = a + _f64(bias)
    return a


def gaussian_similarity(q, k, sigma=1.0, bias=None, causal=False, mask=None,
                        window=None):
    """``s_ij = exp(-|q_i - k_j|^2 / (2 sigma^2) + b_ij)``; 0 where not visible."""
    a = gaussian_logits(q, k, sigma, bias)
    vis = visibility(a.shape[-2], a.shape[-1], causal, mask, window)
    a, vis = np.broadcast_arrays(a, vis)
    with np.errstate(over="ignore"):
        return np.where(vis, np.exp(np.where(vis, a, 0.0)), 0.0)


def gaussian_weights(q, k, sigma=1.0, bias=None, causal=False, mask=None,
                     window=None):
    """Normalised gaussian weights, stabilised per row (row max subtracted)."""
    a = gaussian_logits(q, k, sigma, bias)
    vis = visibility(a.shape[-2], a.shape[-1], causal, mask, window)
    w, _ = _stable_softmax(a, vis)
    return w


def gaussian_attention(q, k, v, sigma=1.0, causal=False, mask=None, bias=None,
                       window=None, return_lse=False):
    """Nadaraya-Watson: ``o_i = sum_j s_ij v_j / sum_j s_ij`` with
    ``s_ij = exp(-|q_i - k_j|^2 / (2 sigma^2) + b_ij)``.

    ``lse_i = log sum_j s_ij`` (the log of this variant's own normaliser,
    i.e. ``log(gaussian_similarity(...).sum(-1))``).
    """
    a = gaussian_logits(q, k, sigma, bias)
    vis = visibility(a.shape[-2], a.shape[-1], causal, mask, window)
    w, lse = _stable_softmax(a, vis)
    o = _weighted_sum(w, v)
    if return_lse:
        return o, lse
    return o


# --------------------------------------------------------------------------
# Kernelised (linear) attention, docs/linear.md
# --------------------------------------------------------------------------

def _fm_elu(x, **_):
    """``elu(x) + 1`` = ``x + 1`` for x > 0, ``exp(x)`` otherwise."""
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def _fm_relu(x, **_):
    """``max(x, 0)``."""
    return np.maximum(x, 0.0)


def _fm_softmax(x, **_):
    """``softmax(x)`` over the feature (last) axis."""
    mx = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - mx)
    return e / e.sum(axis=-1, keepdims=True)


def _fm_taylor(x, **_):
    """``[1, x/|x|]`` (size d+1); a zero vector gives ``[1, 0, ..., 0]``."""
    nrm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
    with np.errstate(invalid="ignore", divide="ignore"):
        u = np.where(nrm > 0, x / np.where(nrm > 0, nrm, 1.0), 0.0)
    ones = np.ones(x.shape[:-1] + (1,))
    return np.concatenate([ones, u], axis=-1)


def _fm_focused(x, p=3, **_):
    """``f_p(relu(x))`` with ``f_p(y) = |y| * y**p / |y**p|`` (norms over the
    head's feature vector); a zero vector gives 0."""
    y = np.maximum(x, 0.0)
    ny = np.sqrt(np.sum(y * y, axis=-1, keepdims=True))
    yp = y ** p
    nyp = np.sqrt(np.sum(yp * yp, axis=-1, keepdims=True))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(nyp > 0, ny * yp / np.where(nyp > 0, nyp, 1.0), 0.0)


def _fm_favor(x, projection=None, **_):
    """FAVOR+: ``r**-0.5 * exp(W x~ - |x~|^2 / 2)``, ``x~ = d**-0.25 x``,
    with ``W = projection`` of shape ``(r, d)``. Unstabilised (literal)."""
    if projection is None:
        raise ValueError("favor needs projection=")
    W = _f64(projection)
    r, d = W.shape
    if x.shape[-1] != d:
        raise ValueError("projection must be (r, d)")
    xt = x * d ** -0.25
    return r ** -0.5 * np.exp(xt @ W.T - 0.5 * np.sum(xt * xt, axis=-1,
                                                       keepdims=True))


def _fm_identity(x, **_):
    """The inputs themselves (must be non-negative)."""
    if np.any(x < 0):
        raise ValueError("identity features must be non-negative")
    return x


FEATURE_MAPS = {
    "elu": _fm_elu,
    "relu": _fm_relu,
    "softmax": _fm_softmax,
    "taylor": _fm_taylor,
    "focused": _fm_focused,
    "favor": _fm_favor,
    "identity": _fm_identity,
}


def apply_feature_map(x, name="elu", projection=None, p=3):
    """Apply the named feature map (or a callable) to the last axis of x."""
    x = _f64(x)
    if callable(name):
        return _f64(name(x))
    return FEATURE_MAPS[name](x, projection=projection, p=p)


def _key_mask_to_mask(key_mask, mask):
    """key_mask ``(..., m)`` -> mask ``(..., 1, m)``, combined with ``mask``."""
    if key_mask is None:
        return mask
    km = np.asarray(key_mask)
    if km.dtype != np.bool_:
        raise TypeError("key_mask must be boolean")
    km = km[..., None, :]
    if mask is None:
        return km
    return np.asarray(mask) & km


def linear_similarity(q, k, feature_map="elu", causal=False, key_mask=None,
                      mask=None, window=None, projection=None, p=3):
    """``s_ij = phi(q_i) . psi(k_j)`` over visible keys (0 elsewhere)."""
    fq = apply_feature_map(q, feature_map, projection, p)
    fk = apply_feature_map(k, feature_map, projection, p)
    s = np.matmul(fq, np.swapaxes(fk, -1, -2))
    vis = visibility(s.shape[-2], s.shape[-1], causal,
                     _key_mask_to_mask(key_mask, mask), window)
    s, vis = np.broadcast_arrays(s, vis)
    return np.where(vis, s, 0.0)


def _clamped_weights(s, eps):
    """``w_ij = s_ij / max(sum_j s_ij, eps)``; a zero row stays zero."""
    tot = s.sum(axis=-1, keepdims=True)
    den = np.maximum(tot, eps)
    # eps = 0: a row of zero mass divides 0 by 0; it returns zeros
    return np.where(den > 0, s / np.where(den > 0, den, 1.0), 0.0)


def linear_weights(q, k, feature_map="elu", causal=False, key_mask=None,
                   mask=None, window=None, eps=1e-6, projection=None, p=3):
    """``w_ij = s_ij / max(sum_j s_ij, eps)`` with the linear ``s_ij``."""
    s = linear_similarity(q, k, feature_map, causal, key_mask, mask, window,
                          projection, p)
    return _clamped_weights(s, eps)


def linear_attention(q, k, v, feature_map="elu", causal=False, key_mask=None,
                     mask=None, window=None, eps=1e-6, projection=None, p=3):
    """``o_i = phi(q_i) S / max(phi(q_i) . z, eps)``, ``S = sum_j psi(k_j) v_j^T``,
    ``z = sum_j psi(k_j)`` over the visible keys; computed as
    ``o = W @ v`` with ``W = linear_weights(...)``."""
    w = linear_weights(q, k, feature_map, causal, key_mask, mask, window, eps,
                       projection, p)
    return _weighted_sum(w, v)


# --------------------------------------------------------------------------
# cosFormer
# --------------------------------------------------------------------------

def cosformer_similarity(q, k, causal=False, key_mask=None, M=None, offset=0,
                         mask=None, window=None):
    """``s_ij = relu(q_i) . relu(k_j) * cos(pi/2 * (i - j) / M)`` with 1-based
    positions (queries 1..n, keys 1..m, both shifted by ``offset``);
    ``M`` defaults to ``max(n, m)``."""
    q = _f64(q)
    k = _f64(k)
    n, m = q.shape[-2], k.shape[-2]
    if M is None:
        M = max(n, m)
    pi = offset + np.arange(1, n + 1, dtype=np.float64)
    pj = offset + np.arange(1, m + 1, dtype=np.float64)
    c = np.cos(np.pi / 2 * (pi[:, None] - pj[None, :]) / M)
    s = np.matmul(np.maximum(q, 0.0), np.swapaxes(np.maximum(k, 0.0), -1, -2))
    s = s * c
    vis = visibility(n, m, causal, _key_mask_to_mask(key_mask, mask), window)
    s, vis = np.broadcast_arrays(s, vis)
    return np.where(vis, s, 0.0)


def cosformer_weights(q, k, causal=False, key_mask=None, M=None, offset=0,
                      mask=None, window=None, eps=1e-6):
    """``w_ij = s_ij / max(sum_j s_ij, eps)`` with the cosFormer ``s_ij``."""
    s = cosformer_similarity(q, k, causal, key_mask, M, offset, mask, window)
    return _clamped_weights(s, eps)


def cosformer_attention(q, k, v, causal=False, key_mask=None, M=None, offset=0,
                        mask=None, window=None, eps=1e-6):
    """``o = W @ v`` with the cosFormer weights."""
    w = cosformer_weights(q, k, causal, key_mask, M, offset, mask, window, eps)
    return _weighted_sum(w, v)


# --------------------------------------------------------------------------
# Efficient attention (Shen et al.)
# --------------------------------------------------------------------------

def _efficient_features(q, k, key_mask=None):
    """``rho_q(Q)`` = softmax of each query over its features;
    ``rho_k(K)`` = softmax of each key feature over the visible keys
    (masked keys get 0; a feature with no visible key is all 0)."""
    q = _f64(q)
    k = _f64(k)
    rq = _fm_softmax(q)
    if key_mask is None:
        km = np.ones(k.shape[:-1], dtype=bool)
    else:
        km = np.asarray(key_mask)
        if km.dtype != np.bool_:
            raise TypeError("key_mask must be boolean")
    shape = np.broadcast_shapes(k.shape[:-1], km.shape)
    k = np.broadcast_to(k, shape + k.shape[-1:])
    km = np.broadcast_to(km, shape)[..., None]  # (..., m, 1)
    kk = np.where(km, k, -np.inf)
    with np.errstate(invalid="ignore"):
        mx = np.max(kk, axis=-2, keepdims=True) if k.shape[-2] else \
            np.zeros(k.shape[:-2] + (1, k.shape[-1]))
        mx = np.where(np.isfinite(mx), mx, 0.0)
        e = np.where(km, np.exp(kk - mx), 0.0)
        tot = e.sum(axis=-2, keepdims=True)
        rk = np.where(tot > 0, e / np.where(tot > 0, tot, 1.0), 0.0)
    return rq, rk


def efficient_weights(q, k, key_mask=None):
    """``W = rho_q(Q) rho_k(K)^T`` (n x m); rows sum to 1 exactly whenever
    some key is visible."""
    rq, rk = _efficient_features(q, k, key_mask)
    return np.matmul(rq, np.swapaxes(rk, -1, -2))


def efficient_attention(q, k, v, key_mask=None):
    """``o = rho_q(Q) (rho_k(K)^T V)``."""
    rq, rk = _efficient_features(q, k, key_mask)
    return np.matmul(rq, np.matmul(np.swapaxes(rk, -1, -2), _f64(v)))


# --------------------------------------------------------------------------
# gradients (moved from tests/reference_grad.py)
# --------------------------------------------------------------------------

def reduce_to(grad, shape):
    """Sum ``grad`` over the axes its input was broadcast along."""
    shape = tuple(shape)
    while grad.ndim > len(shape):
        grad = grad.sum(axis=0)
    for axis, size in enumerate(shape):
        if size == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis=axis, keepdims=True)
    return grad


def _weight_grads(w, v, dout):
    """From o = w v: (dw_logits, dv) for w = softmax(logits) row by row:
    dv = w^T dO; dw = dO v^T; d logits = w * (dw - sum_j w dw)."""
    v, dout = _f64(v), _f64(dout)
    dv = np.matmul(np.swapaxes(w, -1, -2), dout)
    dw = np.matmul(dout, np.swapaxes(v, -1, -2))
    d_logits = w * (dw - np.sum(w * dw, axis=-1, keepdims=True))
    return d_logits, dv


def softmax_attention_grads(dout, q, k, v, scale=None, causal=False, mask=None, bias=None,
                            window=None, dropout_keep=None, dropout_p=0.0):
    """(dq, dk, dv, dbias) of softmax attention, logits a = scale q.k + b.
    dropout_keep: the boolean keep mask of the weights (kept ones scaled
    by 1 / (1 - dropout_p)), or None."""
    q, k = _f64(q), _f64(k)
    d = q.shape[-1]
    scale = 1 / np.sqrt(d) if scale is None else scale
    w = softmax_weights(q, k, scale=scale, bias=bias, causal=causal, mask=mask, window=window)
    if dropout_keep is None:
        d_logits, dv = _weight_grads(w, v, dout)
    else:
        # o = (w * keep / (1 - p)) v: the dropped weights' gradient flows
        # back through the same mask
        factor = np.where(dropout_keep, 1 / (1 - dropout_p), 0.0)
        dw = np.matmul(_f64(dout), np.swapaxes(_f64(v), -1, -2)) * factor
        dv = np.matmul(np.swapaxes(w * factor, -1, -2), _f64(dout))
        d_logits = w * (dw - np.sum(w * dw, axis=-1, keepdims=True))
    dq = scale * np.matmul(d_logits, k)
    dk = scale * np.matmul(np.swapaxes(d_logits, -1, -2), q)
    return dq, dk, dv, d_logits


def gaussian_attention_grads(dout, q, k, v, sigma=1.0, causal=False, mask=None, bias=None,
                             window=None):
    """(dq, dk, dv, dbias) of gaussian attention, logits
    a_ij = -|q_i - k_j|^2 / (2 sigma^2) + b_ij: da/dq_i = (k_j - q_i) / sigma^2,
    da/dk_j = (q_i - k_j) / sigma^2."""
    q, k = _f64(q), _f64(k)
    w = gaussian_weights(q, k, sigma=sigma, bias=bias, causal=causal, mask=mask, window=window)
    d_logits, dv = _weight_grads(w, v, dout)
    row_sums = d_logits.sum(axis=-1)[..., None]      # (..., n, 1)
    col_sums = d_logits.sum(axis=-2)[..., None]      # (..., m, 1)
    dq = (np.matmul(d_logits, k) - row_sums * q) / sigma**2
    dk = (np.matmul(np.swapaxes(d_logits, -1, -2), q) - col_sums * k) / sigma**2
    return dq, dk, dv, d_logits


# --------------------------------------------------------------------------
# Dropout: Philox4x32-10 keep decisions of (seed, head, i, j)
# --------------------------------------------------------------------------

_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_MASK32 = 0xFFFFFFFF


def philox4x32_10(counter, key):
    """Philox4x32-10 of Salmon et al. (SC 2011) on uint64 arrays holding
    32-bit words: counter (4, ...) and key (2,) -> (4, ...)."""
    c0, c1, c2, c3 = (np.asarray(word, dtype=np.uint64) for word in counter)
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for round_index in range(10):
        if round_index:
            k0 = (k0 + np.uint64(_PHILOX_W[0])) & np.uint64(_MASK32)
            k1 = (k1 + np.uint64(_PHILOX_W[1])) & np.uint64(_MASK32)
        p0 = np.uint64(_PHILOX_M[0]) * c0
        p1 = np.uint64(_PHILOX_M[1]) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & np.uint64(_MASK32),
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & np.uint64(_MASK32))
    return np.stack([c0, c1, c2, c3])


def dropout_keep(seed, p, lead, n, m):
    """The keep mask (lead + (n, m)) of attention dropout: weight (head, i, j)
    is kept when word j % 4 of Philox(counter = (i, j // 4, head low, head
    high), key = (seed low, seed high)) is at least floor(p 2^32); head is
    the flat C-order index of the leading axes."""
    heads = int(np.prod(lead, dtype=np.int64))
    head, i, j = np.meshgrid(np.arange(heads, dtype=np.uint64), np.arange(n, dtype=np.uint64),
                             np.arange(m, dtype=np.uint64), indexing="ij")
    words = philox4x32_10((i, j // np.uint64(4), head & np.uint64(_MASK32), head >> np.uint64(32)),
                          (seed & _MASK32, seed >> 32))
    word = np.take_along_axis(words, (j % np.uint64(4)).astype(np.int64)[None], axis=0)[0]
    return (word >= np.uint64(int(p * 2**32))).reshape(tuple(lead) + (n, m))


# --------------------------------------------------------------------------
# the delta rule (moved from tests/reference_delta.py)
# --------------------------------------------------------------------------

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
