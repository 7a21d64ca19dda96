"""Attention over fewer keys than the sequence holds: block-sparse layouts,
low-rank projections of the keys (Linformer) and pooled keys. Each is
exact softmax attention over a chosen or derived set of keys, computed by
the softmax kernel itself."""
import math

import numpy as np

from . import _C
from ._checks import count as _count
from ._grad import Gradients, deliver, grad_dtype, register_vjp, sum_to_shape
from ._softmax import lse_vjp_rule, softmax_attention_backward

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


class _BlockPlan:
    """The calls block-sparse attention makes. For each slice of the layout
    over its own leading axes, the query blocks are grouped by how many key
    blocks they see; each group is one softmax call whose leading axes
    gain a group axis: query blocks (..., R, bs, d) against their own key
    blocks, gathered whole, (..., R, c * bs, d). A few calls per layout
    whatever the number of blocks, so that the threads of one call share
    out all the work (many small calls would each wait at their threads'
    barrier), and block copies rather than token gathers.
    Key blocks that the causal or window rule hides from every query of a
    block are dropped; blocks it hides in part get a token mask, as do the
    padding tokens that fill a short last key block to bs.
    """

    # the gathered keys and values of one call stay under this many bytes
    GATHER_BYTES = 64 << 20

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

    def slices(self):
        """(index, layout2d) for each slice of the layout's varying axes."""
        shape = tuple(self.lead[axis] for axis in self.varying)
        for index in np.ndindex(*shape):
            key = [0] * (self.layout.ndim - 2)
            pad = len(self.lead) - (self.layout.ndim - 2)
            for axis, i in zip(self.varying, index):
                key[axis - pad] = i
            yield index, self.layout[tuple(key)]

    def _active(self, layout2d):
        """The layout without the blocks the causal or window rule hides
        from every query of the query block."""
        lo, hi = self.band
        if lo is None and hi is None:
            return layout2d
        bs = self.block_size
        first_q = np.arange(layout2d.shape[0]) * bs
        last_q = np.minimum(first_q + bs, self.n) - 1
        first_k = np.arange(layout2d.shape[1]) * bs
        last_k = np.minimum(first_k + bs, self.m) - 1
        hidden = np.zeros(layout2d.shape, dtype=bool)
        if lo is not None:  # j - i < lo for every pair
            hidden |= last_k[None, :] - first_q[:, None] < lo
        if hi is not None:  # j - i > hi for every pair
            hidden |= first_k[None, :] - last_q[:, None] > hi
        return layout2d & ~hidden

    def groups(self, layout2d, bytes_per_key):
        """(query blocks (R,), key blocks (R, c) or None, call mask
        (R, bs or 1, c * bs) or None) for each call; key blocks None marks
        query blocks that see no key."""
        bs = self.block_size
        active = self._active(layout2d)
        counts = active.sum(axis=1)
        for count in np.unique(counts):
            rows = np.flatnonzero(counts == count)
            per_call = max(1, self.GATHER_BYTES // max(1, bytes_per_key * int(count) * bs))
            for first in range(0, rows.size, per_call):
                blocks = rows[first:first + per_call]
                if count == 0:
                    yield blocks, None, None
                    continue
                columns = np.nonzero(active[blocks])[1].reshape(blocks.size, int(count))
                yield blocks, columns, self._call_mask(blocks, columns)

    def _call_mask(self, blocks, columns):
        """The token mask of one call: the padding of a short last key
        block, and the causal or window rule where it hides part of a block;
        None when every pair is visible."""
        bs, n, m = self.block_size, self.n, self.m
        lo, hi = self.band
        key_tokens = (columns[:, :, None] * bs + np.arange(bs)).reshape(blocks.size, 1, -1)
        visible = key_tokens < m
        if lo is not None or hi is not None:
            query_tokens = (blocks[:, None] * bs + np.arange(bs))[:, :, None]
            offsets = key_tokens - query_tokens
            if lo is not None:
                visible = visible & (offsets >= lo)
            if hi is not None:
                visible = visible & (offsets <= hi)
            visible |= query_tokens >= n  # padding rows: discarded, whatever they see
        return None if visible.all() else visible

    def tokens(self, blocks, columns, *pairwise):
        """Query tokens (R, bs, 1) and key tokens (R, 1, c * bs) of a call,
        clipped to the sequences (the padding repeats the last token), for
        gathering the pairwise arrays given (None, None if there are none)."""
        if all(x is None for x in pairwise):
            return None, None
        bs = self.block_size
        query_tokens = np.minimum(blocks[:, None] * bs + np.arange(bs), self.n - 1)[:, :, None]
        key_tokens = np.minimum(columns[:, :, None] * bs + np.arange(bs), self.m - 1).reshape(blocks.size, 1, -1)
        return query_tokens, key_tokens


def _as_blocks(x, bs, fill=0, core=2):
    """x (..., L, c) as (..., ceil(L / bs), bs, c) (core=1: (..., L) as
    (..., ceil(L / bs), bs)): a view when bs divides L, else a copy padded
    with `fill`."""
    length = x.shape[-core]
    blocks = -(-length // bs)
    tail = x.shape[x.ndim - core + 1:]
    if length % bs:
        padded = np.full(x.shape[:x.ndim - core] + (blocks * bs,) + tail, fill, dtype=x.dtype)
        padded[(Ellipsis, slice(0, length)) + (slice(None),) * (core - 1)] = x
        x = padded
    # splitting one axis in two is always a view, whatever x's strides
    return x.reshape(x.shape[:x.ndim - core] + (blocks, bs) + tail)


class _BlockTaker:
    """Takes blocks of arrays (..., nb, bs, c): a view for a run of
    consecutive blocks or a band of them, else a copy into a buffer kept
    from call to call
    (numpy.take into a reused buffer, measured 3-10x faster than fancy
    indexing into fresh memory for 8-100 MB of blocks)."""

    def __init__(self):
        self.buffers = {}

    def __call__(self, name, x, blocks):
        """x at blocks (R,) -> (..., R, bs, c), or at blocks (R, c') joined
        per row -> (..., R, c' * bs, c)."""
        if blocks.ndim == 1 and blocks[-1] - blocks[0] + 1 == blocks.size:
            return x[..., int(blocks[0]):int(blocks[-1]) + 1, :, :]
        if blocks.ndim == 2:
            window = self._sliding(x, blocks)
            if window is not None:
                return window
        shape = x.shape[:-3] + blocks.shape + x.shape[-2:]
        size = math.prod(shape)
        buffer = self.buffers.get(name)
        if buffer is None or buffer.size < size or buffer.dtype != x.dtype:
            buffer = self.buffers[name] = np.empty(size, x.dtype)
        taken = buffer[:size].reshape(shape)
        np.take(x, blocks, axis=-3, out=taken, mode="clip")  # "raise" would buffer the output
        if blocks.ndim == 2:
            taken = taken.reshape(shape[:-4] + (blocks.shape[0], -1, shape[-1]))
        return taken

    @staticmethod
    def _sliding(x, columns):
        """When each row's key blocks are consecutive and each row starts a
        fixed number of blocks after the one before (a band, as local and
        causal layouts give), the rows are overlapping windows of x: a
        strided view, no copy. Else None."""
        rows, count = columns.shape
        first = columns[:, 0]
        if np.any(columns[:, -1] - first != count - 1):
            return None
        step = int(first[1] - first[0]) if rows > 1 else 0
        if step < 0 or np.any(np.diff(first) != step):
            return None
        base = x[..., int(first[0]):, :, :]
        block_stride, row_stride = base.strides[-3], base.strides[-2]
        return np.lib.stride_tricks.as_strided(
            base, base.shape[:-3] + (rows, count * x.shape[-2], x.shape[-1]),
            base.strides[:-3] + (step * block_stride, row_stride, base.strides[-1]), writeable=False)


def _gather(x, query_tokens, key_tokens):
    """A mask or bias broadcastable to (..., n, m) at these query and key
    tokens: (..., R, bs, K), size 1 where x has size 1."""
    if x is None:
        return None
    rows = query_tokens if x.shape[-2] != 1 else np.zeros((1, 1, 1), np.intp)
    columns = key_tokens if x.shape[-1] != 1 else np.zeros((1, 1, 1), np.intp)
    return x[..., rows, columns]


def _combine(user_mask, call_mask):
    if call_mask is None:
        return user_mask
    return call_mask if user_mask is None else user_mask & call_mask


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


def _call_lead(*inputs):
    """The leading axes of a softmax call over these slices (core 2)."""
    return np.broadcast_shapes(*(x.shape[:-2] for x in inputs if x is not None))


def _trim(x, ndim):
    """x without the leading size-1 axes beyond ndim (those only the
    layout has)."""
    return x[(0,) * (x.ndim - ndim)]


def block_sparse_attention(q, k, v, layout, block_size, *, scale=None, causal=False, mask=None,
                           bias=None, window=None, out=None, return_lse=False):
    """Softmax attention restricted to a layout of blocks.

    Only the named blocks are computed: the query blocks that see the same
    number of key blocks form one softmax call, each against its own key
    blocks, so the cost is proportional to the number of active blocks and
    a layout takes a few calls, not one per block row.

    Parameters
    ----------
    q : array_like, shape (..., n, d)
        Queries.
    k : array_like, shape (..., m, d)
        Keys.
    v : array_like, shape (..., m, e)
        Values; the leading axes of q, k, v broadcast.
    layout : array_like of bool
        Broadcastable to (..., ceil(n / block_size), ceil(m / block_size));
        query block i sees key block j when ``layout[..., i, j]``. Its
        leading axes broadcast with q, k, v's (one layout per head, or one
        for all). See `attnx.layouts`.
    block_size : int
        The rows of a query block and of a key block.
    scale, causal, mask, bias, window
        As in `softmax_attention`, applied on top of the layout; blocks
        that causal or the window hide entirely are skipped too.
    out : ndarray, optional
        Receives the result.
    return_lse : bool, default False
        Also return the log-sum-exp per query row.

    Returns
    -------
    out : ndarray, shape (..., n, e)
        The output; rows that see no key are zeros.
    lse : ndarray, shape (..., n)
        Only with ``return_lse=True`` (-inf for a row that sees no key).

    Raises
    ------
    ValueError
        A layout of the wrong shape, a block_size below 1, and the errors
        of `softmax_attention`.
    TypeError
        A layout that is not boolean, and the errors of
        `softmax_attention`.

    See Also
    --------
    attnx.layouts.bigbird : One of the layouts.
    softmax_attention : The same under an element mask.
    block_sparse_attention_backward : The gradients.

    Notes
    -----
    Equal to ``softmax_attention(q, k, v, mask=M, ...)`` with ``M =
    kron(layout, ones((block_size, block_size)))[:n, :m]`` (Child et al.
    2019; Zaheer et al. 2020 for BigBird's layouts).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((8, 4)) for _ in range(3))
    >>> layout = attnx.layouts.local(4, 1)           # 4 blocks of 2, one on each side
    >>> o = attnx.block_sparse_attention(q, k, v, layout, 2)
    >>> M = np.kron(layout, np.ones((2, 2), dtype=bool))
    >>> np.allclose(o, attnx.softmax_attention(q, k, v, mask=M))
    True
    """
    q, k, v, mask, bias, plan = _prepare(q, k, v, layout, block_size, causal, mask, bias, window)
    n, m, e, lead, bs = q.shape[-2], k.shape[-2], v.shape[-1], plan.lead, plan.block_size
    dtype = _result_dtype(q, k, v)
    if out is not None:
        if not isinstance(out, np.ndarray) or out.shape != lead + (n, e) or out.dtype != dtype:
            raise ValueError(f"out must be an array of shape {lead + (n, e)} and dtype {dtype}")
        if any(np.shares_memory(out, x) for x in (q, k, v)):
            raise ValueError("out must not overlap q, k or v")
    result = out if out is not None and n % bs == 0 else np.empty(lead + (-(-n // bs) * bs, e), dtype)
    lse_dtype = np.float64 if dtype == np.float64 else np.float32
    lse = np.empty(lead + (-(-n // bs) * bs,), lse_dtype) if return_lse else None
    if n and m:
        q_blocks, k_blocks, v_blocks = (_as_blocks(x, bs) for x in (q, k, v))
        out_blocks = _as_blocks(result, bs)
        lse_blocks = None if lse is None else _as_blocks(lse, bs, core=1)
        bytes_per_key = math.prod(lead) * (q.shape[-1] + e) * dtype.itemsize
        take = _BlockTaker()
        for index, layout2d in plan.slices():
            q_i, k_i, v_i = (plan.select(x, index, core=3) for x in (q_blocks, k_blocks, v_blocks))
            mask_i, bias_i = (plan.select(x, index) for x in (mask, bias))
            call_ndim = len(_call_lead(plan.select(q, index), plan.select(k, index), plan.select(v, index),
                                       mask_i, bias_i))
            out_i = _trim(plan.select(out_blocks, index, core=3), call_ndim + 3)
            lse_i = None if lse is None else _trim(plan.select(lse_blocks, index), call_ndim + 2)
            for blocks, columns, call_mask in plan.groups(layout2d, bytes_per_key):
                if columns is None:
                    out_i[..., blocks, :, :] = 0
                    if lse_i is not None:
                        lse_i[..., blocks, :] = -np.inf
                    continue
                query_tokens, key_tokens = plan.tokens(blocks, columns, mask_i, bias_i)
                computed = _C.softmax_attention(
                    take("q", q_i, blocks), take("k", k_i, columns), take("v", v_i, columns),
                    scale=scale, mask=_combine(_gather(mask_i, query_tokens, key_tokens), call_mask),
                    bias=_gather(bias_i, query_tokens, key_tokens), return_lse=return_lse)
                if lse_i is not None:
                    computed, lse_i[..., blocks, :] = computed
                out_i[..., blocks, :, :] = computed
    elif n:
        result[...] = 0
        if lse is not None:
            lse[...] = -np.inf
    if result is not out:
        if out is None:
            out = result[..., :n, :]
        else:
            out[...] = result[..., :n, :]
    return (out, lse[..., :n]) if return_lse else out


def _add_by_block(target, columns, grad):
    """target[..., j, :, :] += the sum of grad's blocks gathered from key
    block j: grad (..., R, c * bs, e) holds a block per entry of columns
    (R, c), where a key block appears once per query block that sees it."""
    blocks = columns.ravel()
    bs = target.shape[-2]
    grad = grad.reshape(grad.shape[:-3] + (blocks.size, bs, grad.shape[-1]))
    order = np.argsort(blocks, kind="stable")
    unique, starts = np.unique(blocks[order], return_index=True)
    target[..., unique, :, :] += np.add.reduceat(grad[..., order, :, :], starts, axis=-3)


def block_sparse_attention_backward(dout, q, k, v, out, lse, layout, block_size, *, scale=None,
                                    causal=False, mask=None, bias=None, window=None,
                                    bias_grad=False, dq=None, dk=None, dv=None):
    """Gradients of ``sum(dout * block_sparse_attention(q, k, v, layout, block_size, ...))``.

    Runs the forward's plan: one softmax backward per group of query
    blocks over their key blocks, the key and value gradients added back
    to their blocks.

    Parameters
    ----------
    dout : array_like, shape (..., n, e)
        The gradient arriving at the forward's output.
    q, k, v : array_like
        The forward's inputs.
    out, lse : array_like
        The forward's results (``return_lse=True``).
    layout, block_size, scale, causal, mask, bias, window
        The forward's arguments.
    bias_grad : bool, default False
        Also return the gradient of ``bias``.
    dq, dk, dv : ndarray, optional
        Arrays to receive the gradients.

    Returns
    -------
    Gradients
        ``q``, ``k``, ``v`` (and ``bias`` with ``bias_grad=True``), each of
        its input's shape and dtype.

    Raises
    ------
    ValueError
        Shapes that do not match the forward's, or its options' errors.
    TypeError
        Inputs of an unsupported dtype.

    See Also
    --------
    block_sparse_attention : The forward.
    softmax_attention_backward : The backward of each group.

    Notes
    -----
    Equal to ``softmax_attention_backward`` under the expanded mask, with
    only the named blocks computed.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((8, 4)) for _ in range(3))
    >>> layout = np.tri(4, dtype=bool)
    >>> out, lse = attnx.block_sparse_attention(q, k, v, layout, 2, return_lse=True)
    >>> g = attnx.block_sparse_attention_backward(np.ones_like(out), q, k, v, out, lse, layout, 2)
    >>> M = np.kron(layout, np.ones((2, 2), dtype=bool))
    >>> out2, lse2 = attnx.softmax_attention(q, k, v, mask=M, return_lse=True)
    >>> g2 = attnx.softmax_attention_backward(np.ones_like(out), q, k, v, out2, lse2, mask=M)
    >>> all(np.allclose(a, b) for a, b in zip(g[:3], g2[:3]))
    True
    """
    q, k, v, mask, bias, plan = _prepare(q, k, v, layout, block_size, causal, mask, bias, window)
    n, m, e, lead, bs = q.shape[-2], k.shape[-2], v.shape[-1], plan.lead, plan.block_size
    dout, out, lse = np.asarray(dout), np.asarray(out), np.asarray(lse)
    for name, x, shape in (("dout", dout, lead + (n, e)), ("out", out, lead + (n, e)), ("lse", lse, lead + (n,))):
        if x.shape != shape:
            raise ValueError(f"{name} must have the shape of the forward's result {shape}, got {x.shape}")
    compute = _result_dtype(q, k, v)
    padded = [np.zeros(x.shape[:-2] + (-(-x.shape[-2] // bs) * bs, x.shape[-1]), grad_dtype(x, compute))
              for x in (q, k, v)]
    grad_bias = np.zeros(bias.shape, grad_dtype(bias, compute)) if bias_grad and bias is not None else None
    if n and m:
        q_blocks, k_blocks, v_blocks, dout_blocks, out_blocks = (_as_blocks(x, bs) for x in (q, k, v, dout, out))
        lse_blocks = _as_blocks(lse, bs, fill=-np.inf, core=1)  # padding rows see nothing
        grad_blocks = [_as_blocks(x, bs) for x in padded]
        bytes_per_key = math.prod(lead) * (q.shape[-1] + e) * compute.itemsize
        take = _BlockTaker()
        for index, layout2d in plan.slices():
            q_i, k_i, v_i, dq_i, dk_i, dv_i = (plan.select(x, index, core=3)
                                               for x in [q_blocks, k_blocks, v_blocks] + grad_blocks)
            mask_i, bias_i, dbias_i = (plan.select(x, index) for x in (mask, bias, grad_bias))
            call_ndim = len(_call_lead(plan.select(q, index), plan.select(k, index), plan.select(v, index),
                                       mask_i, bias_i))
            dout_i, out_i = (_trim(plan.select(x, index, core=3), call_ndim + 3) for x in (dout_blocks, out_blocks))
            lse_i = _trim(plan.select(lse_blocks, index), call_ndim + 2)
            for blocks, columns, call_mask in plan.groups(layout2d, bytes_per_key):
                if columns is None:
                    continue
                query_tokens, key_tokens = plan.tokens(blocks, columns, mask_i, bias_i)
                g = softmax_attention_backward(
                    take("dout", dout_i, blocks), take("q", q_i, blocks), take("k", k_i, columns),
                    take("v", v_i, columns), take("out", out_i, blocks), lse_i[..., blocks, :],
                    scale=scale, mask=_combine(_gather(mask_i, query_tokens, key_tokens), call_mask),
                    bias=_gather(bias_i, query_tokens, key_tokens), bias_grad=dbias_i is not None)
                dq_i[..., blocks, :, :] += g.q  # query blocks are distinct within a call
                _add_by_block(dk_i, columns, g.k)
                _add_by_block(dv_i, columns, g.v)
                if dbias_i is not None:
                    rows = query_tokens if dbias_i.shape[-2] != 1 else np.zeros((1, 1, 1), np.intp)
                    cols = key_tokens if dbias_i.shape[-1] != 1 else np.zeros((1, 1, 1), np.intp)
                    # padding rows and keys repeat the last token with a zero gradient
                    np.add.at(dbias_i, (Ellipsis, rows, cols), g.bias)
    grads = [x[..., :length, :] for x, length in zip(padded, (n, m, m))]
    return Gradients(q=deliver(grads[0], q, dq, "dq"), k=deliver(grads[1], k, dk, "dk"),
                     v=deliver(grads[2], v, dv, "dv"), bias=grad_bias)


# --------------------------------------------------------------------------
# Pooled keys (PVT's spatial reduction, Funnel-style downsampling)
# --------------------------------------------------------------------------

def _pool_windows(m, stride):
    """First position of each window of `stride` keys and the window sizes
    (the last window holds what remains)."""
    starts = np.arange(0, m, stride)
    return starts, np.minimum(starts + stride, m) - starts


def _compute_dtype(x):
    """float32/float64 stay, float16 pools in float32, integers in float64."""
    if x.dtype.kind == "f":
        return np.float32 if x.dtype == np.float16 else x.dtype
    if x.dtype.kind in "iub":
        return np.float64
    raise TypeError(f"q, k, v must hold real numbers (float, int or bool), got dtype {x.dtype}")


def _pool(x, stride, mode):
    """x (..., m, c) pooled over windows of `stride` positions along -2,
    in x's own float dtype (float16 pooled in float32, integers in float64)."""
    m = x.shape[-2]
    if m == 0:
        return x.astype(_compute_dtype(x), copy=False)
    starts, sizes = _pool_windows(m, stride)
    work = x.astype(_compute_dtype(x), copy=False)
    if mode == "mean":
        pooled = np.add.reduceat(work, starts, axis=-2) / sizes[:, None].astype(work.dtype)
    else:
        pooled = np.maximum.reduceat(work, starts, axis=-2)
    return pooled.astype(x.dtype, copy=False) if x.dtype == np.float16 else pooled


def _unpool(grad, x, stride, mode):
    """The gradient of x (..., m, c) from that of its pooled form: mean
    spreads each window's gradient evenly over it; max routes it to the
    window's largest entry (the first, on ties), feature by feature."""
    m = x.shape[-2]
    starts, sizes = _pool_windows(m, stride)
    if mode == "mean":
        return np.repeat(grad / sizes[:, None].astype(grad.dtype), sizes, axis=-2)
    windows = starts.size
    padded = np.full(x.shape[:-2] + (windows * stride, x.shape[-1]), -np.inf, dtype=_compute_dtype(x))
    padded[..., :m, :] = x
    padded = padded.reshape(x.shape[:-2] + (windows, stride, x.shape[-1]))
    winner = np.argmax(padded, axis=-2)[..., None, :]  # (..., windows, 1, c)
    spread = np.zeros(padded.shape, dtype=grad.dtype)
    np.put_along_axis(spread, winner, grad[..., None, :], axis=-2)
    return spread.reshape(x.shape[:-2] + (windows * stride, x.shape[-1]))[..., :m, :]


def _check_pooling(stride, mode):
    stride = _count(stride, "stride", 1)
    if mode not in ("mean", "max"):
        raise ValueError(f"mode must be 'mean' or 'max', got {mode!r}")
    return stride


def pooled_attention(q, k, v, stride, mode="mean", **softmax_options):
    """Softmax attention over pooled keys and values.

    Parameters
    ----------
    q : array_like, shape (..., n, d)
        Queries.
    k : array_like, shape (..., m, d)
        Keys.
    v : array_like, shape (..., m, e)
        Values; the leading axes of q, k, v broadcast.
    stride : int
        The pooling window: consecutive windows of ``stride`` positions
        (the last over what remains) give ceil(m / stride) keys.
    mode : {"mean", "max"}, default "mean"
        "mean" averages each window (Funnel-style downsampling, PVT's
        spatial reduction without its convolution), "max" takes each
        feature's largest value.
    **softmax_options
        The options of `softmax_attention`; masks, biases, ``causal`` and
        ``window`` refer to the pooled keys (m' = ceil(m / stride)).

    Returns
    -------
    ndarray or (ndarray, ndarray)
        The output (..., n, e), and its lse with ``return_lse=True``.

    Raises
    ------
    ValueError
        A stride below 1, an unknown mode, and the errors of
        `softmax_attention`.
    TypeError
        As in `softmax_attention`.

    See Also
    --------
    softmax_attention : Over the pooled keys.
    pooled_attention_backward : The gradients.

    Notes
    -----
    ``softmax_attention(q, pool(k), pool(v), **softmax_options)``, the
    cost O(n (m / stride) d).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((6, 4)) for _ in range(3))
    >>> o = attnx.pooled_attention(q, k, v, 2)
    >>> pool = lambda x: x.reshape(3, 2, -1).mean(1)
    >>> np.allclose(o, attnx.softmax_attention(q, pool(k), pool(v)))
    True
    """
    q, k, v = _check_qkv(q, k, v)
    stride = _check_pooling(stride, mode)
    return _C.softmax_attention(q, _pool(k, stride, mode), _pool(v, stride, mode), **softmax_options)


def pooled_attention_backward(dout, q, k, v, out, lse, stride, mode="mean", *, bias_grad=False,
                              **softmax_options):
    """Gradients of ``sum(dout * pooled_attention(q, k, v, stride, mode, ...))``.

    Parameters
    ----------
    dout : array_like, shape (..., n, e)
        The gradient arriving at the forward's output.
    q, k, v : array_like
        The forward's inputs.
    out, lse : array_like
        The forward's results (``return_lse=True``).
    stride, mode
        The forward's pooling.
    bias_grad : bool, default False
        Also return the gradient of ``bias``.
    **softmax_options
        The forward's softmax options.

    Returns
    -------
    Gradients
        ``q``, ``k``, ``v`` (and ``bias`` with ``bias_grad=True``), each of
        its input's shape and dtype.

    Raises
    ------
    ValueError
        Shapes that do not match the forward's, or its options' errors.
    TypeError
        Inputs of an unsupported dtype.

    See Also
    --------
    pooled_attention : The forward.

    Notes
    -----
    The softmax backward over the pooled keys, then the pooling's own:
    mean spreads each window's gradient evenly over it; max routes it to
    the window's largest entry (the first on ties).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((6, 4)) for _ in range(3))
    >>> out, lse = attnx.pooled_attention(q, k, v, 3, return_lse=True)
    >>> g = attnx.pooled_attention_backward(np.ones_like(out), q, k, v, out, lse, 3)
    >>> g.k.shape, np.allclose(g.v.sum(), 6 * 4)     # each output row's weights sum to 1
    ((6, 4), True)
    """
    q, k, v = _check_qkv(q, k, v)
    stride = _check_pooling(stride, mode)
    pooled_k, pooled_v = _pool(k, stride, mode), _pool(v, stride, mode)
    g = softmax_attention_backward(dout, q, pooled_k, pooled_v, out, lse, bias_grad=bias_grad,
                                   **softmax_options)
    compute = _result_dtype(q, k, v)
    dk = _unpool(g.k, k, stride, mode).astype(grad_dtype(k, compute), copy=False)
    dv = _unpool(g.v, v, stride, mode).astype(grad_dtype(v, compute), copy=False)
    return Gradients(q=g.q, k=dk, v=dv, bias=g.bias)


# --------------------------------------------------------------------------
# Low-rank keys (Linformer)
# --------------------------------------------------------------------------

def _check_projection(x, name, m):
    x = _as_array(x, name)
    if x.shape[-1] != m:
        raise ValueError(f"{name} must have shape (..., r, m) with m = {m} (k's sequence length), got {x.shape}")
    if x.dtype.kind not in "fiub":
        raise TypeError(f"{name} must hold real numbers, got dtype {x.dtype}")
    return x


def linformer_attention(q, k, v, E, F=None, **softmax_options):
    """Linformer: softmax attention over keys and values projected along the sequence.

    Parameters
    ----------
    q : array_like, shape (..., n, d)
        Queries.
    k : array_like, shape (..., m, d)
        Keys.
    v : array_like, shape (..., m, e)
        Values; the leading axes of q, k, v broadcast.
    E : array_like, shape (r, m) or (..., r, m)
        Projects the keys, ``k' = E @ k``; leading axes broadcast with the
        heads.
    F : array_like, optional
        Projects the values, ``v' = F @ v``; default E.
    **softmax_options
        The options of `softmax_attention`, applied to the r projected keys
        (masks of shape (..., n, r)).

    Returns
    -------
    ndarray or (ndarray, ndarray)
        The output (..., n, e), and its lse with ``return_lse=True``.

    Raises
    ------
    ValueError
        Projections whose shapes do not fit k and v, and the errors of
        `softmax_attention`.
    TypeError
        As in `softmax_attention`.

    See Also
    --------
    softmax_attention : Over the projected keys.
    linformer_attention_backward : The gradients, E's and F's included.

    Notes
    -----
    ``softmax_attention(q, E @ k, F @ v, **softmax_options)``: O(n r d)
    instead of O(n m d) (Wang et al. 2020).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((8, 4)) for _ in range(3))
    >>> E = rng.standard_normal((3, 8)) / np.sqrt(8)
    >>> o = attnx.linformer_attention(q, k, v, E)
    >>> np.allclose(o, attnx.softmax_attention(q, E @ k, E @ v))
    True
    """
    q, k, v = _check_qkv(q, k, v)
    E = _check_projection(E, "E", k.shape[-2])
    F = E if F is None else _check_projection(F, "F", k.shape[-2])
    return _C.softmax_attention(q, E @ k, F @ v, **softmax_options)


def linformer_attention_backward(dout, q, k, v, out, lse, E, F=None, *, bias_grad=False,
                                 **softmax_options):
    """Gradients of ``sum(dout * linformer_attention(q, k, v, E, F, ...))``.

    Parameters
    ----------
    dout : array_like, shape (..., n, e)
        The gradient arriving at the forward's output.
    q, k, v : array_like
        The forward's inputs.
    out, lse : array_like
        The forward's results (``return_lse=True``).
    E, F : array_like
        The forward's projections.
    bias_grad : bool, default False
        Also return the gradient of ``bias``.
    **softmax_options
        The forward's softmax options.

    Returns
    -------
    Gradients
        ``q``, ``k``, ``v`` (and ``bias``), and ``projection = (dE, dF)``
        summed to E's and F's shapes; when F was None (F is E), dF is None
        and its share is added to dE.

    Raises
    ------
    ValueError
        Shapes that do not match the forward's, or its options' errors.
    TypeError
        Inputs of an unsupported dtype.

    See Also
    --------
    linformer_attention : The forward.

    Notes
    -----
    With ``dk'``, ``dv'`` the gradients of the projected keys and values:
    ``dE = dk' k^T``, ``dF = dv' v^T``, ``dk = E^T dk'``, ``dv = F^T dv'``.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((8, 4)) for _ in range(3))
    >>> E = rng.standard_normal((3, 8)) / np.sqrt(8)
    >>> out, lse = attnx.linformer_attention(q, k, v, E, return_lse=True)
    >>> g = attnx.linformer_attention_backward(np.ones_like(out), q, k, v, out, lse, E)
    >>> dE, dF = g.projection
    >>> dE.shape, dF is None
    ((3, 8), True)
    """
    q, k, v = _check_qkv(q, k, v)
    E_arr = _check_projection(E, "E", k.shape[-2])
    F_arr = E_arr if F is None else _check_projection(F, "F", k.shape[-2])
    g = softmax_attention_backward(dout, q, E_arr @ k, F_arr @ v, out, lse, bias_grad=bias_grad,
                                   **softmax_options)
    compute = g.k.dtype
    grad_k = np.swapaxes(E_arr, -1, -2).astype(compute, copy=False) @ g.k
    grad_v = np.swapaxes(F_arr, -1, -2).astype(compute, copy=False) @ g.v
    grad_E = g.k @ np.swapaxes(k, -1, -2).astype(compute, copy=False)
    grad_F = g.v @ np.swapaxes(v, -1, -2).astype(compute, copy=False)
    dk = sum_to_shape(grad_k, k.shape).astype(grad_dtype(k, compute), copy=False)
    dv = sum_to_shape(grad_v, v.shape).astype(grad_dtype(v, compute), copy=False)
    if F is None:
        dE = sum_to_shape(grad_E + grad_F, E_arr.shape).astype(grad_dtype(E_arr, compute), copy=False)
        return Gradients(q=g.q, k=dk, v=dv, bias=g.bias, projection=(dE, None))
    dE = sum_to_shape(grad_E, E_arr.shape).astype(grad_dtype(E_arr, compute), copy=False)
    dF = sum_to_shape(grad_F, F_arr.shape).astype(grad_dtype(F_arr, compute), copy=False)
    return Gradients(q=g.q, k=dk, v=dv, bias=g.bias, projection=(dE, dF))


register_vjp(block_sparse_attention, lse_vjp_rule(block_sparse_attention, block_sparse_attention_backward))
register_vjp(pooled_attention, lse_vjp_rule(pooled_attention, pooled_attention_backward))
register_vjp(linformer_attention, lse_vjp_rule(linformer_attention, linformer_attention_backward))
