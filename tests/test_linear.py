"""Tests of attnx's kernelised ("linear") family, docs/linear.md and docs/inspecting.md:
linear_attention with every feature map ("elu", "relu", "softmax",
"taylor", "focused", "favor", "identity", a Python callable), the front
ends cosformer_attention, focused_linear_attention, taylor_attention,
performer_attention, efficient_attention, random_features, streaming
states, and attention_weights / similarity for the kernelised variants.

Everything is checked against the plain numpy float64 reference in
attnx/reference.py (itself tested in tests/test_reference.py), plus a
log-space FAVOR+ reference (below) for inputs whose literal features
overflow.

Stated tolerances (see `tol`), the same as the softmax suite:
  float64 vs the float64 reference: rtol 1e-10, atol 1e-10 * value scale;
  float32 vs the float64 reference (on the same float32 inputs):
      rtol 2e-5, atol 2e-5 * value scale (value scale = max |v|, >= 1);
  float16 (computed in float32, rounded to float16): 2e-3 relative.
Methods (chunk / recurrent / cumsum / quadratic, every chunk size) and
streaming pieces are compared with the same bounds; they compute the same
sums in different orders, so float64 agrees to ~1e-14 for a correct kernel.
Inputs are ~N(0, 1) (|x| for "identity"); the FAVOR projections used for
the exact comparisons are N(0, 1) matrices of r = 2d + 3 rows, so every
exponent stays below ~40 and the float32 features keep ~1e-6 relative
accuracy, well inside 2e-5.
"""

import concurrent.futures
import math
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnx

import attnx.reference as ref
from helpers import (CAUSAL_MODES, assert_close, f64, hypothesis_settings, make,  # noqa: E402
                     mixed_dtype_qkv, qkv, run_isolated, tol, vscale)

HYP = hypothesis_settings(40)

METHODS = ["chunk", "recurrent", "cumsum", "quadratic"]


# --------------------------------------------------------------------------
# helpers (the softmax suite's)
# --------------------------------------------------------------------------

# --------------------------------------------------------------------------
# the variants under test and their references
# --------------------------------------------------------------------------

# linear_attention(feature_map=...) for each named map and a callable, then
# the named front ends ("focused_front": focused_linear_attention with p=2,
# "taylor_front": taylor_attention, "performer": performer_attention with a
# fixed projection)
FEATURE_MAPS = ["elu", "relu", "softmax", "taylor", "focused", "favor",
                "identity", "callable"]
FRONT_ENDS = ["cosformer", "focused_front", "taylor_front", "performer",
              "efficient"]
VARIANTS = FEATURE_MAPS + FRONT_ENDS
STATEFUL = [v for v in VARIANTS if v != "efficient"]   # causal, streaming
FAVOR_LIKE = ("favor", "performer")


def fm_callable(x):
    """A learned-map stand-in: numpy in, non-negative numpy out, r = 2d."""
    x = np.asarray(x)
    return np.concatenate([np.maximum(x, 0), np.exp(np.minimum(x, 0))], axis=-1)


_PROJ = {}


def projection(d):
    """A fixed N(0, 1) FAVOR projection of r = 2d + 3 rows (any W is valid)."""
    if d not in _PROJ:
        _PROJ[d] = np.random.default_rng(777 + d).standard_normal((2 * d + 3, d))
    return _PROJ[d]


def feature_size(name, d):
    if name in ("taylor", "taylor_front"):
        return d + 1
    if name in FAVOR_LIKE:
        return 2 * d + 3
    if name in ("callable", "cosformer"):
        return 2 * d
    return d


def fixed_options(name, d):
    """The options that select the variant (besides causal, key_mask...)."""
    if name == "favor":
        return dict(feature_map="favor", projection=projection(d))
    if name == "callable":
        return dict(feature_map=fm_callable)
    if name in FEATURE_MAPS:
        return dict(feature_map=name)
    if name == "focused_front":
        return dict(p=2)
    if name == "performer":
        return dict(projection=projection(d))
    return {}


def front(name):
    return {"cosformer": attnx.cosformer_attention,
            "focused_front": attnx.focused_linear_attention,
            "taylor_front": attnx.taylor_attention,
            "performer": attnx.performer_attention,
            "efficient": attnx.efficient_attention}.get(name,
                                                        attnx.linear_attention)


WVARIANT = dict({fm: "linear" for fm in FEATURE_MAPS}, cosformer="cosformer",
                focused_front="focused", taylor_front="taylor",
                performer="performer", efficient="efficient")


def prep(name, q, k):
    """Inputs valid for the variant: identity features must be >= 0."""
    if name == "identity":
        return np.abs(q), np.abs(k)
    return q, k


def _drop_defaults(name, kw):
    """efficient_attention has only key_mask= (and causal=False, out=)."""
    kw = dict(kw)
    if name == "efficient":
        if kw.get("causal", 0) is False:
            del kw["causal"]
        for opt in ("method", "chunk_size"):
            if opt in kw and kw[opt] is None:
                del kw[opt]
    return kw


def call(name, q, k, v, **kw):
    return front(name)(q, k, v, **fixed_options(name, np.shape(q)[-1]),
                       **_drop_defaults(name, kw))


def weights(name, q, k, **kw):
    return attnx.attention_weights(q, k, variant=WVARIANT[name],
                                   **fixed_options(name, np.shape(q)[-1]),
                                   **_drop_defaults(name, kw))


def similarity(name, q, k, **kw):
    return attnx.similarity(q, k, variant=WVARIANT[name],
                            **fixed_options(name, np.shape(q)[-1]),
                            **_drop_defaults(name, kw))


def _ref_fm(name, d):
    """(feature map, p, projection) of the reference for a variant."""
    if name in FAVOR_LIKE:
        return "favor", 3, projection(d)
    if name == "callable":
        return fm_callable, 3, None
    if name == "focused_front":
        return "focused", 2, None
    if name == "taylor_front":
        return "taylor", 3, None
    return name, 3, None


def ref_similarity(name, q, k, causal=False, key_mask=None, mask=None,
                   window=None, M=None, offset=0):
    q, k = f64(q), f64(k)
    if name == "efficient":
        assert not causal and mask is None and window is None
        return ref.efficient_weights(q, k, key_mask)
    if name == "cosformer":
        return ref.cosformer_similarity(q, k, causal, key_mask, M, offset, mask,
                                        window)
    fm, p, W = _ref_fm(name, q.shape[-1])
    return ref.linear_similarity(q, k, fm, causal, key_mask, mask, window,
                                 projection=W, p=p)


def ref_weights(name, q, k, eps=1e-6, **kw):
    s = ref_similarity(name, q, k, **kw)
    if name == "efficient":
        return s
    return ref._clamped_weights(s, eps)


def ref_out(name, q, k, v, eps=1e-6, **kw):
    return ref._weighted_sum(ref_weights(name, q, k, eps=eps, **kw), v)


def row_condition(name, q, k, eps=1e-6, causal=False, key_mask=None, mask=None,
                  window=None, **_):
    """kappa_i = sum_j |phi(q_i)|.|psi(k_j)| / max(sum_j s_ij, eps) over the
    visible keys, the condition number of row i's linear-form sums (o_i is
    computed as phi(q_i) S / phi(q_i) z, not from s_ij): 1 for non-negative
    features, large for taylor where 1 + cos(q, k) cancels towards 0. The
    float32/float64 tolerances of the linear forms scale with it (rounding
    of phi.S and phi.z is ~u * sum |terms|, relative ~u * kappa); shape
    (..., n, 1)."""
    if name not in ("taylor", "taylor_front"):
        return np.ones((1, 1))
    fq = np.abs(ref.apply_feature_map(f64(q), "taylor"))
    fk = np.abs(ref.apply_feature_map(f64(k), "taylor"))
    a = np.matmul(fq, np.swapaxes(fk, -1, -2))
    vis = ref.visibility(a.shape[-2], a.shape[-1], causal,
                         ref._key_mask_to_mask(key_mask, mask), window)
    a, vis = np.broadcast_arrays(a, vis)
    abs_mass = np.where(vis, a, 0.0).sum(-1)
    mass = ref_similarity(name, q, k, causal, key_mask, mask, window).sum(-1)
    kappa = abs_mass / np.maximum(mass, max(eps, 1e-300))
    return np.maximum(kappa, 1.0)[..., None]


def assert_close_cond(got, want, dtype, scale, kappa, err_msg=""):
    """assert_close with the tolerance of row i multiplied by kappa_i."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    t = tol(dtype, scale)
    bound = (t["atol"] + t["rtol"] * np.abs(want)) * kappa
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    bad = ~same & ~(np.abs(got - want) <= bound)
    assert not np.any(bad), "%s\n%d mismatches; got %s want %s (kappa %s)" % (
        err_msg, bad.sum(), got[bad][:5], want[bad][:5],
        np.broadcast_to(kappa, bad.shape)[bad][:5])


def ref_key_features(name, k, offset=0, M=None):
    """psi(k) (..., m, r) as the state accumulates it (cosFormer: the
    [relu sin, relu cos] features at 1-based positions offset + 1...)."""
    k = f64(k)
    if name == "cosformer":
        m = k.shape[-2]
        theta = np.pi / 2 * (offset + np.arange(1, m + 1)) / M
        rk = np.maximum(k, 0.0)
        return np.concatenate([rk * np.sin(theta)[:, None],
                               rk * np.cos(theta)[:, None]], axis=-1)
    fm, p, W = _ref_fm(name, k.shape[-1])
    return ref.apply_feature_map(k, fm, W, p)


def favor_weights_logspace(q, k, W, causal=False, key_mask=None, eps=1e-6):
    """FAVOR+ weights s_ij / max(sum_j s_ij, eps) with the literal
    (unstabilised) features, evaluated in log space so that nothing
    overflows or underflows: log s_ij = logsumexp_f(a_if + b_jf) with
    a = log phi(q), b = log psi(k). Plain numpy from the formula."""
    q, k, W = f64(q), f64(k), f64(W)
    r, d = W.shape
    qt, kt = q * d ** -0.25, k * d ** -0.25
    a = qt @ W.T - 0.5 * np.sum(qt * qt, -1, keepdims=True) - 0.5 * math.log(r)
    b = kt @ W.T - 0.5 * np.sum(kt * kt, -1, keepdims=True) - 0.5 * math.log(r)
    L = a[..., :, None, :] + b[..., None, :, :]          # (..., n, m, r)
    mx = L.max(-1)
    logs = mx + np.log(np.exp(L - mx[..., None]).sum(-1))
    n, m = logs.shape[-2:]
    vis = ref.visibility(n, m, causal,
                         None if key_mask is None else key_mask[..., None, :])
    logs = np.where(vis, logs, -np.inf)
    rmx = logs.max(-1, keepdims=True)
    rmx_f = np.where(np.isfinite(rmx), rmx, 0.0)
    with np.errstate(divide="ignore"):
        logtot = rmx_f + np.log(np.exp(logs - rmx_f).sum(-1, keepdims=True))
    return np.exp(logs - np.maximum(logtot, math.log(eps)))


def test_logspace_favor_reference_matches_literal():
    """The log-space helper above is the reference's formula."""
    rng = np.random.default_rng(0)
    q, k, _ = qkv(rng, (2,), 7, 9, 5, 1)
    W = rng.standard_normal((11, 5))
    km = rng.random((2, 9)) < 0.7
    for causal in (False, True):
        want = ref.linear_weights(q, k, "favor", causal=causal, key_mask=km,
                                  projection=W)
        got = favor_weights_logspace(q, k, W, causal, km)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------
# agreement with the reference, every variant, shapes and causal modes
# --------------------------------------------------------------------------

SHAPES = [
    (1, 1, 1, 1),
    (2, 3, 4, 5),
    (7, 13, 5, 3),
    (13, 7, 8, 16),
    (64, 64, 16, 16),
    (65, 129, 32, 17),
    (129, 65, 17, 32),
    (257, 300, 16, 8),
    (300, 1, 8, 8),
    (1, 300, 16, 16),
    (293, 293, 7, 5),
]


def _ref_cases():
    for name in VARIANTS:
        for shape in SHAPES:
            for causal in CAUSAL_MODES:
                if name == "efficient" and causal is not False:
                    continue
                if name == "cosformer" and causal and shape[0] != shape[1]:
                    continue
                yield name, shape, causal


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name,shape,causal", list(_ref_cases()))
def test_matches_reference(dtype, name, shape, causal):
    n, m, d, e = shape
    rng = np.random.default_rng(n * 1000 + m + d)
    q, k, v = qkv(rng, (2,), n, m, d, e, dtype)
    q, k = prep(name, q, k)
    got = call(name, q, k, v, causal=causal)
    assert got.dtype == dtype and got.shape == (2, n, e)
    assert_close_cond(got, ref_out(name, q, k, v, causal=causal), dtype,
                      vscale(v), row_condition(name, q, k, causal=causal))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", VARIANTS)
def test_key_mask_matches_reference(dtype, name):
    rng = np.random.default_rng(1)
    n, m = 37, 53
    q, k, v = qkv(rng, (2, 3), n, m, 6, 4, dtype)
    q, k = prep(name, q, k)
    for km_shape in [(m,), (2, 1, m), (2, 3, m), (1, 3, m)]:
        km = rng.random(km_shape) < 0.6
        for causal in ([False] if name in ("efficient", "cosformer") else
                       [False, True, "upper_left"]):
            got = call(name, q, k, v, causal=causal, key_mask=km)
            want = ref_out(name, q, k, v, causal=causal, key_mask=km)
            assert_close(got, want, dtype, vscale(v), err_msg=str(km_shape))
    if name == "cosformer":
        km = rng.random((2, 1, n)) < 0.6
        qq, kk, vv = q[..., :n, :], k[..., :n, :], v[..., :n, :]
        got = call(name, qq, kk, vv, causal=True, key_mask=km)
        assert_close(got, ref_out(name, qq, kk, vv, causal=True, key_mask=km),
                     dtype, vscale(v))


@pytest.mark.parametrize("name", STATEFUL)
@pytest.mark.parametrize("eps", [0.0, 1e-6, 1e-2, 0.5, 10.0])
def test_eps_clamp(name, eps):
    """o_i = phi(q_i) S / max(phi(q_i).z, eps): a large eps shrinks rows
    whose mass is below it; eps = 0 divides by the exact mass."""
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, (2,), 19, 23, 5, 3)
    q, k = prep(name, q, k)
    q = q * 0.3
    for causal in ([False] if name == "cosformer" else [False, True]):
        got = call(name, q, k, v, causal=causal, eps=eps)
        want = ref_out(name, q, k, v, causal=causal, eps=eps)
        assert_close(got, want, np.float64, vscale(v))
        w = weights(name, q, k, causal=causal, eps=eps)
        assert_close(w, ref_weights(name, q, k, causal=causal, eps=eps),
                     np.float64)


def test_efficient_takes_no_eps():
    """Efficient attention has no eps (docs/linear.md: "no eps")."""
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, (), 4, 5, 3, 2)
    with pytest.raises(TypeError, match="eps"):
        attnx.efficient_attention(q, k, v, eps=1e-6)


# --------------------------------------------------------------------------
# broadcasting, GQA, strided views
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", VARIANTS)
def test_gqa_broadcast(dtype, name):
    rng = np.random.default_rng(19)
    B, Hkv, g, n, d = 2, 3, 4, 29, 8
    q = make(rng, (B, Hkv, g, n, d), dtype)
    k = make(rng, (B, Hkv, 1, n, d), dtype)
    v = make(rng, (B, Hkv, 1, n, 5), dtype)
    q, k = prep(name, q, k)
    causal = name != "efficient"
    got = call(name, q, k, v, causal=causal)
    assert got.shape == (B, Hkv, g, n, 5)
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    assert_close(got, ref_out(name, q, kk, vv, causal=causal), dtype, vscale(v))
    t = tol(dtype, vscale(v))
    np.testing.assert_allclose(call(name, q, kk, vv, causal=causal), got,
                               rtol=t["rtol"] / 10, atol=t["atol"] / 10)


@pytest.mark.parametrize("name", VARIANTS)
def test_leading_axes_broadcast_rules(name):
    rng = np.random.default_rng(20)
    q = make(rng, (4, 1, 5, 3))
    k = make(rng, (1, 6, 7, 3))
    v = make(rng, (6, 7, 2))
    q, k = prep(name, q, k)
    got = call(name, q, k, v)
    assert got.shape == (4, 6, 5, 2)
    assert_close(got, ref_out(name, q, k, v), np.float64, vscale(v))
    got = call(name, q[0, 0], k[0, 0], v[0])
    assert got.shape == (5, 2)
    assert_close(got, ref_out(name, q[0, 0], k[0, 0], v[0]), np.float64,
                 vscale(v))
    got = call(name, q[0, 0], k[0], v)
    assert got.shape == (6, 5, 2)
    assert_close(got, ref_out(name, q[0, 0], k[0], v), np.float64, vscale(v))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", VARIANTS)
def test_strided_views_equal_contiguous(dtype, name):
    """(B, n, H, d) memory viewed as (B, H, n, d), a row-strided slice, a
    transposed (non-contiguous last axis) input: all equal the C-order call."""
    rng = np.random.default_rng(21)
    B, H, n, d = 2, 3, 41, 8
    x = make(rng, (B, n, 3, H, d), dtype)
    q, k, v = (x[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    q, k = prep(name, q, k)
    causal = name != "efficient"
    got = call(name, q, k, v, causal=causal)
    want = call(name, np.ascontiguousarray(q), np.ascontiguousarray(k),
                np.ascontiguousarray(v), causal=causal)
    t = tol(dtype, vscale(v))
    np.testing.assert_allclose(got, want, rtol=t["rtol"] / 10, atol=t["atol"] / 10)
    assert_close(got, ref_out(name, q, k, v, causal=causal), dtype, vscale(v))
    # a non-contiguous last axis (copied once) and a wide row stride
    vt = np.ascontiguousarray(np.swapaxes(v, -1, -2)).swapaxes(-1, -2)
    wide = np.zeros(k.shape[:-1] + (3 * d,), dtype)
    wide[..., :d] = k
    got2 = call(name, q, wide[..., :d], vt, causal=causal)
    np.testing.assert_allclose(got2, want, rtol=t["rtol"] / 10,
                               atol=t["atol"] / 10)
    # the other byte order: converted once, the same numbers
    swapped = [x.astype(x.dtype.newbyteorder()) for x in (q, k, v)]
    got3 = call(name, *swapped, causal=causal)
    assert got3.dtype == dtype
    np.testing.assert_array_equal(got3, call(name, *map(np.ascontiguousarray, (q, k, v)),
                                             causal=causal))


# --------------------------------------------------------------------------
# mask= and window= through the quadratic form
# --------------------------------------------------------------------------

WINDOWS = [0, 1, 3, (2, 0), (0, 2), (None, 0), (4, None), (1, 5)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", STATEFUL)
def test_mask_and_window_quadratic(dtype, name):
    """docs/linear.md: "An arbitrary mask or a window is honoured through the
    quadratic form"; the default method picks it."""
    rng = np.random.default_rng(22)
    for n, m in [(30, 30), (17, 44), (44, 17)]:
        q, k, v = qkv(rng, (2,), n, m, 5, 3, dtype)
        q, k = prep(name, q, k)
        mask = rng.random((2, n, m)) < 0.6
        km = rng.random((2, m)) < 0.8
        for causal in [False] + ([True, "upper_left"] if name != "cosformer"
                                 or n == m else []):
            for i, window in enumerate(WINDOWS):
                kw = dict(causal=causal, window=window)
                want = ref_out(name, q, k, v, **kw)
                method = (None, "quadratic")[i % 2]
                got = call(name, q, k, v, method=method, **kw)
                assert_close(got, want, dtype, vscale(v),
                             err_msg="%s %s" % (kw, method))
            kw = dict(causal=causal, mask=mask, key_mask=km)
            want = ref_out(name, q, k, v, **kw)
            for method in (None, "quadratic"):
                got = call(name, q, k, v, method=method, **kw)
                assert_close(got, want, dtype, vscale(v), err_msg=method)
            kw = dict(causal=causal, mask=mask[0, :1], window=(3, 2))
            assert_close(call(name, q, k, v, **kw),
                         ref_out(name, q, k, v, **kw), dtype, vscale(v))
            w = weights(name, q, k, mask=mask, window=2, causal=causal)
            assert_close(w, ref_weights(name, q, k, mask=mask, window=2,
                                        causal=causal), dtype)


@pytest.mark.parametrize("name", STATEFUL)
@pytest.mark.parametrize("method", ["chunk", "recurrent", "cumsum"])
def test_mask_window_need_quadratic(name, method):
    """mask= / window= with another method: a clear ValueError (the
    implementation supports them through the quadratic form only)."""
    rng = np.random.default_rng(23)
    q, k, v = qkv(rng, (), 6, 6, 3, 2)
    q, k = prep(name, q, k)
    with pytest.raises(ValueError, match="mask"):
        call(name, q, k, v, causal=True, method=method,
             mask=np.ones((6, 6), bool))
    with pytest.raises(ValueError, match="window"):
        call(name, q, k, v, causal=True, method=method, window=2)


# --------------------------------------------------------------------------
# methods and chunk sizes (property 3)
# --------------------------------------------------------------------------

CHUNKS = [1, 2, 3, 7, 64, 1000]


@pytest.mark.parametrize("name", STATEFUL)
@pytest.mark.parametrize("causal", [True, "upper_left", False])
@pytest.mark.parametrize("n,m", [(1, 1), (37, 37), (150, 150), (23, 61),
                                 (61, 23)])
def test_methods_and_chunk_sizes_agree(name, causal, n, m):
    if name == "cosformer" and causal and n != m:
        return
    rng = np.random.default_rng(n + 7 * m)
    q, k, v = qkv(rng, (2,), n, m, 6, 5)
    q, k = prep(name, q, k)
    km = rng.random((2, m)) < 0.8
    want = ref_out(name, q, k, v, causal=causal, key_mask=km)
    base = call(name, q, k, v, causal=causal, key_mask=km, method="cumsum")
    assert_close(base, want, np.float64, vscale(v), err_msg="cumsum")
    for method in (None, "chunk", "recurrent", "quadratic"):
        sizes = CHUNKS if method == "chunk" else [None, 7] \
            if method == "quadratic" else [None]
        for c in sizes:
            got = call(name, q, k, v, causal=causal, key_mask=km, method=method,
                       chunk_size=c)
            assert_close(got, base, np.float64, vscale(v),
                         err_msg="%s chunk_size=%s" % (method, c))


@pytest.mark.parametrize("name", STATEFUL)
def test_methods_agree_float32(name):
    rng = np.random.default_rng(24)
    n = 131
    q, k, v = qkv(rng, (3,), n, n, 8, 4, np.float32)
    q, k = prep(name, q, k)
    want = ref_out(name, q, k, v, causal=True)
    for method in METHODS:
        for c in ([5, 64] if method == "chunk" else [None]):
            got = call(name, q, k, v, causal=True, method=method, chunk_size=c)
            assert got.dtype == np.float32
            assert_close(got, want, np.float32, vscale(v), err_msg=method)


# --------------------------------------------------------------------------
# streaming (property 3) and decoding
# --------------------------------------------------------------------------

def _stream(name, q, k, v, bounds, M=None, key_mask=None, methods=(None,),
            chunk_sizes=(None,), causal=True):
    """Run the sequence in pieces [bounds[i], bounds[i+1]) carrying the state."""
    extra = {} if M is None else dict(M=M)
    state, outs = None, []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        km = None if key_mask is None else key_mask[..., a:b]
        o, state = call(name, q[..., a:b, :], k[..., a:b, :], v[..., a:b, :],
                        causal=causal, key_mask=km, initial_state=state,
                        return_state=True, method=methods[i % len(methods)],
                        chunk_size=chunk_sizes[i % len(chunk_sizes)], **extra)
        assert state.offset == b
        outs.append(o)
    return np.concatenate(outs, axis=-2), state


def _check_state(name, state, k, v, key_mask=None, M=None, dtype=np.float64):
    """S = sum_j psi(k_j) v_j^T, z = sum_j psi(k_j) over the unmasked keys
    (favor: the same up to one constant positive factor, the stabiliser)."""
    psi = ref_key_features(name, k, 0, M)
    if key_mask is not None:
        psi = psi * np.asarray(key_mask)[..., None]
    S = np.matmul(np.swapaxes(psi, -1, -2), f64(v))
    z = psi.sum(-2)
    lead = np.broadcast_shapes(S.shape[:-2], state.S.shape[:-2])
    S = np.broadcast_to(S, lead + S.shape[-2:])
    z = np.broadcast_to(z, lead + z.shape[-1:])
    assert state.S.shape == S.shape and state.z.shape == z.shape
    assert state.S.shape[-2] == feature_size(name, np.shape(k)[-1])
    assert state.S.dtype == dtype and state.z.dtype == dtype
    gS, gz = np.asarray(state.S, np.float64), np.asarray(state.z, np.float64)
    if name in FAVOR_LIKE:
        zs = z.sum(-1, keepdims=True)
        alpha = np.where(zs > 0, gz.sum(-1, keepdims=True) / np.where(
            zs > 0, zs, 1.0), 1.0)
        assert np.all(alpha > 0)
        gS, gz = gS / alpha[..., None], gz / alpha
    t = tol(dtype)
    np.testing.assert_allclose(gz, z, rtol=t["rtol"] * 10,
                               atol=t["rtol"] * 10 * np.abs(z).max())
    np.testing.assert_allclose(gS, S, rtol=t["rtol"] * 10,
                               atol=t["rtol"] * 10 * np.abs(S).max())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", STATEFUL)
@pytest.mark.parametrize("pieces", ["one", "tokens", "halves", "random",
                                    "mixed_methods"])
def test_streaming_equals_one_call(dtype, name, pieces):
    rng = np.random.default_rng(25)
    n = 97
    q, k, v = qkv(rng, (2, 2), n, n, 6, 4, dtype)
    q, k = prep(name, q, k)
    km = rng.random((2, 1, n)) < 0.85
    M = n + 13 if name == "cosformer" else None
    extra = {} if M is None else dict(M=M)
    full = call(name, q, k, v, causal=True, key_mask=km, **extra)
    assert_close(full, ref_out(name, q, k, v, causal=True, key_mask=km,
                               **extra), dtype, vscale(v))
    if pieces == "one":
        bounds = [0, n]
    elif pieces == "tokens":
        bounds = list(range(n + 1))
    elif pieces == "halves":
        bounds = [0, 48, n]
    else:
        cuts = sorted(rng.choice(np.arange(1, n), 9, replace=False))
        bounds = [0] + list(cuts) + [n]
    methods = METHODS + [None] if pieces == "mixed_methods" else (None,)
    sizes = (None, 1, 3, 64) if pieces == "mixed_methods" else (None,)
    got, state = _stream(name, q, k, v, bounds, M, km, methods, sizes)
    assert got.dtype == dtype
    t = tol(dtype, vscale(v))
    np.testing.assert_allclose(got, full, rtol=t["rtol"], atol=t["atol"])
    _check_state(name, state, k, v, km, M, dtype)


@pytest.mark.parametrize("name", STATEFUL)
def test_state_can_be_reused(name):
    """A state is not consumed or modified by the call that continues it:
    two continuations from one state are identical (a fork), and the state's
    arrays are unchanged."""
    rng = np.random.default_rng(26)
    q, k, v = qkv(rng, (2,), 40, 40, 5, 3)
    q, k = prep(name, q, k)
    extra = dict(M=40) if name == "cosformer" else {}
    _, st0 = call(name, q[:, :20], k[:, :20], v[:, :20], causal=True,
                  return_state=True, **extra)
    S0, z0, off0 = st0.S.copy(), st0.z.copy(), st0.offset
    a, st_a = call(name, q[:, 20:], k[:, 20:], v[:, 20:], causal=True,
                   initial_state=st0, return_state=True, **extra)
    b = call(name, q[:, 20:], k[:, 20:], v[:, 20:], causal=True,
             initial_state=st0, **extra)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(st0.S, S0)
    np.testing.assert_array_equal(st0.z, z0)
    assert st0.offset == off0 == 20 and st_a.offset == 40
    full = call(name, q, k, v, causal=True, **extra)
    assert_close(a, full[:, 20:], np.float64, vscale(v))


@pytest.mark.parametrize("name", STATEFUL)
def test_decoding_one_token_at_a_time(name):
    """Decoding: (1, 32, 1, 64) per step, carrying the state, equals the
    full causal call (float32 and float64)."""
    H, d, n = 32, 64, 24
    for dtype in (np.float32, np.float64):
        rng = np.random.default_rng(27)
        q, k, v = qkv(rng, (1, H), n, n, d, d, dtype)
        q, k = prep(name, q, k)
        extra = dict(M=n) if name == "cosformer" else {}
        full = call(name, q, k, v, causal=True, **extra)
        # a prompt of 5 tokens, then one token per call
        o, state = call(name, q[..., :5, :], k[..., :5, :], v[..., :5, :],
                        causal=True, return_state=True, **extra)
        outs = [o]
        for t in range(5, n):
            o, state = call(name, q[..., t:t + 1, :], k[..., t:t + 1, :],
                            v[..., t:t + 1, :], causal=True,
                            initial_state=state, return_state=True, **extra)
            assert o.shape == (1, H, 1, d) and o.dtype == dtype
            outs.append(o)
        assert state.offset == n
        got = np.concatenate(outs, axis=-2)
        t_ = tol(dtype, vscale(v))
        np.testing.assert_allclose(got, full, rtol=t_["rtol"], atol=t_["atol"])
        assert_close(got, ref_out(name, q, k, v, causal=True, **extra), dtype,
                     vscale(v))


def test_state_shape_and_dtype_rules():
    rng = np.random.default_rng(28)
    q = make(rng, (2, 1, 7, 4))
    k = make(rng, (1, 3, 7, 4))
    v = make(rng, (1, 3, 7, 6))
    o, st_ = attnx.linear_attention(q, k, v, causal=True, return_state=True)
    assert o.shape == (2, 3, 7, 6)
    assert st_.S.shape == (2, 3, 4, 6) and st_.z.shape == (2, 3, 4)
    assert isinstance(st_.offset, int) and st_.offset == 7
    # float16 computes in float32: its state is float32
    o, st_ = attnx.linear_attention(q.astype(np.float16), k.astype(np.float16),
                                    v.astype(np.float16), causal=True,
                                    return_state=True)
    assert o.dtype == np.float16 and st_.S.dtype == np.float32
    o2, _ = attnx.linear_attention(q.astype(np.float16), k.astype(np.float16),
                                   v.astype(np.float16), causal=True,
                                   initial_state=st_, return_state=True)
    assert o2.dtype == np.float16
    # a state and out= together
    out = np.full((2, 3, 7, 6), np.nan)
    res = attnx.linear_attention(q, k, v, causal=True, return_state=True,
                                 out=out)
    assert isinstance(res, tuple) and res[0] is out
    assert_close(out, ref.linear_attention(q, k, v, causal=True), np.float64,
                 vscale(v))


# --------------------------------------------------------------------------
# FAVOR+: random_features, approximation of softmax, large inputs
# --------------------------------------------------------------------------

@pytest.mark.parametrize("r,d", [(1, 1), (1, 8), (5, 8), (16, 16), (35, 16),
                                 (64, 64), (100, 7)])
def test_random_features_shape_orthogonal_blocks(r, d):
    W = attnx.random_features(r, d, seed=5)
    assert W.shape == (r, d) and W.dtype.kind == "f"
    W = np.asarray(W, np.float64)
    assert np.all(np.isfinite(W))
    for b in range(0, r, d):
        blk = W[b:b + d]
        G = blk @ blk.T
        nrm = np.sqrt(np.diag(G))
        cos = G / np.outer(nrm, nrm)
        np.testing.assert_allclose(cos, np.eye(len(blk)), atol=1e-12,
                                   err_msg="block at row %d" % b)


def test_random_features_seed():
    a = attnx.random_features(40, 16, seed=123)
    b = attnx.random_features(40, 16, seed=123)
    c = attnx.random_features(40, 16, seed=124)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)
    # no seed: fresh draws
    assert not np.allclose(attnx.random_features(40, 16),
                           attnx.random_features(40, 16))


def test_random_features_norms_are_chi():
    """Row norms ~ chi(d): E|g| = sqrt(2) Gamma((d+1)/2) / Gamma(d/2),
    E|g|^2 = d, Var|g|^2 = 2d. With r = 8192 rows at d = 16 the standard
    errors are sqrt(Var|g| / r) = 0.0078 (Var|g| = d - E|g|^2 ~ 0.49) for the
    mean norm and sqrt(2d / r) = 0.0625 for the mean squared norm; the
    sample variance of |g|^2 (32) has standard error sqrt((mu4 - 32^2)/r)
    ~ 0.59 (mu4 = (2d)^2 (3 + 12/d)). Bounds of 5 standard errors: a correct
    sampler fails with probability < 1e-5 per check, and the seeds are
    fixed; rows scaled to a constant sqrt(d) (variance 0) or plain
    unit-norm rows fail by hundreds of standard errors."""
    d, r = 16, 8192
    for seed in (0, 1):
        W = np.asarray(attnx.random_features(r, d, seed=seed), np.float64)
        nrm = np.linalg.norm(W, axis=1)
        chi_mean = math.sqrt(2) * math.exp(math.lgamma((d + 1) / 2) -
                                           math.lgamma(d / 2))
        assert abs(nrm.mean() - chi_mean) < 5 * 0.0078, (nrm.mean(), chi_mean)
        sq = nrm ** 2
        assert abs(sq.mean() - d) < 5 * 0.0625, sq.mean()
        assert abs(sq.var() - 2 * d) < 5 * 0.59, sq.var()
        # the norms within a block are independent draws, not one per block
        blocks = nrm[: r // d * d].reshape(-1, d)
        assert np.mean(blocks.std(axis=1)) > 0.4


def test_random_features_directions_are_haar():
    """Each row's direction is uniform on the sphere (Haar blocks): for the
    row at a given position inside its block, the mean over the r/d blocks
    of each coordinate of the unit direction is 0 with standard error
    sqrt(1/d / (r/d)) = 1/sqrt(r) = 0.011 (r = 8192). A plain QR without the
    sign fix has Q[0, 0] <= 0 always (LAPACK's Householder), a bias of
    -E|g_1|/|g| ~ -0.2 = 18 standard errors. Bound: 5.5 standard errors over
    the 256 (position, coordinate) means; fixed seed."""
    d, r = 16, 8192
    W = np.asarray(attnx.random_features(r, d, seed=11), np.float64)
    U = W / np.linalg.norm(W, axis=1, keepdims=True)
    U = U.reshape(r // d, d, d)        # (block, position in block, coordinate)
    se = 1 / math.sqrt(r)
    means = U.mean(axis=0)
    assert np.max(np.abs(means)) < 5.5 * se, np.max(np.abs(means))
    # second moments: E u_c^2 = 1/d for every position and coordinate
    sq = (U ** 2).mean(axis=0)
    # Var(u_c^2) = 2 / (d (d + 2)) for a uniform direction
    se2 = math.sqrt(2 / (d * (d + 2)) / (r // d))
    assert np.max(np.abs(sq - 1 / d)) < 5.5 * se2, np.max(np.abs(sq - 1 / d))


def test_random_features_bad_input():
    with pytest.raises(ValueError):
        attnx.random_features(0, 4)
    with pytest.raises(ValueError):
        attnx.random_features(4, 0)
    with pytest.raises(ValueError):
        attnx.random_features(-3, 4)
    with pytest.raises(TypeError):
        attnx.random_features(2.5, 4)


def _rms(a, b):
    return float(np.sqrt(np.mean((np.asarray(a, np.float64) - b) ** 2)))


@pytest.mark.parametrize("causal", [False, True])
def test_favor_approximates_softmax(causal):
    """FAVOR+ with r = 8192 orthogonal random features at d = 16 estimates
    softmax attention with scale 1/sqrt(d). Inputs ~N(0, 0.25) (logits of
    std ~0.25, |x~|^2 ~ 1). Calibrated with an independent numpy Haar
    sampler over 30 seeds (4 heads, n = m = 64, e = 16, v ~ N(0, 1)): the
    RMS error was at most 0.0056 non-causal and 0.0095 causal (mean 0.0040
    and 0.0067). Bounds: twice those maxima, 0.012 and 0.02. A wrong input
    scaling (exp(q.k) instead of exp(q.k/sqrt d)) is off by ~0.12, scale
    1/(2 sqrt d) by ~0.035; both fail."""
    d, r = 16, 8192
    bound = 0.02 if causal else 0.012
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        q = make(rng, (4, 64, d), scale=0.5)
        k = make(rng, (4, 64, d), scale=0.5)
        v = make(rng, (4, 64, 16))
        W = attnx.random_features(r, d, seed=1000 + seed)
        want = ref.softmax_attention(q, k, v, causal=causal)
        for dtype in (np.float64, np.float32):
            got = attnx.linear_attention(q.astype(dtype), k.astype(dtype),
                                         v.astype(dtype), feature_map="favor",
                                         projection=W, causal=causal)
            assert _rms(got, want) < bound, (seed, dtype, _rms(got, want))
        got = attnx.performer_attention(q, k, v, projection=W, causal=causal)
        assert _rms(got, want) < bound
        # the exact FAVOR+ value (same W) in float64
        assert_close(got, ref.linear_attention(q, k, v, "favor", causal=causal,
                                               projection=W), np.float64,
                     vscale(v))


def test_favor_error_shrinks_with_more_features():
    """The estimator's error falls like 1/sqrt(r): from r = 256 to 8192 the
    expected RMS ratio is sqrt(32) ~ 5.7 (calibration: 0.020 -> 0.004).
    Averaged over 4 seeds, require a factor of at least 2.5."""
    d = 16
    small, large = [], []
    for seed in range(4):
        rng = np.random.default_rng(50 + seed)
        q = make(rng, (4, 64, d), scale=0.5)
        k = make(rng, (4, 64, d), scale=0.5)
        v = make(rng, (4, 64, 16))
        want = ref.softmax_attention(q, k, v)
        for r, acc in ((256, small), (8192, large)):
            W = attnx.random_features(r, d, seed=seed)
            acc.append(_rms(attnx.linear_attention(
                q, k, v, feature_map="favor", projection=W), want))
    assert np.mean(small) > 2.5 * np.mean(large), (small, large)


def test_performer_front_end_projection_and_seed():
    rng = np.random.default_rng(29)
    q, k, v = qkv(rng, (2,), 30, 30, 8, 4)
    W = attnx.random_features(64, 8, seed=9)
    a = attnx.performer_attention(q, k, v, num_features=64, seed=9, causal=True)
    b = attnx.linear_attention(q, k, v, feature_map="favor", projection=W,
                               causal=True)
    np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-13)
    c = attnx.performer_attention(q, k, v, projection=W, causal=True)
    np.testing.assert_allclose(c, b, rtol=1e-13, atol=1e-13)
    # repeatable with a seed; default feature count works
    np.testing.assert_array_equal(attnx.performer_attention(q, k, v, seed=3),
                                  attnx.performer_attention(q, k, v, seed=3))
    o = attnx.performer_attention(q, k, v)
    assert o.shape == (2, 30, 4) and np.all(np.isfinite(o))
    w = attnx.attention_weights(q, k, "performer", projection=W, causal=True)
    assert_close(w, ref.linear_weights(q, k, "favor", causal=True,
                                       projection=W), np.float64)


def _aligned_inputs(rng, W, count, small_rows=True, alpha_lo=0.85):
    """(count, d) inputs x with x~ = d**-0.25 x = alpha W_0 + small noise,
    alpha in [alpha_lo, 1]: the exponent W_0.x~ - |x~|^2/2 comes within a
    few percent of its bound |W_0|^2/2; with small_rows, every third row is
    instead a small random vector (all exponents near 0).

    Only queries get small rows: a key's features are scaled by the fixed
    exp(-c), c = max |W_r|^2/2 (docs/linear.md), so a key whose exponents
    all lie more than ~745 (float64) / ~103 (float32) below c underflows to
    zero features by design; a row seeing only such keys would return 0."""
    r, d = W.shape
    alpha = rng.uniform(alpha_lo, 1.0, size=(count, 1))
    xt = alpha * W[0] + 0.01 * rng.standard_normal((count, d))
    if small_rows:
        xt[::3] = 0.05 * rng.standard_normal((len(xt[::3]), d))
    return xt * d ** 0.25


@pytest.mark.parametrize("dtype,bound", [(np.float64, 709.8), (np.float32, 88.8)])
def test_favor_large_exponents_no_overflow(dtype, bound):
    """A projection whose rows have |W_r|^2/2 = 1.1 x the largest exponent
    the dtype's exp can take (float64 709.8, float32 88.7), with queries
    and keys that reach it: the literal features overflow, the stabilised
    kernel must not (docs/linear.md: per-row max for queries, the bound
    c = max |W_r|^2/2 for keys). One orthogonal block of 4 rows of equal
    norm; the inputs lean on row 0, so every term that matters stays within
    the dtype's range after stabilisation. Compared with the log-space
    reference; methods, chunk sizes and streaming pieces agree to 1e-10 in
    float64 (no stabiliser looks at other keys). float32 tolerance: the
    exponent terms are ~2 * 98 in size, rounded to ~2e-5 absolute each, so
    5e-4 relative."""
    d, n = 16, 45
    rng = np.random.default_rng(30)
    W = np.asarray(attnx.random_features(4, d, seed=4), np.float64)
    W = W / np.linalg.norm(W, axis=1, keepdims=True) * math.sqrt(2.2 * bound)
    assert np.sum(W[0] ** 2) / 2 > bound
    q = np.stack([_aligned_inputs(rng, W, n) for _ in range(2)]).astype(dtype)
    k = np.stack([_aligned_inputs(rng, W, n, small_rows=False)
                  for _ in range(2)]).astype(dtype)
    v = make(rng, (2, n, 5), dtype)
    km = rng.random((2, n)) < 0.9
    km[:, 0] = True
    # the literal features of these inputs overflow the dtype
    for x in (q, k):
        xt = f64(x) * d ** -0.25
        expo = xt @ W.T - 0.5 * np.sum(xt * xt, -1, keepdims=True)
        assert expo.max() > math.log(np.finfo(dtype).max)
    t = tol(dtype, vscale(v)) if dtype == np.float64 else \
        dict(rtol=5e-4, atol=5e-4 * vscale(v))
    for causal in (False, True):
        want = favor_weights_logspace(q, k, W, causal, km) @ f64(v)
        outs = {}
        for method in ([None] + METHODS if causal else [None, "quadratic"]):
            got = attnx.linear_attention(q, k, v, feature_map="favor",
                                         projection=W, causal=causal,
                                         key_mask=km, method=method)
            assert np.all(np.isfinite(got)), method
            outs[method] = got
            np.testing.assert_allclose(got, want, err_msg=str(method), **t)
        if causal and dtype == np.float64:
            for method in METHODS:
                np.testing.assert_allclose(outs[method], outs["cumsum"],
                                           rtol=1e-10, atol=1e-10 * vscale(v))
            for c in (1, 3, 7, 64):
                got = attnx.linear_attention(q, k, v, feature_map="favor",
                                             projection=W, causal=True,
                                             key_mask=km, method="chunk",
                                             chunk_size=c)
                np.testing.assert_allclose(got, outs["cumsum"], rtol=1e-10,
                                           atol=1e-10 * vscale(v))
        if causal:
            state, pieces = None, []
            for a, b in [(0, 1), (1, 13), (13, 14), (14, 40), (40, n)]:
                o, state = attnx.linear_attention(
                    q[:, a:b], k[:, a:b], v[:, a:b], feature_map="favor",
                    projection=W, causal=True, key_mask=km[:, a:b],
                    initial_state=state, return_state=True)
                pieces.append(o)
            assert np.all(np.isfinite(state.S)) and np.all(np.isfinite(state.z))
            np.testing.assert_allclose(np.concatenate(pieces, 1),
                                       outs["cumsum"], rtol=t["rtol"] / 10,
                                       atol=t["atol"] / 10)
    w = attnx.attention_weights(q, k, "linear", feature_map="favor",
                                projection=W, causal=True)
    assert np.all(np.isfinite(w))
    np.testing.assert_allclose(w, favor_weights_logspace(q, k, W, True),
                               rtol=t["rtol"], atol=t["rtol"])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scale", [3.0, 30.0])
def test_favor_large_norm_inputs(dtype, scale):
    """Large-norm inputs with an ordinary random_features projection
    (d = 16): at x 3 the exponents reach ~+-60, at x 30 the literal features
    underflow and every mass falls below eps (the result is then ~0). Finite
    and equal to the log-space definition; methods agree. float32: exponent
    terms up to ~60 (x 3) rounded to ~1e-5 absolute: 5e-4 relative."""
    d, n = 16, 33
    rng = np.random.default_rng(31)
    W = attnx.random_features(48, d, seed=2)
    q, k, v = qkv(rng, (2,), n, n, d, 3, dtype)
    q, k = q * scale, k * scale
    t = tol(dtype, vscale(v)) if dtype == np.float64 else \
        dict(rtol=5e-4, atol=5e-4 * vscale(v))
    for causal in (False, True):
        want = favor_weights_logspace(q, k, W, causal) @ f64(v)
        for method in ([None] + METHODS if causal else [None]):
            got = attnx.linear_attention(q, k, v, feature_map="favor",
                                         projection=W, causal=causal,
                                         method=method)
            assert np.all(np.isfinite(got))
            np.testing.assert_allclose(got, want, err_msg=str(method), **t)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_feature_map_large_inputs(dtype):
    """softmax(x) over the features of x * 100 (float32) / x * 1000
    (float64): a naive exp overflows. float32: the differences x_f - max x
    (~300) are rounded to ~2e-5 absolute, so the features carry ~2e-5
    relative error: 5e-4 relative bound."""
    rng = np.random.default_rng(32)
    q, k, v = qkv(rng, (2,), 40, 40, 8, 3, dtype)
    big = 1000 if dtype == np.float64 else 100
    q, k = q * big, k * big
    t = tol(dtype, vscale(v)) if dtype == np.float64 else \
        dict(rtol=5e-4, atol=5e-4 * vscale(v))
    for causal in (False, True):
        want = ref.linear_attention(q, k, v, "softmax", causal=causal)
        for method in ([None] + METHODS if causal else [None]):
            got = attnx.linear_attention(q, k, v, feature_map="softmax",
                                         causal=causal, method=method)
            assert np.all(np.isfinite(got))
            np.testing.assert_allclose(got, want, err_msg=str(method), **t)
    # elu features of huge negative / positive inputs
    got = attnx.linear_attention(q, k, v, feature_map="elu", causal=True)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, ref.linear_attention(q, k, v, "elu",
                                                         causal=True), **t)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [1, 15, 16, 37, 64])
def test_elu_feature_values(dtype, d):
    """The elu + 1 features themselves, read through similarity against
    one-hot keys (psi(0) = 1, psi(-inf) = 0): x + 1 above 0, e^x within 2
    ulps below, down to the underflow edge (float32: -87, float64: -708,
    where the features flush to 0), at every lane of whole and partial
    vectors (float32 AVX-512 computes them in csrc/mk_decode.h). Then NaN,
    +inf and -inf alone in a row of d = 1."""
    lo = -87.0 if dtype == np.float32 else -708.0
    rng = np.random.default_rng(d)
    edge = [lo, lo + 0.01, lo - 0.01, lo - 1, -0.0, 0.0, 1e-30, -1e-30, -0.5, -1e-3,
            1e-3, 3.5, 1e30]
    x = np.concatenate([edge, rng.uniform(lo, 10, 200)]).astype(dtype)
    x = np.resize(x, (-(-x.size // d), d))
    keys = np.where(np.eye(d, dtype=bool), 0, -np.inf).astype(dtype)
    got = attnx.similarity(x, keys, variant="linear", feature_map="elu")
    x64 = x.astype(np.float64)
    want = np.where(x64 > 0, x64 + 1, np.where(x64 < lo, 0, np.exp(np.minimum(x64, 0))))
    ulp = np.finfo(dtype).eps
    np.testing.assert_allclose(got, want, rtol=2 * ulp, atol=0)
    special = np.array([[np.nan], [np.inf], [-np.inf]], dtype)
    got = attnx.similarity(special, np.zeros((1, 1), dtype), variant="linear",
                           feature_map="elu")
    np.testing.assert_array_equal(got, [[np.nan], [np.inf], [0]])


# --------------------------------------------------------------------------
# efficient attention
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_efficient_rows_sum_to_one_and_key_mask(dtype):
    rng = np.random.default_rng(33)
    n, m = 23, 41
    q, k, v = qkv(rng, (2, 3), n, m, 8, 5, dtype)
    w = attnx.attention_weights(q, k, "efficient")
    assert w.shape == (2, 3, n, m) and w.dtype == dtype
    assert np.all(w >= 0)
    np.testing.assert_allclose(w.astype(np.float64).sum(-1), 1.0,
                               rtol=1e-13 if dtype == np.float64 else 1e-5)
    assert_close(w, ref.efficient_weights(q, k), dtype)
    # tiny similarities: no eps clamp (a clamp at 1e-6 would shrink rows)
    qs, ks = q * 1e-3, k * 1e-3
    w = attnx.attention_weights(qs, ks, "efficient")
    np.testing.assert_allclose(w.astype(np.float64).sum(-1), 1.0,
                               rtol=1e-13 if dtype == np.float64 else 1e-5)
    # key_mask removes keys from the key softmax: same as deleting them
    km = rng.random((m,)) < 0.5
    km[3] = True
    got = attnx.efficient_attention(q, k, v, key_mask=km)
    assert_close(got, ref.efficient_attention(q, k, v, key_mask=km), dtype,
                 vscale(v))
    assert_close(got, ref.efficient_attention(q, k[..., km, :], v[..., km, :]),
                 dtype, vscale(v))
    want = attnx.efficient_attention(q, k[..., km, :], v[..., km, :])
    t = tol(dtype, vscale(v))
    np.testing.assert_allclose(got, want, rtol=t["rtol"], atol=t["atol"])
    w = attnx.attention_weights(q, k, "efficient", key_mask=km)
    assert np.all(w[..., ~km] == 0)
    np.testing.assert_allclose(w.astype(np.float64).sum(-1), 1.0,
                               rtol=1e-13 if dtype == np.float64 else 1e-5)
    # per-head key masks
    km2 = rng.random((2, 3, m)) < 0.5
    km2[..., 0] = True
    assert_close(attnx.efficient_attention(q, k, v, key_mask=km2),
                 ref.efficient_attention(q, k, v, key_mask=km2), dtype,
                 vscale(v))
    # no visible key: zeros
    o = attnx.efficient_attention(q, k, v, key_mask=np.zeros(m, bool))
    assert np.all(o == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_efficient_large_inputs_stable(dtype):
    rng = np.random.default_rng(34)
    q, k, v = qkv(rng, (2,), 30, 50, 6, 4, dtype)
    q, k = q * 300, k * 300
    got = attnx.efficient_attention(q, k, v)
    assert np.all(np.isfinite(got))
    assert_close(got, ref.efficient_attention(q, k, v), dtype, vscale(v))


def test_efficient_similarity_equals_weights():
    """s_ij = rho_q(q_i).rho_k(k_j) already sums to 1 over j: the
    similarity of efficient attention is its weight matrix."""
    rng = np.random.default_rng(35)
    q, k, _ = qkv(rng, (2,), 9, 13, 4, 1)
    km = rng.random(13) < 0.7
    s = attnx.similarity(q, k, "efficient", key_mask=km)
    assert_close(s, ref.efficient_weights(q, k, km), np.float64)


def test_efficient_rejects_causal():
    rng = np.random.default_rng(36)
    q, k, v = qkv(rng, (), 5, 5, 3, 2)
    for causal in (True, "lower_right", "upper_left"):
        with pytest.raises(ValueError, match="causal"):
            attnx.efficient_attention(q, k, v, causal=causal)
        with pytest.raises(ValueError, match="causal"):
            attnx.attention_weights(q, k, "efficient", causal=causal)


# --------------------------------------------------------------------------
# cosFormer
# --------------------------------------------------------------------------

@pytest.mark.parametrize("n,m", [(1, 1), (5, 5), (7, 19), (19, 7), (64, 64)])
def test_cosformer_default_M_and_positions(n, m):
    rng = np.random.default_rng(37)
    q, k, v = qkv(rng, (2,), n, m, 4, 3)
    o = attnx.cosformer_attention(q, k, v)
    np.testing.assert_array_equal(o, attnx.cosformer_attention(q, k, v,
                                                                M=max(n, m)))
    assert_close(o, ref.cosformer_attention(q, k, v, M=max(n, m)), np.float64,
                 vscale(v))
    # M larger than the default changes the result (positions are weighted)
    if max(n, m) > 1:
        o2 = attnx.cosformer_attention(q, k, v, M=3 * max(n, m))
        assert_close(o2, ref.cosformer_attention(q, k, v, M=3 * max(n, m)),
                     np.float64, vscale(v))
    # similarity: relu . relu * cos(pi/2 (i - j)/M) >= 0, with 1-based
    # positions: M = max(n, m) is allowed (the largest |i - j| is M - 1)
    s = attnx.similarity(q, k, "cosformer")
    assert np.all(s >= 0)
    assert_close(s, ref.cosformer_similarity(q, k), np.float64)


def test_cosformer_state_uses_one_based_positions():
    """The state's features are [relu(k) sin(theta_t), relu(k) cos(theta_t)]
    with theta_t = pi/2 t / M at 1-based positions t = 1..m (only the state
    shows absolute positions; s_ij depends on i - j alone)."""
    rng = np.random.default_rng(38)
    n, M = 12, 20
    q, k, v = qkv(rng, (2,), n, n, 3, 2)
    _, state = attnx.cosformer_attention(q, k, v, causal=True, M=M,
                                         return_state=True)
    _check_state("cosformer", state, k, v, None, M)
    # continuing: positions 13.., the offset shifts them
    q2, k2, v2 = qkv(rng, (2,), 8, 8, 3, 2)
    o2, state2 = attnx.cosformer_attention(q2, k2, v2, causal=True, M=M,
                                           initial_state=state,
                                           return_state=True)
    assert state2.offset == 20
    _check_state("cosformer", state2, np.concatenate([k, k2], 1),
                 np.concatenate([v, v2], 1), None, M)
    full = ref.cosformer_attention(np.concatenate([q, q2], 1),
                                   np.concatenate([k, k2], 1),
                                   np.concatenate([v, v2], 1), causal=True, M=M)
    assert_close(o2, full[:, n:], np.float64, vscale(v))


def test_cosformer_M_errors():
    rng = np.random.default_rng(39)
    q, k, v = qkv(rng, (), 8, 8, 3, 2)
    for M in (7, 1, 7.5):
        with pytest.raises(ValueError, match="M"):
            attnx.cosformer_attention(q, k, v, M=M)
    for M in (0, -3, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="M"):
            attnx.cosformer_attention(q, k, v, M=M)
    # n != m: M must cover the larger one
    with pytest.raises(ValueError, match="M"):
        attnx.cosformer_attention(q[:3], k, v, M=5)
    attnx.cosformer_attention(q[:3], k, v, M=8)
    # streaming: a fixed M is required, and must cover offset + n
    with pytest.raises(ValueError, match="M"):
        attnx.cosformer_attention(q, k, v, causal=True, return_state=True)
    _, state = attnx.cosformer_attention(q, k, v, causal=True, M=10,
                                         return_state=True)
    with pytest.raises(ValueError, match="M"):
        attnx.cosformer_attention(q[:3], k[:3], v[:3], causal=True, M=10,
                                  initial_state=state)
    attnx.cosformer_attention(q[:2], k[:2], v[:2], causal=True, M=10,
                              initial_state=state)
    with pytest.raises(ValueError, match="M"):
        attnx.cosformer_attention(q[:2], k[:2], v[:2], causal=True,
                                  initial_state=state)
    # causal needs n == m
    for causal in (True, "lower_right", "upper_left"):
        with pytest.raises(ValueError, match=r"\bn\b|\bm\b|causal"):
            attnx.cosformer_attention(q[:5], k, v, causal=causal)


def test_cosformer_float32_long_sequence():
    rng = np.random.default_rng(40)
    n = 300
    q, k, v = qkv(rng, (2,), n, n, 8, 4, np.float32)
    for method in METHODS:
        got = attnx.cosformer_attention(q, k, v, causal=True, method=method)
        assert_close(got, ref.cosformer_attention(q, k, v, causal=True),
                     np.float32, vscale(v), err_msg=method)


# --------------------------------------------------------------------------
# feature-map details: taylor non-negativity, focused p, callables, identity
# --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["taylor", "taylor_front"])
def test_taylor_similarity_nonnegative_at_opposite_vectors(name):
    """s = 1 + cos(q, k) is 0 at k = -q: it must not come out negative by
    rounding (property 2), and weights stay >= 0."""
    rng = np.random.default_rng(41)
    for dtype in (np.float32, np.float64):
        q = make(rng, (64, 7), dtype, 3.0)
        k = -q
        s = similarity(name, q, k)
        assert np.all(s >= 0), float(s.min())
        np.testing.assert_allclose(np.diag(s.astype(np.float64)), 0.0,
                                   atol=1e-6 if dtype == np.float32 else 1e-14)
        w = weights(name, q, k, causal=True)
        assert np.all(w >= 0), float(w.min())
        # zero vectors: features [1, 0...] -> s = 1
        z = np.zeros((3, 7), dtype)
        np.testing.assert_allclose(similarity(name, z, q[:4]), 1.0, rtol=1e-6)


@pytest.mark.parametrize("name", ["taylor", "taylor_front"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_taylor_d1_opposite_signs_exact_zero(name, dtype):
    """d = 1: the features [1, x/|x|] are exactly [1, +-1] (x / sqrt(x*x)
    is exact in IEEE arithmetic), so s_ij = 1 + sign(q_i) sign(k_j) is
    exactly 0 or 2. A row whose visible keys all have the other sign has
    mass exactly 0 and must be exactly 0 (every method); otherwise its
    weights are exactly uniform over the same-sign keys. Rounded features
    (1 +- ulp) give s = -+ulp, which the eps clamp turns into weights of
    ulp / eps: 0.1 in float32, and negative similarities."""
    rng = np.random.default_rng(60)
    n = 200
    q, k, v = qkv(rng, (), n, n, 1, 3, dtype)
    k[:6], q[[0, 2, 5]] = np.abs(k[:6]), -np.abs(q[[0, 2, 5]])  # zero rows
    want = ref_out(name, q, k, v, causal=True)
    s = similarity(name, q, k)
    assert np.all(s >= 0), float(s.min())
    assert_close(s, np.where(np.sign(q) == np.sign(k.T), 2.0, 0.0), dtype)
    for method in METHODS:
        for c in ([None, 1, 4] if method == "chunk" else [None]):
            got = call(name, q, k, v, causal=True, method=method, chunk_size=c)
            zero = np.all(ref.linear_similarity(q, k, "taylor", causal=True)
                          == 0, axis=-1)
            assert zero.any()
            assert np.all(got[zero] == 0), (method, c, got[zero])
            assert_close(got, want, dtype, vscale(v), err_msg=method)


@pytest.mark.parametrize("p", [1, 1.5, 2, 3, 4.0, 7])
def test_focused_power(p):
    rng = np.random.default_rng(42)
    q, k, v = qkv(rng, (2,), 21, 21, 6, 3)
    want = ref.linear_attention(q, k, v, "focused", causal=True, p=p)
    assert_close(attnx.linear_attention(q, k, v, feature_map="focused", p=p,
                                        causal=True), want, np.float64,
                 vscale(v))
    assert_close(attnx.focused_linear_attention(q, k, v, p=p, causal=True),
                 want, np.float64, vscale(v))
    assert_close(attnx.focused_linear_attention(q, k, v, p, causal=True),
                 want, np.float64, vscale(v))
    w = attnx.attention_weights(q, k, "focused", p=p, causal=True)
    assert_close(w, ref.linear_weights(q, k, "focused", causal=True, p=p),
                 np.float64)


def test_focused_zero_vectors_give_zero_rows():
    """relu(x) = 0 (all entries <= 0): zero features, zero mass, zero row."""
    rng = np.random.default_rng(43)
    q, k, v = qkv(rng, (), 10, 10, 4, 3)
    q[3] = -np.abs(q[3])
    k[:, :] = np.where(np.arange(10)[:, None] < 4, -np.abs(k), k)
    for method in METHODS:
        o = attnx.linear_attention(q, k, v, feature_map="focused", causal=True,
                                   method=method)
        assert not np.any(np.isnan(o))
        assert np.all(o[3] == 0) and np.all(o[:4] == 0), method
        assert_close(o, ref.linear_attention(q, k, v, "focused", causal=True),
                     np.float64, vscale(v))
    o = attnx.linear_attention(q, k, v, feature_map="relu", causal=True)
    assert np.all(o[3] == 0) and np.all(o[:4] == 0)


def test_callable_feature_map_calls_and_result():
    rng = np.random.default_rng(44)
    q, k, v = qkv(rng, (2, 3), 9, 11, 4, 2)
    seen = []

    def f(x):
        seen.append(np.asarray(x).shape)
        return fm_callable(x)

    got = attnx.linear_attention(q, k, v, feature_map=f, causal=True)
    assert_close(got, ref.linear_attention(q, k, v, fm_callable, causal=True),
                 np.float64, vscale(v))
    assert len(seen) >= 2
    # float32 inputs: the features are used in float32
    got = attnx.linear_attention(q.astype(np.float32), k.astype(np.float32),
                                 v.astype(np.float32), feature_map=f)
    assert got.dtype == np.float32
    # a callable with r != d, streaming
    o, state = attnx.linear_attention(q, k, v, feature_map=f, causal=True,
                                      return_state=True)
    assert state.S.shape == (2, 3, 8, 2)


def test_identity_features():
    rng = np.random.default_rng(45)
    q, k, v = qkv(rng, (2,), 9, 11, 4, 2)
    q, k = np.abs(q), np.abs(k)
    got = attnx.linear_attention(q, k, v, feature_map="identity", causal=True)
    want = ref.linear_attention(q, k, v, "identity", causal=True)
    assert_close(got, want, np.float64, vscale(v))
    # zeros are allowed (a zero row gives zeros)
    q[:, 0] = 0
    o = attnx.linear_attention(q, k, v, feature_map="identity")
    assert np.all(o[:, 0] == 0) and not np.any(np.isnan(o))


# --------------------------------------------------------------------------
# dtypes, out=, empty sizes, inputs never written, NaN
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dts,want_dtype", [
    ((np.float32, np.float64, np.float64), np.float64),
    ((np.float64, np.float32, np.float32), np.float64),
    ((np.float16, np.float32, np.float32), np.float32),
    ((np.float16, np.float16, np.float16), np.float16),
    ((np.int64, np.int64, np.int64), np.float64),
    ((np.int32, np.int16, np.int8), np.float64),
    ((np.bool_, np.bool_, np.bool_), np.float64),
    ((np.int32, np.float32, np.float32), np.float64),
])
@pytest.mark.parametrize("name", VARIANTS)
def test_dtype_promotion(dts, want_dtype, name):
    q, k, v = mixed_dtype_qkv(np.random.default_rng(46), dts)
    q, k = prep(name, q, k)
    causal = name != "efficient" and name != "cosformer"
    got = call(name, q, k, v, causal=causal)
    assert got.dtype == want_dtype, (dts, got.dtype)
    want = ref_out(name, q, k, v, causal=causal)
    if np.dtype(want_dtype) == np.float16:
        assert_close(got, want, np.float16, vscale(v))
        # computed in float32, rounded once
        want32 = call(name, q.astype(np.float32), k.astype(np.float32),
                      v.astype(np.float32), causal=causal)
        np.testing.assert_allclose(got.astype(np.float64),
                                   want32.astype(np.float64),
                                   rtol=2 ** -11 + 1e-5, atol=1e-6)
    else:
        assert_close(got, want, want_dtype, vscale(v))


@pytest.mark.parametrize("name", VARIANTS)
def test_bad_dtype_raises_typeerror(name):
    rng = np.random.default_rng(47)
    for which in range(3):
        arrs = list(qkv(rng, (), 3, 4, 2, 2))
        arrs[which] = arrs[which].astype(np.complex128)
        with pytest.raises(TypeError):
            call(name, *arrs)
        arrs[which] = np.array(arrs[which], dtype=object)
        with pytest.raises(TypeError):
            call(name, *arrs)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", VARIANTS)
def test_out(dtype, name):
    rng = np.random.default_rng(48)
    q, k, v = qkv(rng, (2, 3), 9, 12, 4, 5, dtype)
    q, k = prep(name, q, k)
    want = ref_out(name, q, k, v)
    out = np.full((2, 3, 9, 5), np.nan, dtype=dtype)
    assert call(name, q, k, v, out=out) is out
    assert_close(out, want, dtype, vscale(v))
    # a last-axis-contiguous view of a wider buffer
    buf = np.full((2, 9, 3, 10), 7.0, dtype=dtype)
    view = buf.transpose(0, 2, 1, 3)[..., :5]
    assert call(name, q, k, v, out=view) is view
    assert_close(view, want, dtype, vscale(v))
    assert np.all(buf[..., 5:] == 7.0)
    # wrong shape / dtype / overlap
    with pytest.raises(ValueError, match="out"):
        call(name, q, k, v, out=np.zeros((2, 3, 9, 4), dtype))
    other = np.float64 if dtype == np.float32 else np.float32
    with pytest.raises((TypeError, ValueError), match="out"):
        call(name, q, k, v, out=np.zeros((2, 3, 9, 5), other))
    vv = np.ascontiguousarray(np.broadcast_to(v[..., :1, :], (2, 3, 9, 5)))
    with pytest.raises(ValueError, match="out|overlap"):
        call(name, q, k[..., :9, :], vv, out=vv)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", VARIANTS)
def test_empty_sizes(dtype, name):
    rng = np.random.default_rng(49)
    causal = name != "efficient"
    # n == 0 (cosFormer causal needs n == m: use n == m == 0 there)
    m0 = 0 if name == "cosformer" else 5
    q, k, v = qkv(rng, (2,), 0, m0, 3, 4, dtype)
    q, k = prep(name, q, k)
    o = call(name, q, k, v, causal=causal)
    assert o.shape == (2, 0, 4) and o.dtype == dtype
    # m == 0 -> zeros
    q, k, v = qkv(rng, (2,), 6, 0, 3, 4, dtype)
    q, k = prep(name, q, k)
    o = call(name, q, k, v)
    assert o.shape == (2, 6, 4) and np.all(o == 0) and o.dtype == dtype
    out = np.full((2, 6, 4), np.nan, dtype)
    assert call(name, q, k, v, out=out) is out
    assert np.all(out == 0)
    if causal and name != "cosformer":
        o = call(name, q, k, v, causal=True)
        assert np.all(o == 0)
    # zero heads, e == 0
    q, k, v = qkv(rng, (0, 3), 6, 5, 3, 4, dtype)
    q, k = prep(name, q, k)
    assert call(name, q, k, v).shape == (0, 3, 6, 4)
    q, k, v = qkv(rng, (2,), 6, 5, 3, 0, dtype)
    q, k = prep(name, q, k)
    assert call(name, q, k, v).shape == (2, 6, 0)
    # weights of empty sizes
    assert weights(name, np.zeros((0, 3), dtype), np.ones((4, 3), dtype)).shape \
        == (0, 4)
    w = weights(name, np.ones((2, 3), dtype), np.ones((0, 3), dtype))
    assert w.shape == (2, 0)


@pytest.mark.parametrize("name", STATEFUL)
def test_streaming_empty_pieces(name):
    """An empty piece (n == m == 0) keeps the state."""
    rng = np.random.default_rng(50)
    q, k, v = qkv(rng, (2,), 10, 10, 3, 2)
    q, k = prep(name, q, k)
    extra = dict(M=10) if name == "cosformer" else {}
    full = call(name, q, k, v, causal=True, **extra)
    got, state = _stream(name, q, k, v, [0, 4, 4, 10], extra.get("M"))
    assert_close(got, full, np.float64, vscale(v))


@pytest.mark.parametrize("name", VARIANTS)
def test_inputs_never_written(name):
    rng = np.random.default_rng(51)
    q, k, v = qkv(rng, (2,), 33, 33, 5, 4)
    q, k = prep(name, q, k)
    km = rng.random((2, 33)) < 0.8
    arrays = [q, k, v, km]
    copies = [a.copy() for a in arrays]
    for a in arrays:
        a.flags.writeable = False
    causal = name != "efficient"
    extra = dict(M=66) if name == "cosformer" else {}
    call(name, q, k, v, causal=causal, key_mask=km, **extra)
    weights(name, q, k, causal=causal, key_mask=km, **extra)
    similarity(name, q, k, causal=causal, key_mask=km, **extra)
    if causal:
        for method in METHODS:
            call(name, q, k, v, causal=True, key_mask=km, method=method, **extra)
        _, state = call(name, q, k, v, causal=True, return_state=True, **extra)
        S, z = state.S.copy(), state.z.copy()
        state.S.flags.writeable = False
        state.z.flags.writeable = False
        call(name, q, k, v, causal=True, initial_state=state, **extra)
        np.testing.assert_array_equal(state.S, S)
        np.testing.assert_array_equal(state.z, z)
    for a, c in zip(arrays, copies):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("name", VARIANTS)
def test_nan_query_row_isolated(name):
    rng = np.random.default_rng(52)
    n = 150
    q, k, v = qkv(rng, (2,), n, n, 6, 3)
    q, k = prep(name, q, k)
    q[1, 77, 3] = np.nan
    causal = name != "efficient"
    for method in ([None] + METHODS if causal else [None]):
        o = call(name, q, k, v, causal=causal, method=method)
        assert np.all(np.isnan(o[1, 77])), method
        keep = np.ones((2, n), bool)
        keep[1, 77] = False
        want = ref_out(name, np.where(keep[..., None], q, 0.5), k, v,
                       causal=causal)
        assert_close(o[keep], want[keep], np.float64, vscale(v),
                     err_msg=str(method))


# The float32 chunk method on AVX-512 runs whole chunks of 16 through one
# fused register-blocked kernel (features in blocks of 8, values in whole
# vectors: r % 8 == 0, e % 16 == 0); partial chunks, other sizes and value
# blocks holding inf or NaN take the general path. Both must agree with the
# reference and with each other, for every shape the kernel blocks
# differently (r % 6 in {0, 2, 4}, e in 1..4 vectors and past 64).
FUSED_SHAPES = [(64, 64, 64, 64), (100, 100, 32, 48), (96, 130, 48, 16),
                (130, 96, 64, 80), (70, 70, 128, 128), (48, 48, 40, 32)]


@pytest.mark.parametrize("n,m,d,e", FUSED_SHAPES)
@pytest.mark.parametrize("name", ["elu", "relu", "softmax", "focused", "favor64",
                                  "cosformer"])
def test_fused_chunk_kernel_float32(n, m, d, e, name):
    rng = np.random.default_rng(n + 3 * d + e)
    q, k, v = qkv(rng, (2,), n, m, d, e, np.float32)
    key_mask = rng.random((2, m)) < 0.8
    if name == "favor64":
        W = (rng.standard_normal((64, d)) * 0.5).astype(np.float32)
        fn = lambda *args, **kw: attnx.linear_attention(*args, feature_map="favor",
                                                        projection=W, **kw)
        rf = lambda *args, **kw: ref.linear_attention(*args, "favor", projection=W, **kw)
    elif name == "cosformer":
        fn, rf = attnx.cosformer_attention, ref.cosformer_attention
    else:
        fn = lambda *args, **kw: attnx.linear_attention(*args, feature_map=name, **kw)
        rf = lambda *args, **kw: ref.linear_attention(*args, name, **kw)
    for causal in CAUSAL_MODES:
        if name == "cosformer" and n != m:
            continue  # causal cosFormer needs n == m
        for km in (None, key_mask):
            got = fn(q, k, v, causal=causal, key_mask=km)
            want = rf(f64(q), f64(k), f64(v), causal=causal, key_mask=km)
            assert_close(got, want, np.float32, vscale(v), err_msg=str((causal, km is None)))
            other = fn(q, k, v, causal=causal, key_mask=km, method="recurrent")
            assert_close(got, other, np.float32, vscale(v), err_msg="recurrent")


def test_fused_chunk_kernel_nan_and_inf():
    """NaN or inf in a key reaches only the rows that see it, also inside a
    chunk of the fused kernel; a value block holding NaN takes the general
    path with the same guarantee; keys removed by key_mask reach nothing."""
    rng = np.random.default_rng(54)
    n, d = 96, 64
    q, k, v = qkv(rng, (), n, n, d, d, np.float32)
    clean = attnx.linear_attention(q, k, v, causal=True)
    for bad in (21, 40, 95):
        k2, v2 = k.copy(), v.copy()
        k2[bad, 5] = np.nan
        v2[bad + 1 if bad < 95 else bad, 7] = np.inf
        o = attnx.linear_attention(q, k2, v2, causal=True)
        assert_close(o[:bad], clean[:bad], np.float32, vscale(v), err_msg=str(bad))
        assert np.all(np.isnan(o[bad:])), bad
        km = np.ones(n, bool)
        km[bad] = False
        if bad < 95:
            km[bad + 1] = False
        o = attnx.linear_attention(q, k2, v2, causal=True, key_mask=km)
        want = ref.linear_attention(f64(q), f64(k), f64(v), causal=True, key_mask=km)
        assert np.all(np.isfinite(o))
        assert_close(o, want, np.float32, vscale(v), err_msg=str(bad))


@pytest.mark.parametrize("name", STATEFUL)
@pytest.mark.parametrize("method", [None, "chunk", "recurrent", "cumsum",
                                    "quadratic"])
def test_nan_in_future_or_masked_keys_has_no_effect(name, method):
    """docs/conventions.md: NaN/inf never poison unrelated rows. Causal: a NaN value
    of key j does not reach rows i < j (any method, any chunk size, the
    key inside the query's chunk too); a key removed by key_mask can hold
    NaN/inf in its key and value."""
    rng = np.random.default_rng(53)
    n = 40
    q, k, v = qkv(rng, (), n, n, 5, 3)
    q, k = prep(name, q, k)
    v2 = v.copy()
    v2[-1] = np.nan
    v2[-5, 1] = np.inf
    for c in ([None, 1, 8, 64] if method in (None, "chunk", "quadratic")
              else [None]):
        o = call(name, q, k, v2, causal=True, method=method, chunk_size=c)
        assert_close(o[:-5], call(name, q, k, v, causal=True)[:-5], np.float64,
                     vscale(v), err_msg="chunk_size=%s" % c)
    km = np.ones(n, bool)
    km[[3, 17, 30]] = False
    k2 = k.copy()
    v3 = v.copy()
    k2[[3, 30]] = np.nan
    v3[[17, 30]] = np.inf
    v3[3] = np.nan
    o = call(name, q, k2, v3, causal=True, key_mask=km, method=method)
    assert not np.any(np.isnan(o))
    assert_close(o, ref_out(name, q, k, v, causal=True, key_mask=km),
                 np.float64, vscale(v))
    o = call(name, q, k2, v3, key_mask=km, method=method)
    assert not np.any(np.isnan(o))
    assert_close(o, ref_out(name, q, k, v, key_mask=km), np.float64, vscale(v))


# --------------------------------------------------------------------------
# bad input: clear exceptions naming the argument
# --------------------------------------------------------------------------

def _base(rng=None):
    rng = rng or np.random.default_rng(54)
    return qkv(rng, (2,), 4, 5, 3, 2)


def test_error_unknown_feature_map_and_method():
    q, k, v = _base()
    for bad in ["gelu", "ELU", "", "favor+"]:
        with pytest.raises(ValueError, match="feature_map"):
            attnx.linear_attention(q, k, v, feature_map=bad)
        with pytest.raises(ValueError, match="feature_map"):
            attnx.attention_weights(q, k, "linear", feature_map=bad)
    for bad in [3, None, 1.5]:
        with pytest.raises((TypeError, ValueError), match="feature_map"):
            attnx.linear_attention(q, k, v, feature_map=bad)
    for bad in ["parallel", "Chunk", "", "scan"]:
        with pytest.raises(ValueError, match="method"):
            attnx.linear_attention(q, k, v, method=bad, causal=True)
    with pytest.raises((TypeError, ValueError), match="method"):
        attnx.linear_attention(q, k, v, method=1, causal=True)
    for bad in ["upper-left", "lower", "", 2]:
        with pytest.raises((TypeError, ValueError), match="causal"):
            attnx.linear_attention(q, k, v, causal=bad)


def test_error_bad_eps():
    q, k, v = _base()
    for bad in [-1e-6, -1.0, float("nan"), float("inf")]:
        with pytest.raises(ValueError, match="eps"):
            attnx.linear_attention(q, k, v, eps=bad)
        with pytest.raises(ValueError, match="eps"):
            attnx.cosformer_attention(q, k, v, eps=bad)
    for bad in ["1e-6", None, [1e-6]]:
        with pytest.raises((TypeError, ValueError), match="eps"):
            attnx.linear_attention(q, k, v, eps=bad)


def test_error_chunk_size():
    q, k, v = _base()
    for bad in [0, -1, -64]:
        with pytest.raises(ValueError, match="chunk_size"):
            attnx.linear_attention(q, k, v, causal=True, chunk_size=bad)
    for bad in [1.5, "8", True]:
        with pytest.raises((TypeError, ValueError), match="chunk_size"):
            attnx.linear_attention(q, k, v, causal=True, chunk_size=bad)
    # numpy integers are fine, huge sizes act like n
    got = attnx.linear_attention(q, k, v, causal=True, chunk_size=np.int64(2))
    assert_close(got, ref.linear_attention(q, k, v, causal=True), np.float64,
                 vscale(v))
    got = attnx.linear_attention(q, k, v, causal=True, chunk_size=2 ** 62)
    assert_close(got, ref.linear_attention(q, k, v, causal=True), np.float64,
                 vscale(v))


def test_error_favor_projection():
    q, k, v = _base()
    with pytest.raises(ValueError, match="projection"):
        attnx.linear_attention(q, k, v, feature_map="favor")
    for bad in [np.ones((5, 2)), np.ones((5, 4)), np.ones(3), np.ones((2, 5, 3))]:
        with pytest.raises(ValueError, match="projection"):
            attnx.linear_attention(q, k, v, feature_map="favor", projection=bad)
        with pytest.raises(ValueError, match="projection"):
            attnx.performer_attention(q, k, v, projection=bad)
    with pytest.raises((TypeError, ValueError), match="projection"):
        attnx.linear_attention(q, k, v, feature_map="favor",
                               projection=np.ones((5, 3), np.complex128))


def test_error_key_mask():
    q, k, v = _base()
    for name in VARIANTS:
        qq, kk = prep(name, q, k)
        for dt in [np.float64, np.int64, np.uint8]:
            with pytest.raises(TypeError, match="key_mask"):
                call(name, qq, kk, v, key_mask=np.ones(5, dtype=dt))
        for shape in [(4,), (6,), (3, 5), (2, 4, 5), (5, 1)]:
            with pytest.raises(ValueError, match="key_mask"):
                call(name, qq, kk, v, key_mask=np.ones(shape, bool))


def test_error_state_from_another_call():
    rng = np.random.default_rng(55)
    q, k, v = qkv(rng, (2,), 6, 6, 3, 2)
    _, state = attnx.linear_attention(q, k, v, causal=True, return_state=True)
    # another dtype
    with pytest.raises((TypeError, ValueError), match="initial_state|state"):
        attnx.linear_attention(q.astype(np.float32), k.astype(np.float32),
                               v.astype(np.float32), causal=True,
                               initial_state=state)
    # another e, another d (r), another feature size
    with pytest.raises(ValueError, match="initial_state|state"):
        attnx.linear_attention(q, k, make(rng, (2, 6, 3)), causal=True,
                               initial_state=state)
    with pytest.raises(ValueError, match="initial_state|state"):
        attnx.linear_attention(make(rng, (2, 6, 4)), make(rng, (2, 6, 4)), v,
                               causal=True, initial_state=state)
    with pytest.raises(ValueError, match="initial_state|state"):
        attnx.linear_attention(q, k, v, causal=True, initial_state=state,
                               feature_map="taylor")
    # another batch shape (not broadcastable)
    with pytest.raises(ValueError, match="initial_state|state|broadcast"):
        attnx.linear_attention(make(rng, (3, 6, 3)), make(rng, (3, 6, 3)),
                               make(rng, (3, 6, 2)), causal=True,
                               initial_state=state)
    # not a state
    with pytest.raises((TypeError, ValueError), match="initial_state"):
        attnx.linear_attention(q, k, v, causal=True, initial_state=(1, 2, 3))
    with pytest.raises((TypeError, ValueError), match="initial_state"):
        attnx.linear_attention(q, k, v, causal=True, initial_state=state.S)


def test_error_callable_features():
    q, k, v = _base()
    with pytest.raises(ValueError, match="negative"):
        attnx.linear_attention(q, k, v, feature_map=lambda x: x)
    with pytest.raises(ValueError, match="shape|features"):
        attnx.linear_attention(q, k, v, feature_map=lambda x: np.abs(x)[..., 0])
    with pytest.raises(ValueError, match="shape|features"):
        attnx.linear_attention(q, k, v, feature_map=lambda x: np.abs(x)[:1])
    with pytest.raises(ValueError, match="shape|features"):
        attnx.linear_attention(q, k, v, feature_map=lambda x: np.abs(x).T)
    calls = []

    def varying(x):  # q and k get different feature sizes
        calls.append(1)
        return np.abs(x)[..., :len(calls) + 1]
    with pytest.raises(ValueError, match="features|r\\b|agree"):
        attnx.linear_attention(q, k, v, feature_map=varying)
    with pytest.raises(TypeError):
        attnx.linear_attention(q, k, v,
                               feature_map=lambda x: np.abs(x).astype(complex))
    with pytest.raises(ValueError, match="negative"):
        attnx.linear_attention(q, k, v, feature_map=lambda x: x * 0 - 1)
    # an exception inside the callable propagates unchanged
    def boom(x):
        raise KeyError("boom")
    with pytest.raises(KeyError, match="boom"):
        attnx.linear_attention(q, k, v, feature_map=boom)


def test_error_identity_negative():
    q, k, v = _base()
    qa, ka = np.abs(q), np.abs(k)
    with pytest.raises(ValueError, match="negative|identity"):
        attnx.linear_attention(q, ka, v, feature_map="identity")
    with pytest.raises(ValueError, match="negative|identity"):
        attnx.linear_attention(qa, k, v, feature_map="identity")
    qa[0, 0, 0] = -1e-300
    with pytest.raises(ValueError, match="negative|identity"):
        attnx.linear_attention(qa, ka, v, feature_map="identity", causal=True)


def test_error_focused_p():
    q, k, v = _base()
    for bad in [0, -1, float("nan"), float("inf")]:
        with pytest.raises(ValueError, match=r"\bp\b"):
            attnx.focused_linear_attention(q, k, v, p=bad)
        with pytest.raises(ValueError, match=r"\bp\b"):
            attnx.linear_attention(q, k, v, feature_map="focused", p=bad)


def test_error_shapes():
    q, k, v = _base()
    for name in VARIANTS:
        qq, kk = prep(name, q, k)
        with pytest.raises(ValueError, match=r"\bq\b|\bk\b"):
            call(name, qq, kk[..., :2], v)
        with pytest.raises(ValueError, match=r"\bk\b|\bv\b"):
            call(name, qq, kk, v[:, :4])
        with pytest.raises(ValueError, match=r"\bq\b"):
            call(name, qq[0, 0], kk, v)
        with pytest.raises(ValueError, match=r"\bq\b|\bk\b|\bv\b|broadcast"):
            call(name, np.stack([qq] * 3), np.stack([kk] * 2), v)


def test_error_unknown_keyword():
    q, k, v = _base()
    for name in VARIANTS:
        qq, kk = prep(name, q, k)
        with pytest.raises(TypeError, match="is_causal"):
            call(name, qq, kk, v, is_causal=True)
        with pytest.raises(TypeError):
            attnx.attention_weights(qq, kk, WVARIANT[name], nonsense=1)
    with pytest.raises(TypeError):
        attnx.efficient_attention(q, k, v, mask=np.ones((4, 5), bool))
    with pytest.raises(ValueError, match="variant|bogus"):
        attnx.attention_weights(q, k, variant="bogus")
    with pytest.raises(ValueError, match="projection"):
        attnx.linear_attention(q, k, v, feature_map="elu",
                               projection=np.ones((4, 3)))


def test_error_streaming_with_mask_or_window():
    """A state keeps no key positions: mask=/window= with streaming is a
    clear ValueError (the quadratic form has no carried state)."""
    q, k, v = _base()
    with pytest.raises(ValueError, match="mask|window|state"):
        attnx.linear_attention(q, k, v, causal=True, return_state=True,
                               mask=np.ones((4, 5), bool))
    with pytest.raises(ValueError, match="mask|window|state"):
        attnx.linear_attention(q, k, v, causal=True, return_state=True,
                               window=2)


def test_cumsum_refuses_large_sizes():
    """method='cumsum' materialises (m + 1) prefix states: it refuses sizes
    whose prefix tensor would not fit, with a message giving the size. A
    modest input (m = 300, d = e = 1024: 2.5 GB of prefix states) ..."""
    rng = np.random.default_rng(56)
    q, k, v = qkv(rng, (), 300, 300, 1024, 1024, np.float64)
    with pytest.raises(ValueError, match="cumsum") as ei:
        attnx.linear_attention(q, k, v, causal=True, method="cumsum")
    assert "301" in str(ei.value) or "300" in str(ei.value), str(ei.value)
    # smaller sizes run
    o = attnx.linear_attention(q[:40, :64], k[:40, :64], v[:40, :64],
                               causal=True, method="cumsum")
    assert o.shape == (40, 64)


def test_cumsum_refuses_huge_broadcast_n_without_allocating():
    """... and a huge n built with np.broadcast_to from a tiny array (2**28
    rows of d = 4: 8 GiB if copied, 43 GB of prefix states): a ValueError
    naming the size, with nothing big allocated. Run in a subprocess under
    a 3 GiB address-space limit so that a copy fails there, not here."""
    out = run_isolated("""
        import os, resource
        # AddressSanitizer reserves terabytes of shadow address space, so
        # the limit is left off in the sanitizer run (tests/run_sanitizers.sh)
        if "libasan" not in os.environ.get("LD_PRELOAD", ""):
            resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        n = 2 ** 28
        x = np.broadcast_to(np.arange(4.0), (n, 4))
        try:
            attnx.linear_attention(x, x, x, causal=True, method="cumsum")
        except ValueError as exc:
            print("ValueError:", exc)
        except MemoryError as exc:
            print("MemoryError:", exc)
    """)
    assert out.startswith("ValueError:"), out
    assert "cumsum" in out and ("268435456" in out or "268435457" in out
                                or "GiB" in out or "GB" in out), out


def test_efficient_options_not_available():
    q, k, v = _base()
    for kw in (dict(initial_state=None, return_state=True),
               dict(method="chunk"), dict(window=2)):
        with pytest.raises((TypeError, ValueError)):
            attnx.efficient_attention(q, k, v, **kw)


# --------------------------------------------------------------------------
# hypothesis: the properties of docs/testing.md
# --------------------------------------------------------------------------

LEADS = [(), (1,), (3,), (2, 3), (2, 1)]
SMALL = st.integers(1, 20)
BIG = st.one_of(st.integers(1, 20), st.sampled_from([31, 64, 65, 97, 130]))


@st.composite
def problems(draw, variants=VARIANTS, causal_ok=True, causal_only=False,
             key_mask_ok=True, general_ok=False, big=True,
             dtypes=(np.float32, np.float64)):
    name = draw(st.sampled_from(variants))
    dtype = draw(st.sampled_from(dtypes))
    lead = draw(st.sampled_from(LEADS))
    size = BIG if big else SMALL
    n = draw(size)
    if name == "efficient" or not causal_ok:
        causal = False
    elif causal_only:
        causal = draw(st.sampled_from([True, "lower_right", "upper_left"]))
    else:
        causal = draw(st.sampled_from(CAUSAL_MODES))
    m = n if (name == "cosformer" and causal) else draw(size)
    # taylor at d = 1: 1 + cos is exactly 0 for keys of the opposite sign,
    # the eps clamp then turns any rounding of s into an O(1) weight; that
    # corner has its own test (test_taylor_d1_opposite_signs_exact_zero)
    d = draw(st.integers(2 if name in ("taylor", "taylor_front") else 1, 9))
    e = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    q, k, v = qkv(rng, lead, n, m, d, e, dtype)
    q, k = prep(name, q, k)
    kw = dict(causal=causal)
    if key_mask_ok and draw(st.booleans()):
        km_lead = draw(st.sampled_from([(), lead, (1,) * len(lead)]))
        kw["key_mask"] = rng.random(km_lead + (m,)) < draw(st.floats(0.1, 1.0))
    if general_ok and name != "efficient":
        kind = draw(st.sampled_from([None, "mask", "window", "both"]))
        if kind in ("mask", "both"):
            kw["mask"] = rng.random(draw(st.sampled_from(
                [(n, m), lead + (n, m), (1, m), (n, 1)]))) < 0.6
        if kind in ("window", "both"):
            kw["window"] = draw(st.one_of(st.integers(0, 10), st.tuples(
                st.one_of(st.none(), st.integers(0, 10)),
                st.one_of(st.none(), st.integers(0, 10)))))
    if name != "efficient" and draw(st.booleans()):
        kw["eps"] = draw(st.sampled_from([0.0, 1e-6, 1e-3, 0.5]))
    if name == "cosformer" and draw(st.booleans()):
        kw["M"] = max(n, m) + draw(st.integers(0, 50))
    return dict(name=name, dtype=dtype, q=q, k=k, v=v, kw=kw, lead=lead, n=n,
                m=m)


def _call(P, q=None, k=None, v=None, **over):
    kw = dict(P["kw"], **over)
    return call(P["name"], P["q"] if q is None else q, P["k"] if k is None else k,
                P["v"] if v is None else v, **kw)


def _vis(P):
    kw = P["kw"]
    km = kw.get("key_mask")
    mask = kw.get("mask")
    if km is not None:
        kmm = km[..., None, :]
        mask = kmm if mask is None else (mask & kmm)
    return ref.visibility(P["n"], P["m"], kw["causal"], mask, kw.get("window"))


@HYP
@given(problems(general_ok=True))
def test_prop_matches_reference(P):
    """Property 7: float32 and float64 agree with the float64 reference."""
    got = _call(P)
    assert got.dtype == P["dtype"]
    want = ref_out(P["name"], P["q"], P["k"], P["v"], **P["kw"])
    assert_close_cond(got, want, P["dtype"], vscale(P["v"]),
                      row_condition(P["name"], P["q"], P["k"], **P["kw"]))
    assert not np.any(np.isnan(got))


@HYP
@given(problems(general_ok=True))
def test_prop_weights_similarity(P):
    """Properties 1, 2 and 4: similarities >= 0 (0 off the visible set),
    weights >= 0 with rows summing to 1 where the mass reaches eps (else
    mass / eps; 0 for rows that see nothing), output == weights @ v."""
    name, dtype, kw = P["name"], P["dtype"], dict(P["kw"])
    w = weights(name, P["q"], P["k"], **kw)
    s = similarity(name, P["q"], P["k"], **kw)
    shape = np.broadcast_shapes(P["q"].shape[:-2], P["k"].shape[:-2]) + \
        (P["n"], P["m"])
    vis = np.broadcast_to(_vis(P), w.shape)
    assert w.shape == s.shape
    assert w.shape[-2:] == shape[-2:]
    assert w.dtype == dtype and s.dtype == dtype
    assert np.all(w >= 0) and np.all(s >= 0)
    assert np.all(w[~vis] == 0) and np.all(s[~vis] == 0)
    assert_close(s, ref_similarity(name, P["q"], P["k"],
                                   **{a: b for a, b in kw.items() if a != "eps"}),
                 dtype, err_msg="similarity")
    w64 = w.astype(np.float64)
    sums = w64.sum(-1)
    mass = s.astype(np.float64).sum(-1)
    eps = 0.0 if name == "efficient" else kw.get("eps", 1e-6)
    kappa = np.broadcast_to(row_condition(name, P["q"], P["k"], **kw)[..., 0],
                            sums.shape)
    rt = (1e-12 if dtype == np.float64 else 2e-6 * max(1, P["m"]) ** 0.5) * kappa
    full = (mass > eps * (1 + 1e-3)) & (mass > 0)
    assert np.all(np.abs(sums[full] - 1) <= rt[full]), sums[full]
    assert np.all(sums[mass == 0] == 0)
    assert np.all(sums <= 1 + rt)
    o = _call(P)
    assert_close_cond(o, np.matmul(w64, P["v"].astype(np.float64)), dtype,
                      vscale(P["v"]), kappa[..., None])


@HYP
@given(problems(variants=STATEFUL, causal_only=True,
                dtypes=(np.float64,)), st.data())
def test_prop_methods_agree(P, data):
    """Property 3: cumsum == recurrent == chunk (every chunk size) ==
    quadratic == default in float64."""
    base = _call(P, method="cumsum")
    for method in (None, "chunk", "recurrent", "quadratic"):
        c = data.draw(st.sampled_from([None, 1, 2, 3, 7, 64, P["n"] + 3,
                                       max(1, P["n"] // 2)]))
        got = _call(P, method=method, chunk_size=c)
        assert_close(got, base, np.float64, vscale(P["v"]),
                     err_msg="%s %s" % (method, c))


@HYP
@given(problems(variants=STATEFUL, causal_only=True), st.data())
def test_prop_streaming_pieces(P, data):
    """Property 3: streaming in random pieces (one token at a time
    included) equals one call; the final state is sum psi(k) v^T."""
    name, n = P["name"], P["n"]
    if P["m"] != n:   # self-attention pieces
        P = dict(P, k=P["k"][..., :min(n, P["m"]), :],
                 v=P["v"][..., :min(n, P["m"]), :],
                 q=P["q"][..., :min(n, P["m"]), :])
        n = min(n, P["m"])
        if "key_mask" in P["kw"]:
            P["kw"] = dict(P["kw"], key_mask=P["kw"]["key_mask"][..., :n])
    M = P["kw"].get("M", n + data.draw(st.integers(0, 9))) \
        if name == "cosformer" else None
    if M is not None:
        M = max(M, n)
    km = P["kw"].get("key_mask")
    eps = P["kw"].get("eps", 1e-6)
    extra = {} if M is None else dict(M=M)
    full = call(name, P["q"], P["k"], P["v"], causal=True, key_mask=km,
                eps=eps, **extra)
    one_by_one = data.draw(st.booleans())
    if one_by_one:
        bounds = list(range(n + 1))
    else:
        cuts = data.draw(st.lists(st.integers(0, n), max_size=6))
        bounds = sorted(set([0, n] + cuts))
    methods = tuple(data.draw(st.lists(st.sampled_from([None] + METHODS),
                                       min_size=1, max_size=3)))
    sizes = tuple(data.draw(st.lists(st.sampled_from([None, 1, 2, 5, 64]),
                                     min_size=1, max_size=3)))
    state, outs = None, []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        o, state = call(name, P["q"][..., a:b, :], P["k"][..., a:b, :],
                        P["v"][..., a:b, :], causal=True,
                        key_mask=None if km is None else km[..., a:b],
                        eps=eps, initial_state=state, return_state=True,
                        method=methods[i % len(methods)],
                        chunk_size=sizes[i % len(sizes)], **extra)
        assert state.offset == b
        outs.append(o)
    got = np.concatenate(outs, axis=-2)
    # the pieces and the one call round their sums apart: taylor's rows
    # where 1 + cos cancels get their condition number's share (row_condition)
    assert_close_cond(got, full, P["dtype"], vscale(P["v"]),
                      row_condition(name, P["q"], P["k"], eps=eps, causal=True, key_mask=km))
    km_full = None if km is None else np.broadcast_to(
        km, np.broadcast_shapes(km.shape, P["k"].shape[:-1]))
    _check_state(name, state, P["k"], P["v"], km_full, M, P["dtype"])


@HYP
@given(problems(causal_only=True, variants=STATEFUL, general_ok=True), st.data())
def test_prop_causality(P, data):
    """Property 5: changing keys/values a row cannot see leaves it unchanged."""
    vis = _vis(P)
    vis = vis.reshape((-1,) + vis.shape[-2:]).any(0)   # seen by any head
    o = _call(P)
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    j = data.draw(st.integers(0, P["m"] - 1))
    k2, v2 = P["k"].copy(), P["v"].copy()
    k2[..., j:, :] = make(rng, k2[..., j:, :].shape, P["dtype"], 3.0)
    v2[..., j:, :] = make(rng, v2[..., j:, :].shape, P["dtype"], 3.0)
    k2, _ = prep(P["name"], k2, k2)
    o2 = _call(P, k=k2, v=v2)
    rows = ~vis[:, j:].any(-1)
    t = tol(P["dtype"], vscale(P["v"]))
    np.testing.assert_allclose(o2[..., rows, :], o[..., rows, :],
                               rtol=t["rtol"] / 10, atol=t["atol"] / 10)


@HYP
@given(problems(general_ok=True), st.data())
def test_prop_masked_keys_have_no_effect(P, data):
    """Property 5: keys removed by key_mask can have any keys and values
    (for efficient attention too: they leave the key softmax)."""
    lead, m = P["lead"], P["m"]
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    km = rng.random(lead + (m,)) < 0.6
    base = P["kw"].get("key_mask")
    km = km if base is None else (km & base)
    o = _call(P, key_mask=km)
    hidden = ~km[..., :, None]
    k2 = np.where(hidden, make(rng, P["k"].shape, P["dtype"], 5.0), P["k"])
    v2 = np.where(hidden, make(rng, P["v"].shape, P["dtype"], 5.0), P["v"])
    k2, _ = prep(P["name"], k2, k2)
    o2 = _call(P, k=k2.astype(P["dtype"]), v=v2.astype(P["dtype"]), key_mask=km)
    t = tol(P["dtype"], vscale(P["v"]))
    np.testing.assert_allclose(o2, o, rtol=t["rtol"] / 10, atol=t["atol"] / 10)


@HYP
@given(problems(variants=[v for v in VARIANTS if v != "cosformer"],
                causal_ok=False), st.data())
def test_prop_permutation(P, data):
    """Property 6 (non-causal): equivariant to permuting queries, invariant
    to permuting key/value pairs (with the key mask). cosFormer is left out:
    its similarity depends on the positions by design."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    n, m = P["n"], P["m"]
    pq, pk = rng.permutation(n), rng.permutation(m)
    km = P["kw"].get("key_mask")
    o = _call(P)
    o2 = _call(P, q=P["q"][..., pq, :], k=P["k"][..., pk, :],
               v=P["v"][..., pk, :],
               key_mask=None if km is None else km[..., pk])
    assert_close(o2, o[..., pq, :].astype(np.float64), P["dtype"],
                 vscale(P["v"]))


@HYP
@given(problems(big=False, general_ok=True), st.data())
def test_prop_broadcast_equals_loop(P, data):
    """Property 8: a broadcast / strided call equals the loop over slices."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    name, dtype, n, m = P["name"], P["dtype"], P["n"], P["m"]
    d, e = P["q"].shape[-1], P["v"].shape[-1]
    A, Bh = 2, 3
    q = make(rng, (A, n, 1, d), dtype).transpose(0, 2, 1, 3)       # (A,1,n,d)
    k = np.broadcast_to(make(rng, (Bh, m, d), dtype), (1, Bh, m, d))
    v = make(rng, (A, Bh, m, 2 * e), dtype)[..., ::2]
    q, k = prep(name, q, k)
    kw = dict(P["kw"])
    kw["key_mask"] = None if "key_mask" not in kw else \
        (rng.random((Bh, m)) < 0.7)
    if "mask" in kw:
        kw["mask"] = rng.random((A, 1, n, m)) < 0.7
    got = call(name, q, k, v, **kw)
    assert got.shape == (A, Bh, n, e)
    for a in range(A):
        for b in range(Bh):
            kw1 = dict(kw)
            if kw1.get("key_mask") is not None:
                kw1["key_mask"] = kw["key_mask"][b]
            if kw1.get("mask") is not None:
                kw1["mask"] = kw["mask"][a, 0]
            one = call(name, np.ascontiguousarray(q[a, 0]),
                       np.ascontiguousarray(k[0, b]),
                       np.ascontiguousarray(v[a, b]), **kw1)
            t = tol(dtype, vscale(v))
            np.testing.assert_allclose(got[a, b], one, rtol=t["rtol"] / 10,
                                       atol=t["atol"] / 10)


@HYP
@given(problems(dtypes=(np.float32,), general_ok=True))
def test_prop_float32_vs_float64(P):
    """Property 7: float32 agrees with the float64 call on the same
    (float32-representable) inputs within the float32 tolerance."""
    o32 = _call(P)
    o64 = _call(P, q=P["q"].astype(np.float64), k=P["k"].astype(np.float64),
                v=P["v"].astype(np.float64))
    assert o32.dtype == np.float32 and o64.dtype == np.float64
    assert_close_cond(o32, o64, np.float32, vscale(P["v"]),
                      row_condition(P["name"], P["q"], P["k"], **P["kw"]))


# --------------------------------------------------------------------------
# torch and threads
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vs_torch_cumsum_formulation(dtype):
    """Causal elu linear attention against an independent pure-torch
    cumsum formulation (float64), on torch tensors passed through numpy."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(57)
    B, H, n, d, e = 2, 3, 70, 16, 8
    x = torch.from_numpy(make(rng, (B, n, 3 * H * d), dtype))
    qt, kt, vt = x.view(B, n, 3, H, d).permute(2, 0, 3, 1, 4)
    vt = vt[..., :e]
    fq = torch.nn.functional.elu(qt.double()) + 1
    fk = torch.nn.functional.elu(kt.double()) + 1
    S = torch.cumsum(fk[..., :, :, None] * vt.double()[..., :, None, :], dim=-3)
    z = torch.cumsum(fk, dim=-2)
    num = torch.einsum("bhnr,bhnre->bhne", fq, S)
    den = torch.einsum("bhnr,bhnr->bhn", fq, z).clamp_min(1e-6)
    want = (num / den[..., None]).numpy()
    got = attnx.linear_attention(qt.numpy(), kt.numpy(), vt.numpy(), causal=True)
    assert_close(got, want, dtype, vscale(vt.numpy()))


@pytest.mark.parametrize("name", ["elu", "favor", "cosformer", "taylor"])
def test_threads_and_segments_agree(name):
    """One head, long sequence: the chunk method may cut the head into
    segments across threads; 1 thread and 2 threads give the same numbers
    as the reference (float64), for several chunk sizes."""
    rng = np.random.default_rng(58)
    n = 1100
    q, k, v = qkv(rng, (), n, n, 8, 4)
    orig = attnx.get_num_threads()
    try:
        res = {}
        for threads in (1, 2):
            attnx.set_num_threads(threads)
            for c in (None, 3, 16, 64):
                res[threads, c] = call(name, q, k, v, causal=True,
                                       method="chunk", chunk_size=c)
    finally:
        attnx.set_num_threads(orig)
    want = ref_out(name, q, k, v, causal=True)
    for key, got in res.items():
        assert_close(got, want, np.float64, vscale(v), err_msg=str(key))


def test_python_threads_concurrent():
    rng = np.random.default_rng(59)
    jobs = []
    for i in range(12):
        name = STATEFUL[i % len(STATEFUL)]
        dtype = np.float32 if i % 2 else np.float64
        q, k, v = qkv(rng, (2, 2), 60 + 13 * i, 60 + 13 * i, 8, 4, dtype)
        q, k = prep(name, q, k)
        jobs.append((name, q, k, v, dict(causal=bool(i % 3))))

    def run(job):
        name, q, k, v, kw = job
        return call(name, q, k, v, **kw)

    sequential = [run(j) for j in jobs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as ex:
        for _ in range(2):
            for i, got in enumerate(ex.map(run, jobs * 2)):
                want = sequential[i % len(jobs)]
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for (name, q, k, v, kw), got in zip(jobs, sequential):
        assert_close(got, ref_out(name, q, k, v, **kw), got.dtype, vscale(v))
