"""attnx as differentiable PyTorch operators on CPU tensors (needs torch).

    import attnx.torch as at
    out = at.scaled_dot_product_attention(q, k, v, attn_mask=pad, is_causal=False)
    out = at.cosformer_attention(q, k, v, causal=True)
    out.sum().backward()

* ``scaled_dot_product_attention`` has the signature and semantics of
  ``torch.nn.functional.scaled_dot_product_attention`` (bool mask True =
  attend, float mask added to the scores, ``is_causal`` upper-left,
  ``enable_gqa``), so it replaces it by assignment.
* ``softmax_attention``, ``gaussian_attention``, ``linear_attention``,
  ``cosformer_attention``, ``focused_linear_attention``,
  ``taylor_attention``, ``performer_attention``, ``efficient_attention``,
  ``attention_weights``, and the other systems (``MultiheadAttention``,
  ``rotary``, ``block_sparse_attention``, ``pooled_attention``,
  ``linformer_attention``, ``lsh_attention``) keep the names and options of
  the numpy front ends (without ``out=``) and take tensors; the linear ones stream with
  ``initial_state=`` / ``return_state=True``, differentiably.
* They are ``torch.library.custom_op`` operators in the namespace
  ``attnx`` (``torch.ops.attnx.softmax_attention`` ...) with fake
  (meta) implementations and autograd formulas, so ``torch.compile``
  traces them without graph breaks; the backward is attnx's own (the
  ``*_backward`` functions), itself an operator.
* float32 and float64 tensors are read in place (through ``.numpy()``;
  attnx reads any strides whose last axis is contiguous) and the results
  and gradients are written in place into tensors torch allocates;
  bfloat16 and float16 tensors are converted to float32 once on the way
  in (autograd saves those copies) and the results once on the way out;
  their gradients likewise reach the caller in the input dtype (bfloat16
  converted in C, rounding to nearest even; float16 by torch).
  CUDA tensors raise ValueError.
* A mask constant along the query axis (size 1 there, or an expanded
  padding mask with stride 0) is read as key padding, O(m) not O(n m).
* ``register_transformers()`` makes ``attn_implementation="attnx"`` work
  in Hugging Face transformers.
"""
import inspect
import math
import warnings
from typing import List, NamedTuple, Optional, Tuple

import numpy as np

try:
    import torch
except ModuleNotFoundError as error:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "attnx.torch needs PyTorch, which is not installed. Install a CPU build with\n"
        "    pip install torch --index-url https://download.pytorch.org/whl/cpu\n"
        "(a plain `pip install torch` on Linux x86-64 brings several GB of CUDA libraries); "
        "then, from an attnx checkout: pip install -e \".[torch]\" (once attnx is released: "
        "pip install \"attnx[torch]\")") from error

import attnx

from .. import _checks, _linear
from .._variants import VARIANTS, resolve

__all__ = [
    "scaled_dot_product_attention",
    "SDPAValueError",
    "SDPATypeError",
    "softmax_attention",
    "gaussian_attention",
    "linear_attention",
    "cosformer_attention",
    "focused_linear_attention",
    "taylor_attention",
    "performer_attention",
    "efficient_attention",
    "attention_weights",
    "LinearAttentionState",
    "register_transformers",
]

Tensor = torch.Tensor
_HALF = (torch.bfloat16, torch.float16)
_NATIVE = (torch.float32, torch.float64)


# ---------------------------------------------------------------- helpers

def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on device {t.device}; attnx computes on the CPU "
                         f"(move it with .cpu(), or use torch's own attention on {t.device.type})")


def _check_inputs(names, q, k, v, broadcast=True):
    """q (..., n, d), k (..., m, d), v (..., m, e) of one floating dtype,
    whose leading axes broadcast (unless `broadcast` is False: the caller
    checks them itself)."""
    for name, t in zip(names, (q, k, v)):
        _check_tensor(name, t)
        if t.dim() < 2:
            raise ValueError(f"{name} must have at least 2 dimensions (..., length, features), "
                             f"got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{names[0]}, {names[1]} and {names[2]} must share one dtype, got "
                        f"{q.dtype}, {k.dtype} and {v.dtype}")
    if q.dtype not in _NATIVE + _HALF:
        raise TypeError(f"{names[0]} has dtype {q.dtype}; attnx takes float32, float64, "
                        "bfloat16 or float16 tensors")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{names[0]} and {names[1]} must have the same last size d, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"{names[1]} and {names[2]} must have the same length m (axis -2), got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if broadcast:
        _check_broadcast(names, (q, k, v))


def _check_broadcast(names, tensors):
    """The leading (batch, head) axes of `tensors` (..., x, y) broadcast by
    numpy's rules; otherwise a ValueError naming them, before torch's own
    broadcasting reports it in its terms."""
    shapes = [tuple(t.shape[:-2]) for t in tensors]
    try:
        torch.broadcast_shapes(*shapes)
    except RuntimeError:
        listed = ", ".join(f"{name} {tuple(t.shape)}" for name, t in zip(names, tensors))
        raise ValueError(f"the leading (batch, head) axes do not broadcast: {listed}; each "
                         "leading axis must be equal or 1 (for grouped-query attention give "
                         "query (..., Hkv, g, n, d) and key/value (..., Hkv, 1, m, d), or "
                         "enable_gqa=True in scaled_dot_product_attention)") from None


def _compute_dtype(dtype):
    """The dtype attnx computes in for tensors of `dtype`."""
    return torch.float32 if dtype in _HALF else dtype


def _np(t, dtype=None):
    """A numpy view of tensor `t` (converted to `dtype` first if it differs:
    the one conversion of a half-precision tensor)."""
    if t is None:
        return None
    t = t.detach()
    if dtype is not None and t.dtype != dtype and t.dtype != torch.bool:
        t = t.to(dtype)
    return t.resolve_neg().numpy()


def _batch_shape(*tensors):
    return torch.broadcast_shapes(*(t.shape[:-2] for t in tensors if t is not None))


def _query_constant(mask, n):
    """True when `mask` (..., n or 1, m) is the same for every query: size
    1 along the query axis, or stride 0 there (an expanded padding mask)."""
    return mask.dim() >= 2 and (mask.shape[-2] == 1 or mask.stride(-2) == 0 or n <= 1)


def _key_padding_view(mask, n):
    """The (..., 1, m) view of a mask that is constant along the queries,
    which attnx reads as key padding (O(m)); other masks as they are."""
    if mask is None or mask.dim() < 2 or mask.shape[-2] == 1:
        return mask
    if _query_constant(mask, n):
        return mask[..., :1, :]
    return mask


def _encode_window(window):
    """window (w, (left, right) with None for an open side, or None) as an
    operator argument: [w], [left, right] with -1 for an open side, or None."""
    if window is None:
        return None
    if isinstance(window, (tuple, list)):
        if len(window) != 2:
            raise ValueError(f"window must be w or (left, right), got {window!r}")
        sides = list(window)
    else:
        sides = [window]
    encoded = []
    for side in sides:
        if side is None and len(sides) == 2:
            encoded.append(-1)
            continue
        if isinstance(side, bool) or not isinstance(side, (int, np.integer)):
            raise TypeError(f"window sizes must be integers or None, got {window!r}")
        if side < 0:
            raise ValueError(f"window sizes must be >= 0, got {window!r}")
        encoded.append(int(side))
    return encoded


def _decode_window(window):
    if window is None:
        return None
    if len(window) == 1:
        return window[0]
    return tuple(None if side < 0 else side for side in window)


def _encode_causal(causal):
    if causal is False or causal is None:
        return "none"
    if causal is True:
        return "lower_right"
    if causal in ("lower_right", "upper_left"):
        return causal
    raise ValueError(f"causal must be False, True, 'lower_right' or 'upper_left', got {causal!r}")


def _decode_causal(causal):
    return False if causal == "none" else causal


def _from_numpy(array, dtype):
    t = torch.from_numpy(np.ascontiguousarray(array))
    return t if t.dtype == dtype else t.to(dtype)


# ------------------------------------------- bfloat16 <-> float32 ops

def _bf16_bits(t):
    """A numpy int16 view of bfloat16 tensor `t`'s bits (no copy)."""
    return t.detach().resolve_neg().view(torch.int16).numpy()


@torch.library.custom_op("attnx::bfloat16_to_float32", mutates_args=(), device_types="cpu")
def _widen_op(x: Tensor) -> Tensor:
    """x (bfloat16, any strides) as a new C-contiguous float32 tensor:
    exact, in C (attnx._C._convert_bf16)."""
    out = torch.empty(x.shape, dtype=torch.float32)
    attnx._C._convert_bf16(_bf16_bits(x), out.numpy())
    return out


@_widen_op.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("attnx::float32_to_bfloat16", mutates_args=(), device_types="cpu")
def _narrow_op(x: Tensor) -> Tensor:
    """x (float32, any strides) rounded to nearest-even bfloat16 in a new
    C-contiguous tensor, in C."""
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    attnx._C._convert_bf16(x.detach().resolve_neg().numpy(), _bf16_bits(out))
    return out


@_narrow_op.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=torch.bfloat16)


def _widen_backward(ctx, grad):
    return torch.ops.attnx.float32_to_bfloat16(grad)


def _narrow_backward(ctx, grad):
    return torch.ops.attnx.bfloat16_to_float32(grad)


_widen_op.register_autograd(_widen_backward)
_narrow_op.register_autograd(_narrow_backward)


def _in_compute_dtype(*tensors):
    """Half-precision tensors converted to float32, the one conversion on
    the way in (differentiable: their gradients are converted back once);
    others as they are. bfloat16 converts in C (strided tensors read in
    place), float16 by torch."""
    return [None if t is None
            else torch.ops.attnx.bfloat16_to_float32(t) if t.dtype == torch.bfloat16
            else t.to(torch.float32) if t.dtype == torch.float16
            else t for t in tensors]


def _wide_np(t):
    """A float32 numpy array of half-precision tensor `t` (one pass: C for
    bfloat16, reading any strides in place; numpy for float16), or the
    numpy view of a float32 / float64 / bool tensor (None for None)."""
    if t is None or t.dtype not in _HALF:
        return _np(t)
    if t.dtype == torch.float16:
        return t.detach().resolve_neg().numpy().astype(np.float32)
    wide = np.empty(tuple(t.shape), dtype=np.float32)
    attnx._C._convert_bf16(_bf16_bits(t), wide)
    return wide


def _narrowed(array, dtype):
    """float32 numpy `array` as a new tensor of half `dtype`, rounded to
    nearest even in one pass (C for bfloat16, numpy for float16)."""
    if dtype == torch.float16:
        return torch.from_numpy(np.ascontiguousarray(array).astype(np.float16))
    out = torch.empty(array.shape, dtype=torch.bfloat16)
    attnx._C._convert_bf16(array, _bf16_bits(out))
    return out


def _in_dtype(t, dtype):
    """A result computed in float32 returned in the input's `dtype`, the
    one conversion on the way out (differentiable)."""
    if t.dtype == dtype:
        return t
    if dtype == torch.bfloat16:
        return torch.ops.attnx.float32_to_bfloat16(t)
    return t.to(dtype)


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


@torch.library.custom_op("attnx::softmax_attention", mutates_args=(), device_types="cpu")
def _softmax_op(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
                variant: str, param: Optional[float], causal: str, window: Optional[List[int]],
                dropout_p: float, seed: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """Softmax (variant "softmax", param = scale) or gaussian (param =
    sigma) attention: returns out (..., n, e) in q's dtype, lse (..., n)
    in the dtype computed in, and for half-precision inputs the unrounded
    float32 out the backward reads (empty otherwise). Half inputs are
    widened here, each in one pass, and out rounded once."""
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
        args = (_wide_np(q), _wide_np(k), _wide_np(v))
        if variant == "gaussian":
            args += (param,)
        _, lse = forward(*args, mask=_np(mask), bias=_wide_np(bias), out=wide.numpy(),
                         return_lse=True, **options)
        lse = torch.from_numpy(lse)
    if q.dtype == dtype:
        return wide, lse, q.new_empty((0,))
    return _narrowed(wide.numpy(), q.dtype), lse, wide


@_softmax_op.register_fake
def _(q, k, v, mask, bias, variant, param, causal, window, dropout_p, seed):
    shape = _batch_shape(q, k, v, mask, bias)
    dtype = _compute_dtype(q.dtype)
    out = q.new_empty(shape + (q.shape[-2], v.shape[-1]))
    lse = q.new_empty(shape + (q.shape[-2],), dtype=dtype)
    wide = (q.new_empty((0,)) if q.dtype == dtype
            else q.new_empty(shape + (q.shape[-2], v.shape[-1]), dtype=dtype))
    return out, lse, wide


@torch.library.custom_op("attnx::softmax_attention_backward", mutates_args=(), device_types="cpu")
def _softmax_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                         mask: Optional[Tensor], bias: Optional[Tensor], variant: str,
                         param: Optional[float], causal: str, window: Optional[List[int]],
                         dropout_p: float, seed: Optional[Tensor],
                         bias_grad: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv (shapes and dtypes of q, k, v) and dbias (that of bias
    when bias_grad, else an empty tensor) of sum(dout * out); `out` is the
    forward's unrounded result (float32 for half inputs). Half-precision
    dout and inputs are widened here, the gradients rounded once."""
    _, backward = _softmax_kernels(variant)
    if backward is None:
        raise NotImplementedError(f"this attnx has no {variant}_attention_backward")
    dtype = _compute_dtype(q.dtype)
    if dout.numel() == 0 or k.shape[-2] == 0 or dropout_p == 1.0:
        # no output, or one that is constantly zero: every gradient is zero
        dbias = torch.zeros_like(bias) if bias_grad else q.new_empty((0,))
        return (*(torch.zeros_like(t) for t in (q, k, v)), dbias)
    grads = [torch.empty(t.shape, dtype=dtype) for t in (q, k, v)]
    args = tuple(_wide_np(t) for t in (dout, q, k, v)) + (_np(out), lse.numpy())
    if variant == "gaussian":
        args += (param,)
    g = backward(*args, mask=_np(mask), bias=_wide_np(bias), bias_grad=bias_grad,
                 dq=grads[0].numpy(), dk=grads[1].numpy(), dv=grads[2].numpy(),
                 **_softmax_options(variant, param, causal, window, dropout_p, seed))
    if bias_grad:
        dbias = (_narrowed(g.bias, bias.dtype) if bias.dtype in _HALF
                 else _from_numpy(g.bias, bias.dtype))
    else:
        dbias = q.new_empty((0,))
    if q.dtype == dtype:
        return (*grads, dbias)
    return (*(_narrowed(grad.numpy(), q.dtype) for grad in grads), dbias)


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


def _softmax_backward(ctx, dout, dlse, dwide):
    q, k, v, out, lse, mask, bias, seed = ctx.saved_tensors
    variant, param, causal, window, dropout_p = ctx.options
    dq, dk, dv, dbias = torch.ops.attnx.softmax_attention_backward(
        dout, q, k, v, out, lse, mask, bias, variant, param, causal, window, dropout_p, seed,
        ctx.bias_grad)
    return dq, dk, dv, None, dbias if ctx.bias_grad else None, None, None, None, None, None, None


_softmax_op.register_autograd(_softmax_backward, setup_context=_softmax_setup_context)


def _softmax_apply(q, k, v, mask, bias, variant, param, causal, window, dropout_p, seed):
    """The softmax operator on tensors of any supported dtype: (out in q's
    dtype, lse in the computing dtype). Half-precision q, k, v and bias
    cross into the operator as they are: it converts them in one pass."""
    if bias is not None and bias.dtype != q.dtype and bias.dtype != _compute_dtype(q.dtype):
        bias = bias.to(_compute_dtype(q.dtype))
    out, lse, _ = torch.ops.attnx.softmax_attention(q, k, v, mask, bias, variant, param, causal,
                                                    window, dropout_p, seed)
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
    ``torch.compile(fullgraph=True)``. float32 and float64 tensors are read
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


_FRONT_ENDS = {
    "softmax": softmax_attention,
    "gaussian": gaussian_attention,
    **{front: globals()[variant.function] for front, variant in VARIANTS.items()},
}
_SYSTEM_VARIANTS = ("block_sparse", "pooled", "linformer", "lsh")


def _system_weights(variant, q, k, options):
    """The systems' weights, shaped as numpy's attention_weights gives
    them: each system's operator applied to values whose image is the
    identity over the keys it attends to."""
    if variant == "lsh":
        if k is not q and not torch.equal(k, q):
            raise ValueError("variant 'lsh' shares queries and keys: pass k = q")
        return lsh_attention(q, torch.eye(k.shape[-2], dtype=k.dtype), **options)
    if variant == "block_sparse":
        return block_sparse_attention(q, k, torch.eye(k.shape[-2], dtype=k.dtype), **options)
    if variant == "pooled":
        stride = _checks.count(options.get("stride"), "stride", 1)
        # every pooling window of these rows holds copies of one unit row,
        # so mean and max pooling both give the identity over pooled keys
        pooled = -(-k.shape[-2] // stride)
        values = torch.eye(pooled, dtype=k.dtype).repeat_interleave(stride, dim=0)
        return pooled_attention(q, k, values[:k.shape[-2]], **options)
    E = options.pop("E", None)
    options.pop("F", None)  # F projects the values only
    if not isinstance(E, torch.Tensor) or E.dim() < 2 or E.shape[-1] != k.shape[-2]:
        shape = tuple(E.shape) if isinstance(E, torch.Tensor) else type(E).__name__
        raise ValueError(f"E must be a tensor of shape (..., r, m) with m = {k.shape[-2]} "
                         f"(k's length), got {shape}")
    keys = E.to(k.dtype) @ k
    return softmax_attention(q, keys, torch.eye(keys.shape[-2], dtype=k.dtype), **options)


def attention_weights(q, k, variant="softmax", **options):
    """The normalised weights of any variant, differentiable in q and k.

    Parameters
    ----------
    q : torch.Tensor, shape (..., n, d)
        Queries.
    k : torch.Tensor, shape (..., m, d)
        Keys.
    variant : str, default "softmax"
        As in `attnx.attention_weights`.
    **options
        The options of the variant's front end.

    Returns
    -------
    torch.Tensor
        (..., n, m), or over the pooled or projected keys for "pooled" and
        "linformer", as `attnx.attention_weights` gives.

    Raises
    ------
    TypeError
        Arguments that are not tensors, or q, k, v of different dtypes.
    ValueError
        Tensors on another device than the CPU, and the errors of the
        numpy function for shapes and options.

    See Also
    --------
    attnx.attention_weights : The numpy function, with the meaning of each option.

    Notes
    -----
    The variant's operator applied to values whose image is the identity
    (Linformer's E differentiable too). O(n m) memory.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> q = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    >>> w = attnx.torch.attention_weights(q, q, "taylor", causal=True)
    >>> w.shape, torch.allclose(w.sum(-1), torch.ones(5, dtype=torch.float64))
    (torch.Size([5, 5]), True)
    >>> w[:, 0].sum().backward()
    >>> q.grad.shape
    torch.Size([5, 3])
    """
    if variant not in _FRONT_ENDS and variant not in _SYSTEM_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of "
                         f"{', '.join(map(repr, (*_FRONT_ENDS, *_SYSTEM_VARIANTS)))}")
    if {"return_lse", "dropout_p", "initial_state", "return_state"} & options.keys():
        raise TypeError("attention_weights takes no return_lse=, dropout_p=, initial_state= or "
                        "return_state=")
    _check_tensor("k", k)
    if k.dim() < 2:
        raise ValueError(f"k must have at least 2 dimensions, got shape {tuple(k.shape)}")
    if variant in _SYSTEM_VARIANTS:
        return _system_weights(variant, q, k, dict(options))
    identity = torch.eye(k.shape[-2], dtype=k.dtype)
    if "method" in _PARAMETERS.get(variant, ()) and options.get("method") is None:
        # explicit similarities, as attnx.attention_weights computes them
        options["method"] = "quadratic"
    return _FRONT_ENDS[variant](q, k, identity, **options)


from ._systems import (  # noqa: E402  the other systems (attnx/torch/_systems.py)
    MultiheadAttention, block_sparse_attention, linformer_attention, pooled_attention, rotary,
    sinusoidal_positions, add_depthwise_convolution as _add_depthwise_convolution)
__all__ += ["sinusoidal_positions", "rotary", "block_sparse_attention", "pooled_attention",
            "linformer_attention", "MultiheadAttention"]


# ------------------------------------------------ Hugging Face transformers

def _transformers_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            is_causal=None, position_bias=None, **kwargs):
    """transformers' attention interface: query (B, H, n, d), key and value
    (B, Hkv, m, d) -> ((B, n, H, e), None), as its "sdpa" function.

    Masks come from attnx's mask function (registered beside this one):
    None, a bool key padding (B, 1, 1, m) of a causal mask (causality is
    then the causal flag, aligned lower-right as a KV cache needs), or a
    bool mask over (B, 1, n, m) (for padding alone an expanded view, read
    as key padding). Grouped key/value heads are shared by broadcasting."""
    if kwargs.get("softcap") is not None:
        raise ValueError("attnx attention does not support softcap")
    if kwargs.get("output_attentions", False):
        warnings.warn("attnx attention does not return the attention weights (None is returned "
                      "for them); use attn_implementation='eager' for output_attentions=True",
                      stacklevel=2)
    batch, heads, n, _ = query.shape
    kv_heads = key.shape[1]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    mask = bias = None
    causal = "none"
    if attention_mask is None:
        # as torch's is_causal (the sdpa integration's rule)
        causal = "upper_left" if is_causal and n > 1 else "none"
    elif attention_mask.dtype == torch.bool and attention_mask.shape[-2] == 1 and is_causal:
        causal = "lower_right"
        mask = attention_mask
    else:
        mask, bias = _split_mask(attention_mask, n, "attention_mask")
    if position_bias is not None:
        bias = position_bias if bias is None else bias + position_bias
    if heads != kv_heads:
        groups = heads // kv_heads
        query = query.unflatten(1, (kv_heads, groups))
        key, value = key.unsqueeze(2), value.unsqueeze(2)
        mask, bias = (_split_heads(t, heads, kv_heads, groups) for t in (mask, bias))
    out = _softmax_apply(
        query, key, value, mask, bias, "softmax", None if scaling is None else float(scaling),
        causal, None, float(dropout), _seed_tensor(dropout, None))[0]
    out = out.reshape(batch, heads, n, value.shape[-1])
    return out.transpose(1, 2).contiguous(), None


def _transformers_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0,
                       mask_function=None, attention_mask=None, local_size=None,
                       allow_is_causal_skip=True, allow_is_bidirectional_skip=False,
                       use_vmap=False, device="cpu", **kwargs):
    """transformers' mask interface for "attnx": the plain causal and
    bidirectional patterns come back without an n x m mask (None, or the
    padding as a (B, 1, 1, m) causal key padding, or the padding expanded
    along the queries with stride 0); any other pattern (sliding windows,
    packed sequences, custom functions) is built by transformers' own
    sdpa_mask as a full boolean mask."""
    from transformers import masking_utils

    plain = (not use_vmap and local_size is None and isinstance(q_offset, int)
             and isinstance(kv_offset, int))
    padding = masking_utils.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is not None:
        padding = padding[:, kv_offset:kv_offset + kv_length]
    if plain and mask_function is masking_utils.bidirectional_mask_function:
        if padding is None:
            return None
        return padding[:, None, None, :].expand(batch_size, 1, q_length, kv_length)
    if (plain and mask_function is masking_utils.causal_mask_function
            and q_offset + q_length == kv_offset + kv_length):
        if padding is None:
            if q_length == kv_length or q_length == 1:
                return None
            # lower-right causal, which None (upper-left) would not give
            padding = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
        return padding[:, None, None, :].expand(batch_size, 1, 1, kv_length)
    if mask_function is None:
        mask_function = masking_utils.causal_mask_function
    return masking_utils.sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
        kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
        local_size=local_size, allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
        use_vmap=use_vmap, device=device)


def register_transformers(name="attnx"):
    """Register attnx with Hugging Face transformers under `name`.

    Parameters
    ----------
    name : str, default "attnx"
        The ``attn_implementation`` name.

    Returns
    -------
    None

    Raises
    ------
    ImportError
        When transformers is not installed.

    See Also
    --------
    scaled_dot_product_attention : The operator transformers' "sdpa" calls.

    Notes
    -----
    Registers with transformers' AttentionInterface and
    AttentionMaskInterface, so that ``AutoModel.from_pretrained(...,
    attn_implementation="attnx")`` (or ``from_config``) runs every
    attention layer on attnx: padding reaches the kernel as key padding and
    causality as the causal flag (no n x m mask is built for the plain
    causal and bidirectional patterns), in inference, generation with a KV
    cache, and training.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> from transformers import AutoModel, BertConfig
    >>> attnx.torch.register_transformers()
    >>> config = BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
    ...                     intermediate_size=32, vocab_size=50)
    >>> model = AutoModel.from_config(config, attn_implementation="attnx")
    >>> ids = torch.randint(0, 50, (2, 7))
    >>> model(input_ids=ids).last_hidden_state.shape
    torch.Size([2, 7, 16])
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, _transformers_attention)
    AttentionMaskInterface.register(name, _transformers_mask)


# ==========================================================================
# Reformer LSH attention (attnx.lsh_attention as an operator)
# ==========================================================================

@torch.library.custom_op("attnx::lsh_attention", mutates_args=(), device_types="cpu")
def _lsh_op(q: Tensor, v: Tensor, n_buckets: int, n_hashes: int, chunk: int, causal: bool,
            seed: int) -> Tuple[Tensor, Tensor]:
    """out (..., n, e) and lse (..., n) of attnx.lsh_attention, in the dtype
    computed in (float32 for half inputs)."""
    dtype = _compute_dtype(q.dtype)
    shape = _batch_shape(q, v)
    out = torch.empty(shape + (q.shape[-2], v.shape[-1]), dtype=dtype)
    _, lse = attnx.lsh_attention(_np(q, dtype), _np(v, dtype), n_buckets, n_hashes, chunk, causal,
                                 seed, out=out.numpy(), return_lse=True)
    return out, torch.from_numpy(lse)


@_lsh_op.register_fake
def _(q, v, n_buckets, n_hashes, chunk, causal, seed):
    shape = _batch_shape(q, v)
    dtype = _compute_dtype(q.dtype)
    return (q.new_empty(shape + (q.shape[-2], v.shape[-1]), dtype=dtype),
            q.new_empty(shape + (q.shape[-2],), dtype=dtype))


@torch.library.custom_op("attnx::lsh_attention_backward", mutates_args=(), device_types="cpu")
def _lsh_backward_op(dout: Tensor, q: Tensor, v: Tensor, out: Tensor, lse: Tensor, n_buckets: int,
                     n_hashes: int, chunk: int, causal: bool,
                     seed: int) -> Tuple[Tensor, Tensor]:
    """dq, dv (shapes and dtypes of q, v) of sum(dout * out)."""
    dtype = _compute_dtype(q.dtype)
    grads = [torch.empty(t.shape, dtype=dtype) for t in (q, v)]
    attnx.lsh_attention_backward(
        *(_np(t, dtype) for t in (dout, q, v, out)), lse.numpy(), n_buckets, n_hashes, chunk,
        causal, seed, dq=grads[0].numpy(), dv=grads[1].numpy())
    return tuple(grad.to(t.dtype) for grad, t in zip(grads, (q, v)))


@_lsh_backward_op.register_fake
def _(dout, q, v, out, lse, n_buckets, n_hashes, chunk, causal, seed):
    return q.new_empty(q.shape), v.new_empty(v.shape)


def _lsh_setup_context(ctx, inputs, output):
    q, v, n_buckets, n_hashes, chunk, causal, seed = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.options = (n_buckets, n_hashes, chunk, causal, seed)
    ctx.save_for_backward(q, v, out, lse)


def _lsh_backward(ctx, dout, dlse):
    q, v, out, lse = ctx.saved_tensors
    dq, dv = torch.ops.attnx.lsh_attention_backward(dout, q, v, out, lse, *ctx.options)
    return dq, dv, None, None, None, None, None


_lsh_op.register_autograd(_lsh_backward, setup_context=_lsh_setup_context)


def lsh_attention(q, v, n_buckets, n_hashes=1, chunk=64, causal=False, seed=0):
    """`attnx.lsh_attention` on tensors, differentiable in q and v.

    Parameters
    ----------
    q : torch.Tensor, shape (..., n, d)
        The shared queries and keys.
    v : torch.Tensor, shape (..., n, e)
        Values.
    n_buckets, n_hashes, chunk, causal, seed
        As in `attnx.lsh_attention`.

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
    attnx.lsh_attention : The numpy function, with the meaning of each option.

    Notes
    -----
    Reformer's shared-QK LSH attention; the buckets are constants.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> q = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    >>> v = torch.randn(8, 3, dtype=torch.float64)
    >>> out = attnx.torch.lsh_attention(q, v, n_buckets=4, chunk=4)
    >>> out.sum().backward()
    >>> out.shape, q.grad.shape
    (torch.Size([8, 3]), torch.Size([8, 4]))
    """
    from .. import _lsh

    _check_tensor("q", q)
    _check_tensor("v", v)
    n_buckets, n_hashes, seed = _lsh._hash_options(n_buckets, n_hashes, seed)
    chunk = _checks.count(chunk, "chunk", 1)
    if not (isinstance(causal, (bool, np.bool_)) or causal in ("lower_right", "upper_left")):
        raise ValueError(f"causal must be False, True, 'lower_right' or 'upper_left' (the same "
                         f"here: queries and keys are the same tokens), got {causal!r}")
    q32, v32 = _in_compute_dtype(q, v)
    out, _ = torch.ops.attnx.lsh_attention(q32, v32, n_buckets, n_hashes, chunk,
                                           causal is not False and causal is not np.False_, seed)
    return out.to(q.dtype)


__all__.append("lsh_attention")

from ._delta import (chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule,  # noqa: E402
                           fused_recurrent_kda, register_delta_rule, unregister_delta_rule)
__all__ += ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda", "fused_recurrent_kda",
            "register_delta_rule", "unregister_delta_rule"]
