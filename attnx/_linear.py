"""Kernelised ("linear") attention (docs/linear.md).

    o_i = phi(q_i) S / max(phi(q_i) . z, eps),  S = sum_j psi(k_j) v_j^T,  z = sum_j psi(k_j)

over the keys query i sees, with non-negative features phi (queries) and
psi (keys) of size r. Every front end here is a thin wrapper around one C
kernel, attnx._C.linear_attention, which validates the arguments, computes
the feature maps and runs the chosen method with the GIL released. Only
Python callables as feature maps and the random draw of Performer
projections run in Python.
"""
import math
import operator
import os

import numpy as np

from . import _C, _dwc


class LinearAttentionState:
    """The state kernelised attention carries between calls (streaming,
    decoding), returned by ``return_state=True`` and taken back by
    ``initial_state=``:

    * ``S``: array (..., r, e), ``sum_j psi(k_j) v_j^T`` over the keys seen;
    * ``z``: array (..., r), ``sum_j psi(k_j)``;
    * ``offset``: int, how many key positions were consumed (cosFormer
      numbers the next call's positions after it).

    The arrays have the dtype the calls compute in (float32 for float16
    inputs) and the broadcast batch shape of the calls. FAVOR+ key features
    are stored divided by the constant ``exp(c)``, ``c = max_f |W_f|^2 / 2``,
    so a state only continues calls with the same feature map and
    projection.

    Passing a state as ``initial_state=`` never writes it. For decoding,
    ``state.step(q, k, v, out=None)`` is the in-place alternative: it
    returns what ``linear_attention(q, k, v, causal=True,
    initial_state=state, return_state=True)`` (or the front end that made
    the state) returns as output, with that call's options (feature map,
    projection, eps, p, M), but absorbs the new keys and values into this
    object's own ``S`` and ``z`` in place and advances ``offset``, so a
    step allocates nothing but its output (none with ``out=``, nor when
    the output of the state's last step is no longer held anywhere: the
    new one takes its memory). Any number of new tokens per step.

    A step of one token holds its key back from ``S`` (``z`` takes it at
    once) and adds the keys a head holds into ``S`` 4 at a time, the heads
    taking turns; its output counts them all. Most steps then only read
    ``S`` instead of reading and writing it, which halves a step's memory
    traffic. Reading ``state.S`` (or passing the state as
    ``initial_state=``, or a step of several tokens) first adds every held
    key in, in order, giving the state the RNN form would have: ``S`` is
    always exact when read. The state owns its arrays: an array taken from
    it earlier changes with it (copy it to keep a snapshot), but between
    reads of ``state.S`` it lags by the held keys. Assigning ``state.S``
    replaces the sum of every key so far, held ones included. Only a state
    returned by a causal call with ``return_state=True`` can step, while
    ``S`` and ``z`` stay writeable, C-contiguous arrays of the computing
    dtype with the batch shape of the step's q, k, v; otherwise ``step``
    raises ValueError (TypeError for another dtype)."""

    __slots__ = ("_S", "z", "offset", "_options", "_features", "_pending", "_tick", "_out")

    def __init__(self, S, z, offset):
        self._S = S
        self.z = z
        self.offset = offset
        # what step() needs to repeat the call that made the state (set by
        # _attend): (variant, feature_map, causal, eps, projection, p, M),
        # and a callable feature map applied in Python; None: cannot step
        self._options = None
        self._features = None
        # the keys single-token steps hold back from S: two arrays
        # (..., 4, r) and (..., 4, e) made by the first such step, and the
        # steps since S last held every key (0: it holds them all)
        self._pending = None
        self._tick = 0
        # the output of the last single-token step, whose memory the next
        # one takes when nothing else holds it any more
        self._out = None

    @property
    def S(self):
        """sum_j psi(k_j) v_j^T over every key so far (held keys added in)."""
        if self._tick:
            _C.linear_flush(self)
        return self._S

    @S.setter
    def S(self, value):
        self._S = value
        self._tick = 0

    def __repr__(self):
        return (f"LinearAttentionState(S: {self.S.dtype}{self.S.shape}, "
                f"z: {self.z.dtype}{self.z.shape}, offset={self.offset})")


# front end -> (kernel variant, fixed feature map or None for feature_map=)
_KERNEL = {
    "linear": ("linear", None),
    "cosformer": ("cosformer", None),
    "focused": ("linear", "focused"),
    "taylor": ("linear", "taylor"),
    "performer": ("linear", "favor"),
    "efficient": ("efficient", None),
}


def _attend(front, a, normalise=True):
    """Run the kernel for front end `front` with its arguments `a` (by
    name; options a front end does not have take their defaults).
    normalise=False returns phi(q_i) S undivided (similarities)."""
    variant, feature_map = _KERNEL[front]
    if feature_map is None:
        feature_map = a.get("feature_map", "elu")
    projection = a.get("projection")
    if front == "performer":
        projection = _performer_projection(a["q"], projection, a["num_features"], a["seed"])
    return _run(variant, feature_map, a["q"], a["k"], a["v"], a.get("causal", False),
                a.get("key_mask"), a.get("mask"), a.get("window"), a.get("method"),
                a.get("chunk_size"), a.get("eps", 1e-6), projection, a.get("p", 3), a.get("M"),
                a.get("initial_state"), a.get("return_state", False), a.get("out"), normalise)


def _run(variant, feature_map, q, k, v, causal, key_mask, mask, window, method, chunk_size, eps,
         projection, p, M, initial_state, return_state, out, normalise=True):
    """The kernel with every option by position (the front ends' common
    path, kept short: a decoding call through linear_attention spends
    about a microsecond here)."""
    features = None
    if callable(feature_map):
        features = feature_map
        q, k = _callable_features(feature_map, q, k, v)
        feature_map = "identity"
    result = _C.linear_attention(q, k, v, variant, feature_map, causal, key_mask, mask, window,
                                 method, chunk_size, eps, projection, p, M, initial_state,
                                 return_state, out, normalise)
    if not return_state:
        return result
    out, S, z, offset = result
    state = LinearAttentionState(S, z, offset)
    if normalise:
        # the options of this call, for state.step(); the projection in the
        # state's dtype, so that a step converts nothing
        if projection is not None:
            projection = np.asarray(projection, dtype=S.dtype)
        state._options = (variant, feature_map, causal, eps, projection, p, M)
        state._features = features
    return out, state


def _result_dtype(*arrays):
    dtype = np.result_type(*arrays)
    if dtype.kind not in "fiub":
        raise TypeError(f"q, k, v must hold real numbers (float, int or bool), got dtype {dtype}")
    return dtype if dtype.kind == "f" else np.dtype(np.float64)


def _callable_features(feature_map, q, k, v):
    """phi(q), phi(k) from a user's callable, checked (shape, sign) and cast
    to the dtype of the call's result; they enter the kernel as features."""
    dtype = _result_dtype(np.asarray(q), np.asarray(k), np.asarray(v))
    phi_q = _checked_features(feature_map, q, "q", dtype)
    phi_k = _checked_features(feature_map, k, "k", dtype)
    if phi_q.shape[-1] != phi_k.shape[-1]:
        raise ValueError(f"feature_map callable returned {phi_q.shape[-1]} features for q but "
                         f"{phi_k.shape[-1]} for k; they must agree")
    return phi_q, phi_k


def _checked_features(feature_map, x, name, dtype):
    x = np.asarray(x, dtype=dtype)
    features = np.asarray(feature_map(x))
    if features.dtype.kind not in "fiub":
        raise TypeError(f"feature_map callable returned dtype {features.dtype} for {name}; "
                        "features must be real numbers")
    if x.ndim < 1 or features.shape[:-1] != x.shape[:-1]:
        raise ValueError(f"feature_map callable returned shape {features.shape} for {name} of "
                         f"shape {x.shape}; expected {x.shape[:-1]} + (r,)")
    if np.any(features < 0):
        raise ValueError(f"feature_map callable returned negative features for {name}; "
                         "features must be non-negative")
    return features.astype(dtype, copy=False)


# state.step is a C method (csrc/py_linear.c): a decoding step is one C call
LinearAttentionState.step = _C.state_class(LinearAttentionState, _callable_features)


def _performer_projection(q, projection, num_features, seed):
    if projection is not None:
        if seed is not None:
            raise ValueError("performer_attention: give projection= or seed= (to draw one), not both")
        # a projection of the wrong rank is left to the kernel's shape check
        if (num_features is not None and np.ndim(projection) >= 1
                and np.shape(projection)[0] != num_features):
            raise ValueError(f"projection has {np.shape(projection)[0]} rows but "
                             f"num_features={num_features}")
        return projection
    if np.ndim(q) < 2:  # the projection's width is q's last axis
        raise ValueError(f"q must have at least 2 dimensions, got shape {np.shape(q)}")
    d = np.shape(q)[-1]
    if num_features is None:
        num_features = max(1, round(d * math.log(d))) if d > 0 else 1
    return random_features(num_features, d, seed=seed)


def linear_attention(q, k, v, *, feature_map="elu", causal=False, key_mask=None, mask=None,
                     window=None, method=None, chunk_size=None, eps=1e-6, projection=None, p=3,
                     initial_state=None, return_state=False, out=None):
    """Kernelised attention: o_i = phi(q_i) S / max(phi(q_i) . z, eps) with
    S = sum_j psi(k_j) v_j^T, z = sum_j psi(k_j) over the visible keys; a row
    whose denominator is 0 gives zeros.

    q (..., n, d), k (..., m, d), v (..., m, e) -> (..., n, e); leading axes
    broadcast. feature_map: "elu" (elu(x) + 1, default), "relu", "softmax"
    (over the features), "taylor" ([1, x/|x|]), "focused" (f_p(relu(x)),
    power p=3), "favor" (Performer FAVOR+, needs projection= (r, d), see
    random_features), "identity" (the inputs are non-negative features), or
    a callable f(x) -> (..., r) non-negative numpy features.

    causal: False, True / "lower_right" (j <= i + m - n), "upper_left"
    (j <= i). key_mask: bool (..., m), False removes a key. mask (bool,
    broadcast to (..., n, m)) and window (w or (left, right)) select the
    quadratic method. method: "chunk" (default when causal; chunks of
    chunk_size, default 16 for 32 to 128 features, else 32, with a carried
    state), "recurrent" (one token at a time; the default for causal calls
    of at most 8 queries),
    "cumsum" (materialised prefix states, refused above 2 GiB per head),
    "quadratic" (explicit similarities in tiles). Non-causal calls default
    to two GEMM passes, psi(K)^T V then phi(Q) S.

    Streaming: return_state=True returns (out, LinearAttentionState);
    pass it as initial_state= to the next call: pieces (any lengths, one
    token at a time too) give what one call over the whole sequence gives.
    out: array receiving the result."""
    return _run("linear", feature_map, q, k, v, causal, key_mask, mask, window, method,
                chunk_size, eps, projection, p, None, initial_state, return_state, out)


def cosformer_attention(q, k, v, *, causal=False, key_mask=None, M=None, mask=None, window=None,
                        method=None, chunk_size=None, eps=1e-6, initial_state=None,
                        return_state=False, out=None):
    """cosFormer (Qin et al. 2022): s_ij = relu(q_i) . relu(k_j) cos(pi/2 (i - j) / M)
    with 1-based positions (queries 1..n, keys 1..m, shifted by the offset
    of a streaming state), computed as linear attention on the 2d features
    [relu(x) sin(theta_t), relu(x) cos(theta_t)], theta_t = pi/2 t / M.

    M defaults to max(n, m) and must be at least the largest position; a
    fixed M is required when streaming. Causal needs n == m. Other options
    as linear_attention."""
    return _attend("cosformer", locals())


def focused_linear_attention(q, k, v, p=3, *, causal=False, key_mask=None, mask=None,
                             window=None, method=None, chunk_size=None, eps=1e-6,
                             initial_state=None, return_state=False, out=None, dwc_weight=None,
                             spatial=None):
    """FLatten focused linear attention (Han et al. 2023): features
    f_p(relu(x)), f_p(y) = |y| y**p / |y**p| (norms over each head vector,
    power p > 0, a zero vector gives 0). Options as linear_attention.

    dwc_weight: FLatten's depthwise-convolution term, a depthwise
    convolution of v (zero padding, same length) added to the output: along
    the sequence with dwc_weight (e, ks), or over an image grid spatial=(H, W)
    (n = H * W tokens, row-major) with dwc_weight (e, kh, kw); odd kernel
    sizes, n == m (attnx/_dwc.py)."""
    options = dict(locals())
    dwc_weight, spatial = options.pop("dwc_weight"), options.pop("spatial")
    if dwc_weight is None:
        if spatial is not None:
            raise ValueError("spatial is given but dwc_weight is None")
        return _attend("focused", options)
    if return_state or initial_state is not None:
        raise ValueError("dwc_weight cannot be combined with streaming (initial_state, "
                         "return_state): the convolution looks at neighbours on both sides")
    result = _attend("focused", options)
    convolved = _dwc.add_depthwise_convolution(result, v, dwc_weight, spatial)
    if out is None:
        return convolved
    np.copyto(out, convolved, casting="same_kind")
    return out


def taylor_attention(q, k, v, *, causal=False, key_mask=None, mask=None, window=None,
                     method=None, chunk_size=None, eps=1e-6, initial_state=None,
                     return_state=False, out=None):
    """Taylor (first-order) attention: s_ij = 1 + cos(q_i, k_j), as linear
    attention on the features [1, x/|x|] (size d + 1; a zero vector gives
    [1, 0...]). Options as linear_attention."""
    return _attend("taylor", locals())


def performer_attention(q, k, v, projection=None, num_features=None, seed=None, *, causal=False,
                        key_mask=None, mask=None, window=None, method=None, chunk_size=None,
                        eps=1e-6, initial_state=None, return_state=False, out=None):
    """Performer FAVOR+ (Choromanski et al. 2021): an unbiased estimate of
    softmax attention with scale 1/sqrt(d) from positive random features
    r**-0.5 exp(W x~ - |x~|^2 / 2), x~ = d**-0.25 x.

    projection: W (r, d); when None, random_features(num_features, d,
    seed=seed) is drawn on every call (num_features defaults to
    round(d ln d)), so pass projection= (or seed=) for repeatable results
    and for streaming. Other options as linear_attention."""
    return _attend("performer", locals())


def efficient_attention(q, k, v, *, key_mask=None, causal=False, out=None):
    """Efficient attention (Shen et al. 2021): o = rho_q(Q) (rho_k(K)^T V)
    with rho_q the softmax of each query over its features and rho_k the
    softmax of each key feature over the (visible) keys. Weights sum to 1
    exactly; no eps. Non-causal only (causal=True raises ValueError: the
    key softmax runs over the whole sequence)."""
    return _attend("efficient", locals())


def random_features(r, d, seed=None):
    """An (r, d) FAVOR+ projection: orthogonal blocks of d rows from the
    Haar measure (QR of a d x d Gaussian with the signs of R's diagonal
    folded into Q; a plain QR is not uniform and biases the estimate), rows
    scaled by the norms of independent Gaussian d-vectors (chi-distributed,
    like the rows of a Gaussian matrix); r > d stacks independent blocks.
    seed: anything numpy.random.default_rng takes. Returns float64."""
    r, d = operator.index(r), operator.index(d)
    if r < 1 or d < 1:
        raise ValueError(f"random_features needs r >= 1 and d >= 1, got r={r}, d={d}")
    _check_projection_fits(r, d)
    rng = np.random.default_rng(seed)
    # the result is claimed before any QR runs, so a size that cannot be
    # allocated fails at once; blocks are written into it as they come
    projection = np.empty((r, d))
    for first in range(0, r, d):
        orthogonal, upper = np.linalg.qr(rng.standard_normal((d, d)))
        orthogonal *= np.where(np.diag(upper) < 0, -1.0, 1.0)
        projection[first:first + d] = orthogonal[:r - first]
    norms = np.linalg.norm(rng.standard_normal((r, d)), axis=1)
    projection *= norms[:, None]
    return projection


def _check_projection_fits(r, d):
    """Refuse an (r, d) projection that cannot fit, before any work: the
    result and the Gaussian draw for its row norms are r * d doubles each."""
    needed = 2 * r * d * 8
    if needed > np.iinfo(np.intp).max:
        raise ValueError(f"random_features(r={r}, d={d}): an ({r}, {d}) float64 projection "
                         f"is larger than this platform can address")
    try:  # physical memory where the platform reports it (not on Windows)
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return
    if memory > 0 and needed > memory:
        raise MemoryError(f"random_features(r={r}, d={d}) needs {needed / 2**30:.3g} GiB "
                          f"(the ({r}, {d}) float64 projection and its row-norm draw), more "
                          f"than this machine's {memory / 2**30:.3g} GiB of memory")


FRONT_ENDS = {
    "linear": linear_attention,
    "cosformer": cosformer_attention,
    "focused": focused_linear_attention,
    "taylor": taylor_attention,
    "performer": performer_attention,
    "efficient": efficient_attention,
}
