"""attnx.torch's softmax family: softmax and Gaussian attention as the
operators ``torch.ops.attnx.softmax_attention`` (backward
``softmax_attention_backward``), and ``scaled_dot_product_attention`` with
torch's signature on top of them (its errors, SDPAValueError and
SDPATypeError, are also RuntimeErrors, as torch's own)."""
import math
from typing import List, Optional, Tuple

import numpy as np
import torch

import attnx
from attnx._softmax import _backward as _softmax_gradients

from ._common import (
    _HALF,
    _NATIVE,
    Tensor,
    _batch_shape,
    _check_broadcast,
    _check_inputs,
    _check_tensor,
    _compute_dtype,
    _decode_causal,
    _decode_window,
    _encode_causal,
    _encode_window,
    _from_numpy,
    _half_np,
    _key_padding_view,
    _narrowed,
    _np,
    _wide_np,
)


# ------------------------------------------------ softmax and gaussian op

def _softmax_options(variant, param, causal, window, dropout_p, seed):
    options = {"causal": _decode_causal(causal), "window": _decode_window(window)}
    if variant == "softmax":
        options["scale"] = param
    if dropout_p:
        # attnx's counter-based dropout; the seed comes from torch's generator
        options["dropout_p"] = dropout_p
        options["seed"] = int(seed.item())
    return options


def _softmax_kernels(variant):
    if variant == "softmax":
        return attnx.softmax_attention, getattr(attnx, "softmax_attention_backward", None)
    if variant == "gaussian":
        return attnx.gaussian_attention, getattr(attnx, "gaussian_attention_backward", None)
    raise ValueError(f"unknown variant {variant!r}")


def _half_kv_args(q, k, v, options):
    """softmax_attention's q, k, v for bfloat16 or float16 tensors, its
    options told so: q widened, the keys and values as they are (_half_np),
    which the decoding kernels widen as they load them (a half-precision KV
    cache is not widened whole at every step; another path widens them in C
    first)"""
    options["_half_kv"] = True
    return _wide_np(q), _half_np(k), _half_np(v)


def _softmax_forward(q, k, v, mask, bias, variant, param, causal, window, dropout_p, seed):
    """The operator's computation (_softmax_op), which calls that build no
    graph run directly (_softmax_apply)"""
    forward, _ = _softmax_kernels(variant)
    dtype = _compute_dtype(q.dtype)
    shape = _batch_shape(q, k, v, mask, bias)
    wide = torch.empty(shape + (q.shape[-2], v.shape[-1]), dtype=dtype)
    if wide.numel() == 0 or k.shape[-2] == 0 or dropout_p == 1.0:
        # no query, or no key (zeros, lse -inf), or nothing to hold, or
        # every weight dropped (torch's SDPA at dropout_p = 1: zeros)
        wide.zero_()
        lse = torch.full(shape + (q.shape[-2],), float("-inf"), dtype=dtype)
    else:
        options = _softmax_options(variant, param, causal, window, dropout_p, seed)
        if variant == "softmax" and k.dtype in _HALF:
            args = _half_kv_args(q, k, v, options)
        else:
            args = tuple(_wide_np(q, k, v))
        if variant == "gaussian":
            args += (param,)
        _, lse = forward(*args, mask=_np(mask), bias=_wide_np(bias), out=wide.numpy(),
                         return_lse=True, _bf16_products=q.dtype == torch.bfloat16, **options)
        lse = torch.from_numpy(lse)
    if q.dtype == dtype:
        return wide, lse, q.new_empty((0,))
    return _narrowed(wide.numpy(), q.dtype), lse, wide


@torch.library.custom_op("attnx::softmax_attention", mutates_args=(), device_types="cpu")
def _softmax_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
                variant: str, param: Optional[float], causal: str, window: Optional[List[int]],
                dropout_p: float, seed: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """Softmax (variant "softmax", param = scale) or gaussian (param =
    sigma) attention: returns out (..., n, e) in q's dtype, lse (..., n)
    in the dtype computed in, and for half-precision inputs the unrounded
    float32 out the backward reads (empty otherwise). Half inputs are
    widened here, each in one pass, and out rounded once."""
    return _softmax_forward(q, k, v, mask, bias, variant, param, causal, window, dropout_p, seed)


@_softmax_op.register_fake
def _(q, k, v, mask, bias, variant, param, causal, window, dropout_p, seed):
    shape = _batch_shape(q, k, v, mask, bias)
    dtype = _compute_dtype(q.dtype)
    out = q.new_empty(shape + (q.shape[-2], v.shape[-1]))
    lse = q.new_empty(shape + (q.shape[-2],), dtype=dtype)
    wide = (q.new_empty((0,)) if q.dtype == dtype
            else q.new_empty(shape + (q.shape[-2], v.shape[-1]), dtype=dtype))
    return out, lse, wide


def _softmax_backward_body(dout, q, k, v, out, lse, mask, bias, variant, param, causal, window,
                           dropout_p, seed, bias_grad):
    """The backward operator's computation (_softmax_backward_op), which
    the eager autograd formula (_SoftmaxFunction) runs directly"""
    _, backward = _softmax_kernels(variant)
    if backward is None:
        raise NotImplementedError(f"this attnx has no {variant}_attention_backward")
    dtype = _compute_dtype(q.dtype)
    if dout.numel() == 0 or k.shape[-2] == 0 or dropout_p == 1.0:
        # no output, or one that is constantly zero: every gradient is zero
        dbias = torch.zeros_like(bias) if bias_grad else q.new_empty((0,))
        return (*(torch.zeros_like(t) for t in (q, k, v)), dbias)
    grads = [torch.empty(t.shape, dtype=dtype) for t in (q, k, v)]
    options = _softmax_options(variant, param, causal, window, dropout_p, seed)
    if variant == "gaussian":
        options["sigma"] = param
    if variant == "softmax" and k.dtype in _HALF and v.dtype == k.dtype:
        # the kernel widens k and v itself, a key block at a time
        options["_half_kv"] = True
        args = tuple(_wide_np(dout, q)) + (_half_np(k), _half_np(v))
    else:
        args = tuple(_wide_np(dout, q, k, v))
    args += (_np(out), lse.numpy())
    # bfloat16 tensors take bfloat16 products (the probabilities and their
    # gradients rounded, as torch's own CPU kernels do): the C entry's
    # private keyword, which the public backward functions do not take
    g = _softmax_gradients(*args, mask=_np(mask), bias=_wide_np(bias), bias_grad=bias_grad,
                           dq=grads[0].numpy(), dk=grads[1].numpy(), dv=grads[2].numpy(),
                           _bf16_products=q.dtype == torch.bfloat16, **options)
    if bias_grad:
        dbias = (_narrowed(g.bias, bias.dtype) if bias.dtype in _HALF
                 else _from_numpy(g.bias, bias.dtype))
    else:
        dbias = q.new_empty((0,))
    if q.dtype == dtype:
        return (*grads, dbias)
    return (*_narrowed([grad.numpy() for grad in grads], q.dtype), dbias)


@torch.library.custom_op("attnx::softmax_attention_backward", mutates_args=(), device_types="cpu")
def _softmax_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         mask: Optional[Tensor], bias: Optional[Tensor], variant: str,
                         param: Optional[float], causal: str, window: Optional[List[int]],
                         dropout_p: float, seed: Optional[Tensor],
                         bias_grad: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv (shapes and dtypes of q, k, v) and dbias (that of bias
    when bias_grad, else an empty tensor) of sum(dout * out); `out` is the
    forward's unrounded result (float32 for half inputs). Half-precision
    dout and q are widened here, k and v by the kernel a key block at a
    time, the gradients rounded once."""
    return _softmax_backward_body(dout, q, k, v, out, lse, mask, bias, variant, param, causal,
                                  window, dropout_p, seed, bias_grad)


@_softmax_backward_op.register_fake
def _(dout, q, k, v, out, lse, mask, bias, variant, param, causal, window, dropout_p, seed,
      bias_grad):
    dbias = bias.new_empty(bias.shape) if bias_grad else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def _softmax_setup_context(ctx, inputs, output):
    q, k, v, mask, bias, variant, param, causal, window, dropout_p, seed = inputs
    out, lse, wide = output
    ctx.mark_non_differentiable(lse, wide)
    ctx.options = (variant, param, causal, window, dropout_p)
    ctx.bias_grad = bias is not None and ctx.needs_input_grad[4]
    ctx.save_for_backward(q, k, v, wide if wide.numel() else out, lse, mask, bias, seed)


def _softmax_input_grads(ctx, dout, backward):
    """The gradients of the operator's 11 inputs, by `backward` (the
    backward operator or its body)"""
    q, k, v, out, lse, mask, bias, seed = ctx.saved_tensors
    variant, param, causal, window, dropout_p = ctx.options
    dq, dk, dv, dbias = backward(dout, q, k, v, out, lse, mask, bias, variant, param, causal,
                                 window, dropout_p, seed, ctx.bias_grad)
    return dq, dk, dv, None, dbias if ctx.bias_grad else None, None, None, None, None, None, None


def _softmax_backward(ctx, dout, dlse, dwide):
    return _softmax_input_grads(ctx, dout, torch.ops.attnx.softmax_attention_backward)


_softmax_op.register_autograd(_softmax_backward, setup_context=_softmax_setup_context)


class _SoftmaxFunction(torch.autograd.Function):
    """The operator and its autograd formula run eagerly, without the
    custom operator's dispatch, which costs some 150 us a training step
    (forward and backward): the same computations (_softmax_forward,
    _softmax_backward_body), the same saved tensors and the same refusal
    of a second derivative. torch.compile, tracing and torch.func's
    transforms take the operator."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _softmax_forward(*inputs)
        _softmax_setup_context(ctx, inputs, output)
        return output

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse, dwide):
        return _softmax_input_grads(ctx, dout, _softmax_backward_body)


def _softmax_apply(q, k, v, mask, bias, variant, param, causal, window, dropout_p, seed):
    """The softmax operator on tensors of any supported dtype: (out in q's
    dtype, lse in the computing dtype). Half-precision q, k, v and bias
    cross into the operator as they are: it converts them in one pass."""
    if bias is not None and bias.dtype != q.dtype and bias.dtype != _compute_dtype(q.dtype):
        bias = bias.to(_compute_dtype(q.dtype))
    args = (q, k, v, mask, bias, variant, param, causal, window, dropout_p, seed)
    # the operator's dispatch (autograd, the fake kernel) costs some 100 us
    # a call, as much as a decoding step against a few thousand keys: a
    # call that is not being traced or transformed runs the computation
    # itself, through _SoftmaxFunction when it builds a graph
    if torch.compiler.is_compiling() or torch.jit.is_tracing() \
            or torch._C._are_functorch_transforms_active():
        out, lse, _ = torch.ops.attnx.softmax_attention(*args)
    elif torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                         for t in (q, k, v, bias)):
        out, lse, _ = _SoftmaxFunction.apply(*args)
    else:
        out, lse, _ = _softmax_forward(*args)
    return out, lse


def _split_mask(mask, n, name="mask"):
    """A bool mask goes to attnx as mask, a float one as bias; a mask
    constant along the queries is passed as its (..., 1, m) view (a float
    one only when it needs no gradient: its gradient must keep the
    per-query entries)."""
    if mask is None:
        return None, None
    _check_tensor(name, mask)
    if mask.dtype == torch.bool:
        return _key_padding_view(mask, n), None
    if not mask.is_floating_point():
        raise TypeError(f"{name} must be bool (True = attend) or floating point (added to the "
                        f"scores), got dtype {mask.dtype}")
    if mask.requires_grad and torch.is_grad_enabled():
        return None, mask
    return None, _key_padding_view(mask, n)


def _seed_tensor(dropout_p, seed, upper=None):
    """The dropout seed as a tensor (None without dropout). dropout_p = 1
    (`upper` = 1, torch's SDPA) drops every weight: no seed is needed."""
    if not (0.0 <= dropout_p < 1.0 or dropout_p == upper):
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if not dropout_p or dropout_p == 1.0:
        return None
    if seed is None:
        # drawn from torch's generator, so torch.manual_seed makes it repeatable
        return torch.randint(0, 2**62, (), dtype=torch.int64)
    return torch.tensor(int(seed), dtype=torch.int64)


def _softmax_call(variant, q, k, v, param, causal, mask, bias, window, dropout_p, seed,
                  return_lse):
    _check_inputs(("q", "k", "v"), q, k, v)
    n = q.shape[-2]
    if mask is not None:
        _check_tensor("mask", mask)
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be bool (True = attend), got dtype {mask.dtype}; "
                            "give additive float masks as bias=")
        mask = _key_padding_view(mask, n)
    if bias is not None:
        _check_tensor("bias", bias)
        if not bias.is_floating_point():
            raise TypeError(f"bias must be floating point, got dtype {bias.dtype}")
        _, bias = _split_mask(bias, n, "bias")
    out, lse = _softmax_apply(
        q, k, v, mask, bias, variant, None if param is None else float(param),
        _encode_causal(causal), _encode_window(window), float(dropout_p),
        _seed_tensor(dropout_p, seed))
    return (out, lse) if return_lse else out


def softmax_attention(q, k, v, *, scale=None, causal=False, mask=None, bias=None, window=None,
                      dropout_p=0.0, seed=None, return_lse=False):
    """`attnx.softmax_attention` on tensors, differentiable.

    Parameters
    ----------
    q : torch.Tensor, shape (..., n, d)
        Queries, on the CPU: float32, float64, bfloat16 or float16.
    k : torch.Tensor, shape (..., m, d)
        Keys, of q's dtype.
    v : torch.Tensor, shape (..., m, e)
        Values, of q's dtype; the leading axes broadcast.
    scale, causal, mask, bias, window
        As in `attnx.softmax_attention`; mask and bias are tensors (a float
        bias gets its gradient).
    dropout_p : float, default 0.0
        The dropout probability of the weights.
    seed : int, optional
        The dropout seed; None draws it from torch's generator.
    return_lse : bool, default False
        Also return the logsumexp (..., n), float32 for half inputs,
        without gradient.

    Returns
    -------
    out : torch.Tensor, shape (..., n, e)
        In q's dtype.
    lse : torch.Tensor, shape (..., n)
        Only with ``return_lse=True``.

    Raises
    ------
    TypeError
        Arguments that are not tensors, or q, k, v of different dtypes.
    ValueError
        Tensors on another device than the CPU, and the errors of the
        numpy function for shapes and options.

    See Also
    --------
    attnx.softmax_attention : The numpy function, with the meaning of each option.
    scaled_dot_product_attention : torch's signature.

    Notes
    -----
    A ``torch.library.custom_op`` (``torch.ops.attnx.softmax_attention``)
    with a fake kernel and an autograd formula whose backward is
    `attnx.softmax_attention_backward`, so it runs under
    ``torch.compile(fullgraph=True)``; in eager mode the same computation
    runs without the operator's dispatch. float32 and float64 tensors are read
    in place; bfloat16 and float16 are computed in float32 (docs/pytorch.md).

    Examples
    --------
    >>> import torch, attnx.torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> q, k, v = (torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    >>> out = attnx.torch.softmax_attention(q, k, v, causal=True)
    >>> out.shape
    torch.Size([2, 6, 4])
    >>> out.sum().backward()                       # gradients computed by attnx
    >>> q.grad.shape
    torch.Size([2, 6, 4])
    >>> expected = attnx.softmax_attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), causal=True)
    >>> torch.allclose(out, torch.from_numpy(expected))
    True
    """
    return _softmax_call("softmax", q, k, v, scale, causal, mask, bias, window, dropout_p, seed,
                         return_lse)


def gaussian_attention(q, k, v, sigma=1.0, *, causal=False, mask=None, bias=None, window=None,
                       dropout_p=0.0, seed=None, return_lse=False):
    """`attnx.gaussian_attention` on tensors, differentiable.

    Parameters
    ----------
    q : torch.Tensor, shape (..., n, d)
        Queries, on the CPU: float32, float64, bfloat16 or float16.
    k : torch.Tensor, shape (..., m, d)
        Keys, of q's dtype.
    v : torch.Tensor, shape (..., m, e)
        Values, of q's dtype; the leading axes broadcast.
    sigma : float, default 1.0
        The kernel's width (a number, not differentiated).
    causal, mask, bias, window, dropout_p, seed, return_lse
        As in `softmax_attention`.

    Returns
    -------
    out : torch.Tensor, shape (..., n, e)
        In q's dtype.
    lse : torch.Tensor, shape (..., n)
        Only with ``return_lse=True``.

    Raises
    ------
    TypeError
        Arguments that are not tensors, or q, k, v of different dtypes.
    ValueError
        Tensors on another device than the CPU, and the errors of the
        numpy function for shapes and options.

    See Also
    --------
    attnx.gaussian_attention : The numpy function, with the meaning of each option.

    Notes
    -----
    Weights proportional to ``exp(-|q_i - k_j|^2 / (2 sigma^2) + bias_ij)``.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> q, k, v = (torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    >>> out = attnx.torch.gaussian_attention(q, k, v, sigma=2.0)
    >>> out.shape
    torch.Size([2, 6, 4])
    >>> out.sum().backward()                       # gradients computed by attnx
    >>> q.grad.shape
    torch.Size([2, 6, 4])
    >>> expected = attnx.gaussian_attention(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), sigma=2.0)
    >>> torch.allclose(out, torch.from_numpy(expected))
    True
    """
    return _softmax_call("gaussian", q, k, v, sigma, causal, mask, bias, window, dropout_p, seed,
                         return_lse)


class SDPAValueError(RuntimeError, ValueError):
    """A bad argument to :func:`scaled_dot_product_attention` where torch raises RuntimeError.

    Catchable as torch's RuntimeError (code written for torch's function
    keeps working) and as the ValueError attnx's other front ends raise.

    Parameters
    ----------
    message : str
        attnx's description of what is wrong, naming the argument.

    Raises
    ------
    SDPAValueError
        From :func:`scaled_dot_product_attention`: shapes that do not
        broadcast, an ``attn_mask`` with ``is_causal=True``, a non-finite
        scale, ``dropout_p`` outside [0, 1].

    See Also
    --------
    SDPATypeError : the same for wrong dtypes.

    Notes
    -----
    A subclass of both RuntimeError and ValueError.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> q = torch.zeros(2, 3, 4)
    >>> try:
    ...     attnx.torch.scaled_dot_product_attention(q, q, q, scale=float("nan"))
    ... except RuntimeError as error:
    ...     print(type(error).__name__, isinstance(error, ValueError), error)
    SDPAValueError True scale must be finite, got nan
    """

    def __init__(self, message):  # the signature numpydoc checks the Parameters against
        super().__init__(message)


class SDPATypeError(RuntimeError, TypeError):
    """A wrong dtype given to :func:`scaled_dot_product_attention` where torch raises RuntimeError.

    Catchable as torch's RuntimeError and as attnx's TypeError.

    Parameters
    ----------
    message : str
        attnx's description of what is wrong, naming the argument.

    Raises
    ------
    SDPATypeError
        From :func:`scaled_dot_product_attention`: query, key and value of
        different or unsupported dtypes; a mask that is not bool, float32
        or the query's dtype.

    See Also
    --------
    SDPAValueError : the same for bad values and shapes.

    Notes
    -----
    A subclass of both RuntimeError and TypeError.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> q = torch.zeros(2, 3, 4)
    >>> try:
    ...     attnx.torch.scaled_dot_product_attention(q, q.double(), q)
    ... except RuntimeError as error:
    ...     print(type(error).__name__, isinstance(error, TypeError))
    SDPATypeError True
    """

    def __init__(self, message):  # the signature numpydoc checks the Parameters against
        super().__init__(message)


def _as_sdpa_error(error):
    return (SDPATypeError if isinstance(error, TypeError) else SDPAValueError)(str(error))


try:
    from torch.nn.attention.bias import CausalBias, CausalVariant
except ImportError:  # torch before 2.3 has no CausalBias
    CausalBias = CausalVariant = None


def _causal_bias(mask, is_causal, n, m):
    """torch's CausalBias mask as attnx's causal flag, without reading the
    mask's storage (a CausalBias holds no values): upper-left, or
    lower-right when its lengths are the call's (n, m) and differ (equal
    lengths align both corners). Other lengths: its materialised boolean
    mask, as torch broadcasts it. Returns (causal, bool mask or None)."""
    if is_causal:
        raise SDPAValueError("CausalBias should not be used with causal=True: the CausalBias "
                             "attn_mask already makes the attention causal")
    if mask.seq_len_q == mask.seq_len_kv or mask.variant == CausalVariant.UPPER_LEFT:
        return "upper_left", None
    if mask.variant != CausalVariant.LOWER_RIGHT:
        raise SDPAValueError(f"CausalBias.variant must be a CausalVariant, got {mask.variant!r}")
    if (mask.seq_len_q, mask.seq_len_kv) == (n, m):
        return "lower_right", None
    return "none", mask._materialize(torch.device("cpu"))


def _sdpa_mask_dtype(attn_mask, dtype):
    if attn_mask.dtype not in (torch.bool, torch.float32, dtype):
        raise SDPATypeError(f"attn_mask has dtype {attn_mask.dtype}; it must be bool (True = "
                            f"attend), float32 or the query's dtype ({dtype}), as torch requires")


def _sdpa_scale(scale, query):
    """scale as torch takes it, any finite number: (query, scale) to
    compute with a positive scale. A negative scale negates the query
    instead (scale q.k = |scale| (-q).k) and zero zeroes it; both are
    differentiable ops, so the query's gradient comes out right."""
    if scale is None:
        return query, None
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise SDPATypeError(f"scale must be a number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise SDPAValueError(f"scale must be finite, got {scale}")
    if scale < 0:
        return torch.neg(query), -scale
    if scale == 0:
        return query * 0, 1.0
    return query, scale


def _sdpa_plain(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """The result of the commonest call, or None when the call is not it:
    no mask, no dropout, a positive scale, float32, float64, bfloat16 or
    float16 CPU tensors, nothing to differentiate and nothing traced. A decoding step
    is such a call, and the general path's checks and conversions cost some
    25 us of its time; this one asks only what it relies on and leaves the
    shapes to the kernel's own checks: a call they refuse (or any other
    call) takes the general path, which says what is wrong in torch's
    terms. bfloat16 and float16: as the general path computes them (with
    _bf16_products for bfloat16), q widened, k and v passed as they are
    (_half_kv), the result rounded once."""
    if attn_mask is not None or dropout_p != 0 or torch.compiler.is_compiling() \
            or torch.jit.is_tracing():
        return None
    if scale is not None and not (type(scale) in (float, int) and 0 < scale < math.inf):
        return None
    if not (type(query) is Tensor and type(key) is Tensor and type(value) is Tensor):
        return None
    dtype = query.dtype
    if dtype not in _NATIVE + _HALF or key.dtype != dtype \
            or value.dtype != dtype or not (query.is_cpu and key.is_cpu and value.is_cpu) \
            or query.is_neg() or key.is_neg() or value.is_neg():
        return None
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                    or value.requires_grad):
        return None
    options = {"scale": scale, "causal": "upper_left" if is_causal else False}
    if dtype in _HALF:
        options["_bf16_products"] = dtype == torch.bfloat16
        q, k, v = _half_kv_args(query, key, value, options)
    else:
        q, k, v = query.detach().numpy(), key.detach().numpy(), value.detach().numpy()
    heads = groups = 1
    if enable_gqa and q.ndim >= 3 and k.ndim >= 3 and q.shape[-3] != k.shape[-3]:
        heads, kv_heads = q.shape[-3], k.shape[-3]
        if kv_heads == 0 or heads % kv_heads or v.ndim < 3 or v.shape[-3] != kv_heads:
            return None
        groups = heads // kv_heads
        q = q.reshape(q.shape[:-3] + (kv_heads, groups) + q.shape[-2:])
        k, v = k[..., None, :, :], v[..., None, :, :]
    try:
        out = attnx.softmax_attention(q, k, v, **options)
    except (ValueError, TypeError):
        return None
    if groups > 1:
        out = out.reshape(out.shape[:-4] + (heads,) + out.shape[-2:])
    return _narrowed(out, dtype) if dtype in _HALF else torch.from_numpy(out)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention computed by attnx.

    Same signature and semantics, so it replaces torch's by assignment.

    Parameters
    ----------
    query : torch.Tensor, shape (..., Hq, L, E)
        Queries.
    key : torch.Tensor, shape (..., H, S, E)
        Keys.
    value : torch.Tensor, shape (..., H, S, Ev)
        Values.
    attn_mask : torch.Tensor, optional
        Bool (True = attend), float (added to the scores; float32 or the
        query's dtype), or a ``torch.nn.attention.bias.CausalBias``
        (``causal_upper_left``, ``causal_lower_right``: run as attnx's
        causal flag, never materialised), broadcastable to
        (..., Hq, L, S). A mask constant along the query axis is read as
        key padding, O(S).
    dropout_p : float, default 0.0
        The dropout probability of the weights, in [0, 1] (1 drops every
        weight: zeros).
    is_causal : bool, default False
        Query i sees keys ``j <= i`` (upper-left). May not be combined with
        ``attn_mask``.
    scale : float, optional
        Any finite number (zero and negative included). Default
        ``1 / sqrt(E)``.
    enable_gqa : bool, default False
        Lets Hq be a multiple of H, each key/value head shared by Hq / H
        query heads (without a copy).

    Returns
    -------
    torch.Tensor, shape (..., Hq, L, Ev)
        In query's dtype.

    Raises
    ------
    SDPATypeError
        q, k, v of different or unsupported dtypes, a mask of another dtype
        (a RuntimeError, as torch raises, and a TypeError).
    SDPAValueError
        Shapes that do not broadcast, an ``attn_mask`` with
        ``is_causal=True``, a non-finite scale, ``dropout_p`` outside
        [0, 1] (a RuntimeError, as torch raises, and a ValueError).
    ValueError
        Tensors on another device than the CPU; a CausalBias with
        ``is_causal=True`` (as torch).

    See Also
    --------
    softmax_attention : attnx's own options (windows, lower-right causal).

    Notes
    -----
    A row that sees no key gives zeros, as torch's CPU kernels do. Dropout
    uses attnx's counter-based generator seeded from torch's, so the
    dropped weights differ from torch's but are repeatable under
    ``torch.manual_seed``.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    >>> pad = torch.tensor([[True, True, True, False, False]])        # key padding
    >>> out = attnx.torch.scaled_dot_product_attention(q, k, v, attn_mask=pad)
    >>> expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=pad)
    >>> torch.allclose(out, expected, atol=1e-6)
    True
    """
    plain = _sdpa_plain(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if plain is not None:
        return plain
    try:
        _check_inputs(("query", "key", "value"), query, key, value, broadcast=False)
        if attn_mask is not None and not (CausalBias is not None
                                          and isinstance(attn_mask, CausalBias)):
            _check_tensor("attn_mask", attn_mask)
    except (ValueError, TypeError) as error:
        raise _as_sdpa_error(error) from None
    n, m = query.shape[-2], key.shape[-2]
    causal = "upper_left" if is_causal else "none"
    if CausalBias is not None and isinstance(attn_mask, CausalBias):
        causal, attn_mask = _causal_bias(attn_mask, is_causal, n, m)
    elif attn_mask is not None:
        if is_causal:
            # torch's own wording inside, so code matching torch's message matches
            raise SDPAValueError("attn_mask and is_causal=True given together "
                                 "(_scaled_dot_product_attention: Explicit attn_mask should not "
                                 "be set when is_causal=True): put the causal pattern in "
                                 "attn_mask, or pass is_causal alone")
        _sdpa_mask_dtype(attn_mask, query.dtype)
    if attn_mask is not None and attn_mask.dim() >= 1 and (
            attn_mask.shape[-1] not in (1, m)
            or attn_mask.dim() >= 2 and attn_mask.shape[-2] not in (1, n)):
        raise SDPAValueError(f"attn_mask has shape {tuple(attn_mask.shape)}, expected to "
                             f"broadcast to (..., L, S) = (..., {n}, {m})")
    if not 0.0 <= dropout_p <= 1.0:
        raise SDPAValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    query, scale = _sdpa_scale(scale, query)
    mask, bias = _split_mask(attn_mask, n, "attn_mask")
    groups = 1
    if enable_gqa and query.dim() >= 3 and key.dim() >= 3 and query.shape[-3] != key.shape[-3]:
        heads, kv_heads = query.shape[-3], key.shape[-3]
        if kv_heads == 0 or heads % kv_heads or value.dim() < 3 or value.shape[-3] != kv_heads:
            raise SDPAValueError(f"enable_gqa needs the query heads ({heads}) to be a multiple "
                                 f"of the key/value heads ({kv_heads}, value "
                                 f"{tuple(value.shape)})")
        groups = heads // kv_heads
        query = query.unflatten(-3, (kv_heads, groups))
        key, value = key.unsqueeze(-3), value.unsqueeze(-3)
        mask, bias = (_split_heads(t, heads, kv_heads, groups) for t in (mask, bias))
    given = [(name, t) for name, t in (("query", query), ("key", key), ("value", value),
                                       ("attn_mask", mask), ("attn_mask", bias))
             if t is not None and t.dim() >= 2]
    try:
        _check_broadcast([name for name, _ in given], [t for _, t in given])
    except ValueError as error:
        raise _as_sdpa_error(error) from None
    out = _softmax_apply(
        query, key, value, mask, bias, "softmax", scale, causal, None, float(dropout_p),
        _seed_tensor(dropout_p, None, upper=1.0))[0]
    return out.flatten(-4, -3) if groups > 1 else out


def _split_heads(mask, heads, kv_heads, groups):
    """A mask over (..., Hq, L, S) for the grouped layout (..., H, g, L, S)."""
    if mask is None or mask.dim() < 3:
        return mask
    if mask.shape[-3] == heads:
        return mask.unflatten(-3, (kv_heads, groups))
    return mask.unsqueeze(-3)
