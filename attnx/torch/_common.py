"""What every attnx.torch module shares: the torch import (with the
install hint when torch is missing), the checks of tensor arguments and of
the window and causal options, the numpy views attnx's functions read, and
the dtype conversions: bfloat16 and float16 tensors are computed in
float32, widened once on the way in and narrowed once on the way out, in
C (the operators ``torch.ops.attnx.half_to_float32`` and
``float32_to_half``); softmax attention on bfloat16 tensors also asks the
kernels for bfloat16 products where they have them, in the forward and the
backward, and its decoding path reads half-precision keys and values as
they are (_softmax.py, docs/pytorch.md).
"""
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

from .. import _C

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
        _broadcast_shapes(*shapes)
    except (RuntimeError, ValueError):
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


def _broadcast_shapes(*shapes):
    """torch.broadcast_shapes, through numpy's when every size is an int:
    torch's costs some 20 us a call, noticeable beside a decoding step;
    symbolic sizes (torch.compile) take torch's."""
    if all(type(size) is int for shape in shapes for size in shape):
        return np.broadcast_shapes(*shapes)
    return tuple(torch.broadcast_shapes(*shapes))


def _batch_shape(*tensors):
    return _broadcast_shapes(*(tuple(t.shape[:-2]) for t in tensors if t is not None))


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


# ------------------------------------------- half precision <-> float32 ops

def _half_np(t):
    """A numpy view (no copy) of half-precision tensor `t`'s numbers as
    attnx's C code reads them: float16 as float16, bfloat16 (which numpy
    lacks) as its bits in int16."""
    t = t.detach().resolve_neg()
    return t.numpy() if t.dtype == torch.float16 else t.view(torch.int16).numpy()


@torch.library.custom_op("attnx::half_to_float32", mutates_args=(), device_types="cpu")
def _widen_op(x: Tensor) -> Tensor:
    """x (bfloat16 or float16, any strides) as a new C-contiguous float32
    tensor: exact, in C (_C._convert_half)."""
    out = torch.empty(x.shape, dtype=torch.float32)
    _C._convert_half(_half_np(x), out.numpy())
    return out


@_widen_op.register_fake
def _(x):
    return x.new_empty(x.shape, dtype=torch.float32)


@torch.library.custom_op("attnx::float32_to_half", mutates_args=(), device_types="cpu")
def _narrow_op(x: Tensor, dtype: torch.dtype) -> Tensor:
    """x (float32, any strides) rounded to nearest even in a new
    C-contiguous tensor of half-precision `dtype` (bfloat16 or float16),
    in C."""
    if dtype not in _HALF:
        raise ValueError(f"float32_to_half narrows to bfloat16 or float16, not {dtype}")
    out = torch.empty(x.shape, dtype=dtype)
    _C._convert_half(x.detach().resolve_neg().numpy(), _half_np(out))
    return out


@_narrow_op.register_fake
def _(x, dtype):
    return x.new_empty(x.shape, dtype=dtype)


def _widen_setup(ctx, inputs, output):
    ctx.half_dtype = inputs[0].dtype


def _widen_backward(ctx, grad):
    return torch.ops.attnx.float32_to_half(grad, ctx.half_dtype)


def _narrow_backward(ctx, grad):
    return torch.ops.attnx.half_to_float32(grad), None


_widen_op.register_autograd(_widen_backward, setup_context=_widen_setup)
_narrow_op.register_autograd(_narrow_backward)


def _in_compute_dtype(*tensors):
    """Half-precision tensors converted to float32, the one conversion on
    the way in, in C, strided tensors read in place (differentiable: their
    gradients are converted back once); others as they are."""
    return [torch.ops.attnx.half_to_float32(t) if t is not None and t.dtype in _HALF else t
            for t in tensors]


def _wide_np(*tensors):
    """For each tensor: a float32 numpy array of a half-precision tensor
    (one pass, in C, reading any strides in place; those of one call
    converted together, in one parallel region), or the numpy view of a
    float32 / float64 / bool tensor (None for None). One tensor: its
    array; several: a list."""
    half = [t is not None and t.dtype in _HALF for t in tensors]
    arrays = [np.empty(tuple(t.shape), dtype=np.float32) if is_half else _np(t)
              for t, is_half in zip(tensors, half)]
    if any(half):
        _C._convert_half([_half_np(t) for t, is_half in zip(tensors, half) if is_half],
                         [a for a, is_half in zip(arrays, half) if is_half])
    return arrays[0] if len(tensors) == 1 else arrays


def _narrowed(arrays, dtype):
    """float32 numpy array `arrays`, or each of a list of them, as a new
    tensor of half `dtype`, rounded to nearest even in one pass, in C (a
    list's converted together, in one parallel region)."""
    if isinstance(arrays, np.ndarray):
        return _narrowed([arrays], dtype)[0]
    outs = [torch.empty(array.shape, dtype=dtype) for array in arrays]
    _C._convert_half(arrays, [_half_np(out) for out in outs])
    return outs


def _in_dtype(t, dtype):
    """A result computed in float32 returned in the input's `dtype`, the
    one conversion on the way out (differentiable)."""
    if t.dtype == dtype:
        return t
    if dtype in _HALF:
        return torch.ops.attnx.float32_to_half(t, dtype)
    return t.to(dtype)



def _to_compute(t, dtype):
    """t (None, or a floating tensor) in the computing dtype `dtype`
    (differentiable: autograd converts its gradient back); a half-precision
    tensor widened in C."""
    if t is None or t.dtype == dtype:
        return t
    if t.dtype in _HALF and dtype == torch.float32:
        return torch.ops.attnx.half_to_float32(t)
    return t.to(dtype)
