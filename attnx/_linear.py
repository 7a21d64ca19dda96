"""Kernelised ("linear") attention (docs/linear.md).

    o_i = phi(q_i) S / max(phi(q_i) . z, eps),  S = sum_j psi(k_j) v_j^T,  z = sum_j psi(k_j)

over the keys query i sees, with non-negative features phi (queries) and
psi (keys) of size r. Every front end here is a thin wrapper around one C
kernel, attnx._C.linear_attention, which validates the arguments, computes
the feature maps and runs the chosen method with the GIL released. Only
Python callables as feature maps and the random draw of Performer
projections run in Python.
"""
import functools
import math
import operator
import os

import numpy as np

from . import _C, _dwc
from ._variants import VARIANTS


# the state of return_state=True, advanced in place by its step method: a C
# type (csrc/py_linear.c), so that a decoding step reads its fields in C
LinearAttentionState = _C.LinearAttentionState


def _attend(front, a, normalise=True):
    """Run the kernel for front end `front` with its arguments `a` (by
    name; options a front end does not have take their defaults).
    normalise=False returns phi(q_i) S undivided (similarities)."""
    # the C binding knows each variant by `front` (attnx/_variants.py);
    # a variant that fixes its feature map ignores feature_map=
    feature_map = a.get("feature_map", "elu")
    projection = a.get("projection")
    if front == "performer":
        projection = _performer_projection(a["q"], projection, a["num_features"], a["seed"])
    return _run(front, a["q"], a["k"], a["v"], feature_map=feature_map,
                causal=a.get("causal", False), key_mask=a.get("key_mask"), mask=a.get("mask"),
                window=a.get("window"), method=a.get("method"), chunk_size=a.get("chunk_size"),
                eps=a.get("eps", 1e-6), projection=projection, p=a.get("p", 3), M=a.get("M"),
                initial_state=a.get("initial_state"),
                return_state=a.get("return_state", False), out=a.get("out"),
                normalise=normalise)


def _run(variant, q, k, v, *, feature_map, causal, key_mask, mask, window, method, chunk_size,
         eps, projection, p, initial_state, return_state, out, M=None, normalise=True):
    """The kernel with every option (the front ends' common path, kept
    short: a decoding call through linear_attention spends about a
    microsecond here). A callable feature map is applied here, and a
    state remembers it for its steps."""
    features = None
    if callable(feature_map):
        features = functools.partial(_callable_features, feature_map)
        q, k = features(q, k, v)
        feature_map = "identity"
    if projection is None and M is None and features is None and normalise is True:
        # the options left at their defaults left out: CPython passes a
        # call of more than 13 keywords through a dict, which would add
        # half a microsecond to a decoding call
        return _C.linear_attention(q, k, v, variant=variant, feature_map=feature_map,
                                   causal=causal, key_mask=key_mask, mask=mask, window=window,
                                   method=method, chunk_size=chunk_size, eps=eps, p=p,
                                   initial_state=initial_state, return_state=return_state,
                                   out=out)
    return _C.linear_attention(q, k, v, variant=variant, feature_map=feature_map, causal=causal,
                               key_mask=key_mask, mask=mask, window=window, method=method,
                               chunk_size=chunk_size, eps=eps, projection=projection, p=p, M=M,
                               initial_state=initial_state, return_state=return_state, out=out,
                               normalise=normalise, features=features)


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
    """Kernelised ("linear") attention over non-negative feature maps.

    Parameters
    ----------
    q : array_like, shape (..., n, d)
        Queries.
    k : array_like, shape (..., m, d)
        Keys.
    v : array_like, shape (..., m, e)
        Values; the leading axes of q, k, v broadcast.
    feature_map : str or callable, default "elu"
        phi = psi: "elu" (``elu(x) + 1``, the Linear Transformer's),
        "relu", "softmax" (over the features), "taylor" (``[1, x/|x|]``),
        "focused" (``f_p(relu(x))``, power ``p``), "favor" (Performer
        FAVOR+, needs ``projection=``), "identity" (q and k are already
        non-negative features), or a callable ``f(x) -> (..., r)`` of
        non-negative numpy features (learned maps).
    causal : bool or {"lower_right", "upper_left"}, default False
        True or "lower_right": query i sees ``j <= i + m - n``;
        "upper_left": ``j <= i``.
    key_mask : array_like of bool, shape (..., m), optional
        False removes a key from numerator and denominator.
    mask : array_like of bool, optional
        Broadcastable to (..., n, m), True = may attend; selects the
        quadratic method.
    window : int or (int or None, int or None), optional
        As in `softmax_attention`; selects the quadratic method.
    method : {"chunk", "recurrent", "cumsum", "quadratic"}, optional
        For causal calls: "chunk" (default; a masked product inside chunks
        of ``chunk_size``, a carried state across), "recurrent" (one token
        at a time; the default for at most 8 queries), "cumsum" (all prefix
        states materialised; refused above 2 GiB per head), "quadratic"
        (explicit similarities in tiles). Non-causal calls default to two
        GEMMs, ``psi(K)^T V`` then ``phi(Q) S``.
    chunk_size : int, optional
        The chunk of the "chunk" method; default 16 for 32 to 128
        features, else 32.
    eps : float, default 1e-6
        Clamps the denominator from below.
    projection : array_like, shape (r, d), optional
        FAVOR+'s random projection W (see `random_features`).
    p : float, default 3
        The power of the "focused" feature map.
    initial_state : LinearAttentionState, optional
        The state of an earlier call, continued (never written).
    return_state : bool, default False
        Also return the state after this call.
    out : ndarray, optional
        Receives the result (shape (..., n, e), the result's dtype).

    Returns
    -------
    out : ndarray, shape (..., n, e)
        The output.
    state : LinearAttentionState
        Only with ``return_state=True``.

    Raises
    ------
    ValueError
        Mismatched shapes, an unknown feature map or method, a "favor" map
        without a projection, negative "identity" features or callable
        features, a "cumsum" prefix tensor too large, a mask or window with
        a streaming state, a bad eps.
    TypeError
        Complex, object or string inputs, a mask that is not boolean.

    See Also
    --------
    cosformer_attention : cosFormer's re-weighted relu features.
    performer_attention : FAVOR+ random features.
    linear_attention_backward : The gradients.
    LinearAttentionState : The streaming state.

    Notes
    -----
    With non-negative features phi (queries) and psi (keys) of size r::

        o_i = phi(q_i) S / max(phi(q_i) . z, eps),
        S = sum_j psi(k_j) v_j^T,   z = sum_j psi(k_j),

    over the keys query i sees; a row whose denominator is exactly 0 gives
    zeros. Calls over pieces of a sequence, each continuing the state of
    the one before, give what one call over the whole sequence gives.
    dtypes as `softmax_attention` (docs/linear.md).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((5, 3)) for _ in range(3))
    >>> o = attnx.linear_attention(q, k, v, causal=True)
    >>> phi = lambda x: np.where(x > 0, x + 1, np.exp(x))      # elu(x) + 1
    >>> s = np.tril(phi(q) @ phi(k).T)
    >>> np.allclose(o, s / s.sum(1, keepdims=True) @ v)
    True
    >>> all(np.allclose(o, attnx.linear_attention(q, k, v, causal=True, method=m))
    ...     for m in ("recurrent", "cumsum", "quadratic"))
    True
    """
    return _run("linear", q, k, v, feature_map=feature_map, causal=causal, key_mask=key_mask,
                mask=mask, window=window, method=method, chunk_size=chunk_size, eps=eps,
                projection=projection, p=p, initial_state=initial_state,
                return_state=return_state, out=out)


def cosformer_attention(q, k, v, *, causal=False, key_mask=None, M=None, mask=None, window=None,
                        method=None, chunk_size=None, eps=1e-6, initial_state=None,
                        return_state=False, out=None):
    """cosFormer attention (Qin et al. 2022): relu features, re-weighted by distance.

    Parameters
    ----------
    q : array_like, shape (..., n, d)
        Queries.
    k : array_like, shape (..., m, d)
        Keys.
    v : array_like, shape (..., m, e)
        Values; the leading axes of q, k, v broadcast.
    causal, key_mask, mask, window, method, chunk_size, eps
        As in `linear_attention`; causal needs n == m.
    M : float, optional
        The period's scale; default ``max(n, m)``. At least the largest
        position; a fixed M is required when streaming.
    initial_state : LinearAttentionState, optional
        The state of an earlier call, continued.
    return_state : bool, default False
        Also return the state after this call.
    out : ndarray, optional
        Receives the result.

    Returns
    -------
    out : ndarray, shape (..., n, e)
        The output.
    state : LinearAttentionState
        Only with ``return_state=True``.

    Raises
    ------
    ValueError
        M smaller than the largest position, causal with n != m,
        streaming without a fixed M, and the errors of `linear_attention`.
    TypeError
        As in `linear_attention`.

    See Also
    --------
    linear_attention : The kernel this runs.
    cosformer_attention_backward : The gradients.

    Notes
    -----
    With 1-based positions (queries 1..n, keys 1..m, both shifted by a
    streaming state's offset)::

        s_ij = relu(q_i) . relu(k_j) cos(pi/2 (i - j) / M),

    computed as linear attention on the 2d features
    ``[relu(x) sin(theta_t), relu(x) cos(theta_t)]``, ``theta_t = pi/2 t /
    M`` (docs/linear.md).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((4, 3)) for _ in range(3))
    >>> o = attnx.cosformer_attention(q, k, v, causal=True)
    >>> t = np.arange(1, 5)
    >>> s = np.maximum(q, 0) @ np.maximum(k, 0).T * np.cos(np.pi / 2 * (t[:, None] - t) / 4)
    >>> s = np.tril(s)
    >>> np.allclose(o, s / np.maximum(s.sum(1, keepdims=True), 1e-6) @ v)
    True
    """
    return _attend("cosformer", locals())


def focused_linear_attention(q, k, v, p=3, *, causal=False, key_mask=None, mask=None,
                             window=None, method=None, chunk_size=None, eps=1e-6,
                             initial_state=None, return_state=False, out=None, dwc_weight=None,
                             spatial=None):
    """FLatten's focused linear attention (Han et al. 2023).

    Parameters
    ----------
    q : array_like, shape (..., n, d)
        Queries.
    k : array_like, shape (..., m, d)
        Keys.
    v : array_like, shape (..., m, e)
        Values; the leading axes of q, k, v broadcast.
    p : float, default 3
        The focusing power, positive.
    causal, key_mask, mask, window, method, chunk_size, eps
        As in `linear_attention`.
    initial_state : LinearAttentionState, optional
        The state of an earlier call, continued.
    return_state : bool, default False
        Also return the state after this call.
    out : ndarray, optional
        Receives the result.
    dwc_weight : array_like, optional
        FLatten's depthwise-convolution term, a depthwise convolution of v
        (zero padding, same length) added to the output: along the sequence
        with ``dwc_weight`` (e, ks), or over an image grid ``spatial=(H,
        W)`` with ``dwc_weight`` (e, kh, kw); odd kernel sizes, n == m.
    spatial : (int, int), optional
        The grid (H, W) of the n = H * W tokens (row-major).

    Returns
    -------
    out : ndarray, shape (..., n, e)
        The output.
    state : LinearAttentionState
        Only with ``return_state=True``.

    Raises
    ------
    ValueError
        p not positive, ``spatial`` without ``dwc_weight``, ``dwc_weight``
        with streaming, kernel sizes that are even or do not fit, and the
        errors of `linear_attention`.
    TypeError
        As in `linear_attention`.

    See Also
    --------
    linear_attention : The kernel this runs (``feature_map="focused"``).
    focused_linear_attention_backward : The gradients.

    Notes
    -----
    The features are ``f_p(relu(x))`` with ``f_p(y) = |y| y**p / |y**p|``
    (norms over each head vector; a zero vector gives 0), sharpening the
    attention towards the most similar keys (attnx/_dwc.py holds the
    convolution).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((4, 3)) for _ in range(3))
    >>> o = attnx.focused_linear_attention(q, k, v, p=3)
    >>> def f(x):                                # a zero vector gives 0
    ...     y = np.maximum(x, 0)
    ...     y3 = np.linalg.norm(y ** 3, axis=-1, keepdims=True)
    ...     return np.linalg.norm(y, axis=-1, keepdims=True) * y ** 3 / np.where(y3 > 0, y3, 1)
    >>> s = f(q) @ f(k).T
    >>> np.allclose(o, s / np.maximum(s.sum(1, keepdims=True), 1e-6) @ v)
    True
    """
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
    """Taylor (first-order) attention: ``s_ij = 1 + cos(q_i, k_j)``.

    Parameters
    ----------
    q : array_like, shape (..., n, d)
        Queries.
    k : array_like, shape (..., m, d)
        Keys.
    v : array_like, shape (..., m, e)
        Values; the leading axes of q, k, v broadcast.
    causal, key_mask, mask, window, method, chunk_size, eps
        As in `linear_attention`.
    initial_state : LinearAttentionState, optional
        The state of an earlier call, continued.
    return_state : bool, default False
        Also return the state after this call.
    out : ndarray, optional
        Receives the result.

    Returns
    -------
    out : ndarray, shape (..., n, e)
        The output.
    state : LinearAttentionState
        Only with ``return_state=True``.

    Raises
    ------
    ValueError
        As in `linear_attention`.
    TypeError
        As in `linear_attention`.

    See Also
    --------
    linear_attention : The kernel this runs (``feature_map="taylor"``).
    taylor_attention_backward : The gradients.

    Notes
    -----
    ``1 + cos`` is the first-order Taylor expansion of exp around 0 of the
    cosine similarity, non-negative, computed as linear attention on the
    features ``[1, x / |x|]`` (size d + 1; a zero vector gives
    ``[1, 0...]``).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((4, 3)) for _ in range(3))
    >>> unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)
    >>> s = 1 + unit(q) @ unit(k).T
    >>> np.allclose(attnx.taylor_attention(q, k, v), s / s.sum(1, keepdims=True) @ v)
    True
    """
    return _attend("taylor", locals())


def performer_attention(q, k, v, projection=None, num_features=None, seed=None, *, causal=False,
                        key_mask=None, mask=None, window=None, method=None, chunk_size=None,
                        eps=1e-6, initial_state=None, return_state=False, out=None):
    """Performer's FAVOR+ (Choromanski et al. 2021): softmax attention estimated.

    Parameters
    ----------
    q : array_like, shape (..., n, d)
        Queries.
    k : array_like, shape (..., m, d)
        Keys.
    v : array_like, shape (..., m, e)
        Values; the leading axes of q, k, v broadcast.
    projection : array_like, shape (r, d), optional
        The random projection W. When None, ``random_features(num_features,
        d, seed=seed)`` is drawn on every call, so pass ``projection=`` (or
        ``seed=``) for repeatable results and for streaming.
    num_features : int, optional
        r when drawing; default ``round(d ln d)``.
    seed : int, optional
        The seed of the drawn projection; not with ``projection=``.
    causal, key_mask, mask, window, method, chunk_size, eps
        As in `linear_attention`.
    initial_state : LinearAttentionState, optional
        The state of an earlier call, continued.
    return_state : bool, default False
        Also return the state after this call.
    out : ndarray, optional
        Receives the result.

    Returns
    -------
    out : ndarray, shape (..., n, e)
        The output.
    state : LinearAttentionState
        Only with ``return_state=True``.

    Raises
    ------
    ValueError
        Both ``projection`` and ``seed``, a projection whose rows do not
        match ``num_features`` or whose width is not d, and the errors of
        `linear_attention`.
    TypeError
        As in `linear_attention`.

    See Also
    --------
    random_features : Draws the projection.
    softmax_attention : What FAVOR+ estimates.
    performer_attention_backward : The gradients.

    Notes
    -----
    The positive random features ``phi(x) = r**-0.5 exp(W x~ - |x~|^2 /
    2)``, ``x~ = d**-0.25 x``, give an unbiased estimate of the softmax
    kernel ``exp(q . k / sqrt(d))``. The kernel subtracts stabilisers in
    the exponent (per query row its max; for keys the data-independent
    bound ``max_r |W_r|^2 / 2``), which cancel in the ratio, the eps clamp
    scaled to match (docs/linear.md).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((4, 8)) / 2 for _ in range(3))
    >>> W = attnx.random_features(4096, 8, seed=0)
    >>> o = attnx.performer_attention(q, k, v, projection=W)
    >>> exact = attnx.softmax_attention(q, k, v)
    >>> bool(np.abs(o - exact).max() < 0.05)            # close with many features
    True
    """
    return _attend("performer", locals())


def efficient_attention(q, k, v, *, key_mask=None, causal=False, out=None):
    """Efficient attention (Shen et al. 2021): softmax over features, then over keys.

    Parameters
    ----------
    q : array_like, shape (..., n, d)
        Queries.
    k : array_like, shape (..., m, d)
        Keys.
    v : array_like, shape (..., m, e)
        Values; the leading axes of q, k, v broadcast.
    key_mask : array_like of bool, shape (..., m), optional
        False removes a key.
    causal : bool, default False
        Must be False: the key softmax runs over the whole sequence.
    out : ndarray, optional
        Receives the result.

    Returns
    -------
    ndarray, shape (..., n, e)
        The output.

    Raises
    ------
    ValueError
        ``causal=True``, mismatched shapes.
    TypeError
        As in `linear_attention`.

    See Also
    --------
    linear_attention : The kernelised family.
    efficient_attention_backward : The gradients.

    Notes
    -----
    ``o = rho_q(Q) (rho_k(K)^T V)`` with ``rho_q`` the softmax of each
    query over its features and ``rho_k`` the softmax of each key feature
    over the (visible) keys. The weights sum to 1 exactly; no eps.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((4, 3)) for _ in range(3))
    >>> softmax = lambda x, axis: np.exp(x) / np.exp(x).sum(axis, keepdims=True)
    >>> expected = softmax(q, 1) @ (softmax(k, 0).T @ v)
    >>> np.allclose(attnx.efficient_attention(q, k, v), expected)
    True
    """
    return _attend("efficient", locals())


def random_features(r, d, seed=None):
    """Draw an (r, d) FAVOR+ projection of orthogonal random features.

    Parameters
    ----------
    r : int
        Rows (random features), at least 1; r > d stacks independent
        blocks.
    d : int
        Columns, the head size, at least 1.
    seed : int or numpy.random.Generator, optional
        Anything ``numpy.random.default_rng`` takes.

    Returns
    -------
    ndarray, shape (r, d), float64
        The projection.

    Raises
    ------
    ValueError
        r or d below 1, or a size the platform cannot address.
    MemoryError
        When the projection would not fit in this machine's memory.

    See Also
    --------
    performer_attention : Takes it as ``projection=``.

    Notes
    -----
    Blocks of d orthogonal rows from the Haar measure (QR of a d x d
    Gaussian matrix with the signs of R's diagonal folded into Q; a plain
    QR is not uniformly distributed and biases the estimate), each row
    scaled by the norm of an independent Gaussian d-vector (chi-distributed,
    like the rows of a Gaussian matrix).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> W = attnx.random_features(6, 4, seed=0)
    >>> W.shape
    (6, 4)
    >>> block = W[:4] / np.linalg.norm(W[:4], axis=1, keepdims=True)
    >>> np.allclose(block @ block.T, np.eye(4))            # orthogonal within a block
    True
    """
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


# variant name -> its front end, from the variant table
FRONT_ENDS = {front: globals()[variant.function] for front, variant in VARIANTS.items()}
