"""Plain numpy float64 references of the attnx gradients, written straight
from the chain rule over explicit n x m matrices. Nothing here imports attnx.

Every function returns the gradients of ``sum(dout * out)`` at the
broadcast batch shape; ``reduce_to`` sums one down to an input's shape.
"""
import numpy as np

from reference import _f64, gaussian_weights, softmax_weights


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
