"""Plain numpy float64 references of attnx's variants and gradients.

Each function is written straight from the formula of docs/ (conventions.md,
softmax.md, linear.md, gradients.md, delta_rule.md) with explicit n x m
matrices or, for the delta rule, one token at a time: slow, simple and meant
to be obviously correct. They use numpy alone, none of attnx's C code, so
they are an independent check of the fast functions: attnx's tests compare
every kernel with them, ``python -m attnx`` prints the difference, and they
show what each option means (the slow reference kept beside the fast one).

Conventions (docs/conventions.md):

* ``q`` is ``(..., n, d)``, ``k`` is ``(..., m, d)``, ``v`` is ``(..., m, e)``;
  leading axes broadcast like numpy's matmul.
* Every variant is ``o_i = sum_j w_ij v_j`` with ``w_ij = s_ij / sum_j' s_ij'``
  over the visible keys; a row that sees no key gives zeros (lse ``-inf``).
* Inputs of any dtype are read as float64; results are float64.

Memory is O(n m) per head (O(n m r) nowhere): use them on small inputs.

Examples
--------
>>> import numpy as np, attnx, attnx.reference
>>> rng = np.random.default_rng(0)
>>> q, k, v = (rng.standard_normal((2, 6, 4)) for _ in range(3))
>>> np.allclose(attnx.softmax_attention(q, k, v, causal=True),
...             attnx.reference.softmax_attention(q, k, v, causal=True))
True
"""
import math

import numpy as np

__all__ = [
    "visibility",
    "softmax_logits",
    "softmax_similarity",
    "softmax_weights",
    "softmax_attention",
    "gaussian_logits",
    "gaussian_similarity",
    "gaussian_weights",
    "gaussian_attention",
    "apply_feature_map",
    "linear_similarity",
    "linear_weights",
    "linear_attention",
    "cosformer_similarity",
    "cosformer_weights",
    "cosformer_attention",
    "efficient_weights",
    "efficient_attention",
    "softmax_attention_grads",
    "gaussian_attention_grads",
    "reduce_to",
    "philox4x32_10",
    "dropout_keep",
    "delta_rule",
]


def _f64(x):
    return np.asarray(x, dtype=np.float64)


# --------------------------------------------------------------------------
# Visibility
# --------------------------------------------------------------------------

def visibility(n, m, causal=False, mask=None, window=None):
    """Which keys each query sees: the rule of docs/conventions.md.

    Query i sees key j when all of these hold: ``causal=True`` or
    ``"lower_right"``: ``j <= i + (m - n)``; ``causal="upper_left"``:
    ``j <= i``; ``mask`` is True there; ``window=w`` (meaning ``(w, w)``) or
    ``window=(left, right)`` (None for an open side): with
    ``i' = i + (m - n)``, ``i' - left <= j <= i' + right``.

    Parameters
    ----------
    n, m : int
        The numbers of queries and keys.
    causal : bool or {"lower_right", "upper_left"}, default False
        The causal alignment (True is "lower_right").
    mask : array_like of bool, optional
        Broadcastable to ``(..., n, m)``; True = visible.
    window : int or tuple of (int or None), optional
        The band around the (aligned) diagonal.

    Returns
    -------
    ndarray of bool
        ``(n, m)``, or ``(..., n, m)`` when a mask has leading axes.

    Raises
    ------
    ValueError
        For an unknown `causal`.
    TypeError
        For a mask that is not boolean.

    See Also
    --------
    attnx.plot.visibility : Draws this pattern.

    Examples
    --------
    >>> import attnx.reference
    >>> attnx.reference.visibility(2, 3, causal=True).astype(int)
    array([[1, 1, 0],
           [1, 1, 1]])
    """
    i = np.arange(n)[:, None]
    j = np.arange(m)[None, :]
    vis = np.ones((n, m), dtype=bool)

    if causal is True or causal == "lower_right":
        vis &= j <= i + (m - n)
    elif causal == "upper_left":
        vis &= j <= i
    elif causal is False or causal is None:
        pass
    else:
        raise ValueError("causal: unknown value %r" % (causal,))

    if window is not None:
        if isinstance(window, (tuple, list)):
            left, right = window
        else:
            left = right = window
        ip = i + (m - n)
        if left is not None:
            vis &= ip - left <= j
        if right is not None:
            vis &= j <= ip + right

    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype != np.bool_:
            raise TypeError("mask must be boolean")
        vis = vis & mask  # broadcasts to (..., n, m)
    return vis


def _weighted_sum(w, v):
    """``o_i = sum_j w_ij v_j`` over the keys with ``w_ij != 0`` only, so a
    NaN/inf value of a key a row does not see cannot reach that row (plain
    matmul would give 0 * nan = nan)."""
    v = _f64(v)
    if np.all(np.isfinite(v)):
        return np.matmul(w, v)
    lead = np.broadcast_shapes(w.shape[:-2], v.shape[:-2])
    w = np.broadcast_to(w, lead + w.shape[-2:])
    v = np.broadcast_to(v, lead + v.shape[-2:])
    o = np.empty(lead + (w.shape[-2], v.shape[-1]))
    for i in range(w.shape[-2]):
        wi = w[..., i, :, None]  # (..., m, 1)
        with np.errstate(invalid="ignore"):
            o[..., i, :] = np.where(wi != 0, wi * v, 0.0).sum(axis=-2)
    return o


# --------------------------------------------------------------------------
# Softmax (scaled dot product) attention, docs/softmax.md
# --------------------------------------------------------------------------

def softmax_logits(q, k, scale=None, bias=None):
    """The logits ``a_ij = scale q_i k_j^T + b_ij`` of softmax attention.

    Parameters
    ----------
    q : array_like
        Queries ``(..., n, d)``.
    k : array_like
        Keys ``(..., m, d)``.
    scale : float, optional
        Default ``1 / sqrt(d)``.
    bias : array_like, optional
        Added to the logits, broadcastable to ``(..., n, m)``.

    Returns
    -------
    ndarray
        ``(..., n, m)`` float64.

    See Also
    --------
    softmax_weights : These logits normalised.

    Examples
    --------
    >>> import numpy as np, attnx.reference
    >>> attnx.reference.softmax_logits(np.ones((1, 4)), np.ones((2, 4)))
    array([[2., 2.]])
    """
    q = _f64(q)
    k = _f64(k)
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    a = scale * np.matmul(q, np.swapaxes(k, -1, -2))
    if bias is not None:
        a = a + _f64(bias)
    return a


def _stable_softmax(a, vis):
    """Row softmax of logits ``a`` over the visible entries.

    Returns ``(weights, lse)``. Subtracts the row max of the visible logits
    before exponentiating. A row with no visible key (or whose visible
    logits are all -inf) gives zero weights and lse -inf. NaN logits give
    a NaN row.
    """
    a, vis = np.broadcast_arrays(a, vis)
    masked = np.where(vis, a, -np.inf)
    with np.errstate(invalid="ignore", over="ignore"):
        mx = np.max(masked, axis=-1, keepdims=True) if a.shape[-1] else \
            np.full(a.shape[:-1] + (1,), -np.inf)
        finite_mx = np.where(np.isfinite(mx), mx, 0.0)
        e = np.where(vis, np.exp(masked - finite_mx), 0.0)
        tot = e.sum(axis=-1, keepdims=True)
        w = np.where(tot > 0, e / np.where(tot > 0, tot, 1.0), 0.0)
        lse = np.where(tot > 0, np.log(np.where(tot > 0, tot, 1.0)) + finite_mx,
                       -np.inf)
    # a NaN logit in a visible position poisons exactly its row
    bad = np.any(vis & np.isnan(a), axis=-1, keepdims=True)
    # mx == +inf: overflowed logit; the result is not finite either
    bad |= np.isposinf(mx)
    w = np.where(bad, np.nan, w)
    lse = np.where(bad, np.nan, lse)
    return w, lse[..., 0]


def softmax_similarity(q, k, scale=None, bias=None, causal=False, mask=None,
                       window=None):
    """The unnormalised ``s_ij = exp(scale q_i k_j^T + b_ij)``, 0 where not visible.

    The literal definition, not stabilised: it overflows for large logits.

    Parameters
    ----------
    q, k, scale, bias
        As in `softmax_logits`.
    causal, mask, window
        As in `visibility`.

    Returns
    -------
    ndarray
        ``(..., n, m)`` float64.

    See Also
    --------
    attnx.similarity : attnx's, for every variant.

    Examples
    --------
    >>> import numpy as np, attnx.reference
    >>> attnx.reference.softmax_similarity(np.zeros((2, 3)), np.zeros((2, 3)), causal=True)
    array([[1., 0.],
           [1., 1.]])
    """
    a = softmax_logits(q, k, scale, bias)
    vis = visibility(a.shape[-2], a.shape[-1], causal, mask, window)
    a, vis = np.broadcast_arrays(a, vis)
    with np.errstate(over="ignore"):
        return np.where(vis, np.exp(np.where(vis, a, 0.0)), 0.0)


def softmax_weights(q, k, scale=None, bias=None, causal=False, mask=None,
                    window=None):
    """The softmax weights ``w_ij = s_ij / sum_j' s_ij'`` over the visible keys.

    Stable (the row's largest visible logit is subtracted first); a query
    that sees no key gets a row of zeros.

    Parameters
    ----------
    q, k, scale, bias
        As in `softmax_logits`.
    causal, mask, window
        As in `visibility`.

    Returns
    -------
    ndarray
        ``(..., n, m)`` float64.

    See Also
    --------
    attnx.attention_weights : attnx's, for every variant.

    Examples
    --------
    >>> import numpy as np, attnx.reference
    >>> attnx.reference.softmax_weights(np.zeros((2, 3)), np.zeros((2, 3)), causal=True)
    array([[1. , 0. ],
           [0.5, 0.5]])
    """
    a = softmax_logits(q, k, scale, bias)
    vis = visibility(a.shape[-2], a.shape[-1], causal, mask, window)
    w, _ = _stable_softmax(a, vis)
    return w


def softmax_attention(q, k, v, scale=None, causal=False, mask=None, bias=None,
                      window=None, return_lse=False):
    """Softmax attention ``o_i = sum_j w_ij v_j``, ``w_ij = softmax_j(scale q_i k_j^T + b_ij)``.

    Parameters
    ----------
    q, k, scale, bias
        As in `softmax_logits`.
    v : array_like
        Values ``(..., m, e)``.
    causal, mask, window
        As in `visibility`.
    return_lse : bool, default False
        Also return ``lse_i = log sum_j exp(scale q_i . k_j + b_ij)`` over
        the visible keys (``-inf`` for a row that sees nothing).

    Returns
    -------
    out : ndarray
        ``(..., n, e)`` float64.
    lse : ndarray
        ``(..., n)``, with `return_lse` only.

    See Also
    --------
    attnx.softmax_attention : The fast one.

    Examples
    --------
    >>> import numpy as np, attnx, attnx.reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((5, 4)) for _ in range(3))
    >>> np.allclose(attnx.reference.softmax_attention(q, k, v, window=1),
    ...             attnx.softmax_attention(q, k, v, window=1))
    True
    """
    a = softmax_logits(q, k, scale, bias)
    vis = visibility(a.shape[-2], a.shape[-1], causal, mask, window)
    w, lse = _stable_softmax(a, vis)
    o = _weighted_sum(w, v)
    if return_lse:
        return o, lse
    return o


# --------------------------------------------------------------------------
# Gaussian kernel attention, docs/softmax.md
# --------------------------------------------------------------------------

def _check_sigma(sigma):
    if not (np.isfinite(sigma) and sigma > 0):
        raise ValueError("sigma must be finite and > 0")


def gaussian_logits(q, k, sigma=1.0, bias=None):
    """The logits ``a_ij = -|q_i - k_j|^2 / (2 sigma^2) + b_ij``, from the distance itself.

    Parameters
    ----------
    q : array_like
        Queries ``(..., n, d)``.
    k : array_like
        Keys ``(..., m, d)``.
    sigma : float, default 1.0
        The kernel's width, finite and > 0.
    bias : array_like, optional
        Added to the logits, broadcastable to ``(..., n, m)``.

    Returns
    -------
    ndarray
        ``(..., n, m)`` float64.

    Raises
    ------
    ValueError
        For a `sigma` that is not finite and > 0.

    See Also
    --------
    gaussian_weights : These logits normalised.

    Examples
    --------
    >>> import numpy as np, attnx.reference
    >>> attnx.reference.gaussian_logits(np.zeros((1, 2)), np.array([[1.0, 1.0], [3.0, 1.0]]))
    array([[-1., -5.]])
    """
    _check_sigma(sigma)
    q = _f64(q)
    k = _f64(k)
    n, m = q.shape[-2], k.shape[-2]
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    a = np.empty(lead + (n, m))
    for i in range(n):  # one query row at a time: O(m d) memory per row
        diff = q[..., i:i + 1, :] - k  # (..., m, d)
        a[..., i, :] = -np.sum(diff * diff, axis=-1) / (2.0 * sigma * sigma)
    if bias is not None:
        a = a + _f64(bias)
    return a


def gaussian_similarity(q, k, sigma=1.0, bias=None, causal=False, mask=None,
                        window=None):
    """The unnormalised ``s_ij = exp(-|q_i - k_j|^2 / (2 sigma^2) + b_ij)``, 0 where not visible.

    Parameters
    ----------
    q, k, sigma, bias
        As in `gaussian_logits`.
    causal, mask, window
        As in `visibility`.

    Returns
    -------
    ndarray
        ``(..., n, m)`` float64.

    See Also
    --------
    attnx.similarity : attnx's, for every variant.

    Examples
    --------
    >>> import numpy as np, attnx.reference
    >>> mask = np.array([True, False, True])
    >>> attnx.reference.gaussian_similarity(np.zeros((1, 2)), np.zeros((3, 2)), mask=mask)
    array([[1., 0., 1.]])
    """
    a = gaussian_logits(q, k, sigma, bias)
    vis = visibility(a.shape[-2], a.shape[-1], causal, mask, window)
    a, vis = np.broadcast_arrays(a, vis)
    with np.errstate(over="ignore"):
        return np.where(vis, np.exp(np.where(vis, a, 0.0)), 0.0)


def gaussian_weights(q, k, sigma=1.0, bias=None, causal=False, mask=None,
                     window=None):
    """The Gaussian kernel's normalised weights, stabilised per row (row max subtracted).

    Parameters
    ----------
    q, k, sigma, bias
        As in `gaussian_logits`.
    causal, mask, window
        As in `visibility`.

    Returns
    -------
    ndarray
        ``(..., n, m)`` float64; a query that sees no key gets zeros.

    See Also
    --------
    attnx.attention_weights : attnx's, for every variant.

    Examples
    --------
    >>> import numpy as np, attnx.reference
    >>> attnx.reference.gaussian_weights(np.zeros((1, 2)), np.zeros((2, 2)))
    array([[0.5, 0.5]])
    """
    a = gaussian_logits(q, k, sigma, bias)
    vis = visibility(a.shape[-2], a.shape[-1], causal, mask, window)
    w, _ = _stable_softmax(a, vis)
    return w


def gaussian_attention(q, k, v, sigma=1.0, causal=False, mask=None, bias=None,
                       window=None, return_lse=False):
    """Gaussian kernel (Nadaraya-Watson) attention ``o_i = sum_j s_ij v_j / sum_j s_ij``.

    With ``s_ij = exp(-|q_i - k_j|^2 / (2 sigma^2) + b_ij)``.

    Parameters
    ----------
    q, k, sigma, bias
        As in `gaussian_logits`.
    v : array_like
        Values ``(..., m, e)``.
    causal, mask, window
        As in `visibility`.
    return_lse : bool, default False
        Also return ``lse_i = log sum_j s_ij`` (this variant's own
        normaliser, ``log(gaussian_similarity(...).sum(-1))``).

    Returns
    -------
    out : ndarray
        ``(..., n, e)`` float64.
    lse : ndarray
        ``(..., n)``, with `return_lse` only.

    See Also
    --------
    attnx.gaussian_attention : The fast one.

    Examples
    --------
    >>> import numpy as np, attnx, attnx.reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((5, 4)) for _ in range(3))
    >>> np.allclose(attnx.reference.gaussian_attention(q, k, v, 2.0, causal=True),
    ...             attnx.gaussian_attention(q, k, v, 2.0, causal=True))
    True
    """
    a = gaussian_logits(q, k, sigma, bias)
    vis = visibility(a.shape[-2], a.shape[-1], causal, mask, window)
    w, lse = _stable_softmax(a, vis)
    o = _weighted_sum(w, v)
    if return_lse:
        return o, lse
    return o


# --------------------------------------------------------------------------
# Kernelised (linear) attention, docs/linear.md
# --------------------------------------------------------------------------

def _fm_elu(x, **_):
    """``elu(x) + 1`` = ``x + 1`` for x > 0, ``exp(x)`` otherwise."""
    return np.where(x > 0, x + 1.0, np.exp(np.minimum(x, 0.0)))


def _fm_relu(x, **_):
    """``max(x, 0)``."""
    return np.maximum(x, 0.0)


def _fm_softmax(x, **_):
    """``softmax(x)`` over the feature (last) axis."""
    mx = np.max(x, axis=-1, keepdims=True)
    e = np.exp(x - mx)
    return e / e.sum(axis=-1, keepdims=True)


def _fm_taylor(x, **_):
    """``[1, x/|x|]`` (size d+1); a zero vector gives ``[1, 0, ..., 0]``."""
    nrm = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
    with np.errstate(invalid="ignore", divide="ignore"):
        u = np.where(nrm > 0, x / np.where(nrm > 0, nrm, 1.0), 0.0)
    ones = np.ones(x.shape[:-1] + (1,))
    return np.concatenate([ones, u], axis=-1)


def _fm_focused(x, p=3, **_):
    """``f_p(relu(x))`` with ``f_p(y) = |y| * y**p / |y**p|`` (norms over the
    head's feature vector); a zero vector gives 0."""
    y = np.maximum(x, 0.0)
    ny = np.sqrt(np.sum(y * y, axis=-1, keepdims=True))
    yp = y ** p
    nyp = np.sqrt(np.sum(yp * yp, axis=-1, keepdims=True))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(nyp > 0, ny * yp / np.where(nyp > 0, nyp, 1.0), 0.0)


def _fm_favor(x, projection=None, **_):
    """FAVOR+: ``r**-0.5 * exp(W x~ - |x~|^2 / 2)``, ``x~ = d**-0.25 x``,
    with ``W = projection`` of shape ``(r, d)``. Unstabilised (literal)."""
    if projection is None:
        raise ValueError("favor needs projection=")
    W = _f64(projection)
    r, d = W.shape
    if x.shape[-1] != d:
        raise ValueError("projection must be (r, d)")
    xt = x * d ** -0.25
    return r ** -0.5 * np.exp(xt @ W.T - 0.5 * np.sum(xt * xt, axis=-1,
                                                       keepdims=True))


def _fm_identity(x, **_):
    """The inputs themselves (must be non-negative)."""
    if np.any(x < 0):
        raise ValueError("identity features must be non-negative")
    return x


_FEATURE_MAPS = {
    "elu": _fm_elu,
    "relu": _fm_relu,
    "softmax": _fm_softmax,
    "taylor": _fm_taylor,
    "focused": _fm_focused,
    "favor": _fm_favor,
    "identity": _fm_identity,
}


def apply_feature_map(x, name="elu", projection=None, p=3):
    """A named feature map of docs/linear.md (or a callable) on the last axis of `x`.

    "elu": ``elu(x) + 1``; "relu": ``max(x, 0)``; "softmax": softmax over
    the features; "taylor": ``[1, x / |x|]`` (d + 1 features; a zero vector
    gives ``[1, 0, ...]``); "focused": ``|y| y**p / |y**p|`` with
    ``y = relu(x)``; "favor": ``r**-0.5 exp(W x~ - |x~|^2 / 2)`` with
    ``x~ = d**-0.25 x`` and ``W = projection`` (literal, unstabilised);
    "identity": `x` itself (non-negative).

    Parameters
    ----------
    x : array_like
        ``(..., d)``.
    name : str or callable, default "elu"
        The map, or a function of a float64 array returning its features.
    projection : array_like, optional
        FAVOR+'s ``(r, d)`` matrix, for "favor" only.
    p : float, default 3
        The focusing power, for "focused" only.

    Returns
    -------
    ndarray
        ``(..., r)`` float64 features.

    Raises
    ------
    ValueError
        For "favor" without a ``(r, d)`` projection, or "identity" of
        negative inputs.

    See Also
    --------
    attnx.linear_attention : The fast linear attention with these maps.

    Examples
    --------
    >>> import numpy as np, attnx.reference
    >>> attnx.reference.apply_feature_map(np.array([[0.0, 3.0, -4.0]]), "taylor")
    array([[ 1. ,  0. ,  0.6, -0.8]])
    """
    x = _f64(x)
    if callable(name):
        return _f64(name(x))
    return _FEATURE_MAPS[name](x, projection=projection, p=p)


def _key_mask_to_mask(key_mask, mask):
    """key_mask ``(..., m)`` -> mask ``(..., 1, m)``, combined with ``mask``."""
    if key_mask is None:
        return mask
    km = np.asarray(key_mask)
    if km.dtype != np.bool_:
        raise TypeError("key_mask must be boolean")
    km = km[..., None, :]
    if mask is None:
        return km
    return np.asarray(mask) & km


def linear_similarity(q, k, feature_map="elu", causal=False, key_mask=None,
                      mask=None, window=None, projection=None, p=3):
    """The kernelised similarity ``s_ij = phi(q_i) phi(k_j)^T``, 0 where not visible.

    Parameters
    ----------
    q : array_like
        Queries ``(..., n, d)``.
    k : array_like
        Keys ``(..., m, d)``.
    feature_map, projection, p
        As in `apply_feature_map`.
    causal, mask, window
        As in `visibility`.
    key_mask : array_like of bool, optional
        ``(..., m)``: False leaves a key out for every query.

    Returns
    -------
    ndarray
        ``(..., n, m)`` float64.

    See Also
    --------
    attnx.similarity : attnx's, for every variant.

    Examples
    --------
    >>> import numpy as np, attnx.reference
    >>> attnx.reference.linear_similarity(np.ones((1, 2)), np.array([[1.0, 0.0]]), "relu")
    array([[1.]])
    """
    fq = apply_feature_map(q, feature_map, projection, p)
    fk = apply_feature_map(k, feature_map, projection, p)
    s = np.matmul(fq, np.swapaxes(fk, -1, -2))
    vis = visibility(s.shape[-2], s.shape[-1], causal,
                     _key_mask_to_mask(key_mask, mask), window)
    s, vis = np.broadcast_arrays(s, vis)
    return np.where(vis, s, 0.0)


def _clamped_weights(s, eps):
    """``w_ij = s_ij / max(sum_j s_ij, eps)``; a zero row stays zero."""
    tot = s.sum(axis=-1, keepdims=True)
    den = np.maximum(tot, eps)
    # eps = 0: a row of zero mass divides 0 by 0; it returns zeros
    return np.where(den > 0, s / np.where(den > 0, den, 1.0), 0.0)


def linear_weights(q, k, feature_map="elu", causal=False, key_mask=None,
                   mask=None, window=None, eps=1e-6, projection=None, p=3):
    """The kernelised weights ``w_ij = s_ij / max(sum_j s_ij, eps)``.

    Parameters
    ----------
    q, k, feature_map, causal, key_mask, mask, window, projection, p
        As in `linear_similarity`.
    eps : float, default 1e-6
        The floor of each row's normaliser.

    Returns
    -------
    ndarray
        ``(..., n, m)`` float64.

    See Also
    --------
    attnx.attention_weights : attnx's, for every variant.

    Examples
    --------
    >>> import numpy as np, attnx.reference
    >>> attnx.reference.linear_weights(np.ones((1, 2)), np.array([[1.0, 0.0], [3.0, 0.0]]), "relu")
    array([[0.25, 0.75]])
    """
    s = linear_similarity(q, k, feature_map, causal, key_mask, mask, window,
                          projection, p)
    return _clamped_weights(s, eps)


def linear_attention(q, k, v, feature_map="elu", causal=False, key_mask=None,
                     mask=None, window=None, eps=1e-6, projection=None, p=3):
    """Linear attention ``o_i = phi(q_i) S / max(phi(q_i) z, eps)``.

    With ``S = sum_j phi(k_j) v_j^T`` and ``z = sum_j phi(k_j)`` over the
    visible keys; computed as ``W @ v`` with ``W = linear_weights(...)``.

    Parameters
    ----------
    q, k, feature_map, causal, key_mask, mask, window, eps, projection, p
        As in `linear_weights`.
    v : array_like
        Values ``(..., m, e)``.

    Returns
    -------
    ndarray
        ``(..., n, e)`` float64.

    See Also
    --------
    attnx.linear_attention : The fast one.

    Examples
    --------
    >>> import numpy as np, attnx, attnx.reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((5, 4)) for _ in range(3))
    >>> np.allclose(attnx.reference.linear_attention(q, k, v, "elu", causal=True),
    ...             attnx.linear_attention(q, k, v, feature_map="elu", causal=True))
    True
    """
    w = linear_weights(q, k, feature_map, causal, key_mask, mask, window, eps,
                       projection, p)
    return _weighted_sum(w, v)


# --------------------------------------------------------------------------
# cosFormer
# --------------------------------------------------------------------------

def cosformer_similarity(q, k, causal=False, key_mask=None, M=None, offset=0,
                         mask=None, window=None):
    """cosFormer's ``s_ij = relu(q_i) relu(k_j)^T cos(pi/2 (i - j) / M)``, 0 where not visible.

    Positions are 1-based (queries 1..n, keys 1..m), both shifted by `offset`.

    Parameters
    ----------
    q : array_like
        Queries ``(..., n, d)``.
    k : array_like
        Keys ``(..., m, d)``.
    causal, mask, window
        As in `visibility`.
    key_mask : array_like of bool, optional
        ``(..., m)``: False leaves a key out for every query.
    M : float, optional
        The reweighting's length, default ``max(n, m)``.
    offset : int, default 0
        The position of the first token (streaming).

    Returns
    -------
    ndarray
        ``(..., n, m)`` float64.

    See Also
    --------
    attnx.similarity : attnx's, for every variant.

    Examples
    --------
    >>> import numpy as np, attnx.reference
    >>> attnx.reference.cosformer_similarity(np.ones((2, 1)), np.ones((2, 1))).round(3)
    array([[1.   , 0.707],
           [0.707, 1.   ]])
    """
    q = _f64(q)
    k = _f64(k)
    n, m = q.shape[-2], k.shape[-2]
    if M is None:
        M = max(n, m)
    pi = offset + np.arange(1, n + 1, dtype=np.float64)
    pj = offset + np.arange(1, m + 1, dtype=np.float64)
    c = np.cos(np.pi / 2 * (pi[:, None] - pj[None, :]) / M)
    s = np.matmul(np.maximum(q, 0.0), np.swapaxes(np.maximum(k, 0.0), -1, -2))
    s = s * c
    vis = visibility(n, m, causal, _key_mask_to_mask(key_mask, mask), window)
    s, vis = np.broadcast_arrays(s, vis)
    return np.where(vis, s, 0.0)


def cosformer_weights(q, k, causal=False, key_mask=None, M=None, offset=0,
                      mask=None, window=None, eps=1e-6):
    """cosFormer's weights ``w_ij = s_ij / max(sum_j s_ij, eps)``.

    Parameters
    ----------
    q, k, causal, key_mask, M, offset, mask, window
        As in `cosformer_similarity`.
    eps : float, default 1e-6
        The floor of each row's normaliser.

    Returns
    -------
    ndarray
        ``(..., n, m)`` float64.

    See Also
    --------
    attnx.attention_weights : attnx's, for every variant.

    Examples
    --------
    >>> import numpy as np, attnx.reference
    >>> attnx.reference.cosformer_weights(np.ones((2, 1)), np.ones((2, 1)), causal=True).round(3)
    array([[1.   , 0.   ],
           [0.414, 0.586]])
    """
    s = cosformer_similarity(q, k, causal, key_mask, M, offset, mask, window)
    return _clamped_weights(s, eps)


def cosformer_attention(q, k, v, causal=False, key_mask=None, M=None, offset=0,
                        mask=None, window=None, eps=1e-6):
    """cosFormer attention, ``W @ v`` with the weights of `cosformer_weights`.

    Parameters
    ----------
    q, k, causal, key_mask, M, offset, mask, window, eps
        As in `cosformer_weights`.
    v : array_like
        Values ``(..., m, e)``.

    Returns
    -------
    ndarray
        ``(..., n, e)`` float64.

    See Also
    --------
    attnx.cosformer_attention : The fast one.

    Examples
    --------
    >>> import numpy as np, attnx, attnx.reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((5, 4)) for _ in range(3))
    >>> np.allclose(attnx.reference.cosformer_attention(q, k, v, causal=True),
    ...             attnx.cosformer_attention(q, k, v, causal=True))
    True
    """
    w = cosformer_weights(q, k, causal, key_mask, M, offset, mask, window, eps)
    return _weighted_sum(w, v)


# --------------------------------------------------------------------------
# Efficient attention (Shen et al.)
# --------------------------------------------------------------------------

def _efficient_features(q, k, key_mask=None):
    """``rho_q(Q)`` = softmax of each query over its features;
    ``rho_k(K)`` = softmax of each key feature over the visible keys
    (masked keys get 0; a feature with no visible key is all 0)."""
    q = _f64(q)
    k = _f64(k)
    rq = _fm_softmax(q)
    if key_mask is None:
        km = np.ones(k.shape[:-1], dtype=bool)
    else:
        km = np.asarray(key_mask)
        if km.dtype != np.bool_:
            raise TypeError("key_mask must be boolean")
    shape = np.broadcast_shapes(k.shape[:-1], km.shape)
    k = np.broadcast_to(k, shape + k.shape[-1:])
    km = np.broadcast_to(km, shape)[..., None]  # (..., m, 1)
    kk = np.where(km, k, -np.inf)
    with np.errstate(invalid="ignore"):
        mx = np.max(kk, axis=-2, keepdims=True) if k.shape[-2] else \
            np.zeros(k.shape[:-2] + (1, k.shape[-1]))
        mx = np.where(np.isfinite(mx), mx, 0.0)
        e = np.where(km, np.exp(kk - mx), 0.0)
        tot = e.sum(axis=-2, keepdims=True)
        rk = np.where(tot > 0, e / np.where(tot > 0, tot, 1.0), 0.0)
    return rq, rk


def efficient_weights(q, k, key_mask=None):
    """Efficient attention's weights ``W = rho_q(Q) rho_k(K)^T``.

    ``rho_q``: softmax of each query over its features; ``rho_k``: softmax
    of each key feature over the visible keys. Rows sum to 1 whenever some
    key is visible.

    Parameters
    ----------
    q : array_like
        Queries ``(..., n, d)``.
    k : array_like
        Keys ``(..., m, d)``.
    key_mask : array_like of bool, optional
        ``(..., m)``: False leaves a key out.

    Returns
    -------
    ndarray
        ``(..., n, m)`` float64.

    See Also
    --------
    attnx.attention_weights : attnx's, for every variant.

    Examples
    --------
    >>> import numpy as np, attnx.reference
    >>> attnx.reference.efficient_weights(np.zeros((1, 2)), np.zeros((4, 2)))
    array([[0.25, 0.25, 0.25, 0.25]])
    """
    rq, rk = _efficient_features(q, k, key_mask)
    return np.matmul(rq, np.swapaxes(rk, -1, -2))


def efficient_attention(q, k, v, key_mask=None):
    """Efficient attention (Shen et al.) ``o = rho_q(Q) (rho_k(K)^T V)``.

    Parameters
    ----------
    q, k, key_mask
        As in `efficient_weights`.
    v : array_like
        Values ``(..., m, e)``.

    Returns
    -------
    ndarray
        ``(..., n, e)`` float64.

    See Also
    --------
    attnx.efficient_attention : The fast one.

    Examples
    --------
    >>> import numpy as np, attnx, attnx.reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((5, 4)) for _ in range(3))
    >>> np.allclose(attnx.reference.efficient_attention(q, k, v),
    ...             attnx.efficient_attention(q, k, v))
    True
    """
    rq, rk = _efficient_features(q, k, key_mask)
    return np.matmul(rq, np.matmul(np.swapaxes(rk, -1, -2), _f64(v)))


# --------------------------------------------------------------------------
# Gradients of softmax and Gaussian attention, docs/gradients.md: the chain
# rule over explicit n x m matrices, at the broadcast batch shape
# --------------------------------------------------------------------------

def reduce_to(grad, shape):
    """`grad` summed over the axes its input was broadcast along, down to `shape`.

    Parameters
    ----------
    grad : ndarray
        A gradient at the broadcast shape.
    shape : tuple of int
        The input's shape.

    Returns
    -------
    ndarray
        Of `shape`.

    See Also
    --------
    softmax_attention_grads : Whose gradients are at the broadcast shape.

    Examples
    --------
    >>> import numpy as np, attnx.reference
    >>> attnx.reference.reduce_to(np.ones((3, 2, 4)), (1, 4))
    array([[6., 6., 6., 6.]])
    """
    shape = tuple(shape)
    while grad.ndim > len(shape):
        grad = grad.sum(axis=0)
    for axis, size in enumerate(shape):
        if size == 1 and grad.shape[axis] != 1:
            grad = grad.sum(axis=axis, keepdims=True)
    return grad


def _weight_grads(w, v, dout):
    """From o = w v: (dw_logits, dv) for w = softmax(logits) row by row:
    dv = w^T dO; dw = dO v^T; d logits = w * (dw - sum_j w dw)."""
    v, dout = _f64(v), _f64(dout)
    dv = np.matmul(np.swapaxes(w, -1, -2), dout)
    dw = np.matmul(dout, np.swapaxes(v, -1, -2))
    d_logits = w * (dw - np.sum(w * dw, axis=-1, keepdims=True))
    return d_logits, dv


def softmax_attention_grads(dout, q, k, v, scale=None, causal=False, mask=None, bias=None,
                            window=None, dropout_keep=None, dropout_p=0.0):
    """The gradients of ``sum(dout * softmax_attention(q, k, v, ...))``.

    From the chain rule through the logits ``a = scale q . k + b``:
    ``dv = w^T dout``, ``da = w * (dw - sum_j w dw)`` with
    ``dw = dout v^T``, ``dq = scale da k``, ``dk = scale da^T q``,
    ``dbias = da``.

    Parameters
    ----------
    dout : array_like
        ``(..., n, e)``, the gradient of the output.
    q, k, v, scale, causal, mask, bias, window
        As in `softmax_attention`.
    dropout_keep : ndarray of bool, optional
        The keep mask of the weights (`dropout_keep`); kept weights are
        scaled by ``1 / (1 - dropout_p)``.
    dropout_p : float, default 0.0
        The dropout probability that goes with `dropout_keep`.

    Returns
    -------
    dq, dk, dv, dbias : ndarray
        float64, at the broadcast batch shape (`reduce_to` sums one down to
        its input's shape); dbias is ``(..., n, m)``.

    See Also
    --------
    attnx.softmax_attention_backward : The fast one.

    Examples
    --------
    >>> import numpy as np, attnx, attnx.reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, dout = (rng.standard_normal((5, 4)) for _ in range(4))
    >>> dq, dk, dv, _ = attnx.reference.softmax_attention_grads(dout, q, k, v, causal=True)
    >>> out, lse = attnx.softmax_attention(q, k, v, causal=True, return_lse=True)
    >>> g = attnx.softmax_attention_backward(dout, q, k, v, out, lse, causal=True)
    >>> all(np.allclose(a, b) for a, b in zip((dq, dk, dv), (g.q, g.k, g.v)))
    True
    """
    q, k = _f64(q), _f64(k)
    d = q.shape[-1]
    scale = 1 / np.sqrt(d) if scale is None else scale
    w = softmax_weights(q, k, scale=scale, bias=bias, causal=causal, mask=mask, window=window)
    if dropout_keep is None:
        d_logits, dv = _weight_grads(w, v, dout)
    else:
        # o = (w * keep / (1 - p)) v: the dropped weights' gradient flows
        # back through the same mask
        factor = np.where(dropout_keep, 1 / (1 - dropout_p), 0.0)
        dw = np.matmul(_f64(dout), np.swapaxes(_f64(v), -1, -2)) * factor
        dv = np.matmul(np.swapaxes(w * factor, -1, -2), _f64(dout))
        d_logits = w * (dw - np.sum(w * dw, axis=-1, keepdims=True))
    dq = scale * np.matmul(d_logits, k)
    dk = scale * np.matmul(np.swapaxes(d_logits, -1, -2), q)
    return dq, dk, dv, d_logits


def gaussian_attention_grads(dout, q, k, v, sigma=1.0, causal=False, mask=None, bias=None,
                             window=None):
    """The gradients of ``sum(dout * gaussian_attention(q, k, v, sigma, ...))``.

    Through the logits ``a_ij = -|q_i - k_j|^2 / (2 sigma^2) + b_ij``:
    ``da_ij / dq_i = (k_j - q_i) / sigma^2``,
    ``da_ij / dk_j = (q_i - k_j) / sigma^2``.

    Parameters
    ----------
    dout : array_like
        ``(..., n, e)``, the gradient of the output.
    q, k, v, sigma, causal, mask, bias, window
        As in `gaussian_attention`.

    Returns
    -------
    dq, dk, dv, dbias : ndarray
        float64, at the broadcast batch shape; dbias is ``(..., n, m)``.

    See Also
    --------
    attnx.gaussian_attention_backward : The fast one.

    Examples
    --------
    >>> import numpy as np, attnx, attnx.reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v, dout = (rng.standard_normal((5, 4)) for _ in range(4))
    >>> dq, dk, dv, _ = attnx.reference.gaussian_attention_grads(dout, q, k, v, 2.0)
    >>> out, lse = attnx.gaussian_attention(q, k, v, 2.0, return_lse=True)
    >>> g = attnx.gaussian_attention_backward(dout, q, k, v, out, lse, 2.0)
    >>> all(np.allclose(a, b) for a, b in zip((dq, dk, dv), (g.q, g.k, g.v)))
    True
    """
    q, k = _f64(q), _f64(k)
    w = gaussian_weights(q, k, sigma=sigma, bias=bias, causal=causal, mask=mask, window=window)
    d_logits, dv = _weight_grads(w, v, dout)
    row_sums = d_logits.sum(axis=-1)[..., None]      # (..., n, 1)
    col_sums = d_logits.sum(axis=-2)[..., None]      # (..., m, 1)
    dq = (np.matmul(d_logits, k) - row_sums * q) / sigma**2
    dk = (np.matmul(np.swapaxes(d_logits, -1, -2), q) - col_sums * k) / sigma**2
    return dq, dk, dv, d_logits


# --------------------------------------------------------------------------
# Dropout: Philox4x32-10 keep decisions of (seed, head, i, j)
# --------------------------------------------------------------------------

_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_MASK32 = 0xFFFFFFFF


def philox4x32_10(counter, key):
    """The counter-based generator Philox4x32-10 (Salmon et al., SC 2011).

    Parameters
    ----------
    counter : sequence of 4 array_like
        The counter's four 32-bit words (held in any integer arrays of one
        shape).
    key : sequence of 2 int
        The key's two 32-bit words.

    Returns
    -------
    ndarray of uint64
        ``(4, ...)``: the four 32-bit output words of each counter.

    See Also
    --------
    dropout_keep : attnx's dropout decisions from these words.

    Examples
    --------
    >>> import attnx.reference
    >>> [hex(int(word)) for word in attnx.reference.philox4x32_10((0, 0, 0, 0), (0, 0))]
    ['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
    """
    c0, c1, c2, c3 = (np.asarray(word, dtype=np.uint64) for word in counter)
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    for round_index in range(10):
        if round_index:
            k0 = (k0 + np.uint64(_PHILOX_W[0])) & np.uint64(_MASK32)
            k1 = (k1 + np.uint64(_PHILOX_W[1])) & np.uint64(_MASK32)
        p0 = np.uint64(_PHILOX_M[0]) * c0
        p1 = np.uint64(_PHILOX_M[1]) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & np.uint64(_MASK32),
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & np.uint64(_MASK32))
    return np.stack([c0, c1, c2, c3])


def dropout_keep(seed, p, lead, n, m):
    """The keep mask of attnx's attention dropout (``dropout_p=``, ``seed=``).

    Weight (head, i, j) is kept when word ``j % 4`` of
    ``philox4x32_10(counter=(i, j // 4, head low, head high), key=(seed low,
    seed high))`` is at least ``floor(p 2**32)``; head is the flat C-order
    index of the leading axes.

    Parameters
    ----------
    seed : int
        The dropout seed (64 bits).
    p : float
        The dropout probability.
    lead : tuple of int
        The leading (batch, head) axes.
    n, m : int
        The numbers of queries and keys.

    Returns
    -------
    ndarray of bool
        ``lead + (n, m)``: True where the weight is kept.

    See Also
    --------
    attnx.softmax_attention : Its ``dropout_p`` and ``seed`` options.

    Examples
    --------
    >>> import numpy as np, attnx, attnx.reference
    >>> q = np.random.default_rng(0).standard_normal((2, 6, 4))
    >>> keep = attnx.reference.dropout_keep(7, 0.5, (2,), 6, 6)
    >>> w = attnx.reference.softmax_weights(q, q) * keep / 0.5
    >>> v = np.eye(6)
    >>> np.allclose(attnx.softmax_attention(q, q, v, dropout_p=0.5, seed=7), w @ v)
    True
    """
    heads = int(np.prod(lead, dtype=np.int64))
    head, i, j = np.meshgrid(np.arange(heads, dtype=np.uint64), np.arange(n, dtype=np.uint64),
                             np.arange(m, dtype=np.uint64), indexing="ij")
    words = philox4x32_10((i, j // np.uint64(4), head & np.uint64(_MASK32), head >> np.uint64(32)),
                          (seed & _MASK32, seed >> 32))
    word = np.take_along_axis(words, (j % np.uint64(4)).astype(np.int64)[None], axis=0)[0]
    return (word >= np.uint64(int(p * 2**32))).reshape(tuple(lead) + (n, m))


# --------------------------------------------------------------------------
# The delta rule, docs/delta_rule.md: its recurrence, one token at a time
# --------------------------------------------------------------------------

def _l2norm(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def delta_rule(q, k, v, beta, g=None, scale=None, qk_l2norm=False, initial_state=None):
    """The (gated) delta rule by its recurrence, one token at a time (no chunks).

    For each head and token t: ``S <- exp(g_t) S`` (per key feature when
    `g` has one value per feature), ``u = beta_t (v_t - S^T k_t)``,
    ``S <- S + k_t u^T``, ``o_t = S^T (scale q_t)``.

    Parameters
    ----------
    q, k : array_like
        ``(H, n, dk)``.
    v : array_like
        ``(H, n, dv)``.
    beta : array_like
        ``(H, n)``, the write strengths.
    g : array_like, optional
        The log decays, ``(H, n)`` or ``(H, n, dk)``; None for no decay.
    scale : float, optional
        Of the queries, default ``dk ** -0.5``.
    qk_l2norm : bool, default False
        Normalise q and k to unit length first (``x / sqrt(|x|^2 + 1e-6)``).
    initial_state : array_like, optional
        ``(H, dk, dv)``, default zeros.

    Returns
    -------
    out : ndarray
        ``(H, n, dv)`` float64.
    state : ndarray
        ``(H, dk, dv)``, the state after the last token.

    See Also
    --------
    attnx.delta_rule_attention : The fast, chunked one.

    Examples
    --------
    >>> import numpy as np, attnx, attnx.reference
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 5, 4)) / 2 for _ in range(3))
    >>> beta, g = np.full((2, 5), 0.5), np.full((2, 5), -0.1)
    >>> out, _ = attnx.reference.delta_rule(q, k, v, beta, g)
    >>> np.allclose(out, attnx.delta_rule_attention(q, k, v, beta, g))
    True
    """
    q, k, v, beta = (np.asarray(x, np.float64) for x in (q, k, v, beta))
    H, n, dk = q.shape
    dv = v.shape[-1]
    if qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q * (dk ** -0.5 if scale is None else scale)
    S = np.zeros((H, dk, dv)) if initial_state is None else np.array(initial_state, np.float64)
    out = np.zeros((H, n, dv))
    for h in range(H):
        for t in range(n):
            if g is not None:
                decay = np.exp(np.asarray(g, np.float64)[h, t])
                S[h] = (decay[:, None] if np.ndim(decay) else decay) * S[h]
            u = beta[h, t] * (v[h, t] - S[h].T @ k[h, t])
            S[h] = S[h] + np.outer(k[h, t], u)
            out[h, t] = S[h].T @ q[h, t]
    return out, S
