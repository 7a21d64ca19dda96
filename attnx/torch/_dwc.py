"""FLatten's depthwise-convolution term of focused linear attention
(``dwc_weight=``) as the operator ``torch.ops.attnx.depthwise_convolution``
with its backward; attnx/torch/_linear.py adds it to the output."""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .. import _dwc
from ._common import _check_tensor, _compute_dtype, _from_numpy, _in_dtype, _np, _to_compute


def _spatial(spatial):
    return None if spatial is None else tuple(spatial)


@torch.library.custom_op("attnx::depthwise_convolution", mutates_args=(), device_types="cpu")
def _dwc_op(v: Tensor, weight: Tensor, spatial: Optional[List[int]]) -> Tensor:
    """The depthwise convolution of v (..., n, e) with weight (e, ks) along
    the sequence, or (e, kh, kw) over the grid spatial = [H, W]."""
    return _from_numpy(_dwc.depthwise_convolution(_np(v), _np(weight), _spatial(spatial)), v.dtype)


@_dwc_op.register_fake
def _(v, weight, spatial):
    return v.new_empty(v.shape)


@torch.library.custom_op("attnx::depthwise_convolution_backward", mutates_args=(),
                         device_types="cpu")
def _dwc_backward_op(dout: Tensor, v: Tensor, weight: Tensor,
                     spatial: Optional[List[int]]) -> Tuple[Tensor, Tensor]:
    """dv, dweight of sum(dout * depthwise_convolution(v, weight, spatial))."""
    dv, dweight = _dwc.depthwise_convolution_backward(_np(dout), _np(v), _np(weight),
                                                      _spatial(spatial))
    return _from_numpy(dv, v.dtype), _from_numpy(dweight, weight.dtype)


@_dwc_backward_op.register_fake
def _(dout, v, weight, spatial):
    return v.new_empty(v.shape), weight.new_empty(weight.shape)


def _dwc_setup_context(ctx, inputs, output):
    v, weight, spatial = inputs
    ctx.spatial = spatial
    ctx.save_for_backward(v, weight)


def _dwc_grad(ctx, dout):
    v, weight = ctx.saved_tensors
    dv, dweight = torch.ops.attnx.depthwise_convolution_backward(dout, v, weight, ctx.spatial)
    return dv, dweight, None


_dwc_op.register_autograd(_dwc_grad, setup_context=_dwc_setup_context)

def add_depthwise_convolution(out, q, v, dwc_weight, spatial):
    """out + FLatten's depthwise convolution of v (attnx.torch's
    focused_linear_attention with dwc_weight=, spatial=): weight (e, ks)
    along the sequence, or (e, kh, kw) over the grid spatial=(H, W) (n = H *
    W, row-major), zero padding, odd kernel sizes; needs n == m. out
    unchanged when dwc_weight is None."""
    if dwc_weight is None:
        if spatial is not None:
            raise ValueError("spatial is given but dwc_weight is None")
        return out
    _check_tensor("dwc_weight", dwc_weight)
    if not dwc_weight.is_floating_point():
        raise TypeError(f"dwc_weight must be a floating point tensor, got dtype {dwc_weight.dtype}")
    if v.shape[-2] != q.shape[-2]:
        raise ValueError(f"dwc_weight: the convolution of v (m = {v.shape[-2]}) is added to the "
                         f"output (n = {q.shape[-2]}), so n must equal m")
    if spatial is not None and (not isinstance(spatial, (tuple, list)) or len(spatial) != 2):
        raise ValueError(f"spatial must be (H, W), two positive integers, got {spatial!r}")
    compute = _compute_dtype(v.dtype)
    term = torch.ops.attnx.depthwise_convolution(
        _to_compute(v, compute), _to_compute(dwc_weight, compute),
        None if spatial is None else [int(s) for s in spatial])
    return out + _in_dtype(term, out.dtype)
