"""attnx.torch's linear family: the kernelised front ends
(``linear_attention``, ``cosformer_attention``, ``focused_linear_attention``,
``taylor_attention``, ``performer_attention``, ``efficient_attention``) as
the operators ``torch.ops.attnx.linear_attention`` and, streaming with a
state, ``linear_attention_state``, each with its backward operator."""
import inspect
import math
from typing import List, NamedTuple, Optional, Tuple

import numpy as np
import torch

import attnx

from .. import _linear
from .._variants import VARIANTS, resolve
from ._common import (
    Tensor,
    _batch_shape,
    _check_inputs,
    _check_tensor,
    _compute_dtype,
    _decode_causal,
    _decode_window,
    _encode_causal,
    _encode_window,
    _from_numpy,
    _in_compute_dtype,
    _in_dtype,
    _key_padding_view,
    _np,
)
from ._dwc import add_depthwise_convolution as _add_depthwise_convolution


# ------------------------------------------------------- linear family op

_PARAMETERS = {front: set(inspect.signature(fn).parameters)
               for front, fn in _linear.FRONT_ENDS.items()}


def _linear_options(front, feature_map, causal, key_mask, mask, window, method, chunk_size, eps,
                    projection, p, M, dtype):
    given = {"feature_map": feature_map, "causal": _decode_causal(causal),
             "key_mask": _np(key_mask),
             "mask": _np(mask), "window": _decode_window(window), "method": method,
             "chunk_size": chunk_size, "eps": eps, "projection": _np(projection, dtype),
             "p": p if p is None or p != int(p) else int(p),
             "M": M if M is None or M != int(M) else int(M)}
    return {name: value for name, value in given.items() if name in _PARAMETERS[front]}


@torch.library.custom_op("attnx::linear_attention", mutates_args=(), device_types="cpu")
def _linear_op(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor], mask: Optional[Tensor],
               projection: Optional[Tensor], front: str, feature_map: str, causal: str,
               window: Optional[List[int]], method: Optional[str], chunk_size: Optional[int],
               eps: float, p: float, M: Optional[float]) -> Tensor:
    """The kernelised front end `front` ("linear", "cosformer", "focused",
    "taylor", "performer", "efficient") with its options."""
    dtype = _compute_dtype(q.dtype)
    options = _linear_options(front, feature_map, causal, key_mask, mask, window, method,
                              chunk_size, eps, projection, p, M, dtype)
    shape = _batch_shape(q, k, v, mask)
    if key_mask is not None:
        shape = torch.broadcast_shapes(shape, key_mask.shape[:-1])
    out = torch.empty(shape + (q.shape[-2], v.shape[-1]), dtype=dtype)
    if out.numel() == 0 or k.shape[-2] == 0:
        return out.zero_().to(q.dtype)
    _linear.FRONT_ENDS[front](_np(q, dtype), _np(k, dtype), _np(v, dtype), out=out.numpy(),
                              **options)
    return out.to(q.dtype)


@_linear_op.register_fake
def _(q, k, v, key_mask, mask, projection, front, feature_map, causal, window, method, chunk_size,
      eps, p, M):
    shape = _batch_shape(q, k, v, mask)
    if key_mask is not None:
        shape = torch.broadcast_shapes(shape, key_mask.shape[:-1])
    return q.new_empty(shape + (q.shape[-2], v.shape[-1]))


@torch.library.custom_op("attnx::linear_attention_backward", mutates_args=(), device_types="cpu")
def _linear_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
                        mask: Optional[Tensor], projection: Optional[Tensor], front: str,
                        feature_map: str, causal: str, window: Optional[List[int]],
                        method: Optional[str], chunk_size: Optional[int], eps: float, p: float,
                        M: Optional[float], projection_grad: bool
                        ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv and dprojection (empty unless projection_grad) of
    sum(dout * out) for the kernelised front end `front`."""
    backward = getattr(attnx, VARIANTS[front].backward, None)
    if backward is None:
        raise NotImplementedError(f"this attnx has no {VARIANTS[front].backward}")
    dtype = _compute_dtype(q.dtype)
    if dout.numel() == 0 or k.shape[-2] == 0:
        dprojection = torch.zeros_like(projection) if projection_grad else q.new_empty((0,))
        return (*(torch.zeros_like(t) for t in (q, k, v)), dprojection)
    options = _linear_options(front, feature_map, causal, key_mask, mask, window, method,
                              chunk_size, eps, projection, p, M, dtype)
    if projection_grad:
        options["projection_grad"] = True
    grads = [torch.empty(t.shape, dtype=dtype) for t in (q, k, v)]
    g = backward(*(_np(t, dtype) for t in (dout, q, k, v)), dq=grads[0].numpy(),
                 dk=grads[1].numpy(), dv=grads[2].numpy(), **options)
    dprojection = (_from_numpy(g.projection, projection.dtype) if projection_grad
                   else q.new_empty((0,)))
    return (*(grad.to(t.dtype) for grad, t in zip(grads, (q, k, v))), dprojection)


@_linear_backward_op.register_fake
def _(dout, q, k, v, key_mask, mask, projection, front, feature_map, causal, window, method,
      chunk_size, eps, p, M, projection_grad):
    dprojection = projection.new_empty(projection.shape) if projection_grad else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dprojection


def _linear_setup_context(ctx, inputs, output):
    q, k, v, key_mask, mask, projection = inputs[:6]
    ctx.options = inputs[6:]
    ctx.projection_grad = projection is not None and ctx.needs_input_grad[5]
    ctx.save_for_backward(q, k, v, key_mask, mask, projection)


def _linear_backward(ctx, dout):
    q, k, v, key_mask, mask, projection = ctx.saved_tensors
    dq, dk, dv, dprojection = torch.ops.attnx.linear_attention_backward(
        dout, q, k, v, key_mask, mask, projection, *ctx.options, ctx.projection_grad)
    return (dq, dk, dv, None, None, dprojection if ctx.projection_grad else None) + (None,) * 9


_linear_op.register_autograd(_linear_backward, setup_context=_linear_setup_context)


# ------------------------------------- linear family op with a streaming state

class LinearAttentionState(NamedTuple):
    """The state a torch linear front end returns with ``return_state=True``.

    Taken back as ``initial_state=``, as `attnx.LinearAttentionState` is.

    Parameters
    ----------
    S : torch.Tensor, shape (..., r, e)
        ``sum_j psi(k_j) v_j^T`` over the keys so far.
    z : torch.Tensor, shape (..., r)
        ``sum_j psi(k_j)``.
    offset : int
        The key positions consumed.

    Raises
    ------
    TypeError
        When built with unknown fields (as any named tuple).

    See Also
    --------
    linear_attention : Returns and takes it.

    Notes
    -----
    S and z are tensors in the computing dtype (float32 for half inputs)
    that carry gradients: pieces of a sequence chained through the state
    give what one call gives, outputs and gradients (to every piece's q, k,
    v, to the projection, and to the first initial_state's S and z).

    Examples
    --------
    >>> import torch, attnx.torch
    >>> q = torch.randn(6, 4, dtype=torch.float64)
    >>> o1, st = attnx.torch.linear_attention(q[:4], q[:4], q[:4], causal=True, return_state=True)
    >>> o2, st = attnx.torch.linear_attention(q[4:], q[4:], q[4:], causal=True,
    ...                                       initial_state=st, return_state=True)
    >>> st.offset, tuple(st.S.shape)
    (6, (4, 4))
    >>> whole = attnx.torch.linear_attention(q, q, q, causal=True)
    >>> torch.allclose(torch.cat([o1, o2]), whole)
    True
    """
    S: Tensor
    z: Tensor
    offset: int


def _numpy_state(S0, z0, offset, dtype):
    if S0 is None:
        return None
    return attnx.LinearAttentionState(_np(S0, dtype), _np(z0, dtype), offset)


@torch.library.custom_op("attnx::linear_attention_state", mutates_args=(), device_types="cpu")
def _linear_state_op(q: Tensor, k: Tensor, v: Tensor, key_mask: Optional[Tensor],
                     projection: Optional[Tensor], S0: Optional[Tensor], z0: Optional[Tensor],
                     offset: int, front: str, feature_map: str, causal: str,
                     method: Optional[str], chunk_size: Optional[int], eps: float, p: float,
                     M: Optional[float]) -> Tuple[Tensor, Tensor, Tensor]:
    """The kernelised front end `front` continuing the state (S0, z0,
    offset) (S0, z0 None: from the start): out (..., n, e) and the state
    after these keys, S (..., r, e) and z (..., r)."""
    dtype = _compute_dtype(q.dtype)
    options = _linear_options(front, feature_map, causal, key_mask, None, None, method,
                              chunk_size, eps, projection, p, M, dtype)
    out, state = _linear.FRONT_ENDS[front](
        _np(q, dtype), _np(k, dtype), _np(v, dtype), initial_state=_numpy_state(S0, z0, offset, dtype),
        return_state=True, **options)
    return (torch.from_numpy(out), torch.from_numpy(np.ascontiguousarray(state.S)),
            torch.from_numpy(np.ascontiguousarray(state.z)))


def _state_batch_shape(q, k, v, key_mask, S0):
    shape = _batch_shape(q, k, v)
    if key_mask is not None:
        shape = torch.broadcast_shapes(shape, key_mask.shape[:-1])
    if S0 is not None:
        shape = torch.broadcast_shapes(shape, S0.shape[:-2])
    return shape


@_linear_state_op.register_fake
def _(q, k, v, key_mask, projection, S0, z0, offset, front, feature_map, causal, method,
      chunk_size, eps, p, M):
    shape = _state_batch_shape(q, k, v, key_mask, S0)
    dtype = _compute_dtype(q.dtype)
    r = resolve(front, feature_map=feature_map, d=q.shape[-1], projection=projection)["features"]
    return (q.new_empty(shape + (q.shape[-2], v.shape[-1]), dtype=dtype),
            q.new_empty(shape + (r, v.shape[-1]), dtype=dtype),
            q.new_empty(shape + (r,), dtype=dtype))


@torch.library.custom_op("attnx::linear_attention_state_backward", mutates_args=(),
                         device_types="cpu")
def _linear_state_backward_op(dout: Tensor, dS: Tensor, dz: Tensor, q: Tensor, k: Tensor,
                              v: Tensor, key_mask: Optional[Tensor],
                              projection: Optional[Tensor], S0: Optional[Tensor],
                              z0: Optional[Tensor], offset: int, front: str, feature_map: str,
                              causal: str, method: Optional[str], chunk_size: Optional[int],
                              eps: float, p: float, M: Optional[float], projection_grad: bool
                              ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, dprojection (empty unless projection_grad) and dS0, dz0
    (empty without S0) of sum(dout * out) + sum(dS * S) + sum(dz * z)."""
    backward = getattr(attnx, VARIANTS[front].backward)
    dtype = _compute_dtype(q.dtype)
    options = _linear_options(front, feature_map, causal, key_mask, None, None, method,
                              chunk_size, eps, projection, p, M, dtype)
    if projection_grad:
        options["projection_grad"] = True
    g = backward(*(_np(t, dtype) for t in (dout, q, k, v)),
                 initial_state=_numpy_state(S0, z0, offset, dtype),
                 grad_state=(_np(dS, dtype), _np(dz, dtype)), **options)
    grads = [_from_numpy(grad, t.dtype) for grad, t in zip((g.q, g.k, g.v), (q, k, v))]
    dprojection = (_from_numpy(g.projection, projection.dtype) if projection_grad
                   else q.new_empty((0,)))
    dS0, dz0 = ((_from_numpy(g.state[0], S0.dtype), _from_numpy(g.state[1], z0.dtype))
                if S0 is not None else (q.new_empty((0,)), q.new_empty((0,))))
    return (*grads, dprojection, dS0, dz0)


@_linear_state_backward_op.register_fake
def _(dout, dS, dz, q, k, v, key_mask, projection, S0, z0, offset, front, feature_map, causal,
      method, chunk_size, eps, p, M, projection_grad):
    dprojection = projection.new_empty(projection.shape) if projection_grad else q.new_empty((0,))
    if S0 is None:
        dS0, dz0 = q.new_empty((0,)), q.new_empty((0,))
    else:
        dS0, dz0 = S0.new_empty(S0.shape), z0.new_empty(z0.shape)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dprojection, dS0,
            dz0)


def _linear_state_setup_context(ctx, inputs, output):
    q, k, v, key_mask, projection, S0, z0 = inputs[:7]
    ctx.offset = inputs[7]
    ctx.options = inputs[8:]
    ctx.projection_grad = projection is not None and ctx.needs_input_grad[4]
    ctx.save_for_backward(q, k, v, key_mask, projection, S0, z0)


def _linear_state_backward(ctx, dout, dS, dz):
    q, k, v, key_mask, projection, S0, z0 = ctx.saved_tensors
    dq, dk, dv, dprojection, dS0, dz0 = torch.ops.attnx.linear_attention_state_backward(
        dout, dS, dz, q, k, v, key_mask, projection, S0, z0, ctx.offset, *ctx.options,
        ctx.projection_grad)
    state_grads = (dS0, dz0) if S0 is not None else (None, None)
    return ((dq, dk, dv, None, dprojection if ctx.projection_grad else None) + state_grads
            + (None,) * 9)


_linear_state_op.register_autograd(_linear_state_backward,
                                   setup_context=_linear_state_setup_context)


def _state_tensors(initial_state, dtype):
    """(S, z, offset) of an initial_state (attnx.torch's, or attnx's numpy
    LinearAttentionState) as tensors of `dtype` (differentiable)."""
    if initial_state is None:
        return None, None, 0
    if not all(hasattr(initial_state, name) for name in ("S", "z", "offset")):
        raise TypeError("initial_state must be the state a call with return_state=True "
                        f"returned (with S, z and offset), got {type(initial_state).__name__}")
    S, z = (t if isinstance(t, torch.Tensor) else torch.from_numpy(np.asarray(t))
            for t in (initial_state.S, initial_state.z))
    for name, t in (("initial_state.S", S), ("initial_state.z", z)):
        _check_tensor(name, t)
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got dtype {t.dtype}")
    offset = initial_state.offset
    if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or offset < 0:
        raise ValueError(f"initial_state.offset must be an int >= 0, got {offset!r}")
    return S.to(dtype), z.to(dtype), int(offset)


def _torch_features(feature_map, q, k):
    """phi(q), phi(k) from a callable written in torch (differentiated by
    autograd), checked like the numpy front end's."""
    features = []
    for name, x in (("q", q), ("k", k)):
        phi = feature_map(x)
        if not isinstance(phi, torch.Tensor):
            raise TypeError(f"feature_map callable returned {type(phi).__name__} for {name}; "
                            "it must return a torch.Tensor")
        if phi.shape[:-1] != x.shape[:-1]:
            raise ValueError(f"feature_map callable returned shape {tuple(phi.shape)} for {name} "
                             f"of shape {tuple(x.shape)}; expected {tuple(x.shape[:-1])} + (r,)")
        features.append(phi.to(x.dtype))
    if features[0].shape[-1] != features[1].shape[-1]:
        raise ValueError(f"feature_map callable returned {features[0].shape[-1]} features for q "
                         f"but {features[1].shape[-1]} for k; they must agree")
    return features


def _linear_call(front, q, k, v, feature_map="elu", causal=False, key_mask=None, mask=None,
                 window=None, method=None, chunk_size=None, eps=1e-6, projection=None, p=3, M=None,
                 initial_state=None, return_state=False):
    _check_inputs(("q", "k", "v"), q, k, v)
    for name, t in (("key_mask", key_mask), ("mask", mask)):
        if t is not None:
            _check_tensor(name, t)
            if t.dtype != torch.bool:
                raise TypeError(f"{name} must be a bool tensor (True = attend), got {t.dtype}")
    if mask is not None:
        mask = _key_padding_view(mask, q.shape[-2])
    streaming = initial_state is not None or return_state
    if streaming and (mask is not None or window is not None):
        # the kernel's own check (a streaming op takes no mask or window)
        resolve(front, feature_map="elu", mask=mask is not None, window=window, streaming=True)
    if callable(feature_map):
        q, k = _torch_features(feature_map, q, k)
        feature_map = "identity"
    if projection is not None:
        _check_tensor("projection", projection)
    dtype = q.dtype
    q, k, v, projection = _in_compute_dtype(q, k, v, projection)
    options = (front, feature_map, _encode_causal(causal))
    numbers = (method, chunk_size, float(eps), float(p), None if M is None else float(M))
    if not streaming:
        return _in_dtype(torch.ops.attnx.linear_attention(
            q, k, v, key_mask, mask, projection, *options, _encode_window(window), *numbers),
            dtype)
    S0, z0, offset = _state_tensors(initial_state, q.dtype)
    out, S, z = torch.ops.attnx.linear_attention_state(q, k, v, key_mask, projection, S0, z0,
                                                       offset, *options, *numbers)
    out = _in_dtype(out, dtype)
    if return_state:
        return out, LinearAttentionState(S, z, offset + k.shape[-2])
    return out


_STREAMING_DOC = """

    Streaming: return_state=True returns (out, LinearAttentionState);
    pass the state as initial_state= to the next call (it may also be
    attnx's numpy state). Pieces give what one call over the whole
    sequence gives, and gradients flow through the states to every piece
    and to the first initial_state's S and z."""


def linear_attention(q, k, v, *, feature_map="elu", causal=False, key_mask=None, mask=None,
                     window=None, method=None, chunk_size=None, eps=1e-6, projection=None, p=3,
                     initial_state=None, return_state=False):
    """`attnx.linear_attention` on tensors, differentiable.

    Parameters
    ----------
    q : torch.Tensor, shape (..., n, d)
        Queries, on the CPU: float32, float64, bfloat16 or float16.
    k : torch.Tensor, shape (..., m, d)
        Keys, of q's dtype.
    v : torch.Tensor, shape (..., m, e)
        Values, of q's dtype; the leading axes broadcast.
    feature_map : str or callable, default "elu"
        As in `attnx.linear_attention`, or a callable written in torch,
        ``f(x) -> (..., r)`` non-negative: torch applies it (autograd
        through it, so learned maps train) and attnx computes attention on
        the features.
    causal, key_mask, mask, window, method, chunk_size, eps
        As in `attnx.linear_attention` (masks as tensors).
    projection : torch.Tensor, shape (r, d), optional
        FAVOR+'s projection, differentiable.
    p : float, default 3
        The power of the "focused" feature map.
    initial_state : LinearAttentionState, optional
        The state of an earlier call, continued (differentiably).
    return_state : bool, default False
        Also return the state after this call.

    Returns
    -------
    out : torch.Tensor, shape (..., n, e)
        In q's dtype.
    state : LinearAttentionState
        Only with ``return_state=True``.

    Raises
    ------
    TypeError
        Arguments that are not tensors, or q, k, v of different dtypes.
    ValueError
        Tensors on another device than the CPU, and the errors of the
        numpy function for shapes and options.

    See Also
    --------
    attnx.linear_attention : The numpy function, with the meaning of each option.
    LinearAttentionState : The streaming state.

    Notes
    -----
    ``o_i = phi(q_i) S / max(phi(q_i) . z, eps)``, ``S = sum_j psi(k_j)
    v_j^T``, ``z = sum_j psi(k_j)`` over the visible keys; the backward is
    `attnx.linear_attention_backward`.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> q, k, v = (torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    >>> out = attnx.torch.linear_attention(q, k, v, causal=True)
    >>> out.shape
    torch.Size([2, 6, 4])
    >>> out.sum().backward()                       # gradients computed by attnx
    >>> q.grad.shape
    torch.Size([2, 6, 4])
    >>> expected = attnx.linear_attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), causal=True)
    >>> torch.allclose(out, torch.from_numpy(expected))
    True
    >>> phi = torch.nn.Sequential(torch.nn.Linear(4, 4, dtype=torch.float64), torch.nn.Softplus())
    >>> attnx.torch.linear_attention(q, k, v, feature_map=phi).sum().backward()
    >>> phi[0].weight.grad.shape                   # a learned feature map trains
    torch.Size([4, 4])
    """
    return _linear_call("linear", q, k, v, feature_map, causal, key_mask, mask, window, method,
                        chunk_size, eps, projection, p, initial_state=initial_state,
                        return_state=return_state)


def cosformer_attention(q, k, v, *, causal=False, key_mask=None, M=None, mask=None, window=None,
                        method=None, chunk_size=None, eps=1e-6, initial_state=None,
                        return_state=False):
    """`attnx.cosformer_attention` on tensors, differentiable.

    Parameters
    ----------
    q : torch.Tensor, shape (..., n, d)
        Queries, on the CPU: float32, float64, bfloat16 or float16.
    k : torch.Tensor, shape (..., m, d)
        Keys, of q's dtype.
    v : torch.Tensor, shape (..., m, e)
        Values, of q's dtype; the leading axes broadcast.
    causal, key_mask, mask, window, method, chunk_size, eps
        As in `attnx.linear_attention` (masks as tensors).
    M : float, optional
        As in `attnx.cosformer_attention`; streaming needs a fixed M.
    initial_state : LinearAttentionState, optional
        The state of an earlier call, continued (differentiably).
    return_state : bool, default False
        Also return the state after this call.

    Returns
    -------
    out : torch.Tensor, shape (..., n, e)
        In q's dtype.
    state : LinearAttentionState
        Only with ``return_state=True``.

    Raises
    ------
    TypeError
        Arguments that are not tensors, or q, k, v of different dtypes.
    ValueError
        Tensors on another device than the CPU, and the errors of the
        numpy function for shapes and options.

    See Also
    --------
    attnx.cosformer_attention : The numpy function, with the meaning of each option.

    Notes
    -----
    ``s_ij = relu(q_i) . relu(k_j) cos(pi/2 (i - j) / M)``.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> q, k, v = (torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    >>> out = attnx.torch.cosformer_attention(q, k, v, causal=True)
    >>> out.shape
    torch.Size([2, 6, 4])
    >>> out.sum().backward()                       # gradients computed by attnx
    >>> q.grad.shape
    torch.Size([2, 6, 4])
    >>> expected = attnx.cosformer_attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), causal=True)
    >>> torch.allclose(out, torch.from_numpy(expected))
    True
    """
    return _linear_call("cosformer", q, k, v, "elu", causal, key_mask, mask, window, method,
                        chunk_size, eps, M=M, initial_state=initial_state,
                        return_state=return_state)


def focused_linear_attention(q, k, v, p=3, *, causal=False, key_mask=None, mask=None, window=None,
                             method=None, chunk_size=None, eps=1e-6, initial_state=None,
                             return_state=False, dwc_weight=None, spatial=None):
    """`attnx.focused_linear_attention` on tensors, differentiable.

    Parameters
    ----------
    q : torch.Tensor, shape (..., n, d)
        Queries, on the CPU: float32, float64, bfloat16 or float16.
    k : torch.Tensor, shape (..., m, d)
        Keys, of q's dtype.
    v : torch.Tensor, shape (..., m, e)
        Values, of q's dtype; the leading axes broadcast.
    p : float, default 3
        The focusing power.
    causal, key_mask, mask, window, method, chunk_size, eps
        As in `attnx.linear_attention` (masks as tensors).
    dwc_weight : torch.Tensor, optional
        FLatten's depthwise convolution of v added to the output,
        differentiable; (e, ks), or (e, kh, kw) with ``spatial``.
    spatial : (int, int), optional
        The grid (H, W) of the tokens.
    initial_state : LinearAttentionState, optional
        The state of an earlier call, continued (differentiably).
    return_state : bool, default False
        Also return the state after this call.

    Returns
    -------
    out : torch.Tensor, shape (..., n, e)
        In q's dtype.
    state : LinearAttentionState
        Only with ``return_state=True``.

    Raises
    ------
    TypeError
        Arguments that are not tensors, or q, k, v of different dtypes.
    ValueError
        Tensors on another device than the CPU, and the errors of the
        numpy function for shapes and options.

    See Also
    --------
    attnx.focused_linear_attention : The numpy function, with the meaning of each option.

    Notes
    -----
    Features ``f_p(relu(x))``, ``f_p(y) = |y| y**p / |y**p|``.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> q, k, v = (torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    >>> out = attnx.torch.focused_linear_attention(q, k, v, p=3)
    >>> out.shape
    torch.Size([2, 6, 4])
    >>> out.sum().backward()                       # gradients computed by attnx
    >>> q.grad.shape
    torch.Size([2, 6, 4])
    >>> expected = attnx.focused_linear_attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), p=3)
    >>> torch.allclose(out, torch.from_numpy(expected))
    True
    """
    if dwc_weight is not None and (return_state or initial_state is not None):
        raise ValueError("dwc_weight cannot be combined with streaming (initial_state, "
                         "return_state): the convolution looks at neighbours on both sides")
    result = _linear_call("focused", q, k, v, "elu", causal, key_mask, mask, window, method,
                          chunk_size, eps, p=p, initial_state=initial_state,
                          return_state=return_state)
    if return_state:
        out, state = result
        return _add_depthwise_convolution(out, q, v, dwc_weight, spatial), state
    return _add_depthwise_convolution(result, q, v, dwc_weight, spatial)


def taylor_attention(q, k, v, *, causal=False, key_mask=None, mask=None, window=None, method=None,
                     chunk_size=None, eps=1e-6, initial_state=None, return_state=False):
    """`attnx.taylor_attention` on tensors, differentiable.

    Parameters
    ----------
    q : torch.Tensor, shape (..., n, d)
        Queries, on the CPU: float32, float64, bfloat16 or float16.
    k : torch.Tensor, shape (..., m, d)
        Keys, of q's dtype.
    v : torch.Tensor, shape (..., m, e)
        Values, of q's dtype; the leading axes broadcast.
    causal, key_mask, mask, window, method, chunk_size, eps
        As in `attnx.linear_attention` (masks as tensors).
    initial_state : LinearAttentionState, optional
        The state of an earlier call, continued (differentiably).
    return_state : bool, default False
        Also return the state after this call.

    Returns
    -------
    out : torch.Tensor, shape (..., n, e)
        In q's dtype.
    state : LinearAttentionState
        Only with ``return_state=True``.

    Raises
    ------
    TypeError
        Arguments that are not tensors, or q, k, v of different dtypes.
    ValueError
        Tensors on another device than the CPU, and the errors of the
        numpy function for shapes and options.

    See Also
    --------
    attnx.taylor_attention : The numpy function, with the meaning of each option.

    Notes
    -----
    ``s_ij = 1 + cos(q_i, k_j)``.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> q, k, v = (torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    >>> out = attnx.torch.taylor_attention(q, k, v)
    >>> out.shape
    torch.Size([2, 6, 4])
    >>> out.sum().backward()                       # gradients computed by attnx
    >>> q.grad.shape
    torch.Size([2, 6, 4])
    >>> expected = attnx.taylor_attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy())
    >>> torch.allclose(out, torch.from_numpy(expected))
    True
    """
    return _linear_call("taylor", q, k, v, "elu", causal, key_mask, mask, window, method,
                        chunk_size, eps, initial_state=initial_state, return_state=return_state)


def performer_attention(q, k, v, projection=None, num_features=None, seed=None, *, causal=False,
                        key_mask=None, mask=None, window=None, method=None, chunk_size=None,
                        eps=1e-6, initial_state=None, return_state=False):
    """`attnx.performer_attention` on tensors, differentiable.

    Parameters
    ----------
    q : torch.Tensor, shape (..., n, d)
        Queries, on the CPU: float32, float64, bfloat16 or float16.
    k : torch.Tensor, shape (..., m, d)
        Keys, of q's dtype.
    v : torch.Tensor, shape (..., m, e)
        Values, of q's dtype; the leading axes broadcast.
    projection : torch.Tensor, shape (r, d), optional
        Differentiable (a learned projection gets its gradient); when None,
        one is drawn with ``attnx.random_features(num_features, d,
        seed=seed)`` as a constant (pass the same projection or seed to
        every streamed piece).
    num_features, seed
        As in `attnx.performer_attention`.
    causal, key_mask, mask, window, method, chunk_size, eps
        As in `attnx.linear_attention` (masks as tensors).
    initial_state : LinearAttentionState, optional
        The state of an earlier call, continued (differentiably).
    return_state : bool, default False
        Also return the state after this call.

    Returns
    -------
    out : torch.Tensor, shape (..., n, e)
        In q's dtype.
    state : LinearAttentionState
        Only with ``return_state=True``.

    Raises
    ------
    TypeError
        Arguments that are not tensors, or q, k, v of different dtypes.
    ValueError
        Tensors on another device than the CPU, and the errors of the
        numpy function for shapes and options.

    See Also
    --------
    attnx.performer_attention : The numpy function, with the meaning of each option.

    Notes
    -----
    FAVOR+ features ``r**-0.5 exp(W x~ - |x~|^2 / 2)``, ``x~ = d**-0.25 x``.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> q, k, v = (torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    >>> out = attnx.torch.performer_attention(q, k, v, seed=0)
    >>> out.shape
    torch.Size([2, 6, 4])
    >>> out.sum().backward()                       # gradients computed by attnx
    >>> q.grad.shape
    torch.Size([2, 6, 4])
    >>> expected = attnx.performer_attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), seed=0)
    >>> torch.allclose(out, torch.from_numpy(expected))
    True
    """
    if projection is None:
        _check_inputs(("q", "k", "v"), q, k, v)  # before q's width is read
        d = q.shape[-1]
        if num_features is None:
            num_features = max(1, round(d * math.log(d))) if d > 0 else 1
        projection = torch.from_numpy(attnx.random_features(num_features, d, seed=seed))
    elif num_features is not None and projection.shape[0] != num_features:
        raise ValueError(f"projection has {projection.shape[0]} rows but "
                         f"num_features={num_features}")
    elif seed is not None:
        raise ValueError("performer_attention: give projection= or seed= (to draw one), not both")
    return _linear_call("performer", q, k, v, "favor", causal, key_mask, mask, window, method,
                        chunk_size, eps, projection, initial_state=initial_state,
                        return_state=return_state)


for _front_end in (linear_attention, cosformer_attention, focused_linear_attention,
                   taylor_attention, performer_attention):
    _front_end.__doc__ += _STREAMING_DOC


def efficient_attention(q, k, v, *, key_mask=None, causal=False):
    """`attnx.efficient_attention` on tensors, differentiable.

    Parameters
    ----------
    q : torch.Tensor, shape (..., n, d)
        Queries, on the CPU: float32, float64, bfloat16 or float16.
    k : torch.Tensor, shape (..., m, d)
        Keys, of q's dtype.
    v : torch.Tensor, shape (..., m, e)
        Values, of q's dtype; the leading axes broadcast.
    key_mask : torch.Tensor of bool, shape (..., m), optional
        False removes a key.
    causal : bool, default False
        Must be False.

    Returns
    -------
    torch.Tensor, shape (..., n, e)
        In q's dtype.

    Raises
    ------
    TypeError
        Arguments that are not tensors, or q, k, v of different dtypes.
    ValueError
        Tensors on another device than the CPU, and the errors of the
        numpy function for shapes and options.

    See Also
    --------
    attnx.efficient_attention : The numpy function, with the meaning of each option.

    Notes
    -----
    ``o = rho_q(Q) (rho_k(K)^T V)``, softmaxes over each query's features
    and over the keys of each key feature.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> q, k, v = (torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    >>> out = attnx.torch.efficient_attention(q, k, v)
    >>> out.shape
    torch.Size([2, 6, 4])
    >>> out.sum().backward()                       # gradients computed by attnx
    >>> q.grad.shape
    torch.Size([2, 6, 4])
    >>> expected = attnx.efficient_attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy())
    >>> torch.allclose(out, torch.from_numpy(expected))
    True
    """
    return _linear_call("efficient", q, k, v, "elu", causal, key_mask)
