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
    """The normalised weights w_ij, shape (..., n, m), of `variant` under the
    given options (those of its front end, e.g. causal=, mask=, scale=).
    Variants: "softmax", "gaussian", "linear" (with feature_map=),
    "cosformer", "focused", "taylor", "performer", "efficient", and the
    systems over fewer keys: "block_sparse" (layout=, block_size=; zero
    outside the layout), "pooled" (stride=, mode=; weights over the
    ceil(m / stride) pooled keys, shape (..., n, ceil(m / stride))) and
    "linformer" (E=; weights over the r projected keys E @ k, shape
    (..., n, r); F=, which projects the values only, is accepted and
    unused), and "lsh" (k = q, n_buckets=, n_hashes=, chunk=, causal=,
    seed=: Reformer's weights, zero outside the keys its rounds bring
    together). Then out = weights @ v, @ the pooled v, or @ (F @ v).
    Rows that see no key are all zero. O(n m) memory."""
    _check_variant(variant)
    if variant in _linear.FRONT_ENDS:
        return _linear_family(variant, q, k, options, normalise=True)
    if variant in _SYSTEMS:
        return _system(variant, q, k, options)[0]
    weights, _ = _softmax_family(variant, q, k, options)
    return weights


def similarity(q, k, variant="softmax", **options):
    """The unnormalised similarities s_ij >= 0, shape (..., n, m); masked
    entries are 0. For softmax, s_ij = exp(scale q_i.k_j + bias_ij), which
    overflows to inf where that exponent exceeds the dtype's range; for the
    kernelised variants s_ij = phi(q_i) . psi(k_j) (FAVOR+ likewise may
    overflow to inf for large inputs); for "block_sparse", "pooled",
    "linformer" and "lsh", softmax's over their keys, shaped as
    attention_weights."""
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
