"""Attention over fewer keys than the sequence holds: block-sparse layouts,
low-rank projections of the keys (Linformer) and pooled keys. Each is
exact softmax attention over a chosen or derived set of keys, computed by
the softmax kernel itself."""
import math

import numpy as np

from . import _C
from ._grad import Gradients, register_vjp
from ._softmax import _finish, _grad_dtype, softmax_attention_backward

_CAUSAL_MODES = {False: None, True: "lower_right", "lower_right": "lower_right", "upper_left": "upper_left"}


def _result_dtype(*arrays):
    """The dtype softmax attention returns for these inputs."""
    dtype = np.result_type(*(a.dtype for a in arrays))
    if dtype.kind in "iub":
        return np.dtype(np.float64)
    if dtype.kind != "f":
        raise TypeError(f"q, k, v must hold real numbers (float, int or bool), got dtype {dtype}")
    return dtype


def _as_array(x, name, ndim=2):
    x = np.asarray(x)
    if x.ndim < ndim:
        raise ValueError(f"{name} must have at least {ndim} dimensions, got shape {x.shape}")
    return x


def _check_qkv(q, k, v):
    q, k, v = _as_array(q, "q"), _as_array(k, "k"), _as_array(v, "v")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k's last axis ({k.shape[-1]}) must match q's (d = {q.shape[-1]}): "
                         f"q (..., n, d), k (..., m, d)")
    if v.shape[-2] != k.shape[-2]:
        raise ValueError(f"v (..., m, e) must have as many rows as k (m = {k.shape[-2]}), "
                         f"got shape {v.shape}")
    return q, k, v


def _count(value, name, minimum):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


# --------------------------------------------------------------------------
# Block-sparse attention
# --------------------------------------------------------------------------

def _band(n, m, causal, window):
    """The causal and window rules as one band ``lo <= j - i <= hi`` (in
    tokens; None for an open side)."""
    try:
        mode = _CAUSAL_MODES[causal]
    except (KeyError, TypeError):
        raise ValueError(f"causal must be False, True, 'lower_right' or 'upper_left', got {causal!r}") from None
    offset = m - n
    lo = hi = None
    if mode == "lower_right":
        hi = offset
    elif mode == "upper_left":
        hi = 0
    if window is not None:
        sides = window if isinstance(window, tuple) else (window, window)
        if len(sides) != 2:
            raise ValueError(f"window must be w or (left, right), got {window!r}")
        left, right = (None if side is None else _count(side, "window", 0) for side in sides)
        if left is not None:
            lo = offset - left
        if right is not None:
            hi = offset + right if hi is None else min(hi, offset + right)
    return lo, hi


def _key_selection(columns, block_size, m):
    """The key tokens of the given key blocks: a slice when the blocks are
    consecutive (a view, no copy), else an index array."""
    first, last = int(columns[0]), int(columns[-1])
    if last - first + 1 == columns.size:
        return slice(first * block_size, min((last + 1) * block_size, m))
    tokens = (columns[:, None] * block_size + np.arange(block_size)).ravel()
    return tokens[tokens < m] if tokens[-1] >= m else tokens


def _token_range(selection):
    return np.arange(selection.start, selection.stop) if isinstance(selection, slice) else selection


class _BlockPlan:
    """The calls block-sparse attention makes: for each slice of the layout
    over its own leading axes, runs of consecutive query blocks with the
    same key blocks, each one softmax call over just those key blocks.
    Under a causal or window rule each query block is its own run: key
    blocks that the rule hides from all its queries are dropped, and a run
    with partly hidden blocks gets a token mask.
    """

    def __init__(self, layout, block_size, lead, n, m, causal, window):
        self.block_size = block_size = _count(block_size, "block_size", 1)
        layout = np.asarray(layout)
        if layout.dtype != np.bool_:
            raise TypeError(f"layout must be a boolean array of blocks, got dtype {layout.dtype}")
        if layout.ndim < 2:
            raise ValueError(f"layout must have at least 2 dimensions (..., n_blocks, m_blocks), got shape {layout.shape}")
        self.n, self.m = n, m
        n_blocks, m_blocks = -(-n // block_size), -(-m // block_size)
        core = layout.shape[-2:]
        if core[0] not in (1, n_blocks) or core[1] not in (1, m_blocks):
            raise ValueError(f"layout of shape {layout.shape} must broadcast to (..., {n_blocks}, {m_blocks}): "
                             f"ceil(n / block_size) query blocks by ceil(m / block_size) key blocks "
                             f"(n = {n}, m = {m}, block_size = {block_size})")
        self.layout = np.broadcast_to(layout, layout.shape[:-2] + (n_blocks, m_blocks))
        self.lead = lead
        # the axes of the broadcast leading shape along which the layout varies
        pad = len(lead) - (layout.ndim - 2)
        self.varying = tuple(pad + i for i, size in enumerate(layout.shape[:-2]) if size != 1)
        self.band = _band(n, m, causal, window)

    def select(self, x, index, core=2):
        """x's part for one slice of the layout: the layout's varying axes
        taken out at ``index`` (at 0 where x has size 1 there)."""
        if x is None or not self.varying:
            return x
        pad = len(self.lead) - (x.ndim - core)
        key = [slice(None)] * x.ndim
        for axis, i in zip(self.varying, index):
            if axis >= pad:
                key[axis - pad] = i if x.shape[axis - pad] != 1 else 0
        return x[tuple(key)]

    @staticmethod
    def call_ndim(*inputs):
        """The number of axes of a softmax call's result over these inputs."""
        return len(np.broadcast_shapes(*(x.shape[:-2] for x in inputs if x is not None))) + 2

    def slices(self):
        """(index, layout2d) for each slice of the layout's varying axes."""
        shape = tuple(self.lead[axis] for axis in self.varying)
        for index in np.ndindex(*shape):
            key = [0] * (self.layout.ndim - 2)
            pad = len(self.lead) - (self.layout.ndim - 2)
            for axis, i in zip(self.varying, index):
                key[axis - pad] = i
            yield index, self.layout[tuple(key)]

    def runs(self, layout2d):
        """(query rows, key selection or None, token mask or None) per run."""
        bs, n, m = self.block_size, self.n, self.m
        lo, hi = self.band
        n_blocks = layout2d.shape[0]
        if n_blocks == 0:
            return
        if lo is None and hi is None:
            starts = np.flatnonzero(np.r_[True, np.any(layout2d[1:] != layout2d[:-1], axis=1)])
        else:  # the band gives each query block its own key blocks
            starts = np.arange(n_blocks)
        for start, stop in zip(starts, np.r_[starts[1:], n_blocks]):
            rows = slice(int(start) * bs, min(int(stop) * bs, n))
            columns = np.flatnonzero(layout2d[start])
            if columns.size and (lo is not None or hi is not None):
                first_q, last_q = rows.start, rows.stop - 1
                first_k = columns * bs
                last_k = np.minimum(first_k + bs, m) - 1
                # hidden from every query of the run: j - i < lo or > hi throughout
                hidden = np.zeros(columns.size, dtype=bool)
                if lo is not None:
                    hidden |= last_k - first_q < lo
                if hi is not None:
                    hidden |= first_k - last_q > hi
                columns = columns[~hidden]
            if columns.size == 0:
                yield rows, None, None
                continue
            keys = _key_selection(columns, bs, m)
            token_mask = None
            if lo is not None or hi is not None:
                offsets = _token_range(keys)[None, :] - np.arange(rows.start, rows.stop)[:, None]
                visible = np.ones(offsets.shape, dtype=bool)
                if lo is not None:
                    visible &= offsets >= lo
                if hi is not None:
                    visible &= offsets <= hi
                token_mask = None if visible.all() else visible
            yield rows, keys, token_mask


def _gather(x, rows, keys):
    """The part of a mask or bias broadcastable to (..., n, m) for these
    query rows and key tokens (its size-1 axes stay)."""
    if x is None:
        return None
    if x.shape[-2] != 1:
        x = x[..., rows, :]
    if x.shape[-1] != 1:
        x = x[..., keys] if isinstance(keys, slice) else np.take(x, keys, axis=-1)
    return x


def _check_pairwise(x, name, n, m):
    """A mask or bias, broadcastable to (..., n, m)."""
    if x is None:
        return None
    x = np.asarray(x)
    if x.ndim < 2:
        x = x.reshape((1,) * (2 - x.ndim) + x.shape)
    if x.shape[-2] not in (1, n) or x.shape[-1] not in (1, m):
        raise ValueError(f"{name} of shape {x.shape} must broadcast to (..., n, m) = (..., {n}, {m})")
    if name == "mask" and x.dtype != np.bool_:
        raise TypeError(f"mask must be a boolean array (True = may attend), got dtype {x.dtype}")
    return x


def _prepare(q, k, v, layout, block_size, causal, mask, bias, window):
    q, k, v = _check_qkv(q, k, v)
    n, m = q.shape[-2], k.shape[-2]
    mask = _check_pairwise(mask, "mask", n, m)
    bias = _check_pairwise(bias, "bias", n, m)
    layout = np.asarray(layout)
    try:
        lead = np.broadcast_shapes(*(x.shape[:-2] for x in (q, k, v, layout, mask, bias) if x is not None))
    except ValueError:
        raise ValueError("the leading axes of q, k, v, layout, mask and bias do not broadcast: "
                         f"q {q.shape}, k {k.shape}, v {v.shape}, layout {layout.shape}") from None
    return q, k, v, mask, bias, _BlockPlan(layout, block_size, lead, n, m, causal, window)


def _trim(x, ndim):
    """x without the leading size-1 axes beyond ndim (those only the
    layout has): the shape a softmax call over the slice's inputs gives."""
    return x[(0,) * (x.ndim - ndim)]


def block_sparse_attention(q, k, v, layout, block_size, *, scale=None, causal=False, mask=None,
                           bias=None, window=None, out=None, return_lse=False):
    """Softmax attention restricted to a layout of blocks.

    Equal to ``softmax_attention(q, k, v, mask=M, ...)`` with
    ``M = kron(layout, ones((block_size, block_size)))[:n, :m]``: query
    block i (rows ``i*bs .. i*bs + bs - 1``) sees key block j when
    ``layout[..., i, j]``. ``layout`` is boolean, broadcastable to
    (..., ceil(n / block_size), ceil(m / block_size)); its leading axes
    broadcast with q, k, v's (one layout per head, or one for all). Build
    layouts with :mod:`attnx.layouts`.

    Only the named blocks are computed: each run of query blocks with the
    same key blocks is one softmax call over those key blocks alone, so
    the cost is proportional to the number of active blocks. The softmax
    options (``scale``, ``causal``, ``mask``, ``bias``, ``window``) apply on
    top of the layout, with the meaning they have in softmax_attention;
    blocks that causal or the window hide entirely are skipped too.
    ``out=`` receives the result; ``return_lse=True`` also returns the
    log-sum-exp per query row. Rows that see no key are zeros (lse -inf).
    """
    q, k, v, mask, bias, plan = _prepare(q, k, v, layout, block_size, causal, mask, bias, window)
    n, m, e, lead = q.shape[-2], k.shape[-2], v.shape[-1], plan.lead
    dtype = _result_dtype(q, k, v)
    if out is None:
        out = np.empty(lead + (n, e), dtype=dtype)
    else:
        if not isinstance(out, np.ndarray) or out.shape != lead + (n, e) or out.dtype != dtype:
            raise ValueError(f"out must be an array of shape {lead + (n, e)} and dtype {dtype}")
        if any(np.shares_memory(out, x) for x in (q, k, v)):
            raise ValueError("out must not overlap q, k or v")
    lse = np.empty(lead + (n,), dtype=np.float64 if dtype == np.float64 else np.float32) if return_lse else None
    for index, layout2d in plan.slices():
        q_i, k_i, v_i = (plan.select(x, index) for x in (q, k, v))
        mask_i, bias_i, out_i = (plan.select(x, index) for x in (mask, bias, out))
        lse_i = plan.select(lse, index, core=1)
        call_ndim = plan.call_ndim(q_i, k_i, v_i, mask_i, bias_i)
        out_i = _trim(out_i, call_ndim)
        if lse is not None:
            lse_i = _trim(lse_i, call_ndim - 1)
        for rows, keys, token_mask in plan.runs(layout2d):
            if keys is None:
                out_i[..., rows, :] = 0
                if lse is not None:
                    lse_i[..., rows] = -np.inf
                continue
            run_mask = _gather(mask_i, rows, keys)
            if token_mask is not None:
                run_mask = token_mask if run_mask is None else run_mask & token_mask
            result = _C.softmax_attention(
                q_i[..., rows, :], _take_keys(k_i, keys), _take_keys(v_i, keys), scale=scale,
                mask=run_mask, bias=_gather(bias_i, rows, keys),
                out=out_i[..., rows, :], return_lse=return_lse)
            if lse is not None:
                lse_i[..., rows] = result[1]
    return (out, lse) if return_lse else out


def _take_keys(x, keys):
    return x[..., keys, :] if isinstance(keys, slice) else np.take(x, keys, axis=-2)


def _scatter_add(target, rows, keys, grad):
    """target[..., rows, keys] += grad for a bias gradient (size-1 axes of
    the bias are not indexed, as in _gather)."""
    if target.shape[-2] != 1:
        target = target[..., rows, :]
    if target.shape[-1] == 1:
        target += grad
    else:
        target[..., keys] += grad


def block_sparse_attention_backward(dout, q, k, v, out, lse, layout, block_size, *, scale=None,
                                    causal=False, mask=None, bias=None, window=None,
                                    bias_grad=False, dq=None, dk=None, dv=None):
    """Gradients of ``sum(dout * block_sparse_attention(q, k, v, layout,
    block_size, ...))``, with the forward's ``out`` and ``lse``
    (``return_lse=True``) and options. Runs the forward's plan: one
    softmax backward per run of query blocks over its key blocks alone,
    the key and value gradients added into place. Returns
    :class:`attnx.Gradients` (q, k, v, and bias when ``bias_grad=True``)."""
    q, k, v, mask, bias, plan = _prepare(q, k, v, layout, block_size, causal, mask, bias, window)
    n, e, lead = q.shape[-2], v.shape[-1], plan.lead
    dout, out, lse = np.asarray(dout), np.asarray(out), np.asarray(lse)
    for name, x, shape in (("dout", dout, lead + (n, e)), ("out", out, lead + (n, e)), ("lse", lse, lead + (n,))):
        if x.shape != shape:
            raise ValueError(f"{name} must have the shape of the forward's result {shape}, got {x.shape}")
    compute = _result_dtype(q, k, v)
    grads = [np.zeros(x.shape, _grad_dtype(x, compute)) for x in (q, k, v)]
    grad_bias = np.zeros(bias.shape, _grad_dtype(bias, compute)) if bias_grad and bias is not None else None
    for index, layout2d in plan.slices():
        q_i, k_i, v_i, mask_i, bias_i = (plan.select(x, index) for x in (q, k, v, mask, bias))
        call_ndim = plan.call_ndim(q_i, k_i, v_i, mask_i, bias_i)
        dout_i, out_i = (_trim(plan.select(x, index), call_ndim) for x in (dout, out))
        lse_i = _trim(plan.select(lse, index, core=1), call_ndim - 1)
        dq_i, dk_i, dv_i, dbias_i = (plan.select(x, index) for x in grads + [grad_bias])
        for rows, keys, token_mask in plan.runs(layout2d):
            if keys is None:
                continue
            run_mask = _gather(mask_i, rows, keys)
            if token_mask is not None:
                run_mask = token_mask if run_mask is None else run_mask & token_mask
            g = softmax_attention_backward(
                dout_i[..., rows, :], q_i[..., rows, :], _take_keys(k_i, keys), _take_keys(v_i, keys),
                out_i[..., rows, :], lse_i[..., rows], scale=scale, mask=run_mask,
                bias=_gather(bias_i, rows, keys), bias_grad=dbias_i is not None)
            dq_i[..., rows, :] += g.q
            # keys are distinct within a run, so fancy-index += adds each once
            dk_i[..., keys, :] += g.k
            dv_i[..., keys, :] += g.v
            if dbias_i is not None:
                _scatter_add(dbias_i, rows, keys, g.bias)
    return Gradients(q=_finish(grads[0], q, "dq", dq), k=_finish(grads[1], k, "dk", dk),
                     v=_finish(grads[2], v, "dv", dv), bias=grad_bias)


def _block_sparse_vjp(q, k, v, layout, block_size, **options):
    if options.get("return_lse"):
        raise TypeError("vjp: return_lse is not an option of the differentiated function")
    out, lse = block_sparse_attention(q, k, v, layout, block_size, return_lse=True, **options)
    options.pop("out", None)

    def pullback(dout):
        return block_sparse_attention_backward(dout, q, k, v, out, lse, layout, block_size,
                                               bias_grad=options.get("bias") is not None, **options)

    return out, pullback


register_vjp(block_sparse_attention, _block_sparse_vjp)
