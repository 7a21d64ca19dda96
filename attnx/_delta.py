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
DeltaRuleGradients.__doc__ = """Gradients of a delta rule call (`delta_rule_attention_backward`).

A named tuple, returned by `delta_rule_attention_backward` and by the
pullback of ``vjp(delta_rule_attention, ...)``.

Parameters
----------
q, k, v, beta : ndarray
    The gradients of the queries, keys, values and write strengths.
g : ndarray or None
    Of the gate; None for a call without one.
state : ndarray or None
    Of the ``initial_state`` (its ``S`` for a `DeltaRuleState`); None
    without one.

Raises
------
TypeError
    When built with unknown fields (as any named tuple).

See Also
--------
delta_rule_attention_backward : Returns these.
vjp : Pairs the forward with its pullback.

Notes
-----
The gradients of ``sum(dout * out)``, plus ``sum(grad_state * S)`` for
the final state S when a ``grad_state`` is given. Each field has the
shape and dtype of its input, summed over the axes along which that input
was broadcast.

Examples
--------
>>> import numpy as np, attnx
>>> rng = np.random.default_rng(0)
>>> q, k, v = (rng.standard_normal((2, 6, 4)) for _ in range(3))
>>> beta = np.full((2, 6), 0.5)
>>> grads = attnx.delta_rule_attention_backward(np.ones((2, 6, 4)), q, k, v, beta)
>>> grads._fields
('q', 'k', 'v', 'beta', 'g', 'state')
>>> grads.beta.shape, grads.g is None
((2, 6), True)
"""

_METHODS = ("chunk", "recurrent")


class DeltaRuleState:
    """The state the delta rule carries between calls.

    Returned by ``delta_rule_attention(..., return_state=True)`` and taken
    back by ``initial_state=`` (which never writes it), or advanced in place
    by `step`.

    Parameters
    ----------
    S : ndarray, shape (..., H_v, d_k, d_v)
        The state after the tokens seen, in the dtype the calls compute in
        (float32 for float16 inputs).
    scale : float, optional
        The query scale of the call that made the state (default
        ``1/sqrt(d_k)``), which `step` repeats.
    qk_l2norm : bool, default False
        Whether that call L2-normalised q and k, which `step` repeats.

    Methods
    -------
    step(q, k, v, beta, g=None, out=None)
        Decode in place: the outputs of new tokens, the state advanced
        over them.

    Raises
    ------
    ValueError
        From `step`, when ``S`` is no longer a writeable C-contiguous array
        with the batch shape of the step's inputs, or the inputs' shapes
        do not match it.
    TypeError
        From `step`, when ``S`` is not of the computing dtype.

    See Also
    --------
    delta_rule_attention : Returns a state with ``return_state=True``.

    Notes
    -----
    ``state.step(q, k, v, beta, g)`` returns what ``delta_rule_attention(q,
    k, v, beta, g, initial_state=state, method="recurrent")`` returns, with
    the options of the call that made the state, and updates ``S`` where it
    lies, allocating nothing but the output (nothing with ``out=``). One
    token reads and writes each head's state once, the heads spread over
    attnx's threads.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 8, 4)) for _ in range(3))
    >>> beta, g = rng.uniform(0, 1, (2, 8)), -rng.uniform(0, 0.5, (2, 8))
    >>> whole = attnx.delta_rule_attention(q, k, v, beta, g, qk_l2norm=True)
    >>> o, state = attnx.delta_rule_attention(q[:, :6], k[:, :6], v[:, :6], beta[:, :6],
    ...                                       g[:, :6], qk_l2norm=True, return_state=True)
    >>> state
    DeltaRuleState(S: shape (2, 4, 4), dtype float64)
    >>> steps = [state.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], beta[:, t:t + 1],
    ...                     g[:, t:t + 1]) for t in (6, 7)]
    >>> np.allclose(np.concatenate([o] + steps, axis=1), whole)
    True
    """

    __slots__ = ("S", "_scale", "_qk_l2norm")

    def __init__(self, S, scale=None, qk_l2norm=False):
        self.S = S
        self._scale = scale
        self._qk_l2norm = qk_l2norm

    def __repr__(self):
        return f"DeltaRuleState(S: shape {self.S.shape}, dtype {self.S.dtype})"

    def step(self, q, k, v, beta, g=None, *, out=None):
        """Decode in place: the outputs of new tokens, the state advanced over them.

        Parameters
        ----------
        q, k : array_like, shape (..., t, d_k)
            The new tokens' queries and keys (t tokens, usually 1).
        v : array_like, shape (..., t, d_v)
            Their values.
        beta : array_like, shape (..., t)
            Their write strengths.
        g : array_like, shape (..., t) or (..., t, d_k), optional
            Their log decays, of the kind the sequence used.
        out : ndarray, shape (..., t, d_v), optional
            Receives the result.

        Returns
        -------
        ndarray, shape (..., t, d_v)
            What ``delta_rule_attention(q, k, v, beta, g, initial_state=self,
            method="recurrent")`` with the options of the call that made
            the state returns.

        Raises
        ------
        ValueError
            Shapes that do not match ``S``, or ``S`` no longer a writeable
            C-contiguous array.
        TypeError
            ``S`` not of the computing dtype.

        See Also
        --------
        delta_rule_attention : The call with ``initial_state=``, which
            leaves the state as it is.

        Notes
        -----
        ``S`` is updated where it lies; nothing but the output is
        allocated.

        Examples
        --------
        >>> import numpy as np, attnx
        >>> rng = np.random.default_rng(1)
        >>> q, k, v = (rng.standard_normal((3, 4)) for _ in range(3))
        >>> beta = np.full(3, 0.5)
        >>> _, state = attnx.delta_rule_attention(q[:2], k[:2], v[:2], beta[:2],
        ...                                       return_state=True)
        >>> before = state.S.copy()
        >>> o = state.step(q[2:], k[2:], v[2:], beta[2:])
        >>> np.allclose(o, attnx.delta_rule_attention(q[2:], k[2:], v[2:], beta[2:],
        ...                                           initial_state=before))
        True
        """
        call = _Call(q, k, v, beta, g, self.S, self._scale)
        S = call.split(self.S, 3)
        result = _C.delta_rule(call.q, call.k, call.v, call.beta, g_scalar=call.g_scalar,
                               g_channel=call.g_channel, initial_state=S, out=call.split(out, 3),
                               in_place=True, scale=call.scale, l2norm=self._qk_l2norm,
                               recurrent=True, chunk=1)
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
    if isinstance(x, np.ndarray):
        return x.shape  # what np.shape returns, without its dispatch (a decoding step's cost)
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
        q_shape, k_shape, v_shape = _shape(q, "q"), _shape(k, "k"), _shape(v, "v")
        beta_shape = _shape(beta, "beta")
        for name, shape, least in (("q", q_shape, 2), ("k", k_shape, 2), ("v", v_shape, 2),
                                   ("beta", beta_shape, 1)):
            if shape is None:
                raise TypeError(f"{name} is required, got None")
            if len(shape) < least:
                raise ValueError(f"{name} must have shape (..., n{'' if name == 'beta' else ', d'}),"
                                 f" got {shape}")
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
        self.g_channel_kind = g_shape is not None and len(g_shape) == len(beta_shape) + 1
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
        if self.groups == 1:  # as split would leave them (a decoding step's cost)
            self.q, self.k, self.v, self.beta, gate = q, k, v, beta, g
        else:
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
    """The delta rule: DeltaNet, Gated DeltaNet and Kimi Delta Attention.

    Parameters
    ----------
    q, k : array_like, shape (..., n, d_k)
        Queries and keys.
    v : array_like, shape (..., n, d_v)
        Values. Leading axes of all inputs broadcast; value heads may also
        be a multiple G of the key heads (axis -3: q, k ``(..., H_k, n,
        d_k)``, v ``(..., G H_k, n, d_v)``), each key head serving G
        consecutive value heads, as transformers' models do.
    beta : array_like, shape (..., n)
        The write strength of each token (usually in (0, 1)).
    g : array_like, shape (..., n) or (..., n, d_k), optional
        The log decay: one per token (beta's shape: Gated DeltaNet) or one
        per token and key channel (Kimi Delta Attention); ``exp(g)``
        multiplies the state, so g <= 0 decays it. None: DeltaNet.
    scale : float, optional
        Multiplies q; default ``1/sqrt(d_k)``.
    qk_l2norm : bool, default False
        L2-normalise q and k first, ``x / sqrt(|x|^2 + 1e-6)`` (transformers'
        ``use_qk_l2norm_in_kernel``).
    method : {"chunk", "recurrent"}, default "chunk"
        "chunk": chunks of ``chunk`` tokens in the WY representation, GEMMs;
        "recurrent": the token loop. They agree to rounding.
    chunk : int, default 64
        The chunk length of the "chunk" method.
    initial_state : DeltaRuleState or array_like, shape (..., H_v, d_k, d_v), optional
        The state to start from (never written); zeros by default.
    return_state : bool, default False
        Also return the state after this call.
    out : ndarray, optional
        Receives the result (shape (..., n, d_v), the result's dtype).

    Returns
    -------
    out : ndarray, shape (..., n, d_v)
        The output.
    state : DeltaRuleState
        Only with ``return_state=True``: continues the sequence exactly and
        decodes with `DeltaRuleState.step`.

    Raises
    ------
    ValueError
        Shapes that do not match or broadcast, value heads not a multiple
        of the key heads, a g of neither shape, an unknown method, a chunk
        below 1, a scale that is not positive and finite.
    TypeError
        A missing input, complex, object or string inputs, a non-integer
        chunk, flags that are not booleans.

    See Also
    --------
    delta_rule_attention_backward : The gradients.
    DeltaRuleState : The streaming and decoding state.
    attnx.torch.chunk_gated_delta_rule : The same as a PyTorch operator.

    Notes
    -----
    Per head, a state S (d_k, d_v) and per token t, after the optional
    normalisation and q times ``scale``::

        S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t

    with ``exp(g_t)`` a scalar, a diagonal over the d_k channels, or 1.
    Calls over pieces of a sequence, each continuing the state of the one
    before, give what one call over the whole sequence gives. dtypes,
    strided inputs and errors follow attnx's conventions
    (docs/delta_rule.md).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((6, 3)) for _ in range(3))
    >>> beta, g = rng.uniform(0, 1, 6), -rng.uniform(0, 1, 6)
    >>> o = attnx.delta_rule_attention(q, k, v, beta, g, scale=1.0)
    >>> S, rows = np.zeros((3, 3)), []
    >>> for t in range(6):                       # the recurrence, token by token
    ...     S = np.exp(g[t]) * S
    ...     S = S + np.outer(k[t], beta[t] * (v[t] - S.T @ k[t]))
    ...     rows.append(S.T @ q[t])
    >>> np.allclose(o, rows)
    True
    >>> np.allclose(o, attnx.delta_rule_attention(q, k, v, beta, g, scale=1.0, chunk=4))
    True
    """
    recurrent = _check_method(method)
    chunk = _check_chunk(chunk)
    qk_l2norm = _check_flag(qk_l2norm, "qk_l2norm")
    return_state = _check_flag(return_state, "return_state")
    S0 = _state_array(initial_state)
    call = _Call(q, k, v, beta, g, S0, scale)
    if out is not None and not isinstance(out, np.ndarray):
        raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
    result = _C.delta_rule(call.q, call.k, call.v, call.beta, g_scalar=call.g_scalar,
                           g_channel=call.g_channel, initial_state=call.split(S0, 3),
                           out=call.split(out, 3), want_state=return_state, scale=call.scale,
                           l2norm=qk_l2norm, recurrent=recurrent, chunk=chunk)
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
    """Gradients of a `delta_rule_attention` call.

    Parameters
    ----------
    dout : array_like, shape (..., n, d_v)
        The gradient arriving at the output.
    q, k, v, beta, g, scale, qk_l2norm, chunk, initial_state
        As given to `delta_rule_attention`.
    method : {"chunk", "recurrent"}, default "chunk"
        Must be valid; the backward is chunked whatever the forward's
        method.
    grad_state : array_like, shape (..., H_v, d_k, d_v), optional
        The gradient arriving at the returned final state.

    Returns
    -------
    DeltaRuleGradients
        The gradients of ``sum(dout * out)`` (plus ``sum(grad_state * S)``
        for the final state S) with respect to q, k, v, beta, g and the
        initial state.

    Raises
    ------
    ValueError
        As `delta_rule_attention`, and a dout or grad_state of the wrong
        shape.
    TypeError
        As `delta_rule_attention`, and a missing dout.

    See Also
    --------
    delta_rule_attention : The forward.
    vjp : The forward and this as a pullback.

    Notes
    -----
    The chunks run forward once, keeping the state at each chunk border
    and each chunk's small products, then in reverse, carrying the state's
    gradient. With ``grad_state``, backpropagation through pieces (each
    piece's ``state`` gradient the previous piece's ``grad_state``) equals
    one call.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((5, 3)) for _ in range(3))
    >>> beta, g = rng.uniform(0, 1, 5), -rng.uniform(0, 1, 5)
    >>> dout = rng.standard_normal((5, 3))
    >>> grads = attnx.delta_rule_attention_backward(dout, q, k, v, beta, g)
    >>> loss = lambda b: np.sum(dout * attnx.delta_rule_attention(q, k, v, b, g))
    >>> e = 1e-6 * np.eye(5)[2]                  # a central difference in beta[2]
    >>> bool(np.isclose((loss(beta + e) - loss(beta - e)) / 2e-6, grads.beta[2]))
    True
    """
    _check_method(method)
    chunk = _check_chunk(chunk)
    qk_l2norm = _check_flag(qk_l2norm, "qk_l2norm")
    S0 = _state_array(initial_state)
    if dout is None:
        raise TypeError("dout is required, got None")
    call = _Call(q, k, v, beta, g, S0, scale)
    dq, dk, dv, dbeta, dg, dS = _C.delta_rule_backward(
        call.split(dout, 3), call.q, call.k, call.v, call.beta, g_scalar=call.g_scalar,
        g_channel=call.g_channel, initial_state=call.split(S0, 3),
        grad_state=call.split(grad_state, 3), scale=call.scale, l2norm=qk_l2norm, chunk=chunk)
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