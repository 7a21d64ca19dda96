"""attention_weights and similarity: the full (..., n, m) matrices of any
variant, for plots, teaching and tests. They reuse the attention kernels
themselves (values = identity), so they show exactly what the kernels do."""
import inspect

import numpy as np

from . import _C, _linear, _lsh, _systems


def _identity_values(q, k, m):
    dtype = np.result_type(np.asarray(q).dtype, np.asarray(k).dtype)
    if dtype.kind not in "fiub":
        dtype = np.float64  # let the kernel raise the dtype error
    elif dtype.kind != "f":
        dtype = np.float64
    return np.eye(m, dtype=dtype)


def _key_count(k):
    k_arr = np.asarray(k)
    if k_arr.ndim < 2:
        raise ValueError(f"k must have at least 2 dimensions, got shape {k_arr.shape}")
    return k_arr.shape[-2]


def _softmax_family(variant, q, k, options):
    m = _key_count(k)
    fn = {"softmax": _C.softmax_attention, "gaussian": _C.gaussian_attention}[variant]
    if "out" in options or "return_lse" in options:
        raise TypeError("attention_weights and similarity take no out= or return_lse=")
    weights, lse = fn(q, k, _identity_values(q, k, m), return_lse=True, **options)
    return weights, lse


def _required(options, variant, *names):
    missing = [name for name in names if name not in options]
    if missing:
        raise TypeError(f"variant {variant!r} needs {' and '.join(f'{name}=' for name in missing)}")
    return [options.pop(name) for name in names]


def _system(variant, q, k, options):
    """Block-sparse, pooled and Linformer attention are softmax attention
    over a chosen or derived set of keys: the weights over those keys (the
    pooled or projected ones) and the lse."""
    if "out" in options or "return_lse" in options:
        raise TypeError("attention_weights and similarity take no out= or return_lse=")
    options = dict(options)
    if variant == "lsh":
        # shared query-keys: the keys are the queries themselves
        if k is not q and not np.array_equal(np.asarray(k), np.asarray(q)):
            raise ValueError("variant 'lsh' shares queries and keys: pass k = q")
        (n_buckets,) = _required(options, variant, "n_buckets")
        return _lsh.lsh_attention(q, _identity_values(q, q, _key_count(q)), n_buckets,
                                  return_lse=True, **options)
    if variant == "block_sparse":
        layout, block_size = _required(options, variant, "layout", "block_size")
        values = _identity_values(q, k, _key_count(k))
        return _systems.block_sparse_attention(q, k, values, layout, block_size, return_lse=True, **options)
    q, k, _ = _systems._check_qkv(q, k, k)
    if variant == "pooled":
        (stride,) = _required(options, variant, "stride")
        mode = options.pop("mode", "mean")
        keys = _systems._pool(k, _systems._check_pooling(stride, mode), mode)
    else:
        (E,) = _required(options, variant, "E")
        options.pop("F", None)  # F projects the values only
        keys = _systems._check_projection(E, "E", k.shape[-2]) @ k
    return _C.softmax_attention(q, keys, _identity_values(q, keys, keys.shape[-2]), return_lse=True,
                                **options)


def _linear_family(variant, q, k, options, normalise):
    """The kernelised variants run their own kernel on values eye(m);
    unnormalised, its output rows are the similarities themselves."""
    m = _key_count(k)
    if {"out", "initial_state", "return_state"} & options.keys():
        raise TypeError("attention_weights and similarity take no out=, initial_state= or return_state=")
    front = _linear.FRONT_ENDS[variant]
    # binding checks the options against the front end's own signature
    arguments = inspect.signature(front).bind(q, k, _identity_values(q, k, m), **options)
    arguments.apply_defaults()
    if "method" in arguments.arguments and arguments.arguments["method"] is None:
        # explicit similarities, each kept >= 0 against rounding (taylor's
        # 1 + cos(q, -q)), rather than contractions of a state
        arguments.arguments["method"] = "quadratic"
    return _linear._attend(variant, arguments.arguments, normalise)


_SYSTEMS = ("block_sparse", "pooled", "linformer", "lsh")
_VARIANTS = ("softmax", "gaussian") + tuple(_linear.FRONT_ENDS) + _SYSTEMS


def _check_variant(variant):
    if variant not in _VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {', '.join(map(repr, _VARIANTS))}")


def attention_weights(q, k, variant="softmax", **options):
    """The normalised attention weights of any variant, as an array.

    For plots, teaching and tests: the weights the attention functions
    never form (O(n m) memory by nature).

    Parameters
    ----------
    q : array_like, shape (..., n, d)
        Queries.
    k : array_like, shape (..., m, d)
        Keys (for "lsh", the queries again: Reformer shares them).
    variant : str, default "softmax"
        "softmax", "gaussian", "linear" (with ``feature_map=``),
        "cosformer", "focused", "taylor", "performer", "efficient", or a
        system over fewer keys: "block_sparse" (``layout=``,
        ``block_size=``), "pooled" (``stride=``, ``mode=``), "linformer"
        (``E=``; ``F=`` is accepted and unused) and "lsh" (``n_buckets=``,
        ``n_hashes=``, ``chunk=``, ``seed=``).
    **options
        The options of the variant's front end (``causal=``, ``mask=``,
        ``window=``, ``scale=``, ``key_mask=``, ...).

    Returns
    -------
    ndarray, shape (..., n, m)
        The weights, each row summing to 1 over the keys it sees, or all
        zero for a row that sees no key. "pooled" gives (..., n,
        ceil(m / stride)) over the pooled keys, "linformer" (..., n, r)
        over the projected keys ``E @ k``.

    Raises
    ------
    ValueError
        An unknown variant (the message lists them), or the front end's
        errors for its options.
    TypeError
        An option the variant's front end does not take.

    See Also
    --------
    similarity : The unnormalised similarities.
    attnx.plot.weights : A heatmap of these weights.

    Notes
    -----
    The output of the variant is ``weights @ v`` (``@`` the pooled values
    for "pooled", ``@ (F @ v)`` for "linformer"): ``w_ij = s_ij / sum_j'
    s_ij'`` over the visible keys, with the variant's similarity ``s_ij``
    (docs/inspecting.md).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((4, 3)) for _ in range(3))
    >>> w = attnx.attention_weights(q, k, causal=True)
    >>> print(np.round(w, 3))
    [[1.    0.    0.    0.   ]
     [0.403 0.597 0.    0.   ]
     [0.078 0.148 0.774 0.   ]
     [0.654 0.235 0.058 0.054]]
    >>> np.allclose(w @ v, attnx.softmax_attention(q, k, v, causal=True))
    True
    >>> w = attnx.attention_weights(q, k, "linear", feature_map="relu")
    >>> np.allclose(w.sum(1), 1)
    True
    """
    _check_variant(variant)
    if variant in _linear.FRONT_ENDS:
        return _linear_family(variant, q, k, options, normalise=True)
    if variant in _SYSTEMS:
        return _system(variant, q, k, options)[0]
    weights, _ = _softmax_family(variant, q, k, options)
    return weights


def similarity(q, k, variant="softmax", **options):
    """The unnormalised similarities ``s_ij >= 0`` of any variant.

    Parameters
    ----------
    q : array_like, shape (..., n, d)
        Queries.
    k : array_like, shape (..., m, d)
        Keys.
    variant : str, default "softmax"
        As in `attention_weights`.
    **options
        The options of the variant's front end.

    Returns
    -------
    ndarray
        ``s_ij``, shaped as `attention_weights` returns; masked entries 0.

    Raises
    ------
    ValueError
        An unknown variant, or the front end's errors for its options.
    TypeError
        An option the variant's front end does not take.

    See Also
    --------
    attention_weights : The same, normalised.

    Notes
    -----
    For softmax ``s_ij = exp(scale q_i . k_j + bias_ij)``, which overflows
    to inf where the exponent exceeds the dtype's range; for the kernelised
    variants ``s_ij = phi(q_i) . psi(k_j)`` (FAVOR+ may likewise overflow for
    large inputs); for "block_sparse", "pooled", "linformer" and "lsh",
    softmax's over their keys.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> q = np.array([[1.0, 0.0], [0.0, 1.0]])
    >>> print(np.round(attnx.similarity(q, q, "taylor"), 3))     # 1 + cos(q_i, k_j)
    [[2. 1.]
     [1. 2.]]
    >>> s = attnx.similarity(q, q, scale=1.0)                    # exp(q_i . k_j)
    >>> np.allclose(s, np.exp(q @ q.T))
    True
    """
    _check_variant(variant)
    if variant in _linear.FRONT_ENDS:
        return _linear_family(variant, q, k, options, normalise=False)
    if variant in _SYSTEMS:
        weights, lse = _system(variant, q, k, options)
    else:
        weights, lse = _softmax_family(variant, q, k, options)
    with np.errstate(over="ignore", invalid="ignore"):
        row_mass = np.exp(lse)[..., None]
        return np.where(weights == 0, 0, weights * row_mass).astype(weights.dtype, copy=False)
