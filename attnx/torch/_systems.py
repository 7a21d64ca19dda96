"""attnx.torch's operators for the other systems: rotary positions and the
sinusoidal table, and block-sparse, pooled and Linformer attention.
attnx/torch/__init__.py imports this module's public names into its own
namespace; use them from there (``attnx.torch.rotary``).

The operators are ``torch.library.custom_op`` operators in the namespace
``attnx`` with fake implementations and autograd formulas built on the
numpy backward functions, like the rest of attnx.torch:

* ``torch.ops.attnx.rotary`` (backward ``rotary_backward``, itself
  differentiable: the rotation is linear);
* ``torch.ops.attnx.softmax_system``: block-sparse, pooled and Linformer
  attention (softmax attention over a layout of blocks, over pooled keys,
  over keys projected along the sequence), with
  ``softmax_system_backward``.
"""
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

import attnx

from .._checks import count
from ._common import (
    _batch_shape,
    _check_inputs,
    _check_tensor,
    _compute_dtype,
    _decode_causal,
    _decode_window,
    _encode_causal,
    _encode_window,
    _from_numpy,
    _in_dtype,
    _key_padding_view,
    _np,
    _to_compute,
)
from ._softmax import _seed_tensor

__all__ = [
    "sinusoidal_positions",
    "rotary",
    "block_sparse_attention",
    "pooled_attention",
    "linformer_attention",
]



# --------------------------------------------------------------- positions

def sinusoidal_positions(n, d, base=10000, *, dtype=torch.float64):
    """The Transformer's sinusoidal position table as a tensor.

    Parameters
    ----------
    n, d : int
        Positions and features.
    base : float, default 10000
        The base of the wavelengths.
    dtype : torch.dtype, default torch.float64
        The tensor's dtype.

    Returns
    -------
    torch.Tensor, shape (n, d)
        The table (a constant: no gradient).

    Raises
    ------
    ValueError
        Negative sizes.
    TypeError
        Sizes that are not integers.

    See Also
    --------
    attnx.sinusoidal_positions : The numpy function.

    Notes
    -----
    ``PE[p, 2i] = sin(p / base**(2i/d))``, ``PE[p, 2i+1] = cos(p /
    base**(2i/d))``, computed with torch's own functions, so torch.compile
    traces it.

    Examples
    --------
    >>> import numpy as np, attnx, attnx.torch
    >>> P = attnx.torch.sinusoidal_positions(4, 6)
    >>> np.allclose(P.numpy(), attnx.sinusoidal_positions(4, 6))
    True
    """
    n, d = count(n, "n"), count(d, "d")
    base = float(base)
    if not base > 0 or base == float("inf"):
        raise ValueError(f"base must be finite and positive, got {base}")
    column = torch.arange(d)
    angles = (torch.arange(n, dtype=torch.float64)[:, None]
              / torch.pow(base, 2.0 * (column // 2).to(torch.float64) / d))
    table = torch.where(column % 2 == 0, angles.sin(), angles.cos())
    return table.to(dtype)


@torch.library.custom_op("attnx::rotary", mutates_args=(), device_types="cpu")
def _rotary_op(x: Tensor, positions: Optional[Tensor], base: float, interleaved: bool) -> Tensor:
    """attnx.rotary of x (float32 or float64) at `positions` (None: 0..n-1)."""
    return _from_numpy(attnx.rotary(_np(x), _np(positions), base, interleaved), x.dtype)


@_rotary_op.register_fake
def _(x, positions, base, interleaved):
    return x.new_empty(x.shape)


@torch.library.custom_op("attnx::rotary_backward", mutates_args=(), device_types="cpu")
def _rotary_backward_op(dout: Tensor, positions: Optional[Tensor], base: float,
                        interleaved: bool) -> Tensor:
    """attnx.rotary_backward: each pair turned back by its angle."""
    return _from_numpy(attnx.rotary_backward(_np(dout), _np(positions), base, interleaved),
                       dout.dtype)


@_rotary_backward_op.register_fake
def _(dout, positions, base, interleaved):
    return dout.new_empty(dout.shape)


def _rotary_setup_context(ctx, inputs, output):
    _, positions, base, interleaved = inputs
    ctx.save_for_backward(positions)
    ctx.options = (base, interleaved)


def _rotary_grad(ctx, dout):
    (positions,) = ctx.saved_tensors
    return torch.ops.attnx.rotary_backward(dout, positions, *ctx.options), None, None, None


def _rotary_backward_grad(ctx, dgrad):
    # rotary_backward is the transpose of the rotation; its own transpose is the rotation
    (positions,) = ctx.saved_tensors
    return torch.ops.attnx.rotary(dgrad, positions, *ctx.options), None, None, None


_rotary_op.register_autograd(_rotary_grad, setup_context=_rotary_setup_context)
_rotary_backward_op.register_autograd(_rotary_backward_grad, setup_context=_rotary_setup_context)


def rotary(x, positions=None, base=10000, interleaved=False):
    """`attnx.rotary` on a tensor, differentiable in x.

    Parameters
    ----------
    x : torch.Tensor, shape (..., n, d)
        Queries or keys; d even.
    positions : torch.Tensor or array_like, optional
        None (0..n-1 along axis -2) or integers / floats broadcastable to
        ``x.shape[:-1]``.
    base : float, default 10000
        The base of the rotation frequencies.
    interleaved : bool, default False
        RoFormer's pairs ``(x[2i], x[2i+1])`` instead of rotate-half.

    Returns
    -------
    torch.Tensor
        x rotated, its shape and dtype.

    Raises
    ------
    TypeError
        Arguments that are not tensors, or an unsupported dtype.
    ValueError
        Tensors on another device than the CPU, and the errors of the
        numpy function for shapes and options.

    See Also
    --------
    attnx.rotary : The numpy function.

    Notes
    -----
    Pair i at position p turns by ``p * base**(-2i/d)``.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> x = torch.ones(3, 2, dtype=torch.float64, requires_grad=True)
    >>> y = attnx.torch.rotary(x)
    >>> torch.allclose(y[1], torch.tensor([1.0, 1.0], dtype=torch.float64).cos()
    ...                - torch.tensor([1.0, -1.0], dtype=torch.float64).sin())
    True
    >>> y.sum().backward(); x.grad.shape
    torch.Size([3, 2])
    """
    _check_tensor("x", x)
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating point tensor, got dtype {x.dtype}")
    if x.dim() < 2 or x.shape[-1] % 2:
        raise ValueError(f"x must have shape (..., n, d) with d even, got {tuple(x.shape)}")
    if positions is not None:
        positions = torch.as_tensor(positions)
        _check_tensor("positions", positions)
        if positions.dtype == torch.bool or positions.is_complex():
            raise TypeError(f"positions must hold integers or floats, got dtype {positions.dtype}")
        try:
            shape = torch.broadcast_shapes(positions.shape, x.shape[:-1])
        except RuntimeError:
            shape = None
        if shape != x.shape[:-1]:
            raise ValueError(f"positions of shape {tuple(positions.shape)} must broadcast to "
                             f"x.shape[:-1] = {tuple(x.shape[:-1])}")
    dtype = x.dtype
    out = torch.ops.attnx.rotary(_to_compute(x, _compute_dtype(dtype)), positions, float(base),
                                 bool(interleaved))
    return _in_dtype(out, dtype)


# ------------------------------------- block-sparse, pooled and Linformer

_SYSTEMS = ("block_sparse", "pooled", "linformer")


def _system_options(scale, causal, mask, bias, window, dropout_p, seed):
    options = {"scale": scale, "causal": _decode_causal(causal), "mask": _np(mask),
               "bias": _np(bias), "window": _decode_window(window)}
    if dropout_p:
        options["dropout_p"] = dropout_p
        options["seed"] = int(seed.item())
    return options


@torch.library.custom_op("attnx::softmax_system", mutates_args=(), device_types="cpu")
def _system_op(q: Tensor, k: Tensor, v: Tensor, layout: Optional[Tensor], E: Optional[Tensor],
               F: Optional[Tensor], mask: Optional[Tensor], bias: Optional[Tensor], system: str,
               size: int, mode: str, scale: Optional[float], causal: str,
               window: Optional[List[int]], dropout_p: float,
               seed: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    """Softmax attention over a derived set of keys, `system`:
    "block_sparse" (layout, size = block_size), "pooled" (size = stride,
    mode) or "linformer" (E, F). Returns out (..., n, e) and lse (..., n),
    in q's dtype (float32 or float64; the callers convert half tensors)."""
    options = _system_options(scale, causal, mask, bias, window, dropout_p, seed)
    arrays = (_np(q), _np(k), _np(v))
    if system == "block_sparse":
        out, lse = attnx.block_sparse_attention(*arrays, _np(layout), size, return_lse=True,
                                                **options)
    elif system == "pooled":
        out, lse = attnx.pooled_attention(*arrays, size, mode, return_lse=True, **options)
    elif system == "linformer":
        out, lse = attnx.linformer_attention(*arrays, _np(E), _np(F), return_lse=True, **options)
    else:
        raise ValueError(f"unknown system {system!r}; expected one of {_SYSTEMS}")
    return _from_numpy(out, q.dtype), _from_numpy(lse, q.dtype)


@_system_op.register_fake
def _(q, k, v, layout, E, F, mask, bias, system, size, mode, scale, causal, window, dropout_p,
      seed):
    shape = _batch_shape(q, k, v, layout, E, F, mask, bias)
    return (q.new_empty(shape + (q.shape[-2], v.shape[-1])), q.new_empty(shape + (q.shape[-2],)))


@torch.library.custom_op("attnx::softmax_system_backward", mutates_args=(), device_types="cpu")
def _system_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        layout: Optional[Tensor], E: Optional[Tensor], F: Optional[Tensor],
                        mask: Optional[Tensor], bias: Optional[Tensor], system: str, size: int,
                        mode: str, scale: Optional[float], causal: str,
                        window: Optional[List[int]], dropout_p: float, seed: Optional[Tensor],
                        bias_grad: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, dE, dF, dbias of sum(dout * out) (dE for Linformer,
    dF when F was given, dbias when bias_grad; empty tensors otherwise)."""
    options = _system_options(scale, causal, mask, bias, window, dropout_p, seed)
    args: List[Any] = [_np(t) for t in (dout, q, k, v, out, lse)]
    backward: Any
    if system == "block_sparse":
        backward, args = attnx.block_sparse_attention_backward, args + [_np(layout), size]
    elif system == "pooled":
        backward, args = attnx.pooled_attention_backward, args + [size, mode]
    else:
        backward, args = attnx.linformer_attention_backward, args + [_np(E), _np(F)]
    g = backward(*args, bias_grad=bias_grad, **options)
    dE, dF = g.projection if g.projection is not None else (None, None)
    return (_from_numpy(g.q, q.dtype), _from_numpy(g.k, k.dtype), _from_numpy(g.v, v.dtype),
            q.new_empty((0,)) if dE is None or E is None else _from_numpy(dE, E.dtype),
            q.new_empty((0,)) if dF is None or F is None else _from_numpy(dF, F.dtype),
            _from_numpy(g.bias, bias.dtype) if bias_grad and bias is not None else q.new_empty((0,)))


@_system_backward_op.register_fake
def _(dout, q, k, v, out, lse, layout, E, F, mask, bias, system, size, mode, scale, causal, window,
      dropout_p, seed, bias_grad):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((0,)) if E is None else E.new_empty(E.shape),
            q.new_empty((0,)) if F is None else F.new_empty(F.shape),
            bias.new_empty(bias.shape) if bias_grad else q.new_empty((0,)))


def _system_setup_context(ctx, inputs, output):
    q, k, v, layout, E, F, mask, bias = inputs[:8]
    ctx.options = inputs[8:15]  # system .. dropout_p
    ctx.mark_non_differentiable(output[1])
    ctx.bias_grad = bias is not None and ctx.needs_input_grad[7]
    ctx.save_for_backward(q, k, v, output[0], output[1], layout, E, F, mask, bias, inputs[15])


def _system_grad(ctx, dout, dlse):
    q, k, v, out, lse, layout, E, F, mask, bias, seed = ctx.saved_tensors
    dq, dk, dv, dE, dF, dbias = torch.ops.attnx.softmax_system_backward(
        dout, q, k, v, out, lse, layout, E, F, mask, bias, *ctx.options, seed, ctx.bias_grad)
    return (dq, dk, dv, None, dE if E is not None else None, dF if F is not None else None, None,
            dbias if ctx.bias_grad else None) + (None,) * 8


_system_op.register_autograd(_system_grad, setup_context=_system_setup_context)


def _system_call(system, q, k, v, layout=None, E=None, F=None, size=1, mode="mean", *, scale=None,
                 causal=False, mask=None, bias=None, window=None, dropout_p=0.0, seed=None,
                 return_lse=False):
    _check_inputs(("q", "k", "v"), q, k, v)
    dtype, compute = q.dtype, _compute_dtype(q.dtype)
    if mask is not None:
        _check_tensor("mask", mask)
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be bool (True = attend), got dtype {mask.dtype}; "
                            "give additive float masks as bias=")
        mask = _key_padding_view(mask, q.shape[-2])
    for name, t in (("bias", bias), ("E", E), ("F", F)):
        if t is not None:
            _check_tensor(name, t)
            if not t.is_floating_point():
                raise TypeError(f"{name} must be a floating point tensor, got dtype {t.dtype}")
    q, k, v, E, F, bias = (_to_compute(t, compute) for t in (q, k, v, E, F, bias))
    out, lse = torch.ops.attnx.softmax_system(
        q, k, v, layout, E, F, mask, bias, system, size, mode,
        None if scale is None else float(scale), _encode_causal(causal), _encode_window(window),
        float(dropout_p), _seed_tensor(dropout_p, seed))
    out = _in_dtype(out, dtype)
    return (out, lse) if return_lse else out


def block_sparse_attention(q, k, v, layout, block_size, *, scale=None, causal=False, mask=None,
                           bias=None, window=None, return_lse=False):
    """`attnx.block_sparse_attention` on tensors, differentiable.

    Parameters
    ----------
    q : torch.Tensor, shape (..., n, d)
        Queries, on the CPU: float32, float64, bfloat16 or float16.
    k : torch.Tensor, shape (..., m, d)
        Keys, of q's dtype.
    v : torch.Tensor, shape (..., m, e)
        Values, of q's dtype; the leading axes broadcast.
    layout : torch.Tensor or array_like of bool
        Broadcastable to (..., ceil(n / bs), ceil(m / bs)), such as from
        `attnx.layouts`.
    block_size : int
        The block.
    scale, causal, mask, bias, window, return_lse
        As in `attnx.block_sparse_attention` (a float bias gets its
        gradient).

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
    attnx.block_sparse_attention : The numpy function.

    Notes
    -----
    Softmax attention under the mask ``kron(layout, ones(bs, bs))[:n,
    :m]``, only the named blocks computed.

    Examples
    --------
    >>> import torch, attnx, attnx.torch
    >>> q = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    >>> out = attnx.torch.block_sparse_attention(q, q, q, attnx.layouts.local(4, 1), 2)
    >>> out.sum().backward()
    >>> out.shape, q.grad.shape
    (torch.Size([8, 4]), torch.Size([8, 4]))
    """
    layout = torch.as_tensor(layout)
    _check_tensor("layout", layout)
    if layout.dtype != torch.bool:
        raise TypeError(f"layout must be a boolean tensor of blocks, got dtype {layout.dtype}")
    return _system_call("block_sparse", q, k, v, layout, size=count(block_size, "block_size", 1),
                        scale=scale, causal=causal, mask=mask, bias=bias, window=window,
                        return_lse=return_lse)


def pooled_attention(q, k, v, stride, mode="mean", *, scale=None, causal=False, mask=None,
                     bias=None, window=None, dropout_p=0.0, seed=None, return_lse=False):
    """`attnx.pooled_attention` on tensors, differentiable.

    Parameters
    ----------
    q : torch.Tensor, shape (..., n, d)
        Queries, on the CPU: float32, float64, bfloat16 or float16.
    k : torch.Tensor, shape (..., m, d)
        Keys, of q's dtype.
    v : torch.Tensor, shape (..., m, e)
        Values, of q's dtype; the leading axes broadcast.
    stride : int
        The pooling window.
    mode : {"mean", "max"}, default "mean"
        How a window is pooled.
    scale, causal, mask, bias, window, dropout_p, seed, return_lse
        As in `softmax_attention`, referring to the ceil(m / stride) pooled
        keys.

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
    attnx.pooled_attention : The numpy function.

    Notes
    -----
    Keys and values pooled over windows of ``stride`` positions, then
    softmax attention.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> q = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    >>> out = attnx.torch.pooled_attention(q, q, q, 2, "max")
    >>> out.sum().backward()
    >>> out.shape, q.grad.shape
    (torch.Size([8, 4]), torch.Size([8, 4]))
    """
    if mode not in ("mean", "max"):
        raise ValueError(f"mode must be 'mean' or 'max', got {mode!r}")
    return _system_call("pooled", q, k, v, size=count(stride, "stride", 1), mode=mode, scale=scale,
                        causal=causal, mask=mask, bias=bias, window=window, dropout_p=dropout_p,
                        seed=seed, return_lse=return_lse)


def linformer_attention(q, k, v, E, F=None, *, scale=None, causal=False, mask=None, bias=None,
                        window=None, dropout_p=0.0, seed=None, return_lse=False):
    """`attnx.linformer_attention` on tensors, differentiable in q, k, v, E, F.

    Parameters
    ----------
    q : torch.Tensor, shape (..., n, d)
        Queries, on the CPU: float32, float64, bfloat16 or float16.
    k : torch.Tensor, shape (..., m, d)
        Keys, of q's dtype.
    v : torch.Tensor, shape (..., m, e)
        Values, of q's dtype; the leading axes broadcast.
    E : torch.Tensor, shape (..., r, m)
        Projects the keys (a learned E gets its gradient).
    F : torch.Tensor, optional
        Projects the values; default E (its share of the gradient then
        goes to E).
    scale, causal, mask, bias, window, dropout_p, seed, return_lse
        As in `softmax_attention`, referring to the r projected keys.

    Returns
    -------
    out : torch.Tensor, shape (..., n, e)
        In q's dtype.
    lse : torch.Tensor, shape (..., n)
        Only with ``return_lse=True``.

    Raises
    ------
    TypeError
        No E, arguments that are not tensors, or q, k, v of different dtypes.
    ValueError
        Tensors on another device than the CPU, and the errors of the
        numpy function for shapes and options.

    See Also
    --------
    attnx.linformer_attention : The numpy function.

    Notes
    -----
    Softmax attention over ``E @ k`` and ``F @ v``.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> q = torch.randn(8, 4, dtype=torch.float64)
    >>> E = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    >>> out = attnx.torch.linformer_attention(q, q, q, E)
    >>> out.sum().backward()
    >>> out.shape, E.grad.shape
    (torch.Size([8, 4]), torch.Size([3, 8]))
    """
    if E is None:
        raise TypeError("linformer_attention needs the projection E, a tensor (..., r, m)")
    for name, t in (("E", E), ("F", F)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() < 2
                              or t.shape[-1] != k.shape[-2]):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a tensor of shape (..., r, m) with m = "
                             f"{k.shape[-2]} (k's length), got {shape}")
    return _system_call("linformer", q, k, v, E=E, F=F, scale=scale, causal=causal, mask=mask,
                        bias=bias, window=window, dropout_p=dropout_p, seed=seed,
                        return_lse=return_lse)
