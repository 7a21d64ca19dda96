"""Gradients of the kernelised ("linear") family.

Every backward function returns the :class:`attnx.Gradients` of
``sum(dout * out)`` for the forward call with the same inputs and options,
computed in C (attnx._C.linear_attention_backward): the chain rule through

    o_i = phi(q_i) S_i / max(phi(q_i) . z_i, eps)

(the clamp has zero derivative where it binds; a row whose denominator is
exactly 0 has zero gradients) and through each feature map's own
derivative. The causal chunk method runs the chunks forward (the state) and
then in reverse (the state's gradient), recomputing features instead of
storing them: memory O(r e) per thread plus two numbers per query row.
"""
import math

import numpy as np

from . import _C, _dwc
from ._grad import Gradients, deliver, direct_output, grad_dtype, register_vjp, sum_to_shape
from ._linear import (
    cosformer_attention,
    efficient_attention,
    focused_linear_attention,
    linear_attention,
    performer_attention,
    random_features,
    taylor_attention,
)

def _state_arrays(state, name):
    """(S, z) of a LinearAttentionState (or an (S, z) pair for grad_state)"""
    if state is None:
        return None, None
    if isinstance(state, tuple) and len(state) == 2:
        return state
    if hasattr(state, "S") and hasattr(state, "z"):
        return state.S, state.z
    raise TypeError(f"{name} must be a LinearAttentionState or a pair (dS, dz), "
                    f"got {type(state).__name__}")


def _backward(front, dout, q, k, v, a):
    """The gradients for variant `front` ("linear", "cosformer", ...)
    with its options `a` (by name), checked in C as the forward checks them
    (csrc/py_linear.c)."""
    feature_map = a.get("feature_map", "elu")
    if callable(feature_map):
        raise TypeError(
            "linear_attention_backward: a callable feature_map has no derivative in C; train "
            "it through the PyTorch front end, attnx.torch, where autograd differentiates the "
            "callable")
    initial_state, grad_state = a.get("initial_state"), a.get("grad_state")
    S0, z0 = _state_arrays(initial_state, "initial_state")
    dS_in, dz_in = _state_arrays(grad_state, "grad_state")
    if initial_state is not None and not hasattr(initial_state, "offset"):
        raise TypeError(f"initial_state must be the LinearAttentionState the forward call "
                        f"started from (with S, z and offset), got {type(initial_state).__name__}")
    offset = 0 if initial_state is None else int(initial_state.offset)
    projection = a.get("projection")
    mask, key_mask = a.get("mask"), a.get("key_mask")
    shapes = [np.shape(x)[:-2] for x in (dout, q, k, v, mask, S0, dS_in) if x is not None]
    shapes += [np.shape(x)[:-1] for x in (key_mask, z0, dz_in) if x is not None]
    dq, dk, dv = (direct_output(a.get(name), x, (dout, q, k, v), shapes)
                  for name, x in (("dq", q), ("dk", k), ("dv", v)))
    dq, dk, dv, dW, dS0, dz0 = _C.linear_attention_backward(
        dout, q, k, v, front=front, feature_map=feature_map, causal=a.get("causal", False),
        key_mask=key_mask, mask=mask, window=a.get("window"), method=a.get("method"),
        chunk_size=a.get("chunk_size"), eps=a.get("eps", 1e-6), p=a.get("p", 3), M=a.get("M"),
        projection=projection, S0=S0, z0=z0, dS=dS_in, dz=dz_in, offset=offset,
        projection_grad=bool(a.get("projection_grad", False)), dq=dq, dk=dk, dv=dv)
    state = None
    if S0 is not None:
        state = (sum_to_shape(dS0, np.shape(S0)), sum_to_shape(dz0, np.shape(z0)))
    if dW is not None:
        dW = dW.astype(grad_dtype(projection, dW.dtype), copy=False)
    return Gradients(q=deliver(dq, q, a.get("dq"), "dq"), k=deliver(dk, k, a.get("dk"), "dk"),
                     v=deliver(dv, v, a.get("dv"), "dv"), projection=dW, state=state)


def linear_attention_backward(dout, q, k, v, *, feature_map="elu", causal=False, key_mask=None,
                              mask=None, window=None, method=None, chunk_size=None, eps=1e-6,
                              projection=None, p=3, initial_state=None, grad_state=None,
                              projection_grad=False, dq=None, dk=None, dv=None):
    """Gradients of ``sum(dout * linear_attention(q, k, v, ...))``.

    Parameters
    ----------
    dout : array_like, shape (..., n, e)
        The gradient arriving at the forward's output.
    q, k, v : array_like
        The forward's inputs.
    feature_map, causal, key_mask, mask, window, method, chunk_size, eps, projection, p
        The forward's options; every method gives the same gradients.
    initial_state : LinearAttentionState, optional
        The forward's initial state; its gradient is returned as
        ``g.state = (dS, dz)``.
    grad_state : (array_like, array_like), optional
        ``(dS, dz)`` (or a state-like object with S and z), the gradient
        arriving at the state the forward returned with
        ``return_state=True``.
    dq, dk, dv : ndarray, optional
        Arrays to receive the gradients.
    projection_grad : bool, default False
        Also return ``g.projection``, the gradient of FAVOR+'s projection.

    Returns
    -------
    Gradients
        ``q``, ``k``, ``v`` (each of its input's shape, summed over
        broadcast axes, and dtype), ``projection`` with
        ``projection_grad=True``, ``state = (dS, dz)`` when
        ``initial_state`` is given.

    Raises
    ------
    ValueError
        Shapes that do not match the forward's, or its options' errors.
    TypeError
        Inputs of an unsupported dtype, a callable feature map (train it
        through attnx.torch).

    See Also
    --------
    linear_attention : The forward.
    vjp : The forward and this backward in one call.

    Notes
    -----
    With ``grad_state``, backpropagating piece by piece (the last piece
    first, each passing its ``g.state`` as the previous piece's
    ``grad_state``) equals one call over the whole sequence. The causal
    backward runs the chunked form in reverse (docs/gradients.md).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((6, 4)) for _ in range(3))
    >>> out, pullback = attnx.vjp(attnx.linear_attention, q, k, v, causal=True)
    >>> g = attnx.linear_attention_backward(np.ones_like(out), q, k, v, causal=True)
    >>> [x.shape for x in g[:3]]
    [(6, 4), (6, 4), (6, 4)]
    >>> all(np.allclose(a, b) for a, b in zip(g[:3], pullback(np.ones_like(out))[:3]))
    True
    """
    return _backward("linear", dout, q, k, v, locals())


def cosformer_attention_backward(dout, q, k, v, *, causal=False, key_mask=None, M=None,
                                 mask=None, window=None, method=None, chunk_size=None, eps=1e-6,
                                 initial_state=None, grad_state=None, dq=None, dk=None, dv=None):
    """Gradients of ``sum(dout * cosformer_attention(q, k, v, ...))``.

    Parameters
    ----------
    dout : array_like, shape (..., n, e)
        The gradient arriving at the forward's output.
    q, k, v : array_like
        The forward's inputs.
    causal, key_mask, M, mask, window, method, chunk_size, eps
        The forward's options.
    initial_state : LinearAttentionState, optional
        The forward's initial state; its gradient is returned as
        ``g.state = (dS, dz)``.
    grad_state : (array_like, array_like), optional
        ``(dS, dz)`` (or a state-like object with S and z), the gradient
        arriving at the state the forward returned with
        ``return_state=True``.
    dq, dk, dv : ndarray, optional
        Arrays to receive the gradients.

    Returns
    -------
    Gradients
        ``q``, ``k``, ``v``, and ``state`` when ``initial_state`` is given.

    Raises
    ------
    ValueError
        Shapes that do not match the forward's, or its options' errors.
    TypeError
        Inputs of an unsupported dtype, a callable feature map (train it
        through attnx.torch).

    See Also
    --------
    cosformer_attention : The forward.
    linear_attention_backward : The general form.

    Notes
    -----
    The gradient of linear attention on the features ``[relu(x)
    sin(theta_t), relu(x) cos(theta_t)]``, through the relu.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((6, 4)) for _ in range(3))
    >>> out, pullback = attnx.vjp(attnx.cosformer_attention, q, k, v, causal=True)
    >>> g = attnx.cosformer_attention_backward(np.ones_like(out), q, k, v, causal=True)
    >>> [x.shape for x in g[:3]]
    [(6, 4), (6, 4), (6, 4)]
    >>> all(np.allclose(a, b) for a, b in zip(g[:3], pullback(np.ones_like(out))[:3]))
    True
    """
    return _backward("cosformer", dout, q, k, v, locals())


def focused_linear_attention_backward(dout, q, k, v, p=3, *, causal=False, key_mask=None,
                                      mask=None, window=None, method=None, chunk_size=None,
                                      eps=1e-6, initial_state=None, grad_state=None, dq=None,
                                      dk=None, dv=None, dwc_weight=None, spatial=None):
    """Gradients of ``sum(dout * focused_linear_attention(q, k, v, p, ...))``.

    Parameters
    ----------
    dout : array_like, shape (..., n, e)
        The gradient arriving at the forward's output.
    q, k, v : array_like
        The forward's inputs.
    p, causal, key_mask, mask, window, method, chunk_size, eps
        The forward's options.
    initial_state : LinearAttentionState, optional
        The forward's initial state; its gradient is returned as
        ``g.state = (dS, dz)``.
    grad_state : (array_like, array_like), optional
        ``(dS, dz)`` (or a state-like object with S and z), the gradient
        arriving at the state the forward returned with
        ``return_state=True``.
    dq, dk, dv : ndarray, optional
        Arrays to receive the gradients.
    dwc_weight, spatial : array_like, optional
        The forward's depthwise-convolution term.

    Returns
    -------
    Gradients
        ``q``, ``k``, ``v`` (the convolution's share added to ``v``),
        ``projection``: the gradient of ``dwc_weight`` when given.

    Raises
    ------
    ValueError
        Shapes that do not match the forward's, or its options' errors.
    TypeError
        Inputs of an unsupported dtype, a callable feature map (train it
        through attnx.torch).

    See Also
    --------
    focused_linear_attention : The forward.
    linear_attention_backward : The general form.

    Notes
    -----
    The focused features' derivative is taken per head vector (their
    norms couple the features).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((6, 4)) for _ in range(3))
    >>> out, pullback = attnx.vjp(attnx.focused_linear_attention, q, k, v, p=3)
    >>> g = attnx.focused_linear_attention_backward(np.ones_like(out), q, k, v, p=3)
    >>> [x.shape for x in g[:3]]
    [(6, 4), (6, 4), (6, 4)]
    >>> all(np.allclose(a, b) for a, b in zip(g[:3], pullback(np.ones_like(out))[:3]))
    True
    """
    options = dict(locals())
    dwc_weight, spatial = options.pop("dwc_weight"), options.pop("spatial")
    if dwc_weight is None:
        return _backward("focused", dout, q, k, v, options)
    if dv is not None:
        raise ValueError("dv= cannot be combined with dwc_weight: the convolution adds to dv")
    grads = _backward("focused", dout, q, k, v, options)
    dout = np.asarray(dout)
    # v broadcast (e.g. shared by query heads): the convolution ran on the
    # broadcast values, and its gradient is summed back to v's shape
    v_full = np.broadcast_to(v, dout.shape[:-2] + np.shape(v)[-2:])
    dv_conv, dweight = _dwc.depthwise_convolution_backward(dout, v_full, dwc_weight, spatial)
    dv_conv = sum_to_shape(dv_conv, np.shape(v))
    return grads._replace(v=grads.v + dv_conv.astype(grads.v.dtype, copy=False),
                          projection=dweight)


def taylor_attention_backward(dout, q, k, v, *, causal=False, key_mask=None, mask=None,
                              window=None, method=None, chunk_size=None, eps=1e-6,
                              initial_state=None, grad_state=None, dq=None, dk=None, dv=None):
    """Gradients of ``sum(dout * taylor_attention(q, k, v, ...))``.

    Parameters
    ----------
    dout : array_like, shape (..., n, e)
        The gradient arriving at the forward's output.
    q, k, v : array_like
        The forward's inputs.
    causal, key_mask, mask, window, method, chunk_size, eps
        The forward's options.
    initial_state : LinearAttentionState, optional
        The forward's initial state; its gradient is returned as
        ``g.state = (dS, dz)``.
    grad_state : (array_like, array_like), optional
        ``(dS, dz)`` (or a state-like object with S and z), the gradient
        arriving at the state the forward returned with
        ``return_state=True``.
    dq, dk, dv : ndarray, optional
        Arrays to receive the gradients.

    Returns
    -------
    Gradients
        ``q``, ``k``, ``v``, and ``state`` when ``initial_state`` is given.

    Raises
    ------
    ValueError
        Shapes that do not match the forward's, or its options' errors.
    TypeError
        Inputs of an unsupported dtype, a callable feature map (train it
        through attnx.torch).

    See Also
    --------
    taylor_attention : The forward.
    linear_attention_backward : The general form.

    Notes
    -----
    The features ``[1, x / |x|]`` have the derivative ``(I - u u^T) / |x|``
    with ``u = x / |x|`` (0 for a zero vector).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((6, 4)) for _ in range(3))
    >>> out, pullback = attnx.vjp(attnx.taylor_attention, q, k, v)
    >>> g = attnx.taylor_attention_backward(np.ones_like(out), q, k, v)
    >>> [x.shape for x in g[:3]]
    [(6, 4), (6, 4), (6, 4)]
    >>> all(np.allclose(a, b) for a, b in zip(g[:3], pullback(np.ones_like(out))[:3]))
    True
    """
    return _backward("taylor", dout, q, k, v, locals())


def performer_attention_backward(dout, q, k, v, projection=None, num_features=None, seed=None, *,
                                 causal=False, key_mask=None, mask=None, window=None, method=None,
                                 chunk_size=None, eps=1e-6, initial_state=None, grad_state=None,
                                 projection_grad=False, dq=None, dk=None, dv=None):
    """Gradients of ``sum(dout * performer_attention(q, k, v, projection, ...))``.

    Parameters
    ----------
    dout : array_like, shape (..., n, e)
        The gradient arriving at the forward's output.
    q, k, v : array_like
        The forward's inputs.
    projection, num_features, seed
        The forward's projection: pass ``projection=`` or the same
        ``seed=`` (a forward without either drew a projection nobody
        kept).
    causal, key_mask, mask, window, method, chunk_size, eps
        The forward's options.
    initial_state : LinearAttentionState, optional
        The forward's initial state; its gradient is returned as
        ``g.state = (dS, dz)``.
    grad_state : (array_like, array_like), optional
        ``(dS, dz)`` (or a state-like object with S and z), the gradient
        arriving at the state the forward returned with
        ``return_state=True``.
    dq, dk, dv : ndarray, optional
        Arrays to receive the gradients.
    projection_grad : bool, default False
        Also return ``g.projection``, the gradient of W.

    Returns
    -------
    Gradients
        ``q``, ``k``, ``v``, ``projection`` with ``projection_grad=True``,
        ``state`` when ``initial_state`` is given.

    Raises
    ------
    ValueError
        No projection and no seed, shapes that do not match the forward's, or its options' errors.
    TypeError
        Inputs of an unsupported dtype, a callable feature map (train it
        through attnx.torch).

    See Also
    --------
    performer_attention : The forward.
    random_features : Draws a projection.

    Notes
    -----
    The features ``r**-0.5 exp(W x~ - |x~|^2 / 2)`` have the derivative
    ``phi * (W - x~)`` per feature (times ``d**-0.25``); W's gradient sums
    ``phi * x~``, weighted by the features' incoming gradients, over
    queries and keys.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((6, 4)) for _ in range(3))
    >>> W = attnx.random_features(8, 4, seed=0)
    >>> out, pullback = attnx.vjp(attnx.performer_attention, q, k, v, projection=W)
    >>> g = attnx.performer_attention_backward(np.ones_like(out), q, k, v, projection=W)
    >>> [x.shape for x in g[:3]]
    [(6, 4), (6, 4), (6, 4)]
    >>> all(np.allclose(a, b) for a, b in zip(g[:3], pullback(np.ones_like(out))[:3]))
    True
    """
    a = locals()
    if projection is None:
        if seed is None:
            raise ValueError("performer_attention_backward needs the forward's projection: pass "
                             "projection= or the seed= the forward used")
        d = np.shape(q)[-1]
        if num_features is None:
            num_features = max(1, round(d * math.log(d))) if d > 0 else 1
        a["projection"] = random_features(num_features, d, seed=seed)
    elif seed is not None:
        raise ValueError("performer_attention_backward: give projection= or seed=, not both")
    return _backward("performer", dout, q, k, v, a)


def efficient_attention_backward(dout, q, k, v, *, key_mask=None, causal=False, dq=None, dk=None,
                                 dv=None):
    """Gradients of ``sum(dout * efficient_attention(q, k, v, ...))``.

    Parameters
    ----------
    dout : array_like, shape (..., n, e)
        The gradient arriving at the forward's output.
    q, k, v : array_like
        The forward's inputs.
    key_mask, causal
        The forward's options (causal must be False).
    dq, dk, dv : ndarray, optional
        Arrays to receive the gradients.

    Returns
    -------
    Gradients
        ``q``, ``k``, ``v``, each of its input's shape and dtype.

    Raises
    ------
    ValueError
        Shapes that do not match the forward's, or its options' errors.
    TypeError
        Inputs of an unsupported dtype, a callable feature map (train it
        through attnx.torch).

    See Also
    --------
    efficient_attention : The forward.

    Notes
    -----
    Through both softmaxes: over each query's features and over the keys
    of each key feature.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((6, 4)) for _ in range(3))
    >>> out, pullback = attnx.vjp(attnx.efficient_attention, q, k, v)
    >>> g = attnx.efficient_attention_backward(np.ones_like(out), q, k, v)
    >>> [x.shape for x in g[:3]]
    [(6, 4), (6, 4), (6, 4)]
    >>> all(np.allclose(a, b) for a, b in zip(g[:3], pullback(np.ones_like(out))[:3]))
    True
    """
    return _backward("efficient", dout, q, k, v, locals())


def _rule(forward, backward, fixed_projection=False):
    """vjp rule for a front end: run it, and a pullback that calls its
    backward with the same arguments. With return_state=True the forward
    returns (out, state) and the pullback takes (dout, grad_state=None)."""
    def rule(q, k, v, *args, **options):
        options.pop("out", None)
        if fixed_projection and not args and options.get("projection") is None:
            # performer without a projection draws one per call: draw it
            # here once, so that forward and backward use the same
            d = np.shape(q)[-1]
            num = options.pop("num_features", None)
            if num is None:
                num = max(1, round(d * math.log(d))) if d > 0 else 1
            options["projection"] = random_features(num, d, seed=options.pop("seed", None))
        result = forward(q, k, v, *args, **options)
        options.pop("return_state", None)

        def pullback(dout, grad_state=None):
            return backward(dout, q, k, v, *args, grad_state=grad_state, **options)

        return result, pullback

    rule.__name__ = f"{forward.__name__}_vjp"
    return rule


def _efficient_rule(q, k, v, **options):
    options.pop("out", None)
    out = efficient_attention(q, k, v, **options)
    return out, lambda dout: efficient_attention_backward(dout, q, k, v, **options)


register_vjp(linear_attention, _rule(linear_attention, linear_attention_backward))
register_vjp(cosformer_attention, _rule(cosformer_attention, cosformer_attention_backward))
register_vjp(focused_linear_attention,
             _rule(focused_linear_attention, focused_linear_attention_backward))
register_vjp(taylor_attention, _rule(taylor_attention, taylor_attention_backward))
register_vjp(performer_attention,
             _rule(performer_attention, performer_attention_backward, fixed_projection=True))
register_vjp(efficient_attention, _efficient_rule)
