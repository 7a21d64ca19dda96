"""The kernelised family's dtypes, out=, empty sizes, inputs never written, NaN and inf, and the AVX-512 float32 chunk kernel against the general path.

The variants under test, their references and the stated tolerances are
in tests/linear_variants.py.
"""
import numpy as np
import pytest

import attnx

import attnx.reference as ref
from helpers import CAUSAL_MODES, assert_close, f64, mixed_dtype_qkv, qkv, vscale  # noqa: E402
from linear_variants import (METHODS, STATEFUL, VARIANTS, call, prep, ref_out, similarity,  # noqa: E402
                             stream_in_pieces, weights)


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
    got, state = stream_in_pieces(name, q, k, v, [0, 4, 4, 10], extra.get("M"))
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


# The float32 chunk method runs whole chunks of 16 through one fused
# register-blocked kernel of the linear_forward family's set (AVX-512, AVX2
# or NEON; features in blocks of 8, values in blocks of 16: r % 8 == 0,
# e % 16 == 0); partial chunks, other sizes and value blocks holding inf or
# NaN take the general path. Both must agree with the reference and with
# each other, on every set the family can run here, for every shape the
# kernels block differently (r % 6 in {0, 2, 4}, e in 1..4 AVX-512 vectors
# and past 64).
FUSED_SHAPES = [(64, 64, 64, 64), (100, 100, 32, 48), (96, 130, 48, 16),
                (130, 96, 64, 80), (70, 70, 128, 128), (48, 48, 40, 32)]


@pytest.mark.parametrize("n,m,d,e", FUSED_SHAPES)
@pytest.mark.parametrize("name", ["elu", "relu", "softmax", "focused", "favor64",
                                  "cosformer"])
def test_fused_chunk_kernel_float32(n, m, d, e, name, linear_forward_kernels):
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


def test_fused_chunk_kernel_nan_and_inf(linear_forward_kernels):
    """NaN or inf in a key reaches only the rows that see it, also inside a
    chunk of the fused kernel (of each set); a value block holding NaN takes
    the general path with the same guarantee; keys removed by key_mask
    reach nothing."""
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


def elu_causal_grads(dout, q, k, v, key_mask=None, eps=1e-6):
    """dq, dk, dv of sum(dout * out) for causal linear attention with elu + 1
    features: the chain rule written out in float64 numpy (attnx.h,
    attnx_linear_bwd_f64, states the formulas)"""
    phi, psi = np.where(q > 0, q + 1, np.exp(q)), np.where(k > 0, k + 1, np.exp(k))
    vis = ref.visibility(q.shape[-2], k.shape[-2], causal=True)
    if key_mask is not None:
        vis = vis & key_mask[..., None, :]
    scores = phi @ np.swapaxes(psi, -1, -2) * vis
    den = scores.sum(-1)
    D = np.maximum(den, eps)
    out = scores @ v / D[..., None]
    a = np.where(den[..., None] == 0, 0, dout / D[..., None])
    # where the clamp binds (or nothing is seen) the denominator has no gradient
    b = np.where(den >= eps, -(dout * out).sum(-1) / np.where(den == 0, 1, den), 0)
    dscores = (a @ np.swapaxes(v, -1, -2) + b[..., None]) * vis
    dq = dscores @ psi * np.where(q > 0, 1, np.exp(q))
    dk = np.swapaxes(dscores, -1, -2) @ phi * np.where(k > 0, 1, np.exp(k))
    return dq, dk, np.swapaxes(scores, -1, -2) @ a


@pytest.mark.parametrize("n,m,d,e", FUSED_SHAPES)
def test_fused_chunk_backward_float32(n, m, d, e, linear_backward_kernels):
    """The causal backward's fused chunk kernels (whole chunks of 16, of the
    linear_backward family's set) against the chain rule in float64, with
    and without masked keys (a row that sees no key among them), at the
    backward's float32 tolerance (tests/test_linear_grad.py, F32_TOL);
    without torch, so that it runs wherever attnx does (.ci/aarch64)."""
    rng = np.random.default_rng(n + 5 * d + e)
    q, k, v = qkv(rng, (2,), n, m, d, e, np.float32)
    dout = rng.standard_normal((2, n, e)).astype(np.float32)
    key_mask = rng.random((2, m)) < 0.8
    key_mask[:, : max(m - n + 1, 1)] = False   # the first rows see no key
    for km in (None, key_mask):
        g = attnx.linear_attention_backward(dout, q, k, v, causal=True, key_mask=km)
        want = elu_causal_grads(f64(dout), f64(q), f64(k), f64(v), km)
        for got, w, name in zip(g[:3], want, "qkv"):
            assert got.dtype == np.float32
            err = np.abs(got - w).max() / max(np.abs(w).max(), 1e-3)
            assert err <= 2e-4, f"d{name} key_mask={km is not None}: relative error {err:.3g}"


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
