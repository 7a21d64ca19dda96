"""The multi-head attention layer over numpy arrays: projections, heads,
positions, any attnx variant, and the output projection."""
import numpy as np

from . import _C, _linear, _systems
from ._checks import count
from ._positions import rotary, sinusoidal_positions

VARIANTS = {
    "softmax": _C.softmax_attention,
    "gaussian": _C.gaussian_attention,
    **_linear.FRONT_ENDS,
    "block_sparse": _systems.block_sparse_attention,
    "pooled": _systems.pooled_attention,
    "linformer": _systems.linformer_attention,
}

# options that hold one array per head, with the head axis just before
# their last `core` axes: (..., num_heads, n, m) and the like
_PER_HEAD_OPTIONS = {"mask": 2, "bias": 2, "layout": 2, "E": 2, "F": 2, "key_mask": 1}


def _weights(w, name, rows, heads, what):
    w = np.asarray(w)
    if w.ndim != 2 or w.shape[0] != rows or w.shape[1] % heads or w.shape[1] == 0:
        raise ValueError(f"{name} must have shape ({rows}, {heads} * {what}) (in, out: x @ {name}), "
                         f"got {w.shape}")
    return w


def _bias(b, name, size):
    if b is None:
        return None
    b = np.asarray(b)
    if b.shape != (size,):
        raise ValueError(f"{name} must have shape ({size},), got {b.shape}")
    return b


def _project(x, w, b):
    y = x @ w
    return y if b is None else y + b


def _split_heads(x, kv_heads, group):
    """(..., L, heads * c) -> (..., kv_heads, group, L, c) (a view)."""
    y = x.reshape(x.shape[:-1] + (kv_heads, group, -1))
    return np.moveaxis(y, -4, -2)


def _per_head(option, x, num_heads, kv_heads, group):
    """An option array with a head axis (..., num_heads or 1, core...)
    reshaped to the layer's (..., kv_heads, group, core...)."""
    core = _PER_HEAD_OPTIONS[option]
    x = np.asarray(x)
    if x.ndim <= core:
        return x
    heads = x.shape[-core - 1]
    if heads == num_heads:
        return x.reshape(x.shape[:-core - 1] + (kv_heads, group) + x.shape[-core:])
    if heads == 1:
        return x.reshape(x.shape[:-core - 1] + (1, 1) + x.shape[-core:])
    raise ValueError(f"{option} of shape {x.shape}: the axis before its last {core} must be the head "
                     f"axis, of size num_heads ({num_heads}) or 1")


def multi_head_attention(x_q, x_kv, w_q, w_k, w_v, w_o, num_heads, *, b_q=None, b_k=None, b_v=None,
                         b_o=None, num_kv_heads=None, variant="softmax", positions=None, **options):
    """Multi-head attention: ``concat_h(attention(q_h, k_h, v_h)) @ w_o + b_o``.

    x_q (..., n, in_q) and x_kv (..., m, in_kv) (None: x_q, self-attention).
    Projections ``x @ w + b`` with w of shape (in, out) (numpy orientation;
    PyTorch's nn.Linear holds the transpose): w_q (in_q, num_heads * d),
    w_k (in_kv, num_kv_heads * d), w_v (in_kv, num_kv_heads * e), w_o
    (num_heads * e, out). Heads are split from the last axis, head h at
    columns h*d .. h*d + d - 1. ``num_kv_heads`` (default num_heads) must
    divide num_heads: query head h uses key/value head h // (num_heads /
    num_kv_heads) (grouped-query attention, by broadcasting, no copies).

    variant: the attention front end ("softmax", "gaussian", "linear",
    "cosformer", "focused", "taylor", "performer", "efficient",
    "block_sparse", "pooled", "linformer"), called per head with
    ``**options`` (causal=, scale=, feature_map=, layout= and block_size=,
    stride=, E=...). Array options that differ per head (mask, bias,
    key_mask, layout, E, F) put the head axis before their own last axes:
    mask (..., num_heads or 1, n, m), e.g. key padding (batch, 1, 1, m).

    positions: None, "sinusoidal" (the Transformer's table added to x_q and
    x_kv first) or "rotary" (q and k rotated per head, positions 0..n-1 and
    0..m-1, rotate-half pairs).
    Returns (..., n, out).
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {', '.join(map(repr, VARIANTS))}")
    refused = {"out", "return_lse", "return_state", "initial_state"} & options.keys()
    if refused:
        raise TypeError(f"multi_head_attention takes no {', '.join(sorted(refused))} option "
                        "(it returns the layer's output only)")
    if positions not in (None, "rotary", "sinusoidal"):
        raise ValueError(f"positions must be None, 'rotary' or 'sinusoidal', got {positions!r}")
    x_q = np.asarray(x_q)
    x_kv = x_q if x_kv is None else np.asarray(x_kv)
    for name, x in (("x_q", x_q), ("x_kv", x_kv)):
        if x.ndim < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., length, features), got shape {x.shape}")
    heads = count(num_heads, "num_heads", 1)
    kv_heads = heads if num_kv_heads is None else count(num_kv_heads, "num_kv_heads", 1)
    if heads % kv_heads:
        raise ValueError(f"num_kv_heads ({kv_heads}) must divide num_heads ({heads})")
    group = heads // kv_heads
    w_q = _weights(w_q, "w_q", x_q.shape[-1], heads, "d")
    d = w_q.shape[1] // heads
    w_k = _weights(w_k, "w_k", x_kv.shape[-1], kv_heads, "d")
    if w_k.shape[1] != kv_heads * d:
        raise ValueError(f"w_k must have shape ({x_kv.shape[-1]}, {kv_heads * d}): num_kv_heads ({kv_heads}) "
                         f"heads of w_q's head size d = {d}, got {w_k.shape}")
    w_v = _weights(w_v, "w_v", x_kv.shape[-1], kv_heads, "e")
    e = w_v.shape[1] // kv_heads
    w_o = np.asarray(w_o)
    if w_o.ndim != 2 or w_o.shape[0] != heads * e:
        raise ValueError(f"w_o must have shape ({heads * e}, out): num_heads * e rows, got {w_o.shape}")
    b_q, b_k = _bias(b_q, "b_q", heads * d), _bias(b_k, "b_k", kv_heads * d)
    b_v, b_o = _bias(b_v, "b_v", kv_heads * e), _bias(b_o, "b_o", w_o.shape[1])

    if positions == "sinusoidal":
        same = x_kv is x_q
        x_q = x_q + sinusoidal_positions(x_q.shape[-2], x_q.shape[-1]).astype(x_q.dtype, copy=False)
        x_kv = x_q if same else x_kv + sinusoidal_positions(x_kv.shape[-2], x_kv.shape[-1]).astype(
            x_kv.dtype, copy=False)
    q = _split_heads(_project(x_q, w_q, b_q), kv_heads, group)   # (..., Hkv, g, n, d)
    k = _split_heads(_project(x_kv, w_k, b_k), kv_heads, 1)      # (..., Hkv, 1, m, d)
    v = _split_heads(_project(x_kv, w_v, b_v), kv_heads, 1)      # (..., Hkv, 1, m, e)
    if positions == "rotary":
        q, k = rotary(q), rotary(k)
    for option in _PER_HEAD_OPTIONS:
        if options.get(option) is not None:
            options[option] = _per_head(option, options[option], heads, kv_heads, group)
    heads_out = VARIANTS[variant](q, k, v, **options)           # (..., Hkv, g, n, e)
    concatenated = np.moveaxis(heads_out, -2, -4)               # (..., n, Hkv, g, e)
    concatenated = concatenated.reshape(concatenated.shape[:-3] + (heads * e,))
    return _project(concatenated, w_o, b_o)
