"""attnx.torch.register_transformers: attnx as an attention
implementation of Hugging Face transformers (``attn_implementation="attnx"``),
its attention function and its mask function. The delta rule's hooks into
transformers are in attnx/torch/_delta.py (``register_delta_rule``)."""
import warnings

import torch

from ._softmax import _seed_tensor, _softmax_apply, _split_heads, _split_mask


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
