"""The delta rule (docs/delta_rule.md): DeltaNet, Gated DeltaNet and Kimi
Delta Attention, forward, backward and decoding.

Per head, a state S (d_k, d_v) and per token t (q_t and k_t L2-normalised
first with ``qk_l2norm``, q_t times ``scale``)::

    S <- a_t S              a_t = exp(g_t): a scalar (Gated DeltaNet), a
                            diagonal over the d_k channels (Kimi Delta
                            Attention), 1 without g (DeltaNet)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t

The kernels are attnx._C.delta_rule and delta_rule_backward (csrc/delta.c);
this module resolves the options: grouped value heads become broadcasting,
the gate's kind is read from its shape.
"""
import math
from collections import namedtuple

import numpy as np

from . import _C
from ._grad import grad_dtype, register_vjp, sum_to_shape

DeltaRuleGradients = namedtuple("DeltaRuleGradients", "q k v beta g state",
                                defaults=(None, None, None, None, None, None))
DeltaRuleGradients.__doc__ = """Gradients of sum(dout * out) (plus sum(grad_state * final
state) when a grad_state is given) with respect to a delta rule call's inputs.

Each field has the shape and dtype of its input (summed over the axes along
which that input was broadcast); ``g`` is None without a gate, ``state``
None without an ``initial_state``."""

_METHODS = ("chunk", "recurrent")


class DeltaRuleState:
    """The state the delta rule carries between calls, returned by
    ``return_state=True`` and taken back by ``initial_state=`` (which never
    writes it).

    * ``S``: array (..., H_v, d_k, d_v), the state after the tokens seen,
      in the dtype the calls compute in (float32 for float16 inputs).

    ``state.step(q, k, v, beta, g=None, out=None)`` decodes in place: it
    returns what ``delta_rule_attention(q, k, v, beta, g, initial_state=state,
    method="recurrent", ...)`` returns, with the options of the call that
    made the state (``scale``, ``qk_l2norm``), and updates ``S`` where it
    lies, allocating nothing but the output. ``S`` must stay a writeable
    C-contiguous array of the computing dtype with the step's batch shape
    (ValueError otherwise; TypeError for another dtype)."""

    __slots__ = ("S", "_scale", "_qk_l2norm")

    def __init__(self, S, scale=None, qk_l2norm=False):
        self.S = S
        self._scale = scale
        self._qk_l2norm = qk_l2norm

    def __repr__(self):
        return f"DeltaRuleState(S: shape {self.S.shape}, dtype {self.S.dtype})"

    def step(self, q, k, v, beta, g=None, *, out=None):
        call = _Call(q, k, v, beta, g, self.S, self._scale)
        S = call.split(self.S, 3)
        result = _C.delta_rule(call.q, call.k, call.v, call.beta, call.g_scalar, call.g_channel, S,
                               call.split(out, 3), False, True, call.scale, self._qk_l2norm,
                               True, 1)
        return call.merge(result, 3) if out is None else out


def _check_chunk(chunk):
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)):
        raise TypeError(f"chunk must be a positive integer, got {chunk!r}")
    if chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk}")
    return int(chunk)


def _check_method(method):
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    return method == "recurrent"


def _check_flag(value, name):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def _shape(x, name):
    if x is None:
        return None
    try:
        return np.shape(x)
    except Exception as error:  # ragged lists and the like
        raise TypeError(f"{name} must be an array, got {type(x).__name__}") from error


class _Call:
    """The arrays of one call as the kernels take them: grouped value heads
    (q, k with H_k heads on axis -3, v with H_v = G H_k) split into
    (H_k, G) so that broadcasting shares each key head with its G
    consecutive value heads; the gate as scalar or per channel."""

    def __init__(self, q, k, v, beta, g, initial_state, scale):
        shapes = {name: _shape(x, name) for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta))}
        for name, shape in shapes.items():
            if shape is None:
                raise TypeError(f"{name} is required, got None")
            if len(shape) < (1 if name == "beta" else 2):
                raise ValueError(f"{name} must have shape (..., n{'' if name == 'beta' else ', d'}),"
                                 f" got {shape}")
        q_shape, k_shape, v_shape = shapes["q"], shapes["k"], shapes["v"]
        d_k = q_shape[-1]
        self.groups = 1
        if len(q_shape) >= 3 and len(k_shape) >= 3 and len(v_shape) >= 3:
            h_k, h_v = q_shape[-3], v_shape[-3]
            if k_shape[-3] == h_k and h_k > 1 and h_v != h_k:
                if h_v % h_k:
                    raise ValueError(f"v has {h_v} heads (axis -3), not a multiple of the {h_k} "
                                     f"heads of q and k")
                self.groups, self.key_heads = h_v // h_k, h_k
        g_shape = _shape(g, "g")
        self.g_channel_kind = g_shape is not None and len(g_shape) == len(shapes["beta"]) + 1
        if g_shape is not None and self.g_channel_kind and g_shape[-1] != d_k:
            raise ValueError(f"g must have shape (..., n) like beta, or (..., n, d_k) with d_k = "
                             f"{d_k} (q's last axis), got {g_shape}")
        if scale is None:
            self.scale = 1 / math.sqrt(d_k) if d_k else 1.0
        else:
            try:
                self.scale = float(scale)
            except (TypeError, ValueError) as error:
                raise TypeError(f"scale must be a number, got {scale!r}") from error
            if not (math.isfinite(self.scale) and self.scale > 0):
                raise ValueError(f"scale must be a positive finite number, got {scale!r}")
        self.q = self.split(q, 3, key=True)
        self.k = self.split(k, 3, key=True)
        self.v = self.split(v, 3)
        self.beta = self.split(beta, 2)
        gate = self.split(g, 3 if self.g_channel_kind else 2)
        self.g_scalar = None if self.g_channel_kind else gate
        self.g_channel = gate if self.g_channel_kind else None
        self.initial_state = initial_state

    def split_shape(self, shape, axis, key=False):
        """shape with its head axis (-axis) split into (H_k, G), or (H_k, 1)
        for q and k (key=True); unchanged without groups."""
        if self.groups == 1 or len(shape) < axis:
            return shape
        heads = shape[-axis]
        if heads == 1:
            pair = (1, 1)
        elif key:
            pair = (heads, 1)
        elif heads == self.groups * self.key_heads:
            pair = (self.key_heads, self.groups)
        else:
            return shape  # the kernel's broadcasting names the mismatch
        return shape[:-axis] + pair + shape[len(shape) - axis + 1:]

    def split(self, x, axis, key=False):
        """x viewed with split_shape"""
        if x is None or self.groups == 1:
            return x
        x = x if isinstance(x, np.ndarray) else np.asarray(x)
        return x.reshape(self.split_shape(x.shape, axis, key))

    def merge(self, x, axis):
        """the kernel's (..., H_k, G, ...) result as (..., H_v, ...)"""
        if x is None or self.groups == 1:
            return x
        return x.reshape(x.shape[:-axis - 1] + (x.shape[-axis - 1] * x.shape[-axis],) +
                         x.shape[x.ndim - axis + 1:])


def _state_array(initial_state):
    if initial_state is None:
        return None
    if isinstance(initial_state, DeltaRuleState):
        return initial_state.S
    return initial_state


def delta_rule_attention(q, k, v, beta, g=None, *, scale=None, qk_l2norm=False, method="chunk",
                         chunk=64, initial_state=None, return_state=False, out=None):
    """The delta rule (DeltaNet; Gated DeltaNet with a scalar gate g; Kimi
    Delta Attention with a gate per key channel).

    q, k: (..., n, d_k); v: (..., n, d_v); beta: (..., n); g: None, (..., n)
    (the shape of beta: one log decay per token) or (..., n, d_k) (beta's
    shape plus d_k: one per key channel); exp(g) multiplies the state, so
    g <= 0 decays it. Leading axes broadcast; value heads may also be a
    multiple G of the key heads (axis -3: q, k (..., H_k, n, d_k), v
    (..., G H_k, n, d_v)), each key head serving G consecutive value heads
    as transformers' models do. Per token, after the optional L2
    normalisation of q and k (``qk_l2norm``, x / sqrt(|x|^2 + 1e-6)) and q
    times ``scale`` (default 1/sqrt(d_k))::

        S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

    from S = ``initial_state`` (an array (..., H_v, d_k, d_v) or a
    DeltaRuleState) or zeros. ``method="chunk"`` (chunks of ``chunk``
    tokens in the WY representation, GEMMs) and ``"recurrent"`` (the token
    loop) agree to rounding. Returns out (..., n, d_v), or (out, state)
    with ``return_state=True``: a DeltaRuleState that continues the
    sequence exactly and decodes with ``state.step``.
    """
    recurrent = _check_method(method)
    chunk = _check_chunk(chunk)
    qk_l2norm = _check_flag(qk_l2norm, "qk_l2norm")
    return_state = _check_flag(return_state, "return_state")
    S0 = _state_array(initial_state)
    call = _Call(q, k, v, beta, g, S0, scale)
    if out is not None and not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
    result = _C.delta_rule(call.q, call.k, call.v, call.beta, call.g_scalar, call.g_channel,
                           call.split(S0, 3), call.split(out, 3), return_state, False, call.scale,
                           qk_l2norm, recurrent, chunk)
    if not return_state:
        return call.merge(result, 3) if out is None else out
    o, S = result
    o = call.merge(o, 3) if out is None else out
    return o, DeltaRuleState(call.merge(S, 3), scale, qk_l2norm)


def _deliver(grad, x, call, axis, key=False):
    """grad on the kernel's broadcast shape, reduced to x's shape and dtype"""
    x_shape = np.shape(x)
    reduced = sum_to_shape(grad, call.split_shape(x_shape, axis, key)).reshape(x_shape)
    return reduced.astype(grad_dtype(x, grad.dtype), copy=False)


def delta_rule_attention_backward(dout, q, k, v, beta, g=None, *, scale=None, qk_l2norm=False,
                                  method="chunk", chunk=64, initial_state=None, grad_state=None):
    """Gradients of ``sum(dout * out)`` (plus ``sum(grad_state * S)`` for
    the final state S, when given) with respect to the inputs of
    ``delta_rule_attention(q, k, v, beta, g, ...)`` with the same options.
    Returns :class:`DeltaRuleGradients` (q, k, v, beta, g, state).

    Computed chunk by chunk whatever ``method`` (which only must be valid):
    the chunks run forward once keeping the state at each chunk border, then
    in reverse. ``grad_state`` (..., H_v, d_k, d_v) is the gradient arriving
    at the returned state, so backpropagation through pieces (each piece's
    ``state`` gradient the previous piece's ``grad_state``) equals one call.
    """
    _check_method(method)
    chunk = _check_chunk(chunk)
    qk_l2norm = _check_flag(qk_l2norm, "qk_l2norm")
    S0 = _state_array(initial_state)
    if dout is None:
        raise TypeError("dout is required, got None")
    call = _Call(q, k, v, beta, g, S0, scale)
    dq, dk, dv, dbeta, dg, dS = _C.delta_rule_backward(
        call.split(dout, 3), call.q, call.k, call.v, call.beta, call.g_scalar, call.g_channel,
        call.split(S0, 3), call.split(grad_state, 3), call.scale, qk_l2norm, chunk)
    return DeltaRuleGradients(
        q=_deliver(dq, q, call, 3, key=True),
        k=_deliver(dk, k, call, 3, key=True),
        v=_deliver(dv, v, call, 3),
        beta=_deliver(dbeta, beta, call, 2),
        g=None if g is None else _deliver(dg, g, call, 3 if call.g_channel_kind else 2),
        state=None if S0 is None else _deliver(dS, S0, call, 3),
    )


def _vjp_rule(q, k, v, beta, g=None, **options):
    return_state = options.get("return_state", False)
    result = delta_rule_attention(q, k, v, beta, g, **options)
    backward_options = {name: value for name, value in options.items()
                        if name not in ("return_state", "out")}

    def pullback(dout, grad_state=None):
        if isinstance(grad_state, DeltaRuleState):
            grad_state = grad_state.S
        return delta_rule_attention_backward(dout, q, k, v, beta, g, grad_state=grad_state,
                                             **backward_options)

    return result, pullback


register_vjp(delta_rule_attention, _vjp_rule)