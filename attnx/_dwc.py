"""FLatten's depthwise-convolution term (Han et al. 2023, "FLatten
Transformer"): a depthwise convolution of the values added to the output of
focused linear attention, to restore the feature diversity that the
low-rank attention matrix loses.

Each feature channel c of v (..., n, e) is convolved with its own kernel,
with zero padding and the same length, as PyTorch's depthwise Conv1d/Conv2d
compute it (a cross-correlation):

* along the sequence, weight (e, ks):
  ``out[..., t, c] = sum_s weight[c, s] v[..., t + s - (ks - 1) / 2, c]``;
* over an image grid ``spatial=(H, W)`` (n = H * W tokens, row-major),
  weight (e, kh, kw): the same with two offsets, one per grid axis.

Kernel sizes are odd, so that the output lines up with the input.
"""
import numpy as np


def _check(v, weight, spatial):
    v = np.asarray(v)
    weight = np.asarray(weight)
    if v.ndim < 2:
        raise ValueError(f"v must have at least 2 dimensions (..., n, e), got shape {v.shape}")
    n, e = v.shape[-2:]
    if weight.dtype.kind not in "fiub":
        raise TypeError(f"dwc_weight must hold real numbers, got dtype {weight.dtype}")
    if spatial is None:
        if weight.ndim != 2 or weight.shape[0] != e:
            raise ValueError(f"dwc_weight must have shape (e, ks) = ({e}, ks) along the sequence, got {weight.shape}")
        grid = (n,)
    else:
        if (not isinstance(spatial, (tuple, list)) or len(spatial) != 2
                or not all(isinstance(s, (int, np.integer)) and s > 0 for s in spatial)):
            raise ValueError(f"spatial must be (H, W), two positive integers, got {spatial!r}")
        grid = (int(spatial[0]), int(spatial[1]))
        if grid[0] * grid[1] != n:
            raise ValueError(f"spatial {grid} holds {grid[0] * grid[1]} tokens but v has n = {n}")
        if weight.ndim != 3 or weight.shape[0] != e:
            raise ValueError(f"dwc_weight must have shape (e, kh, kw) = ({e}, kh, kw) over a grid, got {weight.shape}")
    if any(size % 2 == 0 for size in weight.shape[1:]):
        raise ValueError(f"dwc_weight's kernel sizes must be odd, got {weight.shape[1:]}")
    return v, weight, grid


def _on_grid(x, grid):
    """(..., n, e) -> (..., *grid, e) (a view)."""
    return x.reshape(x.shape[:-2] + grid + x.shape[-1:])


def _padded(x, kernel):
    """x (..., *grid, e) with (k - 1) / 2 zeros on both sides of each grid axis."""
    pads = [(0, 0)] * (x.ndim - len(kernel) - 1) + [((k - 1) // 2,) * 2 for k in kernel] + [(0, 0)]
    return np.pad(x, pads)


def _window(padded, offset, grid):
    """The slice of a padded grid at kernel offset `offset` (one per axis)."""
    key = (Ellipsis,) + tuple(slice(o, o + size) for o, size in zip(offset, grid)) + (slice(None),)
    return padded[key]


def depthwise_convolution(v, weight, spatial=None):
    """The depthwise convolution of v (..., n, e) described in the module
    docstring: same shape as v, in v's float dtype (float64 for integers)."""
    v, weight, grid = _check(v, weight, spatial)
    dtype = v.dtype if v.dtype.kind == "f" else np.dtype(np.float64)
    kernel = weight.shape[1:]
    weight = weight.astype(dtype, copy=False)
    padded = _padded(_on_grid(v.astype(dtype, copy=False), grid), kernel)
    out = np.zeros(v.shape[:-2] + grid + v.shape[-1:], dtype=dtype)
    for offset in np.ndindex(*kernel):
        out += weight[(slice(None),) + offset] * _window(padded, offset, grid)
    return out.reshape(v.shape[:-2] + v.shape[-2:])


def depthwise_convolution_backward(dout, v, weight, spatial=None):
    """(dv, dweight): the gradients of sum(dout * depthwise_convolution(v,
    weight, spatial)). dv is the convolution of dout with the kernel turned
    round (the transpose); dweight[c, s] sums dout * v at offset s."""
    v, weight, grid = _check(v, weight, spatial)
    dout = np.asarray(dout)
    if dout.shape != v.shape:
        raise ValueError(f"dout must have v's shape {v.shape}, got {dout.shape}")
    dtype = np.result_type(dout.dtype, v.dtype, np.float32 if v.dtype.kind == "f" else np.float64)
    dweight_dtype = weight.dtype if weight.dtype.kind == "f" else dtype
    kernel = weight.shape[1:]
    padded_v = _padded(_on_grid(v.astype(dtype, copy=False), grid), kernel)
    padded_dout = _padded(_on_grid(dout.astype(dtype, copy=False), grid), kernel)
    dv = np.zeros(v.shape[:-2] + grid + v.shape[-1:], dtype=dtype)
    dweight = np.zeros(weight.shape, dtype=dtype)
    lead_axes = tuple(range(v.ndim - 2 + len(grid)))
    weight = weight.astype(dtype, copy=False)
    dout_grid = _on_grid(dout.astype(dtype, copy=False), grid)
    for offset in np.ndindex(*kernel):
        turned = tuple(k - 1 - o for k, o in zip(kernel, offset))
        dv += weight[(slice(None),) + offset] * _window(padded_dout, turned, grid)
        dweight[(slice(None),) + offset] = np.sum(dout_grid * _window(padded_v, offset, grid), axis=lead_axes)
    dv = dv.reshape(v.shape)
    return (dv.astype(v.dtype, copy=False) if v.dtype.kind == "f" else dv,
            dweight.astype(dweight_dtype, copy=False))


def add_depthwise_convolution(out, v, dwc_weight, spatial=None):
    """``out + depthwise_convolution(v, dwc_weight, spatial)`` (out unchanged
    when dwc_weight is None): the term focused_linear_attention adds. Needs
    as many values as outputs (n == m: self-attention)."""
    if dwc_weight is None:
        if spatial is not None:
            raise ValueError("spatial is given but dwc_weight is None")
        return out
    v = np.asarray(v)
    if v.shape[-2] != out.shape[-2]:
        raise ValueError(f"dwc_weight: the convolution of v (m = {v.shape[-2]}) is added to the output "
                         f"(n = {out.shape[-2]}), so n must equal m")
    term = depthwise_convolution(v, dwc_weight, spatial)
    return out + term.astype(out.dtype, copy=False)
