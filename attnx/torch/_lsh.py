"""attnx.torch.lsh_attention: Reformer's LSH attention (attnx.lsh_attention)
as the operator ``torch.ops.attnx.lsh_attention`` with its backward."""
from typing import Tuple

import numpy as np
import torch

import attnx

from .. import _checks
from ._common import (Tensor, _batch_shape, _check_tensor, _compute_dtype, _in_compute_dtype,
                      _in_dtype, _np)


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
    return _in_dtype(out, q.dtype)
