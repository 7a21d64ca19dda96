"""attnx.torch.attention_weights: the normalised weights of any variant,
from the front end of either family (softmax or linear) or of a system, so
this module sits above all of them."""
import torch

from .. import _checks
from .._variants import VARIANTS
from . import _linear
from ._common import _check_tensor
from ._linear import _PARAMETERS
from ._lsh import lsh_attention
from ._softmax import gaussian_attention, softmax_attention
from ._systems import block_sparse_attention, pooled_attention


# each variant of the two families, by name, to its front end;
# attnx/torch/_multihead.py adds the systems for its layers
FRONT_ENDS = {
    "softmax": softmax_attention,
    "gaussian": gaussian_attention,
    **{front: getattr(_linear, variant.function) for front, variant in VARIANTS.items()},
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
    if variant not in FRONT_ENDS and variant not in _SYSTEM_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of "
                         f"{', '.join(map(repr, (*FRONT_ENDS, *_SYSTEM_VARIANTS)))}")
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
    return FRONT_ENDS[variant](q, k, identity, **options)
