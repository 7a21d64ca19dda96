"""What every gradient in attnx shares: the named tuple the backward
functions return, the reduction of a gradient to a broadcast input's shape,
and ``vjp``, which pairs a forward call with its backward.

A backward function computes the gradients of ``sum(dout * out)`` with
respect to the forward's inputs. Each family registers, for each of its
public forward functions, a rule ``rule(*args, **options) -> (out,
pullback)`` with :func:`register_vjp`; ``vjp`` looks the function up.
"""
from collections import namedtuple

import numpy as np

Gradients = namedtuple("Gradients", "q k v bias projection state", defaults=(None,) * 6)
Gradients.__doc__ = """Gradients of ``sum(dout * out)`` with respect to a forward call's inputs.

A named tuple, returned by every ``*_backward`` function and by the
pullback of `vjp`.

Parameters
----------
q, k, v : ndarray or None
    The gradients of the queries, keys and values (``lsh_attention`` has
    no ``k``: None).
bias : ndarray or None
    Of the ``bias`` option; None unless ``bias_grad=True``.
projection : ndarray or tuple or None
    Of FAVOR+'s projection with ``projection_grad=True``, Linformer's
    ``(dE, dF)``, the rotary inputs' gradients; otherwise None.
state : tuple or None
    ``(dS, dz)``, of an ``initial_state`` when one was given.

Raises
------
TypeError
    When built with unknown fields (as any named tuple).

See Also
--------
vjp : Returns a pullback giving these.
MultiHeadGradients : The gradients of the multi-head layer.

Notes
-----
Each field has the shape and dtype of its input, summed over the axes
along which that input was broadcast (docs/gradients.md).

Examples
--------
>>> import numpy as np, attnx
>>> q = np.arange(6.0).reshape(3, 2) / 6
>>> out, pullback = attnx.vjp(attnx.softmax_attention, q, q, q)
>>> g = pullback(np.ones_like(out))
>>> g._fields
('q', 'k', 'v', 'bias', 'projection', 'state')
>>> g.v.shape, g.bias is None
((3, 2), True)
"""

MultiHeadGradients = namedtuple("MultiHeadGradients", "x_q x_kv w_q w_k w_v w_o b_q b_k b_v b_o bias projection",
                                defaults=(None,) * 12)
MultiHeadGradients.__doc__ = """Gradients of ``sum(dout * multi_head_attention(...))``.

A named tuple, returned by `multi_head_attention_backward` and by the
pullback of ``vjp(multi_head_attention, ...)``.

Parameters
----------
x_q, x_kv : ndarray or None
    Of the inputs; ``x_kv`` is None for self-attention (``x_kv=None``:
    ``x_q`` then holds both shares).
w_q, w_k, w_v, w_o : ndarray
    Of the projection weights.
b_q, b_k, b_v, b_o : ndarray or None
    Of the biases; None for a bias not given.
bias : ndarray or None
    Of an attention ``bias`` option.
projection : ndarray or tuple or None
    Of the variant's own weights (Linformer's ``(dE, dF)``, FLatten's
    ``dwc_weight``).

Raises
------
TypeError
    When built with unknown fields (as any named tuple).

See Also
--------
multi_head_attention_backward : Returns these.
Gradients : The gradients of the attention functions.

Notes
-----
Each field has its input's shape and dtype (docs/systems.md).

Examples
--------
>>> import numpy as np, attnx
>>> x = np.random.default_rng(0).standard_normal((5, 4))
>>> w = np.eye(4)
>>> y, pullback = attnx.vjp(attnx.multi_head_attention, x, None, w, w, w, w, 2)
>>> g = pullback(np.ones_like(y))
>>> g.x_q.shape, g.w_o.shape, g.b_q is None
((5, 4), (4, 4), True)
"""

_VJP_RULES = {}


def register_vjp(forward, rule):
    """Make ``vjp(forward, ...)`` call ``rule(*args, **options)``, which
    returns ``(out, pullback)``."""
    _VJP_RULES[forward] = rule


def vjp(fn, *args, **options):
    """Run a forward call and return its output with a pullback.

    Parameters
    ----------
    fn : callable
        A public attnx function that has a backward: the softmax, gaussian
        and kernelised front ends, ``multi_head_attention``, ``rotary``,
        ``block_sparse_attention``, ``pooled_attention``,
        ``linformer_attention``, ``lsh_attention``.
    *args, **options
        Its arguments, as for ``fn(*args, **options)``.

    Returns
    -------
    out : ndarray
        ``fn(*args, **options)``.
    pullback : callable
        ``pullback(dout)`` returns the `Gradients` of ``sum(dout * out)``
        with respect to the inputs, through the same options
        (`MultiHeadGradients` for ``multi_head_attention``).

    Raises
    ------
    TypeError
        When ``fn`` has no backward in attnx (the message lists those that
        have one), or ``return_lse`` is passed as an option.

    See Also
    --------
    Gradients : What the pullback returns.
    softmax_attention_backward : A backward called directly.

    Notes
    -----
    The forward runs once; the pullback keeps what the backward needs (for
    softmax attention, out and its lse) and may be called several times.
    Dropout masks are regenerated from ``seed``.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((4, 3)) for _ in range(3))
    >>> out, pullback = attnx.vjp(attnx.linear_attention, q, k, v, causal=True)
    >>> g = pullback(np.ones_like(out))
    >>> [x.shape for x in (g.q, g.k, g.v)]
    [(4, 3), (4, 3), (4, 3)]
    """
    rule = _VJP_RULES.get(fn)
    if rule is None:
        name = getattr(fn, "__qualname__", repr(fn))
        known = ", ".join(sorted(f.__name__ for f in _VJP_RULES)) or "none yet"
        raise TypeError(f"vjp: {name} has no backward in attnx (functions with one: {known})")
    return rule(*args, **options)


def sum_to_shape(grad, shape):
    """Reduce ``grad`` (computed on the broadcast shape) to ``shape``, the
    shape of the input it belongs to: sum over the leading axes the input
    lacks and over the axes where it has size 1, as broadcasting requires."""
    shape = tuple(shape)
    if grad.shape == shape:
        return grad
    extra = grad.ndim - len(shape)
    if extra < 0:
        raise ValueError(f"cannot reduce a gradient of shape {grad.shape} to {shape}")
    axes = tuple(range(extra)) + tuple(
        extra + i for i, size in enumerate(shape) if size == 1 and grad.shape[extra + i] != 1)
    reduced = grad.sum(axis=axes, keepdims=True) if axes else grad
    return np.ascontiguousarray(reduced.reshape(shape))


def grad_dtype(x, compute_dtype):
    """A gradient has its input's dtype when that is a float type (float16
    included: computed in float32); integer and bool inputs get the
    compute dtype, since their gradient is not an integer."""
    dtype = np.asarray(x).dtype if not hasattr(x, "dtype") else np.dtype(x.dtype)
    return dtype if dtype.kind == "f" and dtype.itemsize <= 8 else compute_dtype


def deliver(grad, x, given, name):
    """grad (on the call's broadcast batch shape) reduced to x's shape and
    dtype, and written into `given` when the caller passed one (unless the
    kernel wrote it there already: see direct_output)."""
    shape = np.shape(x)
    reduced = sum_to_shape(grad, shape)
    dtype = grad_dtype(x, grad.dtype)
    if given is None:
        return reduced.astype(dtype, copy=False)
    if not isinstance(given, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(given).__name__}")
    if given.shape != shape or given.dtype != dtype:
        raise ValueError(f"{name} must have shape {shape} and dtype {dtype}, "
                         f"got shape {given.shape} and dtype {given.dtype}")
    if reduced is not given:
        np.copyto(given, reduced, casting="same_kind")
    return given


def direct_output(given, x, inputs, batch_shapes):
    """`given` when the kernel may write x's gradient straight into it, so
    that no gradient-sized temporary is made: x is not broadcast (its batch
    shape is the call's, the broadcast of `batch_shapes`), the float
    `inputs` share one dtype, float32 or float64, which is given's, and
    given has x's shape, a contiguous last axis and is writeable. Else None:
    the kernel allocates, and deliver() reduces and copies."""
    if not isinstance(given, np.ndarray) or not isinstance(x, np.ndarray):
        return None
    dtypes = {getattr(a, "dtype", None) for a in inputs}
    if len(dtypes) != 1 or given.dtype not in (np.float32, np.float64) or given.dtype not in dtypes:
        return None
    try:
        batch = np.broadcast_shapes(*batch_shapes)
    except ValueError:
        return None
    if (given.shape != x.shape or x.shape[:-2] != batch or given.strides[-1] != given.itemsize
            or not given.flags.writeable or not given.flags.aligned):
        return None
    return given
