"""Agreement of every kernelised variant with the numpy reference (shapes and causal modes); broadcasting, grouped heads and strided views; mask= and window=; every method and chunk size.

The variants under test, their references and the stated tolerances are
in tests/linear_variants.py.
"""
import numpy as np
import pytest

import attnx

from helpers import CAUSAL_MODES, assert_close, make, qkv, tol, vscale  # noqa: E402
from linear_variants import (METHODS, STATEFUL, VARIANTS, assert_close_cond, call, prep,  # noqa: E402
                             ref_out, ref_weights, row_condition, weights)


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
