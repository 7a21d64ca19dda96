"""attnx.torch.MultiheadAttention: the multi-head layer as an
``nn.Module``, on the front end of any variant (softmax, the linear family,
block-sparse, pooled, Linformer)."""
import torch

from .._checks import count
from .._multihead import _PER_HEAD_OPTIONS
from .._variants import VARIANTS
from ._common import _check_tensor
from ._systems import (block_sparse_attention, linformer_attention, pooled_attention, rotary,
                       sinusoidal_positions)
from ._weights import FRONT_ENDS as _FAMILY_FRONT_ENDS


_FRONT_ENDS = {
    **_FAMILY_FRONT_ENDS,
    "block_sparse": block_sparse_attention,
    "pooled": pooled_attention,
    "linformer": linformer_attention,
}
# array options a layer learns: Linformer's projections, FAVOR's, FLatten's kernel
_LEARNED = ("E", "F", "projection", "dwc_weight")


class MultiheadAttention(torch.nn.Module):
    """Multi-head attention on any attnx variant, batch first.

    Its ``nn.Linear`` submodules are ``q_proj`` (embed_dim -> embed_dim),
    ``k_proj`` and ``v_proj`` (embed_dim -> num_kv_heads * head_dim) and
    ``out_proj`` (embed_dim -> embed_dim), head_dim = embed_dim //
    num_heads.

    Parameters
    ----------
    embed_dim : int
        The model's width.
    num_heads : int
        Query heads, dividing embed_dim.
    num_kv_heads : int, optional
        Key/value heads (default num_heads), dividing num_heads: query head
        h uses key/value head ``h // (num_heads / num_kv_heads)``
        (grouped-query attention by broadcasting, no copies).
    variant : str, default "softmax"
        "softmax", "gaussian", "linear", "cosformer", "focused", "taylor",
        "performer", "efficient", "block_sparse", "pooled", "linformer",
        computed by attnx.torch's operator of that name.
    positions : {None, "sinusoidal", "rotary"}, optional
        "sinusoidal" adds the table to query, key and value first;
        "rotary" rotates q and k per head.
    bias : bool, default True
        Biases in the projections.
    device, dtype : optional
        Of the parameters, as for ``nn.Linear`` (CPU only).
    **options
        The variant's options (scale=, sigma=, feature_map=, layout= and
        block_size=, stride=, E=, window=, dropout_p= ...). E, F,
        projection and dwc_weight become learned parameters (given as their
        initial values), the other arrays (layout, mask, key_mask) buffers.
        Array options with a head axis put it before their own last axes,
        as in `attnx.multi_head_attention`. dropout_p applies in training
        mode only.

    Raises
    ------
    ValueError
        num_heads not dividing embed_dim, num_kv_heads not dividing
        num_heads, an unknown variant or positions.
    TypeError
        Sizes that are not integers.

    See Also
    --------
    attnx.multi_head_attention : The numpy function.

    Notes
    -----
    ``forward(query, key=None, value=None, key_padding_mask=None,
    is_causal=False)``: query (..., n, embed_dim), key and value (..., m,
    embed_dim) (key defaults to query, value to key); key_padding_mask
    (..., m) bool, True = padding (as in nn.MultiheadAttention), reaching
    the kernel as key padding; is_causal: query i sees keys j <= i. It
    returns the output (..., n, embed_dim). With weights copied from
    ``torch.nn.MultiheadAttention`` the outputs and gradients are the same
    (docs/systems.md).

    Examples
    --------
    >>> import torch, attnx.torch
    >>> mha = attnx.torch.MultiheadAttention(16, 4, num_kv_heads=2, positions="rotary")
    >>> x = torch.randn(2, 10, 16)
    >>> pad = torch.zeros(2, 10, dtype=torch.bool); pad[1, 7:] = True
    >>> y = mha(x, key_padding_mask=pad, is_causal=True)
    >>> y.shape
    torch.Size([2, 10, 16])
    >>> y.sum().backward(); mha.q_proj.weight.grad.shape
    torch.Size([16, 16])
    """

    def __init__(self, embed_dim, num_heads, *, num_kv_heads=None, variant="softmax",
                 positions=None, bias=True, device=None, dtype=None, **options):
        super().__init__()
        embed_dim = count(embed_dim, "embed_dim", 1)
        heads = count(num_heads, "num_heads", 1)
        kv_heads = heads if num_kv_heads is None else count(num_kv_heads, "num_kv_heads", 1)
        if embed_dim % heads:
            raise ValueError(f"num_heads ({heads}) must divide embed_dim ({embed_dim})")
        if heads % kv_heads:
            raise ValueError(f"num_kv_heads ({kv_heads}) must divide num_heads ({heads})")
        if variant not in _FRONT_ENDS:
            raise ValueError(f"unknown variant {variant!r}; expected one of "
                             f"{', '.join(map(repr, _FRONT_ENDS))}")
        if positions not in (None, "rotary", "sinusoidal"):
            raise ValueError(f"positions must be None, 'rotary' or 'sinusoidal', got {positions!r}")
        refused = {"out", "return_lse", "return_state", "initial_state"} & options.keys()
        if refused:
            raise TypeError(f"MultiheadAttention takes no {', '.join(sorted(refused))} option")
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, heads, kv_heads
        self.head_dim = head_dim = embed_dim // heads
        self.variant, self.positions = variant, positions
        factory = {"device": device, "dtype": dtype}
        self.q_proj = torch.nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.k_proj = torch.nn.Linear(embed_dim, kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = torch.nn.Linear(embed_dim, kv_heads * head_dim, bias=bias, **factory)
        self.out_proj = torch.nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.options, self._tensor_options = {}, []
        for name, value in options.items():
            if value is None or isinstance(value, (bool, int, float, str, tuple)) or callable(value):
                self.options[name] = value
                continue
            tensor = torch.as_tensor(value)
            if name in _LEARNED:
                self.register_parameter(name, torch.nn.Parameter(
                    tensor.to(dtype=dtype or torch.get_default_dtype(), device=device)))
            else:
                self.register_buffer(name, tensor)
            self._tensor_options.append(name)

    def extra_repr(self):
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, variant={self.variant!r}, "
                f"positions={self.positions!r}")

    def _per_head(self, name, t):
        """An option tensor with a head axis (..., num_heads or 1, core...)
        as (..., num_kv_heads, group, core...)."""
        core = _PER_HEAD_OPTIONS.get(name)
        if core is None or t.dim() <= core:
            return t
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if t.shape[-core - 1] == heads:
            return t.reshape(t.shape[:-core - 1] + (kv_heads, heads // kv_heads) + t.shape[-core:])
        if t.shape[-core - 1] == 1:
            return t.reshape(t.shape[:-core - 1] + (1, 1) + t.shape[-core:])
        raise ValueError(f"{name} of shape {tuple(t.shape)}: the axis before its last {core} must "
                         f"be the head axis, of size num_heads ({heads}) or 1")

    def forward(self, query, key=None, value=None, key_padding_mask=None, is_causal=False):
        key = query if key is None else key
        value = key if value is None else value
        if self.positions == "sinusoidal":
            shifted = {}
            for t in (query, key, value):
                if id(t) not in shifted:
                    shifted[id(t)] = t + sinusoidal_positions(t.shape[-2], t.shape[-1],
                                                              dtype=t.dtype)
            query, key, value = shifted[id(query)], shifted[id(key)], shifted[id(value)]
        kv_heads, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        # (..., L, heads * c) -> (..., kv_heads, group, L, c)
        q = self.q_proj(query).unflatten(-1, (kv_heads, group, -1)).movedim(-4, -2)
        k = self.k_proj(key).unflatten(-1, (kv_heads, 1, -1)).movedim(-4, -2)
        v = self.v_proj(value).unflatten(-1, (kv_heads, 1, -1)).movedim(-4, -2)
        if self.positions == "rotary":
            q, k = rotary(q), rotary(k)
        options = dict(self.options)
        for name in self._tensor_options:
            options[name] = self._per_head(name, getattr(self, name))
        if not self.training:
            options.pop("dropout_p", None)
        if is_causal:
            options["causal"] = "upper_left"
        if key_padding_mask is not None:
            self._add_key_padding(options, key_padding_mask, k.shape[-2])
        heads_out = _FRONT_ENDS[self.variant](q, k, v, **options)     # (..., Hkv, g, n, e)
        return self.out_proj(heads_out.movedim(-2, -4).flatten(-3))  # (..., n, Hkv * g * e)

    def _add_key_padding(self, options, key_padding_mask, m):
        """key_padding_mask (..., m), True = padding, as the variant's key
        padding: key_mask (..., 1, 1, m) for the kernelised front ends, a
        mask (..., 1, 1, 1, m) for the softmax ones."""
        _check_tensor("key_padding_mask", key_padding_mask)
        if key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask must be a bool tensor (True = padding), got dtype "
                            f"{key_padding_mask.dtype}")
        if key_padding_mask.dim() < 1 or key_padding_mask.shape[-1] != m:
            raise ValueError(f"key_padding_mask must have shape (..., m) with m = {m}, got "
                             f"{tuple(key_padding_mask.shape)}")
        keep = ~key_padding_mask
        if self.variant in VARIANTS:
            name, padding = "key_mask", keep[..., None, None, :]
        elif self.variant in ("pooled", "linformer"):
            raise ValueError(f"key_padding_mask: variant {self.variant!r} attends to pooled or "
                             "projected keys, which a padding of the original keys does not name")
        else:
            name, padding = "mask", keep[..., None, None, None, :]
        options[name] = padding if options.get(name) is None else options[name] & padding
