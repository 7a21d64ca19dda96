"""The delta rule as PyTorch operators (attnx.torch, docs/delta_rule.md),
under the names and signatures of flash-linear-attention and transformers:
``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``,
``chunk_kda``, ``fused_recurrent_kda``. Tensors are [B, n, H, d] as there
(q, k with H_k heads, v, g, beta with H_v = G H_k), the state [B, H_v, d_k,
d_v]; the kernels are attnx.delta_rule_attention's (csrc/delta.c), read in
place through the transposed views. ``torch.library.custom_op``s in the
namespace ``attnx`` with fake kernels and autograd: torch.compile traces
them whole; bfloat16 and float16 compute in float32.
"""
import math
from typing import List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from .. import _C, _delta
from ._common import _check_tensor, _in_compute_dtype, _in_dtype, _np, _to_compute



def _heads(t):
    """[B, n, H, ...] as the kernels' (B, H, n, ...) view"""
    return None if t is None else t.transpose(1, 2)


def _empty():
    return torch.empty(0)


def _delta_forward(q, k, v, beta, g, initial_state, scale, l2norm, recurrent, chunk):
    """out [B, n, H_v, d_v] and the final state [B, H_v, d_k, d_v]: the
    operator's computation, which calls that need no graph (decoding) run
    directly (_run)"""
    B, n, Hv, dv = v.shape
    # numpy views, their axes swapped by numpy (a tenth of torch's cost)
    q_, k_, v_, beta_, g_ = (None if t is None else _np(t, q.dtype).swapaxes(1, 2)
                             for t in (q, k, v, beta, g))
    out = np.empty((B, n, Hv, dv), dtype=q_.dtype)
    S0 = None if initial_state is None else _np(initial_state, q.dtype)
    call = _delta._Call(q_, k_, v_, beta_, g_, S0, scale)
    _, S = _C.delta_rule(call.q, call.k, call.v, call.beta, g_scalar=call.g_scalar,
                         g_channel=call.g_channel, initial_state=call.split(S0, 3),
                         out=call.split(out.swapaxes(1, 2), 3), want_state=True,
                         scale=call.scale, l2norm=l2norm, recurrent=recurrent, chunk=chunk)
    return torch.from_numpy(out), torch.from_numpy(call.merge(S, 3))


@torch.library.custom_op("attnx::delta_rule", mutates_args=(), device_types="cpu")
def _delta_op(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional[Tensor],
              initial_state: Optional[Tensor], scale: float, l2norm: bool, recurrent: bool,
              chunk: int) -> Tuple[Tensor, Tensor]:
    """out [B, n, H_v, d_v] and the final state [B, H_v, d_k, d_v]"""
    return _delta_forward(q, k, v, beta, g, initial_state, scale, l2norm, recurrent, chunk)


@_delta_op.register_fake
def _(q, k, v, beta, g, initial_state, scale, l2norm, recurrent, chunk):
    B, n, Hv, dv = v.shape
    return (v.new_empty((B, n, Hv, dv), dtype=q.dtype),
            v.new_empty((B, Hv, q.shape[-1], dv), dtype=q.dtype))


@torch.library.custom_op("attnx::delta_rule_backward", mutates_args=(), device_types="cpu")
def _delta_backward_op(dout: Tensor, dstate: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                       beta: Tensor, g: Optional[Tensor], initial_state: Optional[Tensor],
                       scale: float, l2norm: bool, chunk: int) -> List[Tensor]:
    """dq, dk, dv, dbeta, dg, dstate in the inputs' layouts ([B, n, H, ...]
    made contiguous; empty for an absent g or initial_state)"""
    dtype = q.dtype
    arrays = [_np(_heads(t), dtype) if t is not None else None for t in (q, k, v, beta, g)]
    S0 = None if initial_state is None else _np(initial_state, dtype)
    grads = _delta.delta_rule_attention_backward(
        _np(_heads(dout), dtype), *arrays, scale=scale, qk_l2norm=l2norm, chunk=chunk,
        initial_state=S0, grad_state=None if dstate is None else _np(dstate, dtype))
    as_input = (lambda a: torch.from_numpy(a).transpose(1, 2).contiguous())
    return [as_input(grads.q), as_input(grads.k), as_input(grads.v), as_input(grads.beta),
            _empty() if grads.g is None else as_input(grads.g),
            _empty() if grads.state is None else torch.from_numpy(grads.state)]


@_delta_backward_op.register_fake
def _(dout, dstate, q, k, v, beta, g, initial_state, scale, l2norm, chunk):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(beta),
            q.new_empty(0) if g is None else torch.empty_like(g),
            q.new_empty(0) if initial_state is None else torch.empty_like(initial_state)]


def _setup_context(ctx, inputs, output):
    q, k, v, beta, g, initial_state, scale, l2norm, recurrent, chunk = inputs
    ctx.save_for_backward(q, k, v, beta, g, initial_state)
    ctx.options = (scale, l2norm, chunk)


def _backward(ctx, dout, dstate):
    q, k, v, beta, g, initial_state = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(v, dtype=q.dtype)
    dq, dk, dv, dbeta, dg, dS0 = torch.ops.attnx.delta_rule_backward(
        dout, dstate, q, k, v, beta, g, initial_state, *ctx.options)
    return (dq, dk, dv, dbeta, dg if g is not None else None,
            dS0 if initial_state is not None else None, None, None, None, None)


_delta_op.register_autograd(_backward, setup_context=_setup_context)


def _run(query, key, value, g, beta, scale, initial_state, output_final_state,
         use_qk_l2norm_in_kernel, recurrent, chunk_size, kwargs, name):
    plain = _run_plain(query, key, value, g, beta, scale, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, recurrent, chunk_size, kwargs)
    if plain is not None:
        return plain
    if kwargs.get("cu_seqlens") is not None:
        raise NotImplementedError(f"{name}: cu_seqlens (packed variable-length sequences) is not "
                                  "supported by attnx; pass a padded batch")
    for arg, t in (("query", query), ("key", key), ("value", value), ("beta", beta)):
        _check_tensor(arg, t)
        if t.dim() != (3 if arg == "beta" else 4):
            raise ValueError(f"{name}: {arg} must be [B, n, H{'' if arg == 'beta' else ', d'}], "
                             f"got shape {tuple(t.shape)}")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"{name}: query, key and value must share one dtype, got {query.dtype}, "
                        f"{key.dtype} and {value.dtype}")
    if g is not None:
        _check_tensor("g", g)
    dtype = query.dtype
    compute = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    q, k, v = _in_compute_dtype(query, key, value)
    beta, g, state = (_to_compute(t, compute) for t in (beta, g, initial_state))
    if scale is None:
        scale = query.shape[-1] ** -0.5
    args = (q, k, v, beta, g, state, float(scale), bool(use_qk_l2norm_in_kernel), recurrent,
            int(chunk_size))
    # the operator's dispatch (autograd, the fake kernel) costs some 40 us a
    # call, several times a decoding step's arithmetic: a call that builds
    # no graph and is not being traced runs the computation itself
    if (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args[:6])) \
            or torch.compiler.is_compiling():
        out, final = torch.ops.attnx.delta_rule(*args)
    else:
        out, final = _delta_forward(*args)
    return _in_dtype(out, dtype), (final if output_final_state else None)


_PLAIN_DTYPES = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}


def _plain_view(t, dtype, rank, heads_first=False):
    """The numpy view of tensor `t` when it is a plain CPU tensor of numpy
    dtype `dtype` and rank `rank` with nothing to differentiate, else None:
    [B, n, H, ...] as the kernels take it, (B, H, n, ...) (heads_first: as
    it is). ``numpy()`` itself refuses a tensor that requires grad, lives
    off the CPU or has its negative bit set; asking the tensor each of
    these first cost a decoding step some 3 us."""
    if type(t) is not Tensor:
        return None
    try:
        array = t.numpy()
    except (RuntimeError, TypeError):
        return None
    if array.dtype != dtype or array.ndim != rank:
        return None
    return array if heads_first else array.swapaxes(1, 2)


def _run_plain(query, key, value, g, beta, scale, initial_state, output_final_state,
               use_qk_l2norm_in_kernel, recurrent, chunk_size, kwargs):
    """The result of the commonest call, or None when the call is not it:
    float32 or float64 tensors of one dtype, as many key as value heads, a
    scalar gate or none, shapes that agree, nothing to differentiate and
    nothing traced. A decoding step is such a call, and the general path's
    conversions and checks cost some 20 us of it; this one asks only what
    it relies on, and every other call (errors included) takes the general
    path."""
    if (kwargs and (any(name not in ("scale", "cu_seqlens") for name in kwargs)
                    or kwargs.get("cu_seqlens") is not None)) \
            or torch.compiler.is_compiling() \
            or (torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                for t in (query, key, value, g, beta,
                                                          initial_state))):
        return None
    dtype = _PLAIN_DTYPES.get(query.dtype) if type(query) is Tensor else None
    if dtype is None or type(chunk_size) is not int \
            or not (scale is None or type(scale) in (float, int)):
        return None
    q, k = _plain_view(query, dtype, 4), _plain_view(key, dtype, 4)
    v, b = _plain_view(value, dtype, 4), _plain_view(beta, dtype, 3)
    channel = g is not None and type(g) is Tensor and g.dim() == 4
    gate = None if g is None else _plain_view(g, dtype, 4 if channel else 3)
    state = None if initial_state is None else _plain_view(initial_state, dtype, 4, True)
    if q is None or k is None or v is None or b is None or (gate is None) != (g is None) \
            or (state is None) != (initial_state is None):
        return None
    B, H, n, d_k = q.shape
    d_v = v.shape[-1]
    scale = d_k ** -0.5 if scale is None else scale
    if k.shape != q.shape or v.shape[:3] != (B, H, n) or b.shape != (B, H, n) or d_k == 0 \
            or (gate is not None and gate.shape != ((B, H, n, d_k) if channel else (B, H, n))) \
            or (state is not None and state.shape != (B, H, d_k, d_v)) \
            or not (0 < scale < math.inf) or chunk_size < 1:
        return None
    out = np.empty((B, n, H, d_v), dtype=q.dtype)
    _, final = _C.delta_rule(q, k, v, b, g_scalar=None if channel else gate,
                             g_channel=gate if channel else None,
                             initial_state=state, out=out.swapaxes(1, 2), want_state=True,
                             scale=scale, l2norm=bool(use_qk_l2norm_in_kernel),
                             recurrent=recurrent, chunk=chunk_size)
    return torch.from_numpy(out), (torch.from_numpy(final) if output_final_state else None)


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule on attnx, chunked: transformers' and fla's signature.

    Parameters
    ----------
    query, key : Tensor, [B, n, H_k, d_k]
        Queries and keys.
    value : Tensor, [B, n, H_v, d_v]
        Values; H_v a multiple of H_k, each key head serving consecutive
        value heads.
    g : Tensor, [B, n, H_v], or None
        The log decay of each token and head (g <= 0 decays); None: DeltaNet.
    beta : Tensor, [B, n, H_v]
        The write strengths.
    chunk_size : int, default 64
        The chunk length.
    initial_state : Tensor, [B, H_v, d_k, d_v], optional
        The state to start from; zeros by default.
    output_final_state : bool, default False
        Also return the final state.
    use_qk_l2norm_in_kernel : bool, default False
        L2-normalise query and key first.
    **kwargs
        ``scale=`` (default ``d_k ** -0.5``), as in fla; ``cu_seqlens``
        must be None.

    Returns
    -------
    out : Tensor, [B, n, H_v, d_v]
        In query's dtype.
    final_state : Tensor, [B, H_v, d_k, d_v], or None
        In the compute dtype (float32 for bfloat16 and float16), None
        unless ``output_final_state``.

    Raises
    ------
    ValueError
        Tensors of the wrong rank or mismatched shapes.
    TypeError
        query, key and value of different dtypes, non-tensor inputs.
    NotImplementedError
        A ``cu_seqlens`` (packed sequences): pass a padded batch.

    See Also
    --------
    fused_recurrent_gated_delta_rule : The token loop, for decoding.
    chunk_kda : The gate per key channel.
    attnx.delta_rule_attention : The numpy function this runs.

    Notes
    -----
    transformers' ``torch_chunk_gated_delta_rule`` and fla's
    ``chunk_gated_delta_rule``, same signature. A ``torch.library.custom_op``
    (``attnx::delta_rule``) with a fake kernel and autograd for every input
    but the options: torch.compile traces it whole. A call that builds no
    autograd graph (no input requires grad, or grad mode is off) outside a
    trace skips the operator's dispatch. bfloat16 and float16 compute in
    float32. The tensors are read in place through transposed views
    ([B, n, H, d] as [B, H, n, d]).

    Examples
    --------
    >>> import torch, attnx.torch
    >>> from transformers.models.qwen3_next.modeling_qwen3_next import (
    ...     torch_chunk_gated_delta_rule)
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> q, k = torch.randn(2, 1, 10, 2, 8).unbind(0)
    >>> v = torch.randn(1, 10, 4, 8)                # 4 value heads, 2 key heads
    >>> g, beta = -torch.rand(1, 10, 4), torch.rand(1, 10, 4)
    >>> out, state = attnx.torch.chunk_gated_delta_rule(
    ...     q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    >>> ref, ref_state = torch_chunk_gated_delta_rule(
    ...     q, k, v, g, beta, initial_state=None, output_final_state=True,
    ...     use_qk_l2norm_in_kernel=True)
    >>> torch.allclose(out, ref, atol=1e-5), torch.allclose(state, ref_state, atol=1e-5)
    (True, True)
    """
    return _run(query, key, value, g, beta, kwargs.get("scale"), initial_state,
                output_final_state, use_qk_l2norm_in_kernel, False, chunk_size, kwargs,
                "chunk_gated_delta_rule")


def fused_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                                     **kwargs):
    """The gated delta rule's token loop on attnx, for decoding.

    Parameters
    ----------
    query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, **kwargs
        As in `chunk_gated_delta_rule`.

    Returns
    -------
    out : Tensor, [B, n, H_v, d_v]
        In query's dtype.
    final_state : Tensor, [B, H_v, d_k, d_v], or None
        As in `chunk_gated_delta_rule`.

    Raises
    ------
    ValueError, TypeError, NotImplementedError
        As in `chunk_gated_delta_rule`.

    See Also
    --------
    chunk_gated_delta_rule : The chunked form, for prefill and training.
    attnx.DeltaRuleState.step : Decoding in place, in numpy.

    Notes
    -----
    transformers' ``torch_recurrent_gated_delta_rule`` and fla's
    ``fused_recurrent_gated_delta_rule``, same signature. The token loop:
    the form for decoding with a cache (one token and a
    state), where it reads and writes each head's state once. The result
    equals `chunk_gated_delta_rule`'s to rounding; gradients are computed
    by the same chunked backward.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> q, k, v = torch.randn(3, 1, 9, 2, 8).unbind(0)
    >>> g, beta = -torch.rand(1, 9, 2), torch.rand(1, 9, 2)
    >>> whole, _ = attnx.torch.chunk_gated_delta_rule(q, k, v, g, beta)
    >>> head, state = attnx.torch.chunk_gated_delta_rule(
    ...     q[:, :8], k[:, :8], v[:, :8], g[:, :8], beta[:, :8], output_final_state=True)
    >>> last, state = attnx.torch.fused_recurrent_gated_delta_rule(    # one decoding step
    ...     q[:, 8:], k[:, 8:], v[:, 8:], g[:, 8:], beta[:, 8:], initial_state=state,
    ...     output_final_state=True)
    >>> torch.allclose(torch.cat([head, last], 1), whole, atol=1e-6)
    True
    """
    return _run(query, key, value, g, beta, kwargs.get("scale"), initial_state,
                output_final_state, use_qk_l2norm_in_kernel, True, 64, kwargs,
                "fused_recurrent_gated_delta_rule")


def chunk_kda(query, key, value, g, beta, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
    """Kimi Delta Attention on attnx, chunked.

    Parameters
    ----------
    query, key, value, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel
        As in `chunk_gated_delta_rule`.
    g : Tensor, [B, n, H_v, d_k]
        The log decay per token, head and key channel.
    **kwargs
        ``scale=``, ``chunk_size=`` (default 64); ``cu_seqlens`` must be None.

    Returns
    -------
    out : Tensor, [B, n, H_v, d_v]
        In query's dtype.
    final_state : Tensor, [B, H_v, d_k, d_v], or None
        As in `chunk_gated_delta_rule`.

    Raises
    ------
    ValueError, TypeError, NotImplementedError
        As in `chunk_gated_delta_rule`; also a g whose last axis is not d_k.

    See Also
    --------
    fused_recurrent_kda : The token loop, for decoding.
    chunk_gated_delta_rule : One gate per token and head.

    Notes
    -----
    transformers' ``chunk_kimi_delta_attention`` and fla's ``chunk_kda``,
    same signature. The state decays per key channel, ``S <- diag(exp(g_t)) S``, before the
    delta-rule write. The chunked form handles the gate in sub-blocks of 16
    tokens so that no decay factor it forms exceeds 1 for g <= 0.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> q, k, v = torch.randn(3, 1, 12, 2, 8).unbind(0)
    >>> g, beta = -torch.rand(1, 12, 2, 8), torch.rand(1, 12, 2)
    >>> out, _ = attnx.torch.chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    >>> loop, _ = attnx.torch.fused_recurrent_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    >>> out.shape, torch.allclose(out, loop, atol=1e-5)
    (torch.Size([1, 12, 2, 8]), True)
    """
    return _run(query, key, value, g, beta, kwargs.get("scale"), initial_state,
                output_final_state, use_qk_l2norm_in_kernel, False,
                kwargs.get("chunk_size", 64), kwargs, "chunk_kda")


def fused_recurrent_kda(query, key, value, g, beta, initial_state=None, output_final_state=False,
                        use_qk_l2norm_in_kernel=False, **kwargs):
    """Kimi Delta Attention's token loop on attnx, for decoding.

    Parameters
    ----------
    query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, **kwargs
        As in `chunk_kda`.

    Returns
    -------
    out : Tensor, [B, n, H_v, d_v]
        In query's dtype.
    final_state : Tensor, [B, H_v, d_k, d_v], or None
        As in `chunk_gated_delta_rule`.

    Raises
    ------
    ValueError, TypeError, NotImplementedError
        As in `chunk_kda`.

    See Also
    --------
    chunk_kda : The chunked form.

    Notes
    -----
    transformers' ``recurrent_kimi_delta_attention`` and fla's
    ``fused_recurrent_kda``, same signature. The form for decoding with a
    cache; equals `chunk_kda` to rounding.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> q, k, v = torch.randn(3, 1, 1, 2, 8).unbind(0)     # one token
    >>> g, beta = -torch.rand(1, 1, 2, 8), torch.rand(1, 1, 2)
    >>> state = torch.randn(1, 2, 8, 8)
    >>> out, new_state = attnx.torch.fused_recurrent_kda(
    ...     q, k, v, g, beta, initial_state=state, output_final_state=True)
    >>> out.shape, new_state.shape
    (torch.Size([1, 1, 2, 8]), torch.Size([1, 2, 8, 8]))
    """
    return _run(query, key, value, g, beta, kwargs.get("scale"), initial_state,
                output_final_state, use_qk_l2norm_in_kernel, True, 64, kwargs,
                "fused_recurrent_kda")


# ------------------------------------------------------------ Hugging Face

# transformers' modeling modules and the module-level functions their
# linear-attention layers call (the torch fallbacks of fla's kernels), with
# the attnx operator that takes each one's place
_HF_FUNCTIONS = {
    "torch_chunk_gated_delta_rule": chunk_gated_delta_rule,
    "torch_recurrent_gated_delta_rule": fused_recurrent_gated_delta_rule,
    "chunk_kimi_delta_attention": chunk_kda,
    "recurrent_kimi_delta_attention": fused_recurrent_kda,
}
_HF_MODULES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear")
_SILU = (None, "silu", "swish")


def _conv1d_update_for(original):
    """transformers' ``causal_conv1d_update(hidden_states, conv_state,
    weight, bias=None, activation=None)`` (the depthwise causal conv1d's
    decoding step, conv_state updated in place) on attnx's kernel
    (_C.causal_conv1d_update): one pass over the channels, where torch's
    conv1d call costs several times the delta rule's step. Calls it cannot
    take (autograd, a trace, other devices or dtypes, another activation)
    go to `original`."""

    def causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None,
                             *args, **kwargs):
        tensors = [t for t in (hidden_states, conv_state, weight, bias) if t is not None]
        if (args or kwargs or activation not in _SILU or torch.compiler.is_compiling()
                or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
                or any(t.device.type != "cpu" or t.dtype != weight.dtype for t in tensors)
                or weight.dtype not in (torch.float32, torch.float64)
                or hidden_states.dim() != 3 or weight.dim() != 2
                or not conv_state.is_contiguous()):
            return original(hidden_states, conv_state, weight, bias, activation, *args, **kwargs)
        out = _C.causal_conv1d_update(
            hidden_states.detach().resolve_neg().numpy(), conv_state.detach().numpy(),
            weight.detach().contiguous().resolve_neg().numpy(),
            None if bias is None else bias.detach().contiguous().resolve_neg().numpy(),
            silu=activation is not None)
        return torch.from_numpy(out)

    causal_conv1d_update.attnx_replaces = original
    return causal_conv1d_update
_replaced: dict = {}  # (module, name) -> the function attnx replaced


def register_delta_rule():
    """Run the linear-attention layers of transformers' hybrid models on attnx.

    Returns
    -------
    list of str
        The names of the modeling modules changed (those the installed
        transformers has).

    Raises
    ------
    ImportError
        When transformers is not installed.

    See Also
    --------
    unregister_delta_rule : Puts transformers' functions back.
    chunk_gated_delta_rule : One of the operators that take their place.

    Notes
    -----
    The module-level functions that the layers of Qwen3-Next, Qwen3.5
    (dense and MoE), OLMo hybrid and Kimi Linear call
    (``torch_chunk_gated_delta_rule``, ``torch_recurrent_gated_delta_rule``,
    ``chunk_kimi_delta_attention``, ``recurrent_kimi_delta_attention``) are
    replaced by `chunk_gated_delta_rule`, `fused_recurrent_gated_delta_rule`,
    `chunk_kda` and `fused_recurrent_kda`: prefill, decoding with the cache
    and training run on attnx. Models built before or after the call are
    affected alike. The decoding step of these layers' depthwise causal
    conv1d (``causal_conv1d_update``) runs on attnx's kernel too, when no
    autograd graph is built (float32 and float64; other calls go to
    transformers' function); its prefill form stays torch's.

    Examples
    --------
    >>> import torch, attnx.torch
    >>> from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    >>> attnx.torch.register_delta_rule()
    ['transformers.models.qwen3_next.modeling_qwen3_next', ...]
    >>> config = Qwen3NextConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
    ...     moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=2,
    ...     num_experts_per_tok=1, num_hidden_layers=2,
    ...     layer_types=["linear_attention", "full_attention"],
    ...     num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    ...     linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
    ...     linear_value_head_dim=8)
    >>> model = Qwen3NextForCausalLM(config)
    >>> model(torch.randint(0, 64, (1, 5))).logits.shape
    torch.Size([1, 5, 64])
    >>> attnx.torch.unregister_delta_rule()
    """
    import importlib

    changed = []
    for family in _HF_MODULES:
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        for name, replacement in _HF_FUNCTIONS.items():
            if hasattr(module, name) and (module.__name__, name) not in _replaced:
                _replaced[(module.__name__, name)] = getattr(module, name)
                setattr(module, name, replacement)
        name = "causal_conv1d_update"
        if hasattr(module, name) and (module.__name__, name) not in _replaced:
            _replaced[(module.__name__, name)] = getattr(module, name)
            setattr(module, name, _conv1d_update_for(getattr(module, name)))
        changed.append(module.__name__)
    return changed


def unregister_delta_rule():
    """Undo `register_delta_rule`: transformers' own functions again.

    Returns
    -------
    None

    Raises
    ------
    None
        This function does not raise.

    See Also
    --------
    register_delta_rule : What this undoes.

    Notes
    -----
    Calling it without a registration in place does nothing.

    Examples
    --------
    >>> import attnx.torch
    >>> from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next
    >>> original = qwen3_next.torch_chunk_gated_delta_rule
    >>> _ = attnx.torch.register_delta_rule()
    >>> qwen3_next.torch_chunk_gated_delta_rule is attnx.torch.chunk_gated_delta_rule
    True
    >>> attnx.torch.unregister_delta_rule()
    >>> qwen3_next.torch_chunk_gated_delta_rule is original
    True
    """
    import sys

    for (module_name, name), original in list(_replaced.items()):
        setattr(sys.modules[module_name], name, original)
        del _replaced[(module_name, name)]
