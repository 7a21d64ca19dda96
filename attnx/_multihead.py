"""The multi-head attention layer over numpy arrays: projections, heads,
positions, any attnx variant, and the output projection; and its backward,
the chain rule through those steps around the variant's own backward."""
import numpy as np

from . import _C, _linear, _systems
from ._checks import count
from ._grad import MultiHeadGradients, register_vjp, vjp
from ._positions import rotary, rotary_backward, sinusoidal_positions
from ._grad import grad_dtype

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




def _merge_heads(x):
    """(..., kv_heads, group, L, c) -> (..., L, kv_heads * group * c): the
    inverse of _split_heads (a copy)."""
    y = np.moveaxis(x, -2, -4)
    return y.reshape(y.shape[:-3] + (-1,))


class _Layer:
    """One multi-head call's checked arguments: inputs (with the sinusoidal
    table added), weights, biases, head counts, and the variant's options
    with their per-head arrays laid out as (..., kv_heads, group, core...)."""

    def __init__(self, x_q, x_kv, w_q, w_k, w_v, w_o, num_heads, b_q, b_k, b_v, b_o, num_kv_heads,
                 variant, positions, options):
        if variant not in VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; expected one of {', '.join(map(repr, VARIANTS))}")
        refused = {"out", "return_lse", "return_state", "initial_state"} & options.keys()
        if refused:
            raise TypeError(f"multi_head_attention takes no {', '.join(sorted(refused))} option "
                            "(it returns the layer's output only)")
        if positions not in (None, "rotary", "sinusoidal"):
            raise ValueError(f"positions must be None, 'rotary' or 'sinusoidal', got {positions!r}")
        self.self_attention = x_kv is None
        x_q = np.asarray(x_q)
        x_kv = x_q if x_kv is None else np.asarray(x_kv)
        for name, x in (("x_q", x_q), ("x_kv", x_kv)):
            if x.ndim < 2:
                raise ValueError(f"{name} must have at least 2 dimensions (..., length, features), got shape {x.shape}")
        heads = count(num_heads, "num_heads", 1)
        kv_heads = heads if num_kv_heads is None else count(num_kv_heads, "num_kv_heads", 1)
        if heads % kv_heads:
            raise ValueError(f"num_kv_heads ({kv_heads}) must divide num_heads ({heads})")
        self.heads, self.kv_heads, self.group = heads, kv_heads, heads // kv_heads
        self.w_q = _weights(w_q, "w_q", x_q.shape[-1], heads, "d")
        d = self.w_q.shape[1] // heads
        self.w_k = _weights(w_k, "w_k", x_kv.shape[-1], kv_heads, "d")
        if self.w_k.shape[1] != kv_heads * d:
            raise ValueError(f"w_k must have shape ({x_kv.shape[-1]}, {kv_heads * d}): num_kv_heads ({kv_heads}) "
                             f"heads of w_q's head size d = {d}, got {self.w_k.shape}")
        self.w_v = _weights(w_v, "w_v", x_kv.shape[-1], kv_heads, "e")
        e = self.w_v.shape[1] // kv_heads
        self.w_o = np.asarray(w_o)
        if self.w_o.ndim != 2 or self.w_o.shape[0] != heads * e:
            raise ValueError(f"w_o must have shape ({heads * e}, out): num_heads * e rows, got {self.w_o.shape}")
        self.b_q, self.b_k = _bias(b_q, "b_q", heads * d), _bias(b_k, "b_k", kv_heads * d)
        self.b_v, self.b_o = _bias(b_v, "b_v", kv_heads * e), _bias(b_o, "b_o", self.w_o.shape[1])
        self.input_shapes = (x_q.shape, x_kv.shape)
        if positions == "sinusoidal":
            x_q = x_q + sinusoidal_positions(x_q.shape[-2], x_q.shape[-1]).astype(x_q.dtype, copy=False)
            x_kv = x_q if self.self_attention else x_kv + sinusoidal_positions(
                x_kv.shape[-2], x_kv.shape[-1]).astype(x_kv.dtype, copy=False)
        self.x_q, self.x_kv = x_q, x_kv
        self.variant, self.rotary = variant, positions == "rotary"
        self.option_shapes = {}
        for option in _PER_HEAD_OPTIONS:
            if options.get(option) is not None:
                self.option_shapes[option] = np.shape(options[option])
                options[option] = _per_head(option, options[option], heads, kv_heads, group=self.group)
        self.options = options

    def run(self, differentiate):
        """The layer's output, its concatenated heads (..., n, num_heads * e)
        and, when differentiating, the variant's pullback."""
        q = _split_heads(_project(self.x_q, self.w_q, self.b_q), self.kv_heads, self.group)  # (..., Hkv, g, n, d)
        k = _split_heads(_project(self.x_kv, self.w_k, self.b_k), self.kv_heads, 1)          # (..., Hkv, 1, m, d)
        v = _split_heads(_project(self.x_kv, self.w_v, self.b_v), self.kv_heads, 1)          # (..., Hkv, 1, m, e)
        if self.rotary:
            q, k = rotary(q), rotary(k)
        front = VARIANTS[self.variant]
        pullback = None
        if differentiate:
            heads_out, pullback = vjp(front, q, k, v, **self.options)                      # (..., Hkv, g, n, e)
        else:
            heads_out = front(q, k, v, **self.options)
        concatenated = _merge_heads(heads_out)
        return _project(concatenated, self.w_o, self.b_o), concatenated, pullback

    def pull_back(self, dout, out, concatenated, pullback):
        """MultiHeadGradients of sum(dout * out): the output projection, the
        variant's pullback per head, the rotation, the input projections."""
        dout = np.asarray(dout)
        if dout.shape != out.shape:
            raise ValueError(f"dout must have the layer output's shape {out.shape}, got {dout.shape}")
        dout = dout.astype(out.dtype, copy=False)
        g = pullback(_split_heads(dout @ self.w_o.T, self.kv_heads, self.group))
        dq, dk = (rotary_backward(x) for x in (g.q, g.k)) if self.rotary else (g.q, g.k)
        dQ, dK, dV = _merge_heads(dq), _merge_heads(dk), _merge_heads(g.v)
        dx_q = dQ @ self.w_q.T
        dx_kv = dK @ self.w_k.T + dV @ self.w_v.T
        if self.self_attention:
            dx_q, dx_kv = dx_q + dx_kv, None
        compute = out.dtype

        def finish(grad, x):
            return None if grad is None else grad.astype(grad_dtype(x, compute), copy=False)

        def bias_grad(b, grad):
            return None if b is None else finish(grad.reshape(-1, grad.shape[-1]).sum(axis=0), b)

        return MultiHeadGradients(
            x_q=finish(dx_q, self.x_q), x_kv=finish(dx_kv, self.x_kv),
            w_q=finish(_weight_grad(self.x_q, dQ), self.w_q),
            w_k=finish(_weight_grad(self.x_kv, dK), self.w_k),
            w_v=finish(_weight_grad(self.x_kv, dV), self.w_v),
            w_o=finish(_weight_grad(concatenated, dout), self.w_o),
            b_q=bias_grad(self.b_q, dQ), b_k=bias_grad(self.b_k, dK), b_v=bias_grad(self.b_v, dV),
            b_o=bias_grad(self.b_o, dout),
            bias=None if g.bias is None else g.bias.reshape(self.option_shapes["bias"]),
            projection=self._projection_grad(g.projection))

    def _projection_grad(self, grad):
        """The variant's own weight gradients: Linformer's (dE, dF) in the
        shapes the caller gave E and F; others (FLatten's convolution
        weight) as they are."""
        if grad is None or self.variant != "linformer":
            return grad
        return tuple(None if x is None else x.reshape(self.option_shapes[name])
                     for x, name in zip(grad, ("E", "F")))


def _weight_grad(x, dy):
    """sum over the leading axes and rows of x^T dy: x (..., L, a) and
    dy (..., L, b) -> (a, b)."""
    x = np.broadcast_to(x, dy.shape[:-1] + x.shape[-1:])
    return x.reshape(-1, x.shape[-1]).T @ dy.reshape(-1, dy.shape[-1])


def multi_head_attention(x_q, x_kv, w_q, w_k, w_v, w_o, num_heads, *, b_q=None, b_k=None, b_v=None,
                         b_o=None, num_kv_heads=None, variant="softmax", positions=None, **options):
    """Multi-head attention: ``concat_h(attention(q_h, k_h, v_h)) @ w_o + b_o``.

    Parameters
    ----------
    x_q : array_like, shape (..., n, in_q)
        The inputs the queries are projected from.
    x_kv : array_like, shape (..., m, in_kv), or None
        The inputs of the keys and values; None for self-attention (x_q).
    w_q, w_k, w_v, w_o : array_like
        Projections ``x @ w + b`` with w of shape (in, out) (numpy's
        orientation; PyTorch's nn.Linear holds the transpose): w_q (in_q,
        num_heads * d), w_k (in_kv, num_kv_heads * d), w_v (in_kv,
        num_kv_heads * e), w_o (num_heads * e, out). Head h takes columns
        h*d .. h*d + d - 1.
    num_heads : int
        Query heads.
    b_q, b_k, b_v, b_o : array_like, optional
        The projections' biases.
    num_kv_heads : int, optional
        Key/value heads (default num_heads), dividing num_heads: query head
        h uses key/value head ``h // (num_heads / num_kv_heads)``
        (grouped-query attention, by broadcasting, no copies).
    variant : str, default "softmax"
        The attention front end called per head: "softmax", "gaussian",
        "linear", "cosformer", "focused", "taylor", "performer",
        "efficient", "block_sparse", "pooled", "linformer".
    positions : {None, "sinusoidal", "rotary"}, optional
        "sinusoidal" adds the Transformer's table to x_q and x_kv first;
        "rotary" rotates q and k per head (positions 0..n-1 and 0..m-1,
        rotate-half pairs).
    **options
        The variant's options (causal=, scale=, feature_map=, layout= and
        block_size=, stride=, E=...). Array options that differ per head
        (mask, bias, key_mask, layout, E, F) put the head axis before their
        own last axes: mask (..., num_heads or 1, n, m), such as key
        padding (batch, 1, 1, m).

    Returns
    -------
    ndarray, shape (..., n, out)
        The layer's output.

    Raises
    ------
    ValueError
        Weights whose shapes do not fit the inputs or the head counts,
        num_kv_heads not dividing num_heads, an unknown variant or
        positions, and the variant's errors.
    TypeError
        An option the variant does not take.

    See Also
    --------
    multi_head_attention_backward : The gradients.
    attnx.torch.MultiheadAttention : The PyTorch module.

    Notes
    -----
    ``q = x_q w_q + b_q``, ``k = x_kv w_k + b_k``, ``v = x_kv w_v + b_v``
    split into heads, ``o_h = attention(q_h, k_h, v_h)``, and ``y =
    concat_h(o_h) w_o + b_o`` (Vaswani et al. 2017; docs/systems.md).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((5, 8))
    >>> w_q, w_k, w_v, w_o = (rng.standard_normal((8, 8)) / 3 for _ in range(4))
    >>> y = attnx.multi_head_attention(x, None, w_q, w_k, w_v, w_o, num_heads=2, causal=True)
    >>> heads = lambda t: t.reshape(5, 2, 4).transpose(1, 0, 2)
    >>> o = attnx.softmax_attention(heads(x @ w_q), heads(x @ w_k), heads(x @ w_v), causal=True)
    >>> np.allclose(y, o.transpose(1, 0, 2).reshape(5, 8) @ w_o)
    True
    """
    layer = _Layer(x_q, x_kv, w_q, w_k, w_v, w_o, num_heads, b_q, b_k, b_v, b_o, num_kv_heads,
                   variant, positions, options)
    return layer.run(differentiate=False)[0]


def multi_head_attention_backward(dout, x_q, x_kv, w_q, w_k, w_v, w_o, num_heads, *, b_q=None,
                                  b_k=None, b_v=None, b_o=None, num_kv_heads=None,
                                  variant="softmax", positions=None, **options):
    """Gradients of ``sum(dout * multi_head_attention(x_q, x_kv, ...))``.

    Parameters
    ----------
    dout : array_like, shape (..., n, out)
        The gradient arriving at the layer's output.
    x_q, x_kv, w_q, w_k, w_v, w_o, num_heads
        The forward's arguments.
    b_q, b_k, b_v, b_o, num_kv_heads, variant, positions
        The forward's options.
    **options
        The variant's options, as in the forward. Random parts must
        repeat: dropout needs its ``seed=``, performer its ``projection=``
        or ``seed=``.

    Returns
    -------
    MultiHeadGradients
        The gradients of the inputs, weights and biases (``x_q``, ``x_kv``,
        ``w_q``, ..., ``b_o``, ``bias``, ``projection``).

    Raises
    ------
    ValueError
        As in `multi_head_attention`, or a dout of the wrong shape.
    TypeError
        As in `multi_head_attention`.

    See Also
    --------
    multi_head_attention : The forward.
    vjp : The same gradients from a pullback, without recomputing.

    Notes
    -----
    The forward is recomputed, then the output projection, the variant's
    own backward per head, the rotary rotation's transpose and the input
    projections are pulled back.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> x = rng.standard_normal((5, 8))
    >>> w = [rng.standard_normal((8, 8)) / 3 for _ in range(4)]
    >>> y = attnx.multi_head_attention(x, None, *w, num_heads=2)
    >>> g = attnx.multi_head_attention_backward(np.ones_like(y), x, None, *w, num_heads=2)
    >>> g.x_q.shape, g.w_o.shape, g.x_kv is None
    ((5, 8), (8, 8), True)
    >>> out, pullback = attnx.vjp(attnx.multi_head_attention, x, None, *w, num_heads=2)
    >>> np.allclose(pullback(np.ones_like(y)).w_q, g.w_q)
    True
    """
    layer = _Layer(x_q, x_kv, w_q, w_k, w_v, w_o, num_heads, b_q, b_k, b_v, b_o, num_kv_heads,
                   variant, positions, options)
    out, concatenated, pullback = layer.run(differentiate=True)
    return layer.pull_back(dout, out, concatenated, pullback)


def _vjp_rule(x_q, x_kv, w_q, w_k, w_v, w_o, num_heads, *, b_q=None, b_k=None, b_v=None, b_o=None,
              num_kv_heads=None, variant="softmax", positions=None, **options):
    layer = _Layer(x_q, x_kv, w_q, w_k, w_v, w_o, num_heads, b_q, b_k, b_v, b_o, num_kv_heads,
                   variant, positions, options)
    out, concatenated, pullback = layer.run(differentiate=True)
    return out, lambda dout: layer.pull_back(dout, out, concatenated, pullback)


register_vjp(multi_head_attention, _vjp_rule)
