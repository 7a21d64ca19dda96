"""attnx on dask arrays: the same attention functions, lazily, chunk by chunk.

    import dask.array as da, attnx.dask
    q = da.from_array(q_np, chunks=(1, 8, 1024, 64))   # (B, H, n, d)
    o = attnx.dask.softmax_attention(q, k, v, causal=True)  # lazy dask array
    o.compute()                                        # or on a dask.distributed Client

Every function takes dask arrays (numpy arrays are accepted too and chunked
to match) with the options of the numpy function of the same name, and
returns a lazy dask array (a pair of them with ``return_lse=True``) equal to
the single-machine call. Each task is one call of the C kernel on numpy
blocks, with the GIL released, so the threads of a worker and the workers of
a cluster run in parallel.

How the work is split:

* Leading (batch, head) axes: block by block. Inputs must have the same
  chunks along every axis they share; an axis of size 1 broadcasts.
* Query axis: query chunks are independent.
* Key axis, softmax and gaussian: each key chunk gives a partial output and
  its log-sum-exp; the partials of a query chunk are merged exactly by
  log-sum-exp. Causal masks and windows use global positions (each block's
  call gets a window shifted to the block's place), masks and biases are
  sliced with the block, and key chunks no query of a query chunk can see
  are never computed.
* Key axis, kernelised family, non-causal: each key chunk's summary
  (S, z) = (sum_j psi(k_j) v_j^T, sum_j psi(k_j)), summed, then applied to
  each query chunk. Causal: the key axis is rechunked to follow the query
  chunks (query chunk [a, b) takes the keys [a + m - n, b + m - n) with the
  lower-right mask, [a, b) with upper-left); the summaries of the segments
  before a chunk give its incoming state (an exclusive prefix sum), so the
  chunks run in parallel. cosFormer blocks keep their global positions.
* One chunk where a variant cannot be split: the key axis of efficient
  attention (its key softmax runs over the whole sequence) and of the
  linear family under mask= or window= (the quadratic form; cosFormer's
  query axis too).

The feature axes d and e are always made one chunk. Results are lazy; there
is no ``out=`` and no streaming state (``initial_state``, ``return_state``:
the chunks pass states among themselves).
"""
import functools
import itertools
import math
import operator

import numpy as np

try:
    import dask.array as da
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError('attnx.dask needs dask: pip install '
                      '"dask[distributed]" (from an attnx checkout: pip install -e ".[dask]"; '
                      'once attnx is released: pip install "attnx[dask]")') from error

from . import _C
from ._linear import (
    FRONT_ENDS,
    LinearAttentionState,
    _performer_projection,
    _result_dtype,
)
from ._variants import resolve

__all__ = [
    "softmax_attention",
    "gaussian_attention",
    "linear_attention",
    "cosformer_attention",
    "focused_linear_attention",
    "taylor_attention",
    "performer_attention",
    "efficient_attention",
]

# the C side treats a window side of 2**52 or more as open
_OPEN_WINDOW = 1 << 52


# ---------------------------------------------------------------------------
# Inputs: broadcast, shape checks and common chunks
# ---------------------------------------------------------------------------

class _Operands:
    """The array arguments of one call as dask arrays of the same number of
    dimensions (leading axes padded with size-1 axes), with common chunks.

    roles: per argument the names of its core axes ("n", "m", "d", "e").
    After construction: lead (number of leading axes), lead_shape, and
    chunks[axis] for the leading axes 0..lead-1 and for "n", "m", "d", "e".
    """

    def __init__(self, arrays, roles):
        self.roles = roles
        self.names = [name for name in roles if arrays.get(name) is not None]
        raw = {name: arrays[name] for name in self.names}
        for name, x in raw.items():
            if not isinstance(x, da.Array):
                raw[name] = np.asarray(x)
            elif any(math.isnan(size) for sizes in x.chunks for size in sizes):
                raise ValueError(f"{name} has chunks of unknown size {x.chunks}; call "
                                 f"{name}.compute_chunk_sizes() first")
        # pad masks, biases and key masks to their core rank (numpy broadcasting)
        for name, x in raw.items():
            core = len(roles[name])
            if name in ("q", "k", "v") and x.ndim < core:
                raise ValueError(f"{name} must have at least {core} dimensions "
                                 f"({_core_text(name, roles)}), got shape {x.shape}")
            if x.ndim < core:
                raw[name] = x.reshape((1,) * (core - x.ndim) + x.shape)
        self.lead = max(x.ndim - len(roles[name]) for name, x in raw.items())
        for name, x in raw.items():
            pad = self.lead + len(roles[name]) - x.ndim
            if pad:
                raw[name] = x[(None,) * pad] if isinstance(x, da.Array) else \
                    x.reshape((1,) * pad + x.shape)
        self._check_core_sizes(raw)
        self._unify(raw)
        self.raw = raw

    def _axes(self, name):
        return list(range(self.lead)) + list(self.roles[name])

    def _check_core_sizes(self, raw):
        q, k, v = raw["q"], raw["k"], raw["v"]
        n, d = q.shape[-2:]
        m = k.shape[-2]
        if k.shape[-1] != d:
            raise ValueError(f"k must have shape (..., m, d) with d = {d} from q (..., n, d), "
                             f"got {k.shape}")
        if v.shape[-2] != m:
            raise ValueError(f"v must have shape (..., m, e) with m = {m} keys from k "
                             f"(..., m, d), got {v.shape}")
        self.sizes = {"n": n, "m": m, "d": d, "e": v.shape[-1]}
        for name in self.names:
            if name in ("q", "k", "v"):
                continue
            x = raw[name]
            for axis, role in zip(range(-len(self.roles[name]), 0), self.roles[name]):
                if x.shape[axis] not in (1, self.sizes[role]):
                    raise ValueError(f"{name} must broadcast to {_core_text(name, self.roles)} = "
                                     f"{self._core_sizes(name)}, got shape {x.shape}")
        lead_shape = []
        for axis in range(self.lead):
            sizes = {raw[name].shape[axis] for name in self.names} - {1}
            if len(sizes) > 1:
                shapes = ", ".join(f"{name} {raw[name].shape}" for name in self.names)
                raise ValueError(f"the leading (batch) axes of the inputs do not broadcast "
                                 f"(axis {axis}): {shapes}")
            lead_shape.append(sizes.pop() if sizes else 1)
        self.lead_shape = tuple(lead_shape)

    def _core_sizes(self, name):
        return "(..., " + ", ".join(str(self.sizes[role]) for role in self.roles[name]) + ")"

    def _unify(self, raw):
        """chunks per axis: those of the dask inputs that hold the axis with
        its full size (they must agree), else one chunk; d and e one chunk."""
        self.chunks = {}
        keys = list(range(self.lead)) + ["n", "m", "d", "e"]
        for key in keys:
            size = self.lead_shape[key] if isinstance(key, int) else self.sizes[key]
            found = None
            for name in self.names:
                x = raw[name]
                if not isinstance(x, da.Array) or key not in self._axes(name):
                    continue
                axis = self._axes(name).index(key)
                if x.shape[axis] != size or size == 1:
                    continue  # broadcast along this axis
                if found is None:
                    found = (name, x.chunks[axis])
                elif x.chunks[axis] != found[1]:
                    where = (f"leading axis {key}" if isinstance(key, int)
                             else f"the {key} axis")
                    raise ValueError(
                        f"{found[0]} and {name} are chunked differently along {where} "
                        f"({found[1]} vs {x.chunks[axis]}); inputs must have the same chunks "
                        f"along every axis they share (rechunk one of them, e.g. "
                        f"{name}.rechunk(...))")
            if key in ("d", "e") or found is None:
                self.chunks[key] = (size,)
            else:
                self.chunks[key] = found[1]

    def finish(self):
        """every argument as a dask array with the common chunks (size-1
        broadcast axes one chunk of 1), by name; kept for block_key"""
        self.arrays = {}
        for name in self.names:
            x = self.raw[name]
            target = tuple((1,) if x.shape[axis] == 1 and self._size(key) != 1 else
                           self.chunks[key] for axis, key in enumerate(self._axes(name)))
            if isinstance(x, da.Array):
                self.arrays[name] = x if x.chunks == target else x.rechunk(target)
            else:
                self.arrays[name] = da.from_array(x, chunks=target)
        return self.arrays

    def _size(self, key):
        return self.lead_shape[key] if isinstance(key, int) else self.sizes[key]

    def block_key(self, name, lead_index, n_index=0, m_index=0):
        """the key of argument name's block for output block lead_index
        (leading axes) and query/key chunks n_index, m_index; None for an
        argument not given. Index 0 along one-chunk (broadcast) axes."""
        if name not in self.arrays:
            return None
        array = self.arrays[name]
        wanted = list(lead_index) + [{"n": n_index, "m": m_index}.get(role, 0)
                                     for role in self.roles[name]]
        return (array.name,) + tuple(i if blocks > 1 else 0
                                     for i, blocks in zip(wanted, array.numblocks))


def _core_text(name, roles):
    return "(..., " + ", ".join(roles[name]) + ")"


def _starts(chunks):
    return (0,) + tuple(itertools.accumulate(chunks))


def _lead_blocks(ops):
    return itertools.product(*(range(len(ops.chunks[axis])) for axis in range(ops.lead)))


def _lead_chunk_shape(ops, lead_index):
    return tuple(ops.chunks[axis][i] for axis, i in enumerate(lead_index))


def _array(graph_layer, name, dependencies, chunks, dtype):
    graph = HighLevelGraph.from_collections(name, graph_layer, dependencies=dependencies)
    return da.Array(graph, name, chunks, dtype=dtype)


# ---------------------------------------------------------------------------
# Visibility: global bands and their shifted form on one block
# ---------------------------------------------------------------------------

def _window_sides(window):
    """(left, right) of a validated window, None for an open side"""
    if window is None:
        return None, None
    sides = tuple(window) if isinstance(window, (tuple, list)) else (window, window)
    return tuple(None if side is None or operator.index(side) >= _OPEN_WINDOW
                 else operator.index(side) for side in sides)


def _band(n, m, causal, window):
    """The keys query i sees as a band of j - i: [low, high], None for an
    open side (lower-right causal j <= i + m - n, upper-left j <= i, window
    i + m - n - left <= j <= i + m - n + right)."""
    left, right = _window_sides(window)
    high = None
    if isinstance(causal, str):
        high = 0 if causal == "upper_left" else m - n
    elif causal:
        high = m - n
    if right is not None:
        high = m - n + right if high is None else min(high, m - n + right)
    low = None if left is None else m - n - left
    return low, high


def _block_geometry(rows, keys, low, high):
    """The part of block rows [a, b) x keys [ka, kb) (global positions) that
    band [low, high] of j - i leaves, as (a, b, ka, kb, left, right):
    trimmed ranges and the window that gives the band in a call on them
    alone (None for an open side); None when no query sees a key.

    A call on n' rows and m' keys centres its window on i' + m' - n', so on
    the trimmed block the band [low, high] becomes the window
    left = kb - b - low, right = high + b - kb; trimming the keys past the
    last row's reach (kb <= b + high) and the rows past the last key's reach
    (b <= kb - low) makes both sides >= 0."""
    (a, b), (ka, kb) = rows, keys
    if low is not None and high is not None and low > high:
        return None  # e.g. upper-left causal with a window ahead of the diagonal
    # two passes: after the first, b <= kb - low; the second's kb <= b + high
    # then moves b no more when low <= high (kb - low >= b + high - low >= b)
    for _ in range(2):
        if high is not None:
            kb = min(kb, b + high)
            a = max(a, ka - high)
        if low is not None:
            ka = max(ka, a + low)
            b = min(b, kb - low)
        if a >= b or ka >= kb:
            return None
    left = None if low is None else kb - b - low
    right = None if high is None else high + b - kb
    return a, b, ka, kb, left, right


def _local_window(left, right):
    return None if left is None and right is None else (left, right)


def _slice_core(x, rows, keys, core):
    """x's block sliced to rows / keys (chunk-local ranges) along the core
    axes core (("n", "m"), ("m",), ...), leaving size-1 broadcast axes"""
    if x is None:
        return None
    index = [Ellipsis]
    for axis, role in zip(range(-len(core), 0), core):
        span = {"n": rows, "m": keys}.get(role)
        take = span is not None and x.shape[axis] == span[2]  # not a broadcast axis
        index.append(slice(span[0], span[1]) if take else slice(None))
    return x[tuple(index)]


# ---------------------------------------------------------------------------
# Softmax and gaussian attention
# ---------------------------------------------------------------------------

def _softmax_part(function, options, geometry, want_lse, upcast, q, k, v, mask, bias):
    """One block's call: (out, lse) over the block's keys, rows the band
    leaves out of the block as zeros and lse -inf. geometry: chunk-local
    (a, b, ka, kb, left, right)."""
    a, b, ka, kb, left, right = geometry
    n_rows, m_keys = q.shape[-2], k.shape[-2]
    rows, keys = (a, b, n_rows), (ka, kb, m_keys)
    if upcast:  # float16: partial results merged in float32
        q, k, v = (x.astype(np.float32) for x in (q, k, v))
    result = function(_slice_core(q, rows, keys, "nd"), _slice_core(k, rows, keys, "md"),
                      _slice_core(v, rows, keys, "me"), mask=_slice_core(mask, rows, keys, "nm"),
                      bias=_slice_core(bias, rows, keys, "nm"), window=_local_window(left, right),
                      return_lse=want_lse, **options)
    if (a, b) == (0, n_rows):
        return result
    out, lse = result if want_lse else (result, None)
    full = np.zeros(out.shape[:-2] + (n_rows, out.shape[-1]), out.dtype)
    full[..., a:b, :] = out
    if not want_lse:
        return full
    full_lse = np.full(lse.shape[:-1] + (n_rows,), -np.inf, lse.dtype)
    full_lse[..., a:b] = lse
    return full, full_lse


def _softmax_combine(*parts):
    """The exact combination of partial (out, lse) pairs over disjoint key
    sets: weights exp(lse_c - lse) with lse = log sum_c exp(lse_c); rows
    that see no key in any part stay zeros with lse -inf (never NaN)."""
    if len(parts) == 1:
        return parts[0]
    lses = [lse for _, lse in parts]
    top = functools.reduce(np.maximum, lses)
    top = np.where(np.isneginf(top), 0, top)  # no key anywhere: every weight 0
    weights = [np.exp(lse - top) for lse in lses]
    total = functools.reduce(np.add, weights)
    out = functools.reduce(np.add, (w[..., None] * part for w, (part, _) in zip(weights, parts)))
    with np.errstate(divide="ignore"):
        out /= np.where(total > 0, total, 1)[..., None]
        lse = top + np.log(total)
    return out, lse


def _softmax_finish(shape, out_dtype, lse_dtype, want_lse, *parts):
    """A query chunk's result from its last partials (zeros and lse -inf
    when it sees no key chunk), in the dtypes of the single call"""
    if parts:
        out, lse = _softmax_combine(*parts)
    else:
        out, lse = np.zeros(shape, out_dtype), np.full(shape[:-1], -np.inf, lse_dtype)
    out = np.broadcast_to(out, shape).astype(out_dtype, copy=False)
    if not want_lse:
        return out
    return out, np.broadcast_to(lse, shape[:-1]).astype(lse_dtype, copy=False)


# partials of a query chunk merged this many at a time (a tree), so that a
# merge holds a few blocks however many key chunks there are
_MERGE_FAN_IN = 8


def _softmax_graph(function, front, q, k, v, mask, bias, options, causal, window, return_lse):
    ops = _Operands({"q": q, "k": k, "v": v, "mask": mask, "bias": bias},
                    {"q": "nd", "k": "md", "v": "me", "mask": "nm", "bias": "nm"})
    x = ops.finish()
    n, m, d, e = (ops.sizes[r] for r in "nmde")
    # options, dtypes and masks checked now, by the kernel, on one row
    probe = {name: np.zeros((1,) * len(ops.roles[name]), x[name].dtype) for name in x}
    probe["q"], probe["k"], probe["v"] = (np.zeros((1, s), x[c].dtype)
                                          for c, s in (("q", d), ("k", d), ("v", e)))
    out_probe, lse_probe = function(probe["q"], probe["k"], probe["v"], mask=probe.get("mask"),
                                    bias=probe.get("bias"), causal=causal, window=window,
                                    return_lse=True, **options)
    out_dtype, lse_dtype = out_probe.dtype, lse_probe.dtype
    low, high = _band(n, m, causal, window)
    q_starts, k_starts = _starts(ops.chunks["n"]), _starts(ops.chunks["m"])
    many_keys = len(ops.chunks["m"]) > 1
    want_lse = return_lse or many_keys
    upcast = many_keys and out_dtype == np.float16

    token = tokenize(front, [a.name for a in x.values()], options, causal, window, return_lse)
    part_name, merged_name = f"{front}-part-{token}", f"{front}-{token}"
    combine_name = f"{front}-combine-{token}"
    layer = {}
    for lead_index in _lead_blocks(ops):
        for qi in range(len(ops.chunks["n"])):
            a, b = q_starts[qi], q_starts[qi + 1]
            parts = []
            for ki in range(len(ops.chunks["m"])):
                ka, kb = k_starts[ki], k_starts[ki + 1]
                geometry = _block_geometry((a, b), (ka, kb), low, high)
                if geometry is None:
                    continue  # no query of this chunk sees these keys: never computed
                ga, gb, gka, gkb, left, right = geometry
                local = (ga - a, gb - a, gka - ka, gkb - ka, left, right)
                key = (part_name,) + lead_index + (qi, ki)
                layer[key] = (functools.partial(_softmax_part, function, options, local,
                                                want_lse, upcast),) + tuple(
                    ops.block_key(name, lead_index, qi, ki)
                    for name in ("q", "k", "v", "mask", "bias"))
                parts.append(key)
            shape = _lead_chunk_shape(ops, lead_index) + (b - a, e)
            merged_key = (merged_name,) + lead_index + (qi, 0)
            if not many_keys and parts:  # one key chunk: the block's call is the result
                layer[merged_key] = layer.pop(parts[0])
                continue
            level = 0
            while len(parts) > _MERGE_FAN_IN:
                groups = [parts[i:i + _MERGE_FAN_IN] for i in range(0, len(parts), _MERGE_FAN_IN)]
                parts = []
                for g, group in enumerate(groups):
                    key = (combine_name,) + lead_index + (qi, level, g)
                    layer[key] = (_softmax_combine,) + tuple(group)
                    parts.append(key)
                level += 1
            layer[merged_key] = (functools.partial(_softmax_finish, shape, out_dtype, lse_dtype,
                                                   return_lse),) + tuple(parts)
    lead_chunks = tuple(ops.chunks[axis] for axis in range(ops.lead))
    out_chunks = lead_chunks + (ops.chunks["n"], (e,))
    deps = list(x.values())
    if not return_lse:
        return _array(layer, merged_name, deps, out_chunks, out_dtype)
    # (out, lse) per block, taken apart into two arrays
    out_name, lse_name = f"{front}-out-{token}", f"{front}-lse-{token}"
    merged_keys = [key for key in layer if key[0] == merged_name]
    merged = _array(layer, merged_name, deps, out_chunks, out_dtype)
    out = _array({(out_name,) + key[1:]: (operator.getitem, key, 0) for key in merged_keys},
                 out_name, [merged], out_chunks, out_dtype)
    lse = _array({(lse_name,) + key[1:-1]: (operator.getitem, key, 1) for key in merged_keys},
                 lse_name, [merged], lead_chunks + (ops.chunks["n"],), lse_dtype)
    return out, lse


def softmax_attention(q, k, v, *, scale=None, causal=False, mask=None, bias=None, window=None,
                      return_lse=False):
    """`attnx.softmax_attention` on dask arrays, lazily.

    Parameters
    ----------
    q : dask.array.Array or array_like, shape (..., n, d)
        Queries.
    k : dask.array.Array or array_like, shape (..., m, d)
        Keys.
    v : dask.array.Array or array_like, shape (..., m, e)
        Values. Inputs must share chunks along every axis they share
        (numpy arrays are chunked to match); d and e are made one chunk.
    scale, causal, mask, bias, window
        As in `attnx.softmax_attention`; masks and biases may be dask or
        numpy arrays and are sliced with the blocks.
    return_lse : bool, default False
        Also return the lse, a (..., n) dask array.

    Returns
    -------
    out : dask.array.Array, shape (..., n, e)
        Lazy, chunked like q along the leading and query axes.
    lse : dask.array.Array, shape (..., n)
        Only with ``return_lse=True``.

    Raises
    ------
    ValueError
        Inputs whose chunks differ along a shared axis (the message says
        which), and the errors of the numpy function, raised when the graph
        is built where the shapes allow, else when it is computed.
    TypeError
        As in the numpy function.

    See Also
    --------
    attnx.softmax_attention : The numpy function.
    linear_attention : The kernelised family on dask arrays.

    Notes
    -----
    Leading-axis chunks are independent calls, and so are query chunks;
    key chunks give partial outputs with their lse, merged exactly by
    log-sum-exp. causal and window keep their global alignment (query i
    sees ``j <= i + m - n``, ...) in every block; key chunks that no query
    of a query chunk sees are skipped. Every task is one C call on numpy
    blocks with the GIL released (docs/dask.md).

    Examples
    --------
    >>> import numpy as np, dask.array as da, attnx, attnx.dask
    >>> x = np.random.default_rng(0).standard_normal((2, 8, 4))
    >>> q = da.from_array(x, chunks=(1, 4, 4))            # 2 heads, 2 chunks of 4 positions
    >>> o = attnx.dask.softmax_attention(q, q, q, causal=True)
    >>> o.chunks
    ((1, 1), (4, 4), (4,))
    >>> np.allclose(o.compute(), attnx.softmax_attention(x, x, x, causal=True))
    True
    """
    options = {"scale": scale}
    return _softmax_graph(_C.softmax_attention, "softmax_attention", q, k, v, mask, bias,
                          options, causal, window, return_lse)


def gaussian_attention(q, k, v, sigma=1.0, *, causal=False, mask=None, bias=None, window=None,
                       return_lse=False):
    """`attnx.gaussian_attention` on dask arrays, lazily.

    Parameters
    ----------
    q : dask.array.Array or array_like, shape (..., n, d)
        Queries.
    k : dask.array.Array or array_like, shape (..., m, d)
        Keys.
    v : dask.array.Array or array_like, shape (..., m, e)
        Values. Inputs must share chunks along every axis they share
        (numpy arrays are chunked to match); d and e are made one chunk.
    sigma : float, default 1.0
        The kernel's width.
    causal, mask, bias, window
        As in `attnx.gaussian_attention`.
    return_lse : bool, default False
        Also return the lse, a (..., n) dask array.

    Returns
    -------
    out : dask.array.Array, shape (..., n, e)
        Lazy, chunked like q along the leading and query axes.
    lse : dask.array.Array, shape (..., n)
        Only with ``return_lse=True``.

    Raises
    ------
    ValueError
        Inputs whose chunks differ along a shared axis (the message says
        which), and the errors of the numpy function, raised when the graph
        is built where the shapes allow, else when it is computed.
    TypeError
        As in the numpy function.

    See Also
    --------
    attnx.gaussian_attention : The numpy function.
    softmax_attention : The chunking rules.

    Notes
    -----
    Chunked as `softmax_attention`: the per-key bias ``-|k_j|^2 / (2
    sigma^2)`` travels with each key chunk, so key chunks merge exactly.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attnx, attnx.dask
    >>> x = np.random.default_rng(0).standard_normal((2, 8, 4))
    >>> q = da.from_array(x, chunks=(1, 4, 4))            # 2 heads, 2 chunks of 4 positions
    >>> o = attnx.dask.gaussian_attention(q, q, q, sigma=2.0)
    >>> o.chunks
    ((1, 1), (4, 4), (4,))
    >>> np.allclose(o.compute(), attnx.gaussian_attention(x, x, x, sigma=2.0))
    True
    """
    options = {"sigma": sigma}
    return _softmax_graph(_C.gaussian_attention, "gaussian_attention", q, k, v, mask, bias,
                          options, causal, window, return_lse)


# ---------------------------------------------------------------------------
# The kernelised (linear) family
# ---------------------------------------------------------------------------

def _compute_dtype(*dtypes):
    """the dtype the kernel computes in (and states hold): float16 -> float32"""
    dtype = _result_dtype(*(np.empty(0, dt) for dt in dtypes))
    return np.dtype(np.float32) if dtype == np.float16 else dtype


def _linear_call(front, options, geometry, q, k, v, key_mask, mask):
    """One block's call with the keys it sees. geometry (general masks):
    chunk-local (a, b, ka, kb, left, right), rows outside [a, b) zeros."""
    if geometry is None:
        return FRONT_ENDS[front](q, k, v, key_mask=key_mask, **_with_mask(mask, options))
    a, b, ka, kb, left, right = geometry
    n_rows, m_keys = q.shape[-2], k.shape[-2]
    rows, keys = (a, b, n_rows), (ka, kb, m_keys)
    out = FRONT_ENDS[front](
        _slice_core(q, rows, keys, "nd"), _slice_core(k, rows, keys, "md"),
        _slice_core(v, rows, keys, "me"), key_mask=_slice_core(key_mask, rows, keys, "m"),
        mask=_slice_core(mask, rows, keys, "nm"), window=_local_window(left, right), **options)
    if (a, b) == (0, n_rows):
        return out
    full = np.zeros(out.shape[:-2] + (n_rows, out.shape[-1]), out.dtype)
    full[..., a:b, :] = out
    return full


def _with_mask(mask, options):
    """options plus mask= when there is one (efficient_attention has none)"""
    return options if mask is None else dict(options, mask=mask)


def _linear_summary(front, options, q_dtype, zero_state, k, v, key_mask):
    """(S, z) of a key chunk: sum_j psi(k_j) v_j^T and sum_j psi(k_j) over
    its keys (positions from zero_state's offset for cosFormer)"""
    q = np.zeros((0, k.shape[-1]), q_dtype)
    initial = None if zero_state is None else LinearAttentionState(*zero_state)
    _, state = FRONT_ENDS[front](q, k, v, key_mask=key_mask, initial_state=initial,
                                 return_state=True, **options)
    return state.S, state.z


def _add_states(*states):
    """the sum of (S, z) pairs; None stands for no keys"""
    states = [s for s in states if s is not None]
    if not states:
        return None
    return (functools.reduce(np.add, (s[0] for s in states)),
            functools.reduce(np.add, (s[1] for s in states)))


def _linear_apply(front, options, offset, empty_dtypes, state, q, k, v, key_mask):
    """A query chunk's output from its incoming state (keys before it) and,
    causal, its own keys k, v; non-causal calls have no keys of their own
    (k is None) and take every key through the state."""
    if k is None:
        d, e = q.shape[-1], state[0].shape[-1]
        k, v = np.zeros((0, d), empty_dtypes[0]), np.zeros((0, e), empty_dtypes[1])
    initial = None if state is None else LinearAttentionState(state[0], state[1], offset)
    return FRONT_ENDS[front](q, k, v, key_mask=key_mask, initial_state=initial, **options)


def _linear_graph(front, q, k, v, key_mask, mask, options):
    ops = _Operands({"q": q, "k": k, "v": v, "key_mask": key_mask, "mask": mask},
                    {"q": "nd", "k": "md", "v": "me", "key_mask": "m", "mask": "nm"})
    n, m, d, e = (ops.sizes[r] for r in "nmde")
    dtypes = {name: ops.raw[name].dtype for name in ops.names}
    causal, window = options.get("causal", False), options.get("window")
    # options, dtypes and masks checked now, by the kernel, on one row
    probe = {name: np.zeros((1,) * len(ops.roles[name]), dtypes[name]) for name in ops.names}
    probe["q"], probe["k"], probe["v"] = (np.zeros((1, s), dtypes[c])
                                          for c, s in (("q", d), ("k", d), ("v", e)))
    if front == "performer":  # one projection for every block
        options["projection"] = _performer_projection(
            probe["q"], options["projection"], options.pop("num_features"), options.pop("seed"))
    out_dtype = FRONT_ENDS[front](probe["q"], probe["k"], probe["v"],
                                  key_mask=probe.get("key_mask"),
                                  **_with_mask(probe.get("mask"), options)).dtype
    # the variant's checks on the whole shapes; cosFormer's M, defaulted
    # from them, is then fixed for every block
    feature_map = options.get("feature_map", "elu")
    resolved = resolve(front, feature_map="identity" if callable(feature_map) else feature_map,
                       causal=causal,
                       M=options.get("M"), projection=options.get("projection"), d=d, n=n, m=m)
    if "M" in options:
        options["M"] = resolved["M"]

    general = mask is not None or window is not None
    if general and front == "cosformer":
        mode = "whole"   # positions and masks: one call per leading block
        ops.chunks["n"], ops.chunks["m"] = (n,), (m,)
    elif general:
        mode = "general"
        ops.chunks["m"] = (m,)
    elif front == "efficient":
        mode = "direct"
        ops.chunks["m"] = (m,)
    elif causal and len(ops.chunks["n"]) > 1:
        mode = "causal"
    elif causal:
        mode = "direct"  # one query chunk: one call over every key
        ops.chunks["m"] = (m,)
    elif len(ops.chunks["m"]) == 1 and (front != "cosformer" or len(ops.chunks["n"]) == 1):
        mode = "direct"
    else:
        mode = "summaries"
    q_starts = _starts(ops.chunks["n"])
    if mode == "causal":
        # key segment of query chunk [a, b): [clip(a + high), clip(b + high)),
        # preceded by the keys every query sees, [0, clip(high))
        high = 0 if causal == "upper_left" else m - n
        ends = [min(max(s + high, 0), m) for s in q_starts]
        ops.chunks["m"] = tuple(b - a for a, b in zip([0] + ends[:-1], ends)) + (m - ends[-1],)
    x = ops.finish()
    deps = list(x.values())
    token = tokenize(front, [a.name for a in deps], options, mode)
    out_name = f"{front}-{token}"
    layer = {}
    n_chunks = len(ops.chunks["n"])

    def keys_of(lead_index, qi, ki, names):
        return tuple(ops.block_key(name, lead_index, qi, ki) for name in names)

    if mode in ("whole", "direct", "general"):
        call_options = dict(options)
        if mode == "general":  # causal and window become each block's own window
            low, high = _band(n, m, causal, window)
            del call_options["window"]
            call_options["causal"] = False
        for lead_index in _lead_blocks(ops):
            for qi in range(n_chunks):
                a, b = q_starts[qi], q_starts[qi + 1]
                geometry = None
                if mode == "general":
                    found = _block_geometry((a, b), (0, m), low, high)
                    if found is None:
                        shape = _lead_chunk_shape(ops, lead_index) + (b - a, e)
                        layer[(out_name,) + lead_index + (qi, 0)] = (np.zeros, shape, out_dtype)
                        continue
                    ga, gb, gka, gkb, left, right = found
                    geometry = (ga - a, gb - a, gka, gkb, left, right)
                layer[(out_name,) + lead_index + (qi, 0)] = (
                    functools.partial(_linear_call, front, call_options, geometry),
                ) + keys_of(lead_index, qi, 0, ("q", "k", "v", "key_mask", "mask"))
    else:
        # summaries: the state (S, z) of each key chunk, from a call without
        # queries (non-causal; positions from the chunk's start for cosFormer)
        summary_options = {name: value for name, value in options.items()
                           if name not in ("causal", "method", "chunk_size", "window")}
        apply_options = dict(options)
        r = resolved["features"] if front == "cosformer" else None
        state_dtype = _compute_dtype(dtypes["q"], dtypes["k"], dtypes["v"])
        k_starts = _starts(ops.chunks["m"])
        summary_name, state_name = f"{front}-summary-{token}", f"{front}-state-{token}"
        key_names = [name for name in ("k", "v", "key_mask") if name in x]
        for lead_index in _lead_blocks(ops):
            # summaries and states belong to the key blocks: made once for
            # every leading block that shares them (the query groups of GQA)
            key_lead = tuple(i if any(x[name].numblocks[axis] > 1 for name in key_names) else 0
                             for axis, i in enumerate(lead_index))
            summaries = []
            for ki in range(len(ops.chunks["m"]) if mode == "summaries" else n_chunks):
                # causal: the segments after the last query chunk's own enter
                # no incoming state
                key = (summary_name,) + key_lead + (ki,)
                summaries.append(key)
                if key in layer:
                    continue
                zero = None if r is None else (np.zeros((r, e), state_dtype),
                                               np.zeros(r, state_dtype), k_starts[ki])
                layer[key] = (functools.partial(_linear_summary, front, summary_options,
                                                dtypes["q"], zero),
                              ) + keys_of(lead_index, 0, ki, ("k", "v", "key_mask"))
            empty = (dtypes["k"], dtypes["v"])
            if mode == "summaries":
                total = (state_name,) + key_lead
                layer[total] = (_add_states,) + tuple(summaries)
                for qi in range(n_chunks):
                    layer[(out_name,) + lead_index + (qi, 0)] = (
                        functools.partial(_linear_apply, front, apply_options, q_starts[qi],
                                          empty),
                        total, ops.block_key("q", lead_index, qi), None, None, None)
                continue
            # causal: chunk qi's keys are segment qi + 1 (segment 0: the keys
            # every query sees); its incoming state sums the segments before
            incoming = summaries[0]
            for qi in range(n_chunks):
                if qi:
                    incoming_key = (state_name,) + key_lead + (qi,)
                    layer[incoming_key] = (_add_states, incoming, summaries[qi])
                    incoming = incoming_key
                layer[(out_name,) + lead_index + (qi, 0)] = (
                    functools.partial(_linear_apply, front, apply_options, k_starts[qi + 1],
                                      empty),
                    incoming,
                ) + keys_of(lead_index, qi, qi + 1, ("q", "k", "v", "key_mask"))
    lead_chunks = tuple(ops.chunks[axis] for axis in range(ops.lead))
    return _array(layer, out_name, deps, lead_chunks + (ops.chunks["n"], (e,)), out_dtype)


def _linear_front(front, q, k, v, key_mask=None, mask=None, **options):
    return _linear_graph(front, q, k, v, key_mask, mask, options)


_LINEAR_SPLITS = """
    Chunking: leading-axis and query chunks are independent calls.
    Non-causal key chunks each give their summary (S, z), summed and then
    applied to every query chunk. Causal: the key axis is rechunked to
    follow the query chunks (query chunk [a, b) takes keys
    [a + m - n, b + m - n), upper-left [a, b)); each segment's summary,
    an exclusive prefix sum of them, then each chunk from its incoming
    state, all chunks in parallel. mask= or window= (the quadratic form)
    puts the key axis in one chunk (query chunks stay independent, each
    with its window shifted to its place). Results equal the one call
    within rounding; there is no out=, initial_state or return_state."""


def linear_attention(q, k, v, *, feature_map="elu", causal=False, key_mask=None, mask=None,
                     window=None, method=None, chunk_size=None, eps=1e-6, projection=None, p=3):
    """`attnx.linear_attention` on dask arrays, lazily.

    Parameters
    ----------
    q : dask.array.Array or array_like, shape (..., n, d)
        Queries.
    k : dask.array.Array or array_like, shape (..., m, d)
        Keys.
    v : dask.array.Array or array_like, shape (..., m, e)
        Values. Inputs must share chunks along every axis they share
        (numpy arrays are chunked to match); d and e are made one chunk.
    feature_map : str or callable, default "elu"
        As in `attnx.linear_attention`; a callable runs on every block.
    causal, key_mask, mask, window, method, chunk_size, eps
        As in `attnx.linear_attention`.
    projection, p
        As in `attnx.linear_attention`.

    Returns
    -------
    dask.array.Array, shape (..., n, e)
        Lazy, chunked like q along the leading and query axes.

    Raises
    ------
    ValueError
        Inputs whose chunks differ along a shared axis (the message says
        which), and the errors of the numpy function, raised when the graph
        is built where the shapes allow, else when it is computed.
    TypeError
        As in the numpy function.

    See Also
    --------
    attnx.linear_attention : The numpy function, with the meaning of the options.

    Notes
    -----
    The kernelised family sums per-chunk (S, z) summaries.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attnx, attnx.dask
    >>> x = np.random.default_rng(0).standard_normal((2, 8, 4))
    >>> q = da.from_array(x, chunks=(1, 4, 4))            # 2 heads, 2 chunks of 4 positions
    >>> o = attnx.dask.linear_attention(q, q, q, causal=True)
    >>> o.chunks
    ((1, 1), (4, 4), (4,))
    >>> np.allclose(o.compute(), attnx.linear_attention(x, x, x, causal=True))
    True
    """
    return _linear_front("linear", q, k, v, key_mask, mask, feature_map=feature_map,
                         causal=causal, window=window, method=method, chunk_size=chunk_size,
                         eps=eps, projection=projection, p=p)


def cosformer_attention(q, k, v, *, causal=False, key_mask=None, M=None, mask=None, window=None,
                        method=None, chunk_size=None, eps=1e-6):
    """`attnx.cosformer_attention` on dask arrays, lazily.

    Parameters
    ----------
    q : dask.array.Array or array_like, shape (..., n, d)
        Queries.
    k : dask.array.Array or array_like, shape (..., m, d)
        Keys.
    v : dask.array.Array or array_like, shape (..., m, e)
        Values. Inputs must share chunks along every axis they share
        (numpy arrays are chunked to match); d and e are made one chunk.
    causal, key_mask, mask, window, method, chunk_size, eps
        As in `attnx.cosformer_attention`.
    M : float, optional
        Default ``max(n, m)`` of the whole call; every block uses it.

    Returns
    -------
    dask.array.Array, shape (..., n, e)
        Lazy, chunked like q along the leading and query axes.

    Raises
    ------
    ValueError
        Inputs whose chunks differ along a shared axis (the message says
        which), and the errors of the numpy function, raised when the graph
        is built where the shapes allow, else when it is computed.
    TypeError
        As in the numpy function.

    See Also
    --------
    attnx.cosformer_attention : The numpy function, with the meaning of the options.

    Notes
    -----
    Every block keeps its global positions. Leading-axis and query chunks
    are independent; key chunks pass (S, z) summaries (causal: an
    exclusive prefix of them gives each chunk its incoming state). mask= or
    window= put both the query and the key axis in one chunk.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attnx, attnx.dask
    >>> x = np.random.default_rng(0).standard_normal((2, 8, 4))
    >>> q = da.from_array(x, chunks=(1, 4, 4))            # 2 heads, 2 chunks of 4 positions
    >>> o = attnx.dask.cosformer_attention(q, q, q, causal=True)
    >>> o.chunks
    ((1, 1), (4, 4), (4,))
    >>> np.allclose(o.compute(), attnx.cosformer_attention(x, x, x, causal=True))
    True
    """
    return _linear_front("cosformer", q, k, v, key_mask, mask, causal=causal, M=M,
                         window=window, method=method, chunk_size=chunk_size, eps=eps)


def focused_linear_attention(q, k, v, p=3, *, causal=False, key_mask=None, mask=None,
                             window=None, method=None, chunk_size=None, eps=1e-6):
    """`attnx.focused_linear_attention` on dask arrays, lazily.

    Parameters
    ----------
    q : dask.array.Array or array_like, shape (..., n, d)
        Queries.
    k : dask.array.Array or array_like, shape (..., m, d)
        Keys.
    v : dask.array.Array or array_like, shape (..., m, e)
        Values. Inputs must share chunks along every axis they share
        (numpy arrays are chunked to match); d and e are made one chunk.
    p : float, default 3
        The focusing power.
    causal, key_mask, mask, window, method, chunk_size, eps
        As in `attnx.linear_attention`.

    Returns
    -------
    dask.array.Array, shape (..., n, e)
        Lazy, chunked like q along the leading and query axes.

    Raises
    ------
    ValueError
        Inputs whose chunks differ along a shared axis (the message says
        which), and the errors of the numpy function, raised when the graph
        is built where the shapes allow, else when it is computed.
    TypeError
        As in the numpy function.

    See Also
    --------
    attnx.focused_linear_attention : The numpy function, with the meaning of the options.

    Notes
    -----
    The features of `attnx.focused_linear_attention`.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attnx, attnx.dask
    >>> x = np.random.default_rng(0).standard_normal((2, 8, 4))
    >>> q = da.from_array(x, chunks=(1, 4, 4))            # 2 heads, 2 chunks of 4 positions
    >>> o = attnx.dask.focused_linear_attention(q, q, q, p=2)
    >>> o.chunks
    ((1, 1), (4, 4), (4,))
    >>> np.allclose(o.compute(), attnx.focused_linear_attention(x, x, x, p=2))
    True
    """
    return _linear_front("focused", q, k, v, key_mask, mask, p=p, causal=causal, window=window,
                         method=method, chunk_size=chunk_size, eps=eps)


def taylor_attention(q, k, v, *, causal=False, key_mask=None, mask=None, window=None,
                     method=None, chunk_size=None, eps=1e-6):
    """`attnx.taylor_attention` on dask arrays, lazily.

    Parameters
    ----------
    q : dask.array.Array or array_like, shape (..., n, d)
        Queries.
    k : dask.array.Array or array_like, shape (..., m, d)
        Keys.
    v : dask.array.Array or array_like, shape (..., m, e)
        Values. Inputs must share chunks along every axis they share
        (numpy arrays are chunked to match); d and e are made one chunk.
    causal, key_mask, mask, window, method, chunk_size, eps
        As in `attnx.linear_attention`.

    Returns
    -------
    dask.array.Array, shape (..., n, e)
        Lazy, chunked like q along the leading and query axes.

    Raises
    ------
    ValueError
        Inputs whose chunks differ along a shared axis (the message says
        which), and the errors of the numpy function, raised when the graph
        is built where the shapes allow, else when it is computed.
    TypeError
        As in the numpy function.

    See Also
    --------
    attnx.taylor_attention : The numpy function, with the meaning of the options.

    Notes
    -----
    The features of `attnx.taylor_attention`.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attnx, attnx.dask
    >>> x = np.random.default_rng(0).standard_normal((2, 8, 4))
    >>> q = da.from_array(x, chunks=(1, 4, 4))            # 2 heads, 2 chunks of 4 positions
    >>> o = attnx.dask.taylor_attention(q, q, q)
    >>> o.chunks
    ((1, 1), (4, 4), (4,))
    >>> np.allclose(o.compute(), attnx.taylor_attention(x, x, x))
    True
    """
    return _linear_front("taylor", q, k, v, key_mask, mask, causal=causal, window=window,
                         method=method, chunk_size=chunk_size, eps=eps)


def performer_attention(q, k, v, projection=None, num_features=None, seed=None, *, causal=False,
                        key_mask=None, mask=None, window=None, method=None, chunk_size=None,
                        eps=1e-6):
    """`attnx.performer_attention` on dask arrays, lazily.

    Parameters
    ----------
    q : dask.array.Array or array_like, shape (..., n, d)
        Queries.
    k : dask.array.Array or array_like, shape (..., m, d)
        Keys.
    v : dask.array.Array or array_like, shape (..., m, e)
        Values. Inputs must share chunks along every axis they share
        (numpy arrays are chunked to match); d and e are made one chunk.
    projection : array_like, shape (r, d), optional
        Without one, one projection is drawn when the graph is built
        (``random_features(num_features, d, seed=seed)``) and every block
        uses it.
    num_features, seed
        As in `attnx.performer_attention`.
    causal, key_mask, mask, window, method, chunk_size, eps
        As in `attnx.linear_attention`.

    Returns
    -------
    dask.array.Array, shape (..., n, e)
        Lazy, chunked like q along the leading and query axes.

    Raises
    ------
    ValueError
        Inputs whose chunks differ along a shared axis (the message says
        which), and the errors of the numpy function, raised when the graph
        is built where the shapes allow, else when it is computed.
    TypeError
        As in the numpy function.

    See Also
    --------
    attnx.performer_attention : The numpy function, with the meaning of the options.

    Notes
    -----
    The features of `attnx.performer_attention`.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attnx, attnx.dask
    >>> x = np.random.default_rng(0).standard_normal((2, 8, 4))
    >>> q = da.from_array(x, chunks=(1, 4, 4))            # 2 heads, 2 chunks of 4 positions
    >>> o = attnx.dask.performer_attention(q, q, q, seed=0)
    >>> o.chunks
    ((1, 1), (4, 4), (4,))
    >>> np.allclose(o.compute(), attnx.performer_attention(x, x, x, seed=0))
    True
    """
    return _linear_front("performer", q, k, v, key_mask, mask, projection=projection,
                         num_features=num_features, seed=seed, causal=causal, window=window,
                         method=method, chunk_size=chunk_size, eps=eps)


def efficient_attention(q, k, v, *, key_mask=None, causal=False):
    """`attnx.efficient_attention` on dask arrays, lazily.

    Parameters
    ----------
    q : dask.array.Array or array_like, shape (..., n, d)
        Queries.
    k : dask.array.Array or array_like, shape (..., m, d)
        Keys.
    v : dask.array.Array or array_like, shape (..., m, e)
        Values. Inputs must share chunks along every axis they share
        (numpy arrays are chunked to match); d and e are made one chunk.
    key_mask : array_like of bool, shape (..., m), optional
        False removes a key.
    causal : bool, default False
        Must be False.

    Returns
    -------
    dask.array.Array, shape (..., n, e)
        Lazy, chunked like q along the leading and query axes.

    Raises
    ------
    ValueError
        Inputs whose chunks differ along a shared axis (the message says
        which), and the errors of the numpy function, raised when the graph
        is built where the shapes allow, else when it is computed.
    TypeError
        As in the numpy function.

    See Also
    --------
    attnx.efficient_attention : The numpy function, with the meaning of the options.

    Notes
    -----
    Its key softmax runs over the whole sequence, so the key axis is put
    in one chunk; leading-axis and query chunks are independent calls.

    Examples
    --------
    >>> import numpy as np, dask.array as da, attnx, attnx.dask
    >>> x = np.random.default_rng(0).standard_normal((2, 8, 4))
    >>> q = da.from_array(x, chunks=(1, 4, 4))            # 2 heads, 2 chunks of 4 positions
    >>> o = attnx.dask.efficient_attention(q, q, q)
    >>> o.chunks
    ((1, 1), (4, 4), (4,))
    >>> np.allclose(o.compute(), attnx.efficient_attention(x, x, x))
    True
    """
    return _linear_front("efficient", q, k, v, key_mask, None, causal=causal)


# the chunking rules they share, at the end of each one's Notes section
for _function in (linear_attention, focused_linear_attention, taylor_attention,
                  performer_attention):
    _function.__doc__ = _function.__doc__.replace(
        "\n\n    Examples\n", "\n" + _LINEAR_SPLITS + "\n\n    Examples\n", 1)
cosformer_attention.__doc__ += "\n" + _LINEAR_SPLITS
del _function
