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
from ._common import torch  # noqa: F401  first: the install hint when torch is missing
from ._delta import (chunk_gated_delta_rule, chunk_kda, fused_recurrent_gated_delta_rule,
                     fused_recurrent_kda, register_delta_rule, unregister_delta_rule)
from ._linear import (LinearAttentionState, cosformer_attention, efficient_attention,
                      focused_linear_attention, linear_attention, performer_attention,
                      taylor_attention)
from ._lsh import lsh_attention
from ._multihead import MultiheadAttention
from ._softmax import (SDPATypeError, SDPAValueError, gaussian_attention,
                       scaled_dot_product_attention, softmax_attention)
from ._systems import (block_sparse_attention, linformer_attention, pooled_attention, rotary,
                       sinusoidal_positions)
from ._transformers import register_transformers
from ._weights import attention_weights

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
    "sinusoidal_positions",
    "rotary",
    "block_sparse_attention",
    "pooled_attention",
    "linformer_attention",
    "MultiheadAttention",
    "lsh_attention",
    "chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "chunk_kda",
    "fused_recurrent_kda",
    "register_delta_rule",
    "unregister_delta_rule",
]
