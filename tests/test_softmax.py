"""Tests of attnx's softmax family: softmax_attention, gaussian_attention,
attention_weights / similarity (variants "softmax" and "gaussian"), and the
runtime helpers (threads, show_config).

Everything is checked against the numpy float64 reference in
attnx/reference.py (itself tested in tests/test_reference.py) and, where
torch is installed, against torch.nn.functional.scaled_dot_product_attention.

Stated tolerances (see `tol`):
  float64 vs the float64 reference: rtol 1e-10, atol 1e-10 * value scale;
  float32 vs the float64 reference (on the same float32 inputs):
      rtol 2e-5, atol 2e-5 * value scale (value scale = max |v|, >= 1);
  float16 (computed in float32, rounded to float16): 2e-3 relative.
Inputs keep the logits moderate (entries ~N(0,1), scale ~ 1/sqrt(d); for
gaussian, sigma ~ sqrt(d) in float32), where those float32 bounds hold with
a wide margin for a correct kernel.
"""

import concurrent.futures
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnx

import attnx.reference as ref
from helpers import (CAUSAL_MODES, assert_close, f64, hypothesis_settings, make,  # noqa: E402
                     mixed_dtype_qkv, qkv, run_isolated, tol, vscale)
from helpers import cpuinfo_field, dispatched, kernels_here  # noqa: E402

HYP = hypothesis_settings(60)


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

def lse_close(got, want, dtype, err_msg=""):
    """lse: -inf exactly where the reference is -inf, close elsewhere."""
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want),
                                  err_msg=err_msg)
    fin = np.isfinite(want)
    t = tol(dtype)
    np.testing.assert_allclose(got[fin], want[fin], rtol=t["rtol"],
                               atol=t["rtol"] * 4, err_msg=err_msg)


def ref_softmax(q, k, v, **kw):
    return ref.softmax_attention(f64(q), f64(k), f64(v), **kw)


def ref_gaussian(q, k, v, **kw):
    return ref.gaussian_attention(f64(q), f64(k), f64(v), **kw)


FRONT = {
    "softmax": (lambda q, k, v, **kw: attnx.softmax_attention(q, k, v, **kw),
                ref_softmax),
    "gaussian": (lambda q, k, v, **kw: attnx.gaussian_attention(q, k, v, **kw),
                 ref_gaussian),
}


# --------------------------------------------------------------------------
# basic agreement with the reference
# --------------------------------------------------------------------------

SHAPES = [
    (1, 1, 1, 1),
    (2, 3, 4, 5),
    (7, 13, 5, 3),
    (13, 7, 8, 16),
    (64, 64, 64, 64),
    (65, 129, 32, 17),
    (129, 65, 17, 32),
    (257, 300, 64, 8),
    (300, 1, 8, 8),
    (1, 300, 16, 16),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,m,d,e", SHAPES)
@pytest.mark.parametrize("causal", CAUSAL_MODES)
def test_softmax_matches_reference(dtype, n, m, d, e, causal):
    rng = np.random.default_rng(n * 1000 + m)
    q, k, v = qkv(rng, (2,), n, m, d, e, dtype)
    got = attnx.softmax_attention(q, k, v, causal=causal)
    assert got.dtype == dtype and got.shape == (2, n, e)
    assert_close(got, ref_softmax(q, k, v, causal=causal), dtype, vscale(v))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,m,d,e", SHAPES)
@pytest.mark.parametrize("causal", [False, True, "upper_left"])
def test_gaussian_matches_reference(dtype, n, m, d, e, causal):
    rng = np.random.default_rng(n * 1000 + m + 1)
    q, k, v = qkv(rng, (2,), n, m, d, e, dtype)
    sigma = math.sqrt(d)
    got = attnx.gaussian_attention(q, k, v, sigma, causal=causal)
    assert got.dtype == dtype and got.shape == (2, n, e)
    assert_close(got, ref_gaussian(q, k, v, sigma=sigma, causal=causal),
                 dtype, vscale(v))


@pytest.mark.parametrize("sigma", [0.3, 1.0, 2.5])
def test_gaussian_sigma_float64(sigma):
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, (3,), 33, 47, 8, 5)
    got = attnx.gaussian_attention(q, k, v, sigma=sigma, causal=True)
    assert_close(got, ref_gaussian(q, k, v, sigma=sigma, causal=True),
                 np.float64, vscale(v))
    # default sigma is 1
    assert_close(attnx.gaussian_attention(q, k, v),
                 ref_gaussian(q, k, v, sigma=1.0), np.float64, vscale(v))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scale", [0.01, 0.125, 0.5, 1, 2.0])
def test_scale(dtype, scale):
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, (2,), 17, 23, 16, 4, dtype)
    got = attnx.softmax_attention(q, k, v, scale=scale)
    assert_close(got, ref_softmax(q, k, v, scale=scale), dtype, vscale(v))
    got = attnx.softmax_attention(q, k, v, scale=np.float32(scale))
    assert_close(got, ref_softmax(q, k, v, scale=float(np.float32(scale))),
                 dtype, vscale(v))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
@pytest.mark.parametrize("bias_shape", [(9, 14), (3, 1, 14), (3, 9, 1), (14,),
                                        (2, 3, 9, 14)])
def test_bias(dtype, variant, bias_shape):
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, (2, 3), 9, 14, 6, 5, dtype)
    bias = make(rng, bias_shape, dtype)
    fn, rf = FRONT[variant]
    kw = dict(sigma=math.sqrt(6)) if variant == "gaussian" else {}
    got = fn(q, k, v, bias=bias, causal=True, **kw)
    assert got.shape == (2, 3, 9, 5)
    assert_close(got, rf(q, k, v, bias=f64(bias), causal=True, **kw), dtype,
                 vscale(v))


def test_bias_alibi_like_float64():
    rng = np.random.default_rng(6)
    H, n = 4, 37
    q, k, v = qkv(rng, (2, H), n, n, 16, 16)
    slopes = 2.0 ** -np.arange(1, H + 1)
    pos = np.arange(n)
    bias = -slopes[:, None, None] * np.abs(pos[:, None] - pos[None, :])
    got = attnx.softmax_attention(q, k, v, bias=bias, causal=True)
    assert_close(got, ref_softmax(q, k, v, bias=bias, causal=True), np.float64,
                 vscale(v))


def test_bias_minus_inf_acts_like_mask():
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, (), 6, 8, 4, 3)
    mask = rng.random((6, 8)) < 0.5
    mask[:, 2] = True
    bias = np.where(mask, 0.0, -np.inf)
    got = attnx.softmax_attention(q, k, v, bias=bias)
    assert_close(got, ref_softmax(q, k, v, mask=mask), np.float64, vscale(v))


def test_bias_all_minus_inf_row_gives_zeros_not_nan():
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, (), 4, 5, 3, 2)
    bias = np.zeros((4, 5))
    bias[1] = -np.inf
    o, lse = attnx.softmax_attention(q, k, v, bias=bias, return_lse=True)
    assert not np.any(np.isnan(o)) and not np.any(np.isnan(lse))
    assert np.all(o[1] == 0) and lse[1] == -np.inf
    want, wlse = ref_softmax(q, k, v, bias=bias, return_lse=True)
    assert_close(o, want, np.float64, vscale(v))
    lse_close(lse, wlse, np.float64)


# --------------------------------------------------------------------------
# masks and windows
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
@pytest.mark.parametrize("mask_shape", [(11, 19), (1, 19), (19,), (2, 1, 1, 19),
                                        (2, 3, 11, 19), (3, 11, 1)])
def test_mask_shapes(dtype, variant, mask_shape):
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, (2, 3), 11, 19, 8, 4, dtype)
    mask = rng.random(mask_shape) < 0.6
    fn, rf = FRONT[variant]
    kw = dict(sigma=math.sqrt(8)) if variant == "gaussian" else {}
    got = fn(q, k, v, mask=mask, **kw)
    want = rf(q, k, v, mask=mask, **kw)
    assert got.shape == (2, 3, 11, 4)
    assert_close(got, want, dtype, vscale(v))
    assert not np.any(np.isnan(got))


WINDOWS = [0, 1, 3, 50, (2, 0), (0, 2), (None, 0), (0, None), (None, 3),
           (4, None), (None, None), (1, 5), (10, 1)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,m", [(40, 40), (17, 70), (70, 17), (1, 33),
                                 (33, 1), (200, 200)])
@pytest.mark.parametrize("window", WINDOWS)
def test_window(dtype, n, m, window):
    rng = np.random.default_rng(n + m)
    q, k, v = qkv(rng, (2,), n, m, 8, 3, dtype)
    got, lse = attnx.softmax_attention(q, k, v, window=window, return_lse=True)
    want, wlse = ref_softmax(q, k, v, window=window, return_lse=True)
    assert_close(got, want, dtype, vscale(v))
    lse_close(lse, wlse, dtype)


@pytest.mark.parametrize("causal", CAUSAL_MODES)
@pytest.mark.parametrize("window", [2, (3, 1), (None, 5), [4, None]])
@pytest.mark.parametrize("n,m", [(30, 30), (12, 41), (41, 12)])
def test_window_causal_mask_combined(causal, window, n, m):
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, (2,), n, m, 5, 4)
    mask = rng.random((2, 1, m)) < 0.7
    for variant in ("softmax", "gaussian"):
        fn, rf = FRONT[variant]
        got = fn(q, k, v, causal=causal, window=window, mask=mask)
        want = rf(q, k, v, causal=causal, window=tuple(window)
                  if isinstance(window, list) else window, mask=mask)
        assert_close(got, want, np.float64, vscale(v), err_msg=variant)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,m", [(60, 60), (70, 17), (17, 70)])
def test_window_wider_than_the_sequences(dtype, n, m):
    """A side as large as an index can be hides nothing, like an open side
    (the band's shifts must not overflow on the way)."""
    rng = np.random.default_rng(n * m)
    q, k, v = qkv(rng, (2,), n, m, 16, 16, dtype)
    huge = sys.maxsize
    for window, same in (((huge, huge), (None, None)), ((huge, 0), (None, 0)),
                         ((3, huge), (3, None))):
        for causal in (False, True):
            got = attnx.softmax_attention(q, k, v, window=window, causal=causal)
            want = ref_softmax(q, k, v, window=same, causal=causal)
            assert_close(got, want, dtype, vscale(v), err_msg=str((window, causal)))
            lin = attnx.linear_attention(q, k, v, window=window, causal=causal)
            lin_want = attnx.linear_attention(q, k, v, window=same, causal=causal)
            assert_close(lin, lin_want, dtype, vscale(v), err_msg=str((window, causal)))


def test_window_numpy_integer_accepted():
    rng = np.random.default_rng(12)
    q, k, v = qkv(rng, (), 20, 20, 4, 4)
    got = attnx.softmax_attention(q, k, v, window=np.int64(2))
    assert_close(got, ref_softmax(q, k, v, window=2), np.float64, vscale(v))
    got = attnx.softmax_attention(q, k, v, window=(np.int32(1), None))
    assert_close(got, ref_softmax(q, k, v, window=(1, None)), np.float64,
                 vscale(v))


def test_causal_lower_right_vs_upper_left_n_ne_m():
    rng = np.random.default_rng(13)
    q, k, v = qkv(rng, (), 5, 9, 4, 3)
    lr = attnx.softmax_attention(q, k, v, causal=True)
    lr2 = attnx.softmax_attention(q, k, v, causal="lower_right")
    ul = attnx.softmax_attention(q, k, v, causal="upper_left")
    np.testing.assert_array_equal(lr, lr2)
    # the last query sees every key under lower_right
    assert_close(lr[-1], ref_softmax(q[-1:], k, v)[0], np.float64)
    # the first query sees only key 0 under upper_left
    assert_close(ul[0], v[0], np.float64)
    assert not np.allclose(lr, ul)


# --------------------------------------------------------------------------
# return_lse
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,lse_dtype", [(np.float16, np.float32),
                                             (np.float32, np.float32),
                                             (np.float64, np.float64)])
@pytest.mark.parametrize("causal", [False, True])
def test_return_lse(dtype, lse_dtype, causal):
    rng = np.random.default_rng(14)
    q, k, v = qkv(rng, (2, 3), 10, 6, 8, 4, dtype)
    res = attnx.softmax_attention(q, k, v, causal=causal, return_lse=True)
    assert isinstance(res, tuple) and len(res) == 2
    o, lse = res
    assert o.dtype == dtype and o.shape == (2, 3, 10, 4)
    assert lse.dtype == lse_dtype and lse.shape == (2, 3, 10)
    want, wlse = ref_softmax(q, k, v, causal=causal, return_lse=True)
    assert_close(o, want, dtype, vscale(v))
    lse_close(lse, wlse, np.float32 if dtype == np.float16 else dtype)
    if causal:  # n > m lower right: the first 4 rows see nothing
        assert np.all(np.isneginf(lse[..., :4])) and np.all(o[..., :4, :] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gaussian_return_lse_is_log_of_its_similarity(dtype):
    """lse of gaussian attention is log sum_j s_ij with the gaussian
    s_ij = exp(-|q_i - k_j|^2 / (2 sigma^2)) (consistent with similarity())."""
    rng = np.random.default_rng(15)
    q, k, v = qkv(rng, (2,), 7, 9, 4, 3, dtype)
    o, lse = attnx.gaussian_attention(q, k, v, sigma=1.7, return_lse=True)
    want, wlse = ref_gaussian(q, k, v, sigma=1.7, return_lse=True)
    assert_close(o, want, dtype, vscale(v))
    lse_close(lse, wlse, dtype)
    s = attnx.similarity(q, k, "gaussian", sigma=1.7)
    lse_close(lse, np.log(np.asarray(s, np.float64).sum(-1)), dtype)


# --------------------------------------------------------------------------
# attention_weights and similarity
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", CAUSAL_MODES)
@pytest.mark.parametrize("n,m", [(1, 1), (6, 6), (5, 12), (12, 5), (70, 130)])
def test_attention_weights_softmax(dtype, causal, n, m):
    rng = np.random.default_rng(16)
    q, k, _ = qkv(rng, (2,), n, m, 8, 1, dtype)
    mask = rng.random((n, m)) < 0.8
    bias = make(rng, (2, n, m), dtype)
    kw = dict(causal=causal, mask=mask, bias=bias, scale=0.3, window=(7, None))
    w = attnx.attention_weights(q, k, **kw)
    assert w.shape == (2, n, m) and w.dtype == dtype
    assert_close(w, ref.softmax_weights(f64(q), f64(k), scale=0.3,
                                        bias=f64(bias), causal=causal,
                                        mask=mask, window=(7, None)), dtype)
    w2 = attnx.attention_weights(q, k, variant="softmax", **kw)
    np.testing.assert_array_equal(w, w2)
    s = attnx.similarity(q, k, **kw)
    assert s.shape == (2, n, m) and s.dtype == dtype
    want = ref.softmax_similarity(f64(q), f64(k), scale=0.3, bias=f64(bias),
                                  causal=causal, mask=mask, window=(7, None))
    assert_close(s, want, dtype, err_msg="similarity")
    vis = np.broadcast_to(ref.visibility(n, m, causal, mask, (7, None)), s.shape)
    assert np.all(s[~vis] == 0) and np.all(w[~vis] == 0)
    assert np.all(s >= 0) and np.all(w >= 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_weights_gaussian(dtype, causal):
    rng = np.random.default_rng(17)
    q, k, _ = qkv(rng, (3,), 9, 11, 4, 1, dtype)
    w = attnx.attention_weights(q, k, "gaussian", sigma=2.0, causal=causal)
    assert w.shape == (3, 9, 11) and w.dtype == dtype
    assert_close(w, ref.gaussian_weights(f64(q), f64(k), sigma=2.0,
                                         causal=causal), dtype)
    s = attnx.similarity(q, k, "gaussian", sigma=2.0, causal=causal)
    assert s.shape == (3, 9, 11)
    want = ref.gaussian_similarity(f64(q), f64(k), sigma=2.0, causal=causal)
    assert_close(s, want, dtype, err_msg="gaussian similarity")
    assert np.all(s <= 1.0 + 1e-6)  # exp(-dist^2/...) <= 1


def test_weights_bad_variant_and_options():
    rng = np.random.default_rng(18)
    q, k, _ = qkv(rng, (), 3, 4, 2, 1)
    with pytest.raises(ValueError, match="variant|bogus"):
        attnx.attention_weights(q, k, variant="bogus")
    with pytest.raises(ValueError, match="variant|bogus"):
        attnx.similarity(q, k, variant="bogus")
    with pytest.raises(TypeError, match="nonsense"):
        attnx.attention_weights(q, k, nonsense=1)
    with pytest.raises(ValueError, match="scale"):
        attnx.attention_weights(q, k, scale=-1.0)
    with pytest.raises(ValueError, match="sigma"):
        attnx.similarity(q, k, "gaussian", sigma=0.0)


# --------------------------------------------------------------------------
# GQA / broadcasting
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gqa_broadcast(dtype):
    rng = np.random.default_rng(19)
    B, Hkv, g, n, m, d = 2, 3, 4, 17, 29, 16
    q = make(rng, (B, Hkv, g, n, d), dtype)
    k = make(rng, (B, Hkv, 1, m, d), dtype)
    v = make(rng, (B, Hkv, 1, m, d), dtype)
    got = attnx.softmax_attention(q, k, v, causal=True)
    assert got.shape == (B, Hkv, g, n, d)
    kk = np.repeat(k, g, axis=2)
    vv = np.repeat(v, g, axis=2)
    want = ref_softmax(q, kk, vv, causal=True)
    assert_close(got, want, dtype, vscale(v))
    # identical to the call on explicitly repeated k/v
    np.testing.assert_allclose(
        attnx.softmax_attention(q, kk, vv, causal=True), got,
        **tol(dtype, vscale(v)))


def test_leading_axes_broadcast_rules():
    rng = np.random.default_rng(20)
    q = make(rng, (4, 1, 5, 3))
    k = make(rng, (1, 6, 7, 3))
    v = make(rng, (6, 7, 2))
    got = attnx.softmax_attention(q, k, v)
    assert got.shape == (4, 6, 5, 2)
    assert_close(got, ref_softmax(q, k, v), np.float64, vscale(v))
    # no leading axes at all
    got = attnx.softmax_attention(q[0, 0], k[0, 0], v[0])
    assert got.shape == (5, 2)
    # leading axes only on one side
    got = attnx.softmax_attention(q[0, 0], k[0], v)
    assert got.shape == (6, 5, 2)
    assert_close(got, ref_softmax(q[0, 0], k[0], v), np.float64, vscale(v))


# --------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dts,want_dtype", [
    ((np.float32, np.float64, np.float64), np.float64),
    ((np.float64, np.float32, np.float32), np.float64),
    ((np.float32, np.float32, np.float64), np.float64),
    ((np.float16, np.float32, np.float32), np.float32),
    ((np.float16, np.float64, np.float16), np.float64),
    ((np.float16, np.float16, np.float16), np.float16),
    ((np.int64, np.int64, np.int64), np.float64),
    ((np.int32, np.int16, np.int8), np.float64),
    ((np.uint8, np.uint8, np.uint8), np.float64),
    ((np.bool_, np.bool_, np.bool_), np.float64),
    ((np.int32, np.float64, np.float64), np.float64),
])
@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
def test_dtype_promotion(dts, want_dtype, variant):
    q, k, v = mixed_dtype_qkv(np.random.default_rng(21), dts)
    fn, rf = FRONT[variant]
    kw = dict(sigma=2.0) if variant == "gaussian" else {}
    got = fn(q, k, v, causal=True, **kw)
    assert got.dtype == want_dtype, (dts, got.dtype)
    want = rf(q, k, v, causal=True, **kw)
    # the precision is that of the compute dtype, float32 for float16
    compute = {np.dtype(np.float16): np.float32}.get(np.dtype(want_dtype),
                                                     want_dtype)
    if np.dtype(want_dtype) == np.float16:
        assert_close(got, want, np.float16, vscale(v))
    else:
        assert_close(got, want, compute, vscale(v))


def test_float16_computes_in_float32():
    """float16 in -> float16 out, but the accumulation is float32: the result
    is the float32 result rounded once (not a float16 accumulation)."""
    rng = np.random.default_rng(22)
    q, k, v = qkv(rng, (2,), 100, 300, 32, 8, np.float16)
    got = attnx.softmax_attention(q, k, v)
    assert got.dtype == np.float16
    want32 = attnx.softmax_attention(q.astype(np.float32), k.astype(np.float32),
                                     v.astype(np.float32))
    # one rounding: within half an ulp of float16 (+ float32 noise)
    np.testing.assert_allclose(got.astype(np.float64), want32.astype(np.float64),
                               rtol=2 ** -11 + 1e-5, atol=1e-6)
    assert_close(got, ref_softmax(q, k, v), np.float16, vscale(v))


@pytest.mark.parametrize("bad", ["complex", "object", "str", "datetime"])
@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
def test_bad_dtype_raises_typeerror(bad, which, variant):
    rng = np.random.default_rng(23)
    arrs = list(qkv(rng, (), 3, 4, 2, 2))
    a = arrs[which]
    if bad == "complex":
        a = a.astype(np.complex128)
    elif bad == "object":
        a = a.astype(object)
    elif bad == "str":
        a = a.astype(str)
    else:
        a = np.zeros(a.shape, dtype="datetime64[s]")
    arrs[which] = a
    fn, _ = FRONT[variant]
    with pytest.raises(TypeError, match="qkv"[which]):
        fn(*arrs)


def test_python_lists_accepted():
    q = [[1.0, 0.0], [0.0, 1.0]]
    k = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    v = [[1.0], [2.0], [3.0]]
    got = attnx.softmax_attention(q, k, v)
    assert got.dtype == np.float64
    assert_close(got, ref_softmax(q, k, v), np.float64, 3)


# --------------------------------------------------------------------------
# out=
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
def test_out_c_order(dtype, variant):
    rng = np.random.default_rng(24)
    q, k, v = qkv(rng, (2, 3), 9, 12, 4, 5, dtype)
    fn, rf = FRONT[variant]
    out = np.full((2, 3, 9, 5), np.nan, dtype=dtype)
    res = fn(q, k, v, out=out, causal=True)
    assert res is out
    assert_close(out, rf(q, k, v, causal=True), dtype, vscale(v))
    out2 = np.full((2, 3, 9, 5), np.nan, dtype=dtype)
    res = fn(q, k, v, out=out2, causal=True, return_lse=True)
    assert isinstance(res, tuple) and res[0] is out2
    np.testing.assert_array_equal(out2, out)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_out_strided_last_axis_contiguous(dtype):
    rng = np.random.default_rng(25)
    B, H, n, m, d = 2, 3, 10, 14, 8
    q, k, v = qkv(rng, (B, H), n, m, d, d, dtype)
    # (B, n, H, e) memory viewed as (B, H, n, e): last axis contiguous
    buf = np.full((B, n, H, d), np.nan, dtype=dtype)
    out = buf.transpose(0, 2, 1, 3)
    res = attnx.softmax_attention(q, k, v, out=out)
    assert res is out
    assert_close(out, ref_softmax(q, k, v), dtype, vscale(v))
    # a slice of a wider buffer (row stride > e)
    buf = np.full((B, H, n, 2 * d), 7.0, dtype=dtype)
    out = buf[..., :d]
    res = attnx.softmax_attention(q, k, v, out=out)
    assert res is out
    assert_close(out, ref_softmax(q, k, v), dtype, vscale(v))
    assert np.all(buf[..., d:] == 7.0)  # nothing written outside out


def test_out_float16():
    rng = np.random.default_rng(26)
    q, k, v = qkv(rng, (), 5, 6, 4, 3, np.float16)
    out = np.zeros((5, 3), np.float16)
    res = attnx.softmax_attention(q, k, v, out=out)
    assert res is out
    np.testing.assert_array_equal(out, attnx.softmax_attention(q, k, v))


def test_out_wrong_shape_or_dtype():
    rng = np.random.default_rng(27)
    q, k, v = qkv(rng, (2,), 4, 5, 3, 2)
    for bad_shape in [(2, 4, 3), (4, 2), (1, 4, 2), (2, 2, 4, 2), (2, 5, 2)]:
        with pytest.raises(ValueError, match="out"):
            attnx.softmax_attention(q, k, v, out=np.zeros(bad_shape))
    with pytest.raises((TypeError, ValueError), match="out"):
        attnx.softmax_attention(q, k, v, out=np.zeros((2, 4, 2), np.float32))
    with pytest.raises((TypeError, ValueError), match="out"):
        attnx.softmax_attention(q.astype(np.float32), k.astype(np.float32),
                                v.astype(np.float32), out=np.zeros((2, 4, 2)))
    with pytest.raises((TypeError, ValueError), match="out"):
        attnx.softmax_attention(q, k, v, out=np.zeros((2, 4, 2), np.int64))
    with pytest.raises((TypeError, ValueError), match="out"):
        attnx.softmax_attention(q, k, v, out=[[0.0] * 2] * 4)
    ro = np.zeros((2, 4, 2))
    ro.flags.writeable = False
    with pytest.raises((TypeError, ValueError), match="out"):
        attnx.softmax_attention(q, k, v, out=ro)


def test_out_overlapping_input_raises():
    rng = np.random.default_rng(28)
    n, d = 6, 4
    q, k, v = qkv(rng, (2,), n, n, d, d)
    q0, k0, v0 = q.copy(), k.copy(), v.copy()
    for name, arr in (("q", q), ("k", k), ("v", v)):
        with pytest.raises(ValueError, match="out|overlap"):
            attnx.softmax_attention(q, k, v, out=arr)
    # a view overlapping v partially
    big = rng.standard_normal((2, n + 1, d))
    v2 = big[:, :n]
    with pytest.raises(ValueError, match="out|overlap"):
        attnx.softmax_attention(q, k, v2, out=big[:, 1:])
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(k, k0)
    np.testing.assert_array_equal(v, v0)


def test_out_not_overlapping_interleaved_views_ok():
    """q and out interleaved in one buffer, no shared element: allowed."""
    rng = np.random.default_rng(29)
    buf = rng.standard_normal((5, 2, 4))
    q = buf[:, 0]
    out = buf[:, 1]
    k, v = make(rng, (7, 4)), make(rng, (7, 4))
    want = ref_softmax(q.copy(), k, v)
    res = attnx.softmax_attention(q, k, v, out=out)
    assert res is out
    assert_close(out, want, np.float64, vscale(v))


# --------------------------------------------------------------------------
# empty sizes, fully masked rows, NaN
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
def test_empty_sizes(dtype, variant):
    rng = np.random.default_rng(30)
    fn, _ = FRONT[variant]
    q, k, v = qkv(rng, (2,), 0, 5, 3, 4, dtype)
    o, lse = fn(q, k, v, return_lse=True)
    assert o.shape == (2, 0, 4) and o.dtype == dtype and lse.shape == (2, 0)
    q, k, v = qkv(rng, (2,), 6, 0, 3, 4, dtype)
    o, lse = fn(q, k, v, return_lse=True, causal=True)
    assert o.shape == (2, 6, 4) and o.dtype == dtype
    assert np.all(o == 0) and np.all(np.isneginf(lse))
    q, k, v = qkv(rng, (0, 3), 6, 5, 3, 4, dtype)
    o = fn(q, k, v)
    assert o.shape == (0, 3, 6, 4)
    q, k, v = qkv(rng, (2,), 6, 5, 3, 0, dtype)
    o = fn(q, k, v)
    assert o.shape == (2, 6, 0)
    # m == 0 with out= : zeros written
    q, k, v = qkv(rng, (), 3, 0, 2, 2, dtype)
    out = np.full((3, 2), np.nan, dtype)
    assert fn(q, k, v, out=out) is out
    assert np.all(out == 0)
    # n == 0 weights
    w = attnx.attention_weights(np.zeros((0, 3), dtype), np.zeros((4, 3), dtype),
                                variant)
    assert w.shape == (0, 4)
    w = attnx.attention_weights(np.zeros((2, 3), dtype), np.zeros((0, 3), dtype),
                                variant)
    assert w.shape == (2, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
def test_fully_masked_rows(dtype, variant):
    rng = np.random.default_rng(31)
    n, m = 70, 90
    q, k, v = qkv(rng, (2,), n, m, 8, 4, dtype)
    mask = rng.random((2, n, m)) < 0.3
    mask[0, 5] = False
    mask[1, 60:] = False
    fn, rf = FRONT[variant]
    kw = dict(sigma=math.sqrt(8)) if variant == "gaussian" else {}
    o, lse = fn(q, k, v, mask=mask, return_lse=True, **kw)
    lse_full = lse
    assert not np.any(np.isnan(o)) and not np.any(np.isnan(lse))
    assert np.all(o[0, 5] == 0) and np.isneginf(lse[0, 5])
    assert np.all(o[1, 60:] == 0) and np.all(np.isneginf(lse[1, 60:]))
    want, wlse = rf(q, k, v, mask=mask, return_lse=True, **kw)
    assert_close(o, want, dtype, vscale(v))
    # everything masked
    o = fn(q, k, v, mask=np.zeros((m,), bool), **kw)
    assert np.all(o == 0)
    # window outside the key range: n > m lower right, window (0, 0)
    o, lse = fn(q[:, :, :], k[:, :20], v[:, :20], window=(0, 0),
                return_lse=True, **kw)
    assert np.all(o[:, :n - 20] == 0) and np.all(np.isneginf(lse[:, :n - 20]))
    w = attnx.attention_weights(q, k, variant, mask=mask, **kw)
    assert np.all(w[0, 5] == 0) and not np.any(np.isnan(w))
    lse_close(lse_full, wlse, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
def test_nan_query_row_isolated(dtype, variant):
    rng = np.random.default_rng(32)
    n, m = 150, 70
    q, k, v = qkv(rng, (2,), n, m, 8, 4, dtype)
    q[1, 77, 3] = np.nan
    q[0, 3, 0] = np.inf
    fn, rf = FRONT[variant]
    kw = dict(sigma=math.sqrt(8)) if variant == "gaussian" else {}
    o = fn(q, k, v, **kw)
    assert np.all(np.isnan(o[1, 77]))
    assert not np.all(np.isfinite(o[0, 3]))
    keep = np.ones((2, n), bool)
    keep[1, 77] = keep[0, 3] = False
    want = rf(np.where(keep[..., None], q, 0), k, v, **kw)
    assert_close(o[keep], want[keep], dtype, vscale(v))


def test_nan_in_masked_key_values_has_no_effect():
    """Masked keys are unrelated to the row: NaN/inf in their values must not
    reach it (docs/conventions.md: never poison unrelated rows; property 5)."""
    rng = np.random.default_rng(33)
    n = m = 40
    q, k, v = qkv(rng, (), n, m, 8, 4)
    v[-1] = np.nan       # only the last row sees the last key
    k[-2] = np.inf       # only the last two rows see key m-2
    o = attnx.softmax_attention(q, k, v, causal=True)
    want = ref_softmax(q[:-2], k[:-2], v[:-2], causal=True)
    assert_close(o[:-2], want, np.float64, vscale(v[:-2]))
    mask = np.ones((n, m), bool)
    mask[:, 7] = False
    v2 = v.copy()
    v2[-1] = 1.0
    v2[7] = np.nan
    k2 = k.copy()
    k2[-2] = 0.0
    o = attnx.softmax_attention(q, k2, v2, mask=mask)
    assert not np.any(np.isnan(o))
    assert_close(o, ref_softmax(q, np.delete(k2, 7, 0), np.delete(v2, 7, 0)),
                 np.float64, vscale(v2[~np.isnan(v2).any(1)]))


def test_large_logits_are_stable():
    rng = np.random.default_rng(34)
    for dtype in (np.float32, np.float64):
        q, k, v = qkv(rng, (), 33, 65, 8, 4, dtype)
        q *= 30  # logits ~ +-100s: exp overflows without the running max
        o, lse = attnx.softmax_attention(q, k, v, return_lse=True)
        assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse))
        want, wlse = ref_softmax(q, k, v, return_lse=True)
        # float32 logits of size ~300 carry ~3e-5 absolute error
        t = dict(rtol=1e-10, atol=1e-9) if dtype == np.float64 else \
            dict(rtol=1e-3, atol=1e-3 * vscale(v))
        np.testing.assert_allclose(o, want, **t)
        np.testing.assert_allclose(lse, wlse, rtol=1e-6 if dtype == np.float32
                                   else 1e-12)


# --------------------------------------------------------------------------
# bad input: clear exceptions naming the argument
# --------------------------------------------------------------------------

def _base(rng=None):
    rng = rng or np.random.default_rng(35)
    return qkv(rng, (2,), 4, 5, 3, 2)


@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
def test_error_mismatched_core_sizes(variant):
    fn, _ = FRONT[variant]
    q, k, v = _base()
    with pytest.raises(ValueError, match=r"\bq\b|\bk\b"):
        fn(q, k[..., :2], v)                    # d mismatch
    with pytest.raises(ValueError, match=r"\bq\b|\bk\b"):
        fn(q[..., :2], k, v)
    with pytest.raises(ValueError, match=r"\bk\b|\bv\b"):
        fn(q, k, v[:, :4])                      # m mismatch
    with pytest.raises(ValueError, match=r"\bk\b|\bv\b"):
        fn(q, k[:, :3], v)


@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
def test_error_leading_axes_not_broadcastable(variant):
    fn, _ = FRONT[variant]
    rng = np.random.default_rng(36)
    q = make(rng, (2, 3, 4, 3))
    k = make(rng, (3, 3, 5, 3))
    v = make(rng, (3, 3, 5, 2))
    with pytest.raises(ValueError, match=r"\bq\b|\bk\b|\bv\b|broadcast"):
        fn(q, k, v)
    with pytest.raises(ValueError, match=r"\bv\b|broadcast"):
        fn(q[:1], k[:1], make(rng, (2, 5, 5, 2)))


@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
def test_error_too_few_dims(variant):
    fn, _ = FRONT[variant]
    q, k, v = _base()
    with pytest.raises(ValueError, match=r"\bq\b"):
        fn(q[0, 0], k, v)
    with pytest.raises(ValueError, match=r"\bk\b"):
        fn(q, k[0, 0], v)
    with pytest.raises(ValueError, match=r"\bv\b"):
        fn(q, k, v[0, 0])
    with pytest.raises(ValueError, match=r"\bq\b"):
        fn(np.float64(1.0), k, v)
    with pytest.raises((ValueError, TypeError), match=r"\bq\b|\bk\b"):
        attnx.attention_weights(q[0, 0], k, variant)
    with pytest.raises((ValueError, TypeError), match=r"\bk\b"):
        attnx.similarity(q, k[0, 0], variant)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 0.0, -1.0, -1e-300])
def test_error_bad_scale(bad):
    q, k, v = _base()
    with pytest.raises(ValueError, match="scale"):
        attnx.softmax_attention(q, k, v, scale=bad)
    with pytest.raises(ValueError, match="sigma"):
        attnx.gaussian_attention(q, k, v, sigma=bad)
    with pytest.raises(ValueError, match="sigma"):
        attnx.gaussian_attention(q, k, v, bad)


def test_error_scale_wrong_type():
    q, k, v = _base()
    for bad in ["0.5", [0.5, 0.5], 1j]:
        with pytest.raises((TypeError, ValueError), match="scale"):
            attnx.softmax_attention(q, k, v, scale=bad)
        with pytest.raises((TypeError, ValueError), match="sigma"):
            attnx.gaussian_attention(q, k, v, sigma=bad)


@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
def test_error_bad_causal(variant):
    fn, _ = FRONT[variant]
    q, k, v = _base()
    for bad in ["upper-left", "lower", "", "True", "causal"]:
        with pytest.raises(ValueError, match="causal"):
            fn(q, k, v, causal=bad)
    for bad in [2, 1.5, [True], object()]:
        with pytest.raises((ValueError, TypeError), match="causal"):
            fn(q, k, v, causal=bad)


@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
def test_error_bad_window(variant):
    fn, _ = FRONT[variant]
    q, k, v = _base()
    for bad in [-1, (-1, 2), (2, -3), (1, 2, 3), (1,), "a", 1.5, (1.5, 2),
                ("a", None), True]:
        with pytest.raises((ValueError, TypeError), match="window"):
            fn(q, k, v, window=bad)


@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
def test_error_bad_mask(variant):
    fn, _ = FRONT[variant]
    q, k, v = _base()
    for dt in [np.float64, np.int64, np.uint8, np.float32]:
        with pytest.raises(TypeError, match="mask"):
            fn(q, k, v, mask=np.ones((4, 5), dtype=dt))
    for shape in [(4, 4), (5, 5), (4,), (3, 4, 5), (2, 4, 1, 5), (4, 6)]:
        with pytest.raises(ValueError, match="mask"):
            fn(q, k, v, mask=np.ones(shape, dtype=bool))
    with pytest.raises((TypeError, ValueError), match="mask"):
        fn(q, k, v, mask="yes")


@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
def test_error_bad_bias(variant):
    fn, _ = FRONT[variant]
    q, k, v = _base()
    for shape in [(4, 4), (5, 5), (4,), (3, 4, 5), (2, 4, 1, 5), (4, 6)]:
        with pytest.raises(ValueError, match="bias"):
            fn(q, k, v, bias=np.zeros(shape))
    with pytest.raises(TypeError, match="bias"):
        fn(q, k, v, bias=np.zeros((4, 5), np.complex128))
    with pytest.raises(TypeError, match="bias"):
        fn(q, k, v, bias=np.zeros((4, 5), object))


@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
def test_error_unknown_keyword_and_positional(variant):
    fn, _ = FRONT[variant]
    q, k, v = _base()
    with pytest.raises(TypeError, match="is_causal"):
        fn(q, k, v, is_causal=True)
    with pytest.raises(TypeError, match="attn_mask"):
        fn(q, k, v, attn_mask=None)
    with pytest.raises(TypeError):
        fn(q, k)
    # options after (q, k, v[, sigma]) are keyword-only
    with pytest.raises(TypeError):
        attnx.softmax_attention(q, k, v, 0.5)
    with pytest.raises(TypeError):
        attnx.gaussian_attention(q, k, v, 1.0, True)


def test_error_messages_name_expected_shape():
    q, k, v = _base()
    with pytest.raises(ValueError) as ei:
        attnx.softmax_attention(q, k[..., :2], v)
    msg = str(ei.value)
    assert "3" in msg and "2" in msg, msg  # the two sizes of d
    with pytest.raises(ValueError) as ei:
        attnx.softmax_attention(q, k, v, mask=np.ones((4, 4), bool))
    assert "4" in str(ei.value) and "5" in str(ei.value), str(ei.value)


def test_huge_shapes_raise_not_crash():
    """Products of sizes that overflow, built from stride-0 views of tiny
    arrays (nothing big is allocated): ValueError or MemoryError, never a
    crash or a hang. Run in a subprocess so a crash fails only this test."""
    out = run_isolated("""
        from numpy.lib.stride_tricks import as_strided
        def fake(shape):
            # every axis stride 0 except a contiguous last axis, so that the
            # array is used in place (no copy) and only the size checks stand
            # between the call and the kernel
            base = np.zeros(shape[-1])
            return as_strided(base, shape=shape,
                              strides=(0,) * (len(shape) - 1) + (8,))
        cases = {
            # leading axes broadcast to 2**64 heads
            "heads": (fake((2**32, 1, 1, 4)), fake((1, 2**32, 1, 4)),
                      fake((1, 1, 1, 4))),
            # n * e output elements overflow
            "out": (fake((2**36, 2**20, 1, 1)), fake((1, 1, 3, 1)),
                    fake((1, 1, 3, 2**20))),
            # n = m = 2**40: the output alone is 2**43 doubles (64 TiB)
            "nm": (fake((2**40, 8)), fake((2**40, 8)), fake((2**40, 8))),
            # heads * n * e = 2**61 elements: 2**64 bytes
            "total": (fake((2**29, 2**28, 4)), fake((1, 5, 4)),
                      fake((1, 5, 16))),
        }
        for name, (q, k, v) in cases.items():
            for fn in ("softmax_attention", "gaussian_attention"):
                try:
                    getattr(attnx, fn)(q, k, v)
                except (ValueError, MemoryError) as e:
                    print(name, fn, "ok", type(e).__name__, str(e)[:80])
                else:
                    print(name, fn, "NO ERROR")
        # the weight matrix n x m = 2**64 elements
        q, k = fake((2**32, 4)), fake((2**32, 4))
        for fn in ("attention_weights", "similarity"):
            try:
                getattr(attnx, fn)(q, k)
            except (ValueError, MemoryError) as e:
                print("weights", fn, "ok", type(e).__name__)
            else:
                print("weights", fn, "NO ERROR")
        # a broadcast mask/bias of a huge fake shape
        q, k, v = np.zeros((4, 2)), np.zeros((5, 2)), np.zeros((5, 2))
        try:
            attnx.softmax_attention(q, k, v, bias=fake((2**27, 2**27, 4, 5)))
        except (ValueError, MemoryError) as e:
            print("bias ok", type(e).__name__)
        else:
            print("bias NO ERROR")
    """, timeout=120)
    assert "NO ERROR" not in out, out
    assert out.count("ok") == 11, out


# --------------------------------------------------------------------------
# inputs are never written
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_inputs_never_written(dtype):
    rng = np.random.default_rng(37)
    B, H, n, m, d = 2, 3, 33, 47, 16
    q = make(rng, (B, n, H, d), dtype).transpose(0, 2, 1, 3)
    k = make(rng, (B, H, m, d), dtype)
    v = make(rng, (B, H, m, 2 * d), dtype)[..., ::2]
    mask = rng.random((B, 1, n, m)) < 0.8
    bias = make(rng, (H, n, m), dtype)
    saved = [x.copy() for x in (q, k, v, mask, bias)]
    ro = []
    for x in (q, k, v, mask, bias):
        y = x.copy()
        y.flags.writeable = False
        ro.append(y)
    for call in (
        lambda a: attnx.softmax_attention(a[0], a[1], a[2], mask=a[3], bias=a[4],
                                          causal=True, return_lse=True),
        lambda a: attnx.gaussian_attention(a[0], a[1], a[2], 3.0, mask=a[3],
                                           bias=a[4], window=5),
        lambda a: attnx.softmax_attention(a[0], a[1], a[2], mask=a[3],
                                          out=np.empty((B, H, n, d), dtype)),
        lambda a: attnx.attention_weights(a[0], a[1], mask=a[3], bias=a[4]),
        lambda a: attnx.similarity(a[0], a[1], "gaussian", mask=a[3]),
    ):
        call((q, k, v, mask, bias))
        for x, s in zip((q, k, v, mask, bias), saved):
            np.testing.assert_array_equal(x, s)
        call(ro)  # read-only inputs are accepted


# --------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------

def _layouts(rng, dtype, n, m):
    """(name, q, k, v) with the same values in different memory layouts."""
    B, H, d = 2, 3, 16
    base_q = make(rng, (B, H, n, d), dtype)
    base_k = make(rng, (B, H, m, d), dtype)
    base_v = make(rng, (B, H, m, d), dtype)
    out = [("c", base_q, base_k, base_v)]
    # (B, n, H, d) memory viewed as (B, H, n, d)
    tq = np.ascontiguousarray(base_q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    tk = np.ascontiguousarray(base_k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    tv = np.ascontiguousarray(base_v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    out.append(("bnhd", tq, tk, tv))
    out.append(("fortran", np.asfortranarray(base_q), np.asfortranarray(base_k),
                np.asfortranarray(base_v)))
    # negative strides on the sequence axis and on the feature axis
    out.append(("neg-rows",
                np.ascontiguousarray(base_q[..., ::-1, :])[..., ::-1, :],
                np.ascontiguousarray(base_k[..., ::-1, :])[..., ::-1, :],
                np.ascontiguousarray(base_v[..., ::-1, :])[..., ::-1, :]))
    out.append(("neg-cols",
                np.ascontiguousarray(base_q[..., ::-1])[..., ::-1],
                np.ascontiguousarray(base_k[..., ::-1])[..., ::-1],
                np.ascontiguousarray(base_v[..., ::-1])[..., ::-1]))
    # non-contiguous last axis
    def spread(x):
        buf = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), dtype)
        buf[..., ::2] = x
        return buf[..., ::2]
    out.append(("step2", spread(base_q), spread(base_k), spread(base_v)))
    # rows of a wider buffer (row stride > d)
    def wide(x):
        buf = np.zeros(x.shape[:-1] + (x.shape[-1] + 5,), dtype)
        buf[..., 3:3 + x.shape[-1]] = x
        return buf[..., 3:3 + x.shape[-1]]
    out.append(("wide", wide(base_q), wide(base_k), wide(base_v)))
    # mixed
    out.append(("mixed", tq, np.asfortranarray(base_k), spread(base_v)))
    # unaligned data pointer (offset by one element)
    def unaligned(x):
        flat = np.zeros(x.size + 1, dtype)
        y = flat[1:].reshape(x.shape)
        y[...] = x
        return y
    out.append(("unaligned", unaligned(base_q), unaligned(base_k),
                unaligned(base_v)))
    # the other byte order (converted once: the kernels read native numbers)
    def swapped(x):
        return x.astype(x.dtype.newbyteorder())
    out.append(("byteswapped", swapped(base_q), swapped(base_k), swapped(base_v)))
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("variant", ["softmax", "gaussian"])
# plain loops; micro-kernels with the values read in place (one query tile
# per head) and packed (several)
@pytest.mark.parametrize("n,m", [(37, 53), (100, 130), (300, 130)])
def test_layouts(dtype, variant, n, m):
    rng = np.random.default_rng(38)
    layouts = _layouts(rng, dtype, n, m)
    _, q0, k0, v0 = layouts[0]
    fn, rf = FRONT[variant]
    kw = dict(sigma=4.0) if variant == "gaussian" else {}
    want = rf(q0, k0, v0, causal=True, **kw)
    for name, q, k, v in layouts:
        np.testing.assert_array_equal(q, q0)
        np.testing.assert_array_equal(k, k0)
        np.testing.assert_array_equal(v, v0)
        got = fn(q, k, v, causal=True, **kw)
        assert_close(got, want, dtype, vscale(v0), err_msg=name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_broadcast_stride0_leading_axes(dtype):
    rng = np.random.default_rng(39)
    n, m, d = 21, 34, 8
    q1, k1, v1 = qkv(rng, (), n, m, d, 5, dtype)
    q = np.broadcast_to(q1, (3, 4, n, d))
    k = np.broadcast_to(k1[None], (4, m, d))
    v = np.broadcast_to(v1, (3, 1, m, 5))
    got = attnx.softmax_attention(q, k, v)
    assert got.shape == (3, 4, n, 5)
    want = ref_softmax(q1, k1, v1)
    for a in range(3):
        for b in range(4):
            assert_close(got[a, b], want, dtype, vscale(v1))
    # stride-0 inside the core axes too (all rows equal)
    qr = np.broadcast_to(q1[:1], (n, d))
    got = attnx.softmax_attention(qr, k1, v1)
    assert_close(got, ref_softmax(np.repeat(q1[:1], n, 0), k1, v1), dtype,
                 vscale(v1))
    kr = np.broadcast_to(k1[:1], (m, d))
    got = attnx.softmax_attention(q1, kr, v1, causal=True)
    assert_close(got, ref_softmax(q1, np.repeat(k1[:1], m, 0), v1, causal=True),
                 dtype, vscale(v1))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mask_and_bias_layouts(dtype):
    rng = np.random.default_rng(40)
    q, k, v = qkv(rng, (2, 3), 19, 23, 8, 4, dtype)
    mask_c = rng.random((2, 3, 19, 23)) < 0.7
    bias_c = make(rng, (2, 3, 19, 23), dtype)
    want = ref_softmax(q, k, v, mask=mask_c, bias=bias_c)
    variants = [
        (mask_c, bias_c),
        (np.asfortranarray(mask_c), np.asfortranarray(bias_c)),
        (np.ascontiguousarray(mask_c[..., ::-1])[..., ::-1],
         np.ascontiguousarray(bias_c[..., ::-1, :])[..., ::-1, :]),
        (np.ascontiguousarray(mask_c.swapaxes(-1, -2)).swapaxes(-1, -2),
         np.ascontiguousarray(bias_c.swapaxes(-1, -2)).swapaxes(-1, -2)),
    ]
    buf = np.zeros((2, 3, 19, 46), bool)
    buf[..., ::2] = mask_c
    bbuf = np.zeros((2, 3, 19, 46), dtype)
    bbuf[..., 1::2] = bias_c
    variants.append((buf[..., ::2], bbuf[..., 1::2]))
    for i, (mask, bias) in enumerate(variants):
        got = attnx.softmax_attention(q, k, v, mask=mask, bias=bias)
        assert_close(got, want, dtype, vscale(v), err_msg=str(i))


AMX_USABLE = attnx.cpu_dispatch()["softmax_forward"] == "amx"
KERNELS_HERE = kernels_here("softmax_forward")


@pytest.fixture
def kernels(softmax_forward_kernels):
    """Run a test on every kernel set of the softmax forward this CPU has
    (tests/conftest.py): plain C + BLAS, the AVX2 and AVX-512 micro-kernels
    (with the bfloat16 dot products where the CPU has them), and for float32
    the AMX products (float64 runs the micro-kernels there)."""
    return softmax_forward_kernels


# The float32 micro-kernels (at least 48 query rows, e a multiple of the
# panel width, 8 with AVX-512) hold the scores transposed, fold key-only
# masks and biases into a per-key term and apply the others to the tile:
# every kind must match the reference there too, on tiles that straddle the
# band, partial strips and panels, and more than one key tile; values read
# in place (one query tile) and packed (several).
MK_SHAPES = [(48, 48, 64, 16), (100, 300, 64, 64), (257, 263, 32, 32), (250, 517, 128, 128),
             (300, 130, 32, 24)]


@pytest.mark.parametrize("n,m,d,e", MK_SHAPES)
@pytest.mark.parametrize("kind", ["none", "key_mask", "key_bias", "query_mask", "query_bias",
                                  "window", "gaussian"])
def test_microkernel_path_masks_and_biases(kernels, n, m, d, e, kind):
    rng = np.random.default_rng(n + m + d)
    q, k, v = qkv(rng, (2,), n, m, d, e, np.float32)
    kw = {}
    if kind == "key_mask":
        kw["mask"] = rng.random((2, 1, m)) < 0.6
        kw["mask"][1, 0, m // 2:] = False          # a padded tail: whole panels and tiles
    elif kind == "key_bias":
        kw["bias"] = make(rng, (2, 1, m), np.float32)
    elif kind == "query_mask":
        kw["mask"] = rng.random((n, m)) < 0.6
    elif kind == "query_bias":
        kw["bias"] = make(rng, (2, n, m), np.float32)
    elif kind == "window":
        kw["window"] = (37, 5)
    fn, rf = FRONT["gaussian" if kind == "gaussian" else "softmax"]
    if kind == "gaussian":
        kw["sigma"] = math.sqrt(d)
    for causal in CAUSAL_MODES:
        got, lse = fn(q, k, v, causal=causal, return_lse=True, **kw)
        want, wlse = rf(q, k, v, causal=causal, return_lse=True,
                        **{key: f64(val) if key == "bias" else val for key, val in kw.items()})
        assert_close(got, want, np.float32, vscale(v), err_msg=str(causal))
        seen = np.isfinite(wlse)
        assert np.array_equal(np.isfinite(lse), seen)
        if seen.any():
            assert_close(lse[seen], wlse[seen], np.float32, np.max(np.abs(wlse[seen])))


@pytest.mark.parametrize("heads", [2, 3])
@pytest.mark.parametrize("window", [(40, 0), (30, 20), (0, 0), (300, 100)])
def test_microkernel_window_ring_of_key_panels(kernels, heads, window):
    """Under a window the packed keys live in a ring that holds the keys of
    two neighbouring query tiles: with many more keys than that, panels are
    evicted and packed again. The result must not depend on it, whether a
    thread takes whole heads (2 heads) or tiles of several (3), and for n !=
    m (the band shifted by m - n)."""
    rng = np.random.default_rng(heads * 7 + window[0])
    orig = attnx.get_num_threads()
    try:
        attnx.set_num_threads(2)
        # (100, 1000) upper-left: under a narrow window no row sees a key
        for n, m in ((1500, 1500), (1300, 1700), (100, 1000)):
            q, k, v = qkv(rng, (heads,), n, m, 64, 64, np.float32)
            for causal in (False, True, "upper_left"):
                got = attnx.softmax_attention(q, k, v, window=window, causal=causal)
                want = ref_softmax(q, k, v, window=window, causal=causal)
                assert_close(got, want, np.float32, vscale(v), err_msg=str((n, m, causal)))
    finally:
        attnx.set_num_threads(orig)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shared", ["k", "v"])
@pytest.mark.parametrize("threads", [1, 2])
def test_microkernel_heads_sharing_keys_or_values(kernels, dtype, shared, threads):
    """A thread packs the keys and values of a head once and keeps them for
    the next head when that head reads the same arrays: heads that share
    their keys but not their values (or the other way round) must each get
    their own values (keys)."""
    rng = np.random.default_rng(43)
    heads, n, m, d, e = 4, 300, 300, 32, 32
    q, k, v = qkv(rng, (heads,), n, m, d, e, dtype)
    if shared == "k":
        k = np.broadcast_to(k[:1], k.shape)
    else:
        v = np.broadcast_to(v[:1], v.shape)
    orig = attnx.get_num_threads()
    try:
        attnx.set_num_threads(threads)
        for causal in (False, True):
            got = attnx.softmax_attention(q, k, v, causal=causal)
            want = ref_softmax(q, np.ascontiguousarray(k), np.ascontiguousarray(v), causal=causal)
            assert_close(got, want, dtype, vscale(v), err_msg=str(causal))
    finally:
        attnx.set_num_threads(orig)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("tail", [1, 8, 9, 16, 17, 31, 32, 33, 47])
def test_microkernel_last_strip_sizes(kernels, dtype, tail):
    """A tile's last strip computes only the vectors its rows reach (1 or 2
    of 3: 16 float32 or 8 float64 rows each with AVX-512, half that with
    AVX2): every number of rows left across those edges, with a band, whose
    edges fall inside the short strip too, and a key padding mask."""
    rng = np.random.default_rng(59 + tail)
    n, m = 240 + tail, 150
    q, k, v = qkv(rng, (2,), n, m, 32, 16, dtype)
    mask = rng.random((2, 1, m)) < 0.7
    for kw in (dict(), dict(causal=True), dict(window=(60, 10)), dict(mask=mask)):
        got, lse = attnx.softmax_attention(q, k, v, return_lse=True, **kw)
        want, wlse = ref_softmax(q, k, v, return_lse=True, **kw)
        assert_close(got, want, dtype, vscale(v), err_msg=str(kw))
        seen = np.isfinite(wlse)
        assert np.array_equal(np.isfinite(lse), seen)
        assert_close(lse[seen], wlse[seen], dtype, np.max(np.abs(wlse[seen])))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("threads", [2, 3])
def test_uneven_shares_taken_over(kernels, dtype, threads):
    """Each thread starts on its own share of the query tiles and then takes
    the others' last tiles. Causal, with one head (or two), the last shares
    are the heaviest, so the first thread to finish takes tiles of a head
    another thread has packed keys and values for: its own packing of them
    must give the same result."""
    rng = np.random.default_rng(53)
    orig = attnx.get_num_threads()
    try:
        attnx.set_num_threads(threads)
        for heads, n in ((1, 1500), (2, 1000)):
            q, k, v = qkv(rng, (heads,), n, n, 32, 32, dtype)
            for kw in (dict(causal=True), dict(window=(700, 0))):
                got = attnx.softmax_attention(q, k, v, **kw)
                assert_close(got, ref_softmax(q, k, v, **kw), dtype, vscale(v), err_msg=str(kw))
    finally:
        attnx.set_num_threads(orig)


def test_microkernel_weights_under_the_smallest_normal(kernels):
    """A per-key bias spreads each row's scores over hundreds of log2
    units, so that many weights fall under 2^-126: they are 0 (the kernels
    flush them to zero while they run), the rest as the reference has them,
    and the calling thread gets its own floating-point mode back: float32
    subnormals still work after the call."""
    rng = np.random.default_rng(47)
    n, m = 96, 300
    q, k, v = qkv(rng, (2,), n, m, 16, 16, np.float32)
    bias = (-0.7 * np.arange(m)).astype(np.float32)     # e^-210 at the last key
    orig = attnx.get_num_threads()
    try:
        attnx.set_num_threads(1)                        # all of it on this thread
        for causal in (False, True):
            got = attnx.softmax_attention(q, k, v, bias=bias, causal=causal)
            want = ref_softmax(q, k, v, bias=f64(bias), causal=causal)
            assert_close(got, want, np.float32, vscale(v), err_msg=str(causal))
    finally:
        attnx.set_num_threads(orig)
    smallest_normal = np.finfo(np.float32).tiny
    assert np.float32(smallest_normal) / np.float32(4) > 0


def test_microkernel_path_nan_in_masked_keys_has_no_effect(kernels):
    """On the micro-kernels too: NaN or inf in a masked key (its k or its v),
    whether masked per key or per query, reaches no row."""
    rng = np.random.default_rng(41)
    n, m, d, e = 96, 300, 32, 32
    q, k, v = qkv(rng, (), n, m, d, e, np.float32)
    key_mask = np.ones(m, bool)
    key_mask[[5, 130, 299]] = False
    k_bad, v_bad = k.copy(), v.copy()
    k_bad[5] = np.nan
    v_bad[130] = np.inf
    v_bad[299] = np.nan
    want = ref_softmax(q, k[key_mask], v[key_mask])
    for mask in (key_mask, np.broadcast_to(key_mask, (n, m)).copy()):
        got = attnx.softmax_attention(q, k_bad, v_bad, mask=mask)
        assert np.all(np.isfinite(got))
        assert_close(got, want, np.float32, vscale(v))


def test_amx_used_where_the_cpu_has_it():
    """A CPU whose flags list AMX with bfloat16 (Linux) runs float32 softmax
    and the backward's bfloat16 products on it, in a build with the AMX
    kernels (gcc 11 or later: csrc/amx.h; a clang build has none), unless
    ATTNX_DISABLE_CPU_FEATURES leaves AMX out, and filling the tables again
    without AMX, or holding the family below it, takes it off."""
    flags = (cpuinfo_field("flags") or "").split()
    try:
        with dispatched(softmax_forward="amx"):
            built = True
    except ValueError:          # "softmax_forward has no kernel set amx here"
        built = False
    if built:
        assert attnx._C.build_info()["compiler"].startswith("gcc")
    has_amx = built and {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags)
    with dispatched(""):
        assert attnx._C.build_info()["amx"] == has_amx
        assert ("amx" in kernels_here("softmax_forward")) == has_amx
        assert ("amx" in kernels_here("softmax_backward")) == has_amx
    with dispatched("AMX"):
        assert attnx._C.build_info()["amx"] is False
        assert "AMX_TILE" in attnx._C.build_info()["disabled_cpu_features"]
    if "avx512" in KERNELS_HERE:
        with dispatched(softmax_forward="avx512"):
            assert attnx._C.build_info()["amx"] is False


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_set_reaches_the_kernel(dtype):
    """Each kernel set of the softmax forward this CPU has computes the same
    call in its own order of operations (BLAS, the micro-kernels, AMX
    products): the results all match the reference but no two are the
    same bits, so the table's choice does choose the kernel that runs, and
    the tests above do run each one. The bfloat16 dot products take only
    inputs that are all bfloat16 values, so on these avx512_bf16 is avx512
    bit for bit. The micro-kernels of the two x86 widths are one order of
    operations (csrc/microkernel.h: the same sums, and the same 2^x,
    mk_exp2_w8 and mk_exp2_w16): avx2 is avx512 bit for bit."""
    rng = np.random.default_rng(67)
    q, k, v = qkv(rng, (2,), 300, 300, 64, 64, dtype)
    want = ref_softmax(q, k, v, causal=True)
    results = {}
    for name in KERNELS_HERE:
        if name == "amx" and dtype == np.float64:
            continue                                    # float64 has no AMX backend
        with dispatched(softmax_forward=name):
            results[name] = attnx.softmax_attention(q, k, v, causal=True)
        assert_close(results[name], want, dtype, vscale(v), err_msg=name)
    if "avx512_bf16" in results:
        np.testing.assert_array_equal(results.pop("avx512_bf16"), results["avx512"])
    if "avx2" in results and "avx512" in results:
        np.testing.assert_array_equal(results.pop("avx2"), results["avx512"])
    pairs = [(first, second) for i, first in enumerate(results) for second in list(results)[i + 1:]]
    for first, second in pairs:
        assert not np.array_equal(results[first], results[second]), (first, second)


def test_micro_kernel_weights_at_the_extremes():
    """The micro-kernels' 2^x (csrc/microkernel.h: mk_exp2_w8 on AVX2,
    mk_exp2_w16 on AVX-512) where it is most fragile: scores spread over
    a hundred log2 units and more, so that weights fall under 2^-126 (0,
    never subnormal), masked keys, and a NaN query row, causal and not;
    every kernel set here against the reference, and the two x86 widths bit
    for bit."""
    rng = np.random.default_rng(71)
    # small integers: exact dot products, so that the float32 scores'
    # rounding, not at issue here, stays within tol; scores of std ~27 log2
    # units put 5% of the weights under 2^-126 and 16% in [2^-126, 2^-100)
    q, k = (rng.integers(-7, 8, (2, count, 64)).astype(np.float32) for count in (200, 300))
    v = make(rng, (2, 300, 64), np.float32)
    q[1, 7, 3] = np.nan
    mask = rng.random((2, 1, 300)) < 0.8
    for causal in (False, True):
        want = ref_softmax(q, k, v, mask=mask, causal=causal)
        results = {}
        for name in KERNELS_HERE:
            with dispatched(softmax_forward=name):
                results[name] = attnx.softmax_attention(q, k, v, mask=mask, causal=causal)
            got = results[name]
            assert np.all(np.isnan(got[1, 7])), name
            rest = np.ones(got.shape[:2], bool)
            rest[1, 7] = False
            assert_close(got[rest], want[rest], np.float32, vscale(v), err_msg=name)
        if "avx2" in results and "avx512" in results:
            np.testing.assert_array_equal(results["avx2"], results["avx512"])


@pytest.mark.parametrize("n,m,d,e", [(100, 100, 40, 40), (130, 77, 130, 136), (64, 300, 8, 8),
                                     (257, 513, 96, 32)])
def test_amx_padding_of_d_e_and_keys(kernels, n, m, d, e):
    """The AMX products run on steps of 32 in d, e and the keys, padded
    with zeros: sizes off those steps, n != m, causal both ways, a key
    mask, a per-query bias, lse, on 1 and 2 threads."""
    rng = np.random.default_rng(n + d)
    q, k, v = qkv(rng, (2,), n, m, d, e, np.float32)
    mask = rng.random((2, 1, m)) < 0.8
    bias = make(rng, (n, m), np.float32)
    orig = attnx.get_num_threads()
    try:
        for threads in (1, 2):
            attnx.set_num_threads(threads)
            for kw in (dict(), dict(causal=True), dict(causal="upper_left", mask=mask),
                       dict(bias=bias)):
                got, lse = attnx.softmax_attention(q, k, v, return_lse=True, **kw)
                want, wlse = ref_softmax(q, k, v, return_lse=True,
                                         **{key: f64(val) if key == "bias" else val
                                            for key, val in kw.items()})
                assert_close(got, want, np.float32, vscale(v), err_msg=str((threads, kw)))
                seen = np.isfinite(wlse)
                assert np.array_equal(np.isfinite(lse), seen)
                assert_close(lse[seen], wlse[seen], np.float32, np.max(np.abs(wlse[seen])))
    finally:
        attnx.set_num_threads(orig)


def test_amx_split_keeps_float32_accuracy(kernels):
    """Large logits (scale 1 at d = 128: scores up to ~60) make the weights
    as sensitive to the scores as they get in practice: an error of x in a
    score is a relative error x in its weight. The AMX products carry each
    float32 number as three bfloat16 parts; dropping the last (three
    products instead of six) gives score errors near 1e-3 and fails here,
    while the six agree with the float64 reference as float32 FMAs do."""
    rng = np.random.default_rng(61)
    q, k, v = qkv(rng, (2,), 256, 256, 128, 128, np.float32)
    for causal in (False, True):
        got, lse = attnx.softmax_attention(q, k, v, scale=1.0, causal=causal, return_lse=True)
        want, wlse = ref_softmax(q, k, v, scale=1.0, causal=causal, return_lse=True)
        assert_close(got, want, np.float32, vscale(v), err_msg=str(causal))
        assert_close(lse, wlse, np.float32, np.max(np.abs(wlse)))


def _bf16_rounded(x):
    """x (float32) rounded to the nearest bfloat16 value, as float32"""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("plain_block", ["none", "queries", "keys", "values"])
def test_amx_one_plane_for_bfloat16_values(kernels, plain_block):
    """Operands whose numbers are bfloat16 values take the AMX products'
    hi plane only (csrc/amx.h), per block of 32 keys and per query tile,
    and the others all three: inputs that are bfloat16 values but for one
    block of plain float32 numbers (keys 32-63, values 64-95, or the
    queries of the first tile) keep float32 accuracy at logits as large as
    in test_amx_split_keeps_float32_accuracy, where a plain block taken as
    one plane misses by about 1e-3."""
    rng = np.random.default_rng(62)
    q, k, v = qkv(rng, (2,), 256, 256, 128, 128, np.float32)
    q, k, v = _bf16_rounded(q), _bf16_rounded(k), _bf16_rounded(v)
    if plain_block == "queries":
        q[:, :48] = make(rng, (2, 48, 128), np.float32)
    elif plain_block == "keys":
        k[:, 32:64] = make(rng, (2, 32, 128), np.float32)
    elif plain_block == "values":
        v[:, 64:96] = make(rng, (2, 32, 128), np.float32)
    for causal in (False, True):
        got, lse = attnx.softmax_attention(q, k, v, scale=1.0, causal=causal, return_lse=True)
        want, wlse = ref_softmax(q, k, v, scale=1.0, causal=causal, return_lse=True)
        assert_close(got, want, np.float32, vscale(v), err_msg=str(causal))
        assert_close(lse, wlse, np.float32, np.max(np.abs(wlse)))


# --------------------------------------------------------------------------
# hypothesis properties (docs/testing.md)
# --------------------------------------------------------------------------

SIZES = st.one_of(st.integers(1, 9),
                  st.sampled_from([1, 2, 3, 5, 7, 11, 13, 31, 61, 63, 64, 65,
                                   97, 127, 128, 129, 191, 257, 300]))
FEATS = st.sampled_from([1, 2, 3, 5, 8, 13, 16, 32, 33, 64])
WINDOW = st.one_of(
    st.none(),
    st.integers(0, 40),
    st.tuples(st.one_of(st.none(), st.integers(0, 40)),
              st.one_of(st.none(), st.integers(0, 40))))


@st.composite
def problems(draw, causal_ok=True, window_ok=True, mask_ok=True, bias_ok=True,
             big=True):
    sizes = SIZES if big else st.integers(1, 40)
    n, m = draw(sizes), draw(sizes)
    d, e = draw(FEATS), draw(FEATS)
    lead = draw(st.sampled_from([(), (1,), (2,), (2, 1)]))
    if n * m * max(1, int(np.prod(lead))) > 120_000:
        lead = ()
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    variant = draw(st.sampled_from(["softmax", "gaussian"]))
    causal = draw(st.sampled_from(CAUSAL_MODES)) if causal_ok else False
    window = draw(WINDOW) if window_ok else None
    mask_kind = draw(st.sampled_from([None, "full", "keys", "rows"])) \
        if mask_ok else None
    bias_kind = draw(st.sampled_from([None, "full", "keys"])) if bias_ok \
        else None
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, lead, n, m, d, e, dtype)
    p = draw(st.floats(0.05, 1.0))
    if mask_kind == "full":
        mask = rng.random(lead + (n, m)) < p
    elif mask_kind == "keys":
        mask = rng.random(lead + (1, m)) < p
    elif mask_kind == "rows":
        mask = rng.random((n, 1)) < p
    else:
        mask = None
    if bias_kind == "full":
        bias = make(rng, (n, m), dtype)
    elif bias_kind == "keys":
        bias = make(rng, lead + (1, m), dtype)
    else:
        bias = None
    kw = dict(causal=causal, window=window, mask=mask, bias=bias)
    if variant == "gaussian":
        kw["sigma"] = draw(st.floats(0.5, 2.0)) * math.sqrt(d)
    else:
        kw["scale"] = draw(st.one_of(st.none(), st.floats(0.1, 1.5).map(
            lambda s: s / math.sqrt(d))))
    return dict(variant=variant, dtype=dtype, q=q, k=k, v=v, kw=kw, lead=lead,
                n=n, m=m)


def _call(P, q=None, k=None, v=None, **over):
    fn, _ = FRONT[P["variant"]]
    kw = dict(P["kw"], **over)
    return fn(P["q"] if q is None else q, P["k"] if k is None else k,
              P["v"] if v is None else v, **kw)


def _ref(P, q=None, k=None, v=None, **over):
    _, rf = FRONT[P["variant"]]
    kw = dict(P["kw"], **over)
    return rf(P["q"] if q is None else q, P["k"] if k is None else k,
              P["v"] if v is None else v, **kw)


def _vis(P):
    kw = P["kw"]
    return ref.visibility(P["n"], P["m"], kw["causal"], kw["mask"], kw["window"])


@HYP
@given(problems())
def test_prop_matches_reference(P):
    """Property 7: float32 and float64 agree with the float64 reference."""
    got = _call(P)
    want = _ref(P)
    assert got.dtype == P["dtype"]
    assert_close(got, want, P["dtype"], vscale(P["v"]))
    assert not np.any(np.isnan(got))
    got2, lse = _call(P, return_lse=True)
    np.testing.assert_array_equal(got2, got)
    assert lse.shape == got.shape[:-1]


@HYP
@given(problems())
def test_prop_lse_matches_reference(P):
    """lse = log sum_j s_ij over the visible keys (-inf when none)."""
    _, lse = _call(P, return_lse=True)
    _, wlse = _ref(P, return_lse=True)
    lse_close(lse, wlse, P["dtype"])


@HYP
@given(problems())
def test_prop_weights_nonnegative_rows_sum(P):
    """Properties 1, 2 and 4: weights >= 0, rows sum to 1 (or 0 exactly when
    the row sees no key), similarity >= 0 and 0 off the visible set,
    output == weights @ v."""
    variant, dtype = P["variant"], P["dtype"]
    kw = dict(P["kw"])
    w = attnx.attention_weights(P["q"], P["k"], variant, **kw)
    s = attnx.similarity(P["q"], P["k"], variant, **kw)
    assert np.all(w >= 0) and np.all(s >= 0)
    vis = np.broadcast_to(_vis(P), w.shape)
    assert np.all(w[~vis] == 0) and np.all(s[~vis] == 0)
    sums = w.astype(np.float64).sum(-1)
    sees = vis.any(-1)
    assert np.all(sums[~sees] == 0)
    np.testing.assert_allclose(sums[sees], 1.0,
                               rtol=1e-12 if dtype == np.float64 else 2e-6 *
                               max(1, P["m"]) ** 0.5)
    o = _call(P)
    wv = np.matmul(w.astype(np.float64), P["v"].astype(np.float64))
    assert_close(o, wv, dtype, vscale(P["v"]))


@HYP
@given(problems(mask_ok=False, bias_ok=False), st.data())
def test_prop_causality(P, data):
    """Property 5: changing keys/values a row cannot see leaves it unchanged."""
    kw = P["kw"]
    if kw["causal"] is False and kw["window"] is None:
        kw["causal"] = True
    vis = _vis(P)
    o = _call(P)
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    j = data.draw(st.integers(0, P["m"] - 1))
    k2, v2 = P["k"].copy(), P["v"].copy()
    k2[..., j:, :] = make(rng, k2[..., j:, :].shape, P["dtype"], 3.0)
    v2[..., j:, :] = make(rng, v2[..., j:, :].shape, P["dtype"], 3.0)
    o2 = _call(P, k=k2, v=v2)
    rows = ~vis[:, j:].any(-1)  # rows that see none of the changed keys
    t = tol(P["dtype"], vscale(P["v"]))
    np.testing.assert_allclose(o2[..., rows, :], o[..., rows, :],
                               rtol=t["rtol"] / 10, atol=t["atol"] / 10)


@HYP
@given(problems(), st.data())
def test_prop_masked_keys_have_no_effect(P, data):
    """Property 5: keys hidden by the mask (here: a key-padding mask) can
    have any keys and values."""
    lead, m = P["lead"], P["m"]
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    keymask = rng.random(lead + (1, m)) < 0.6
    base = P["kw"]["mask"]
    mask = keymask if base is None else (base & keymask)
    o = _call(P, mask=mask)
    hidden = np.broadcast_to(~keymask[..., 0, :, None], P["k"].shape[:-1] + (1,))
    k2 = np.where(hidden, make(rng, P["k"].shape, P["dtype"], 5.0), P["k"])
    hidden_v = np.broadcast_to(~keymask[..., 0, :, None], P["v"].shape[:-1] + (1,))
    v2 = np.where(hidden_v, make(rng, P["v"].shape, P["dtype"], 5.0), P["v"])
    o2 = _call(P, k=k2.astype(P["dtype"]), v=v2.astype(P["dtype"]), mask=mask)
    t = tol(P["dtype"], vscale(P["v"]))
    np.testing.assert_allclose(o2, o, rtol=t["rtol"] / 10, atol=t["atol"] / 10)


@HYP
@given(problems(causal_ok=False, window_ok=False), st.data())
def test_prop_permutation(P, data):
    """Property 6 (non-causal): equivariant to permuting queries, invariant
    to permuting key/value pairs (with the mask and bias permuted too)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    n, m = P["n"], P["m"]
    pq, pk = rng.permutation(n), rng.permutation(m)
    kw = P["kw"]
    mask, bias = kw["mask"], kw["bias"]
    pm = None if mask is None else \
        mask[..., pq if mask.shape[-2] == n else slice(None), :][
            ..., pk if mask.shape[-1] == m else slice(None)]
    pb = None if bias is None else \
        bias[..., pq if bias.shape[-2] == n else slice(None), :][
            ..., pk if bias.shape[-1] == m else slice(None)]
    o = _call(P)
    o2 = _call(P, q=P["q"][..., pq, :], k=P["k"][..., pk, :],
               v=P["v"][..., pk, :], mask=pm, bias=pb)
    assert_close(o2, o[..., pq, :].astype(np.float64), P["dtype"],
                 vscale(P["v"]))


@HYP
@given(problems(big=False), st.data())
def test_prop_broadcast_equals_loop(P, data):
    """Property 8: a broadcast / strided call equals the loop over slices."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    dtype, n, m = P["dtype"], P["n"], P["m"]
    d, e = P["q"].shape[-1], P["v"].shape[-1]
    A, Bh = 2, 3
    # q varies over A only, k over Bh only, v over both; transposed memory
    q = make(rng, (A, n, 1, d), dtype).transpose(0, 2, 1, 3)       # (A,1,n,d)
    k = np.broadcast_to(make(rng, (Bh, m, d), dtype), (1, Bh, m, d))
    v = make(rng, (A, Bh, m, 2 * e), dtype)[..., ::2]
    kw = dict(P["kw"])
    mask = None if kw["mask"] is None else (rng.random((A, 1, n, m)) < 0.7)
    bias = None if kw["bias"] is None else make(rng, (Bh, 1, m), dtype)
    kw.update(mask=mask, bias=bias)
    fn, _ = FRONT[P["variant"]]
    got = fn(q, k, v, **kw)
    assert got.shape == (A, Bh, n, e)
    for a in range(A):
        for b in range(Bh):
            kw1 = dict(kw, mask=None if mask is None else mask[a, 0],
                       bias=None if bias is None else bias[b])
            one = fn(np.ascontiguousarray(q[a, 0]), np.ascontiguousarray(k[0, b]),
                     np.ascontiguousarray(v[a, b]), **kw1)
            t = tol(dtype, vscale(v))
            np.testing.assert_allclose(got[a, b], one, rtol=t["rtol"] / 10,
                                       atol=t["atol"] / 10)


# --------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------

def _sdpa(q, k, v, **kw):
    torch = pytest.importorskip("torch")
    return torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(np.ascontiguousarray(q)),
        torch.from_numpy(np.ascontiguousarray(k)),
        torch.from_numpy(np.ascontiguousarray(v)), **kw).numpy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n,m,d,e", [(1, 1, 8, 8), (64, 64, 64, 64),
                                     (100, 37, 32, 16), (37, 100, 16, 32),
                                     (257, 257, 64, 64)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.2])
def test_vs_torch_sdpa(dtype, n, m, d, e, is_causal, scale):
    rng = np.random.default_rng(41)
    q, k, v = qkv(rng, (2, 4), n, m, d, e, dtype)
    want = _sdpa(q, k, v, is_causal=is_causal, scale=scale)
    got = attnx.softmax_attention(q, k, v, scale=scale,
                                  causal="upper_left" if is_causal else False)
    assert_close(got, want.astype(np.float64), dtype, vscale(v))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vs_torch_sdpa_bool_mask_and_lower_right(dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(42)
    n, m = 45, 130
    q, k, v = qkv(rng, (2, 3), n, m, 32, 16, dtype)
    mask = rng.random((2, 1, n, m)) < 0.4
    mask[..., 17] = True  # no fully masked row (torch returns NaN there)
    want = _sdpa(q, k, v, attn_mask=torch.from_numpy(mask))
    assert_close(attnx.softmax_attention(q, k, v, mask=mask), want, dtype,
                 vscale(v))
    tril = torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n)
    want = _sdpa(q, k, v, attn_mask=tril)
    assert_close(attnx.softmax_attention(q, k, v, causal=True), want, dtype,
                 vscale(v))
    # float additive mask == bias
    bias = make(rng, (3, n, m), dtype)
    want = _sdpa(q, k, v, attn_mask=torch.from_numpy(bias))
    assert_close(attnx.softmax_attention(q, k, v, bias=bias), want, dtype,
                 vscale(v))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vs_torch_sdpa_gqa(dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(43)
    B, Hkv, g, n, d = 2, 2, 3, 50, 16
    q = make(rng, (B, Hkv * g, n, d), dtype)
    k = make(rng, (B, Hkv, n, d), dtype)
    v = make(rng, (B, Hkv, n, d), dtype)
    want = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
        is_causal=True, enable_gqa=True).numpy()
    got = attnx.softmax_attention(q.reshape(B, Hkv, g, n, d),
                                  k[:, :, None], v[:, :, None], causal=True)
    assert_close(got.reshape(B, Hkv * g, n, d), want, dtype, vscale(v))


def test_torch_tensors_via_numpy_zero_copy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(44)
    B, n, H, d = 2, 40, 4, 16
    x = torch.from_numpy(make(rng, (B, n, 3 * H * d), np.float32))
    qt, kt, vt = x.view(B, n, 3, H, d).permute(2, 0, 3, 1, 4)  # (B, H, n, d)
    got = attnx.softmax_attention(qt.numpy(), kt.numpy(), vt.numpy(), causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        qt, kt, vt, is_causal=True).numpy()
    assert_close(got, want, np.float32, vscale(vt.numpy()))


# --------------------------------------------------------------------------
# threads and runtime
# --------------------------------------------------------------------------

def test_python_threads_concurrent():
    rng = np.random.default_rng(45)
    jobs = []
    for i in range(16):
        dtype = np.float32 if i % 2 else np.float64
        n = 64 + 17 * i
        q, k, v = qkv(rng, (2, 2), n, n + 5, 32, 16, dtype)
        kw = dict(causal=bool(i % 3), window=(i if i % 4 == 0 else None))
        variant = "gaussian" if i % 5 == 0 else "softmax"
        jobs.append((variant, q, k, v, kw))

    def run(job):
        variant, q, k, v, kw = job
        fn, _ = FRONT[variant]
        return fn(q, k, v, **kw)

    sequential = [run(j) for j in jobs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as ex:
        for _ in range(3):
            concurrent_res = list(ex.map(run, jobs * 2))
            for i, got in enumerate(concurrent_res):
                want = sequential[i % len(jobs)]
                t = tol(want.dtype, 1)
                np.testing.assert_allclose(got, want, rtol=t["rtol"] / 10,
                                           atol=t["atol"] / 10)
    for (variant, q, k, v, kw), got in zip(jobs, sequential):
        _, rf = FRONT[variant]
        assert_close(got, rf(q, k, v, **kw), got.dtype, vscale(v))


def test_num_threads():
    orig = attnx.get_num_threads()
    assert isinstance(orig, int) and orig >= 1
    rng = np.random.default_rng(46)
    q, k, v = qkv(rng, (4, 4), 200, 200, 32, 32)
    try:
        attnx.set_num_threads(1)
        assert attnx.get_num_threads() == 1
        one = attnx.softmax_attention(q, k, v, causal=True)
        attnx.set_num_threads(3)
        assert attnx.get_num_threads() == 3
        three = attnx.softmax_attention(q, k, v, causal=True)
        np.testing.assert_allclose(one, three, rtol=1e-12, atol=1e-12)
        assert_close(one, ref_softmax(q, k, v, causal=True), np.float64,
                     vscale(v))
        for bad in (0, -1, -100):
            with pytest.raises(ValueError):
                attnx.set_num_threads(bad)
        assert attnx.get_num_threads() == 3
        with pytest.raises(TypeError):
            attnx.set_num_threads("2")
        with pytest.raises(TypeError):
            attnx.set_num_threads(1.5)
    finally:
        attnx.set_num_threads(orig)
    assert attnx.get_num_threads() == orig


def test_omp_num_threads_honoured():
    out = run_isolated("""
        print(attnx.get_num_threads())
    """)
    env_out = subprocess.run(
        [sys.executable, "-c", "import attnx; print(attnx.get_num_threads())"],
        capture_output=True, text=True, timeout=60,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert env_out.returncode == 0, env_out.stderr
    assert env_out.stdout.strip() == "1"
    assert int(out.strip()) >= 1


def test_show_config(capsys):
    r = attnx.show_config()
    text = capsys.readouterr().out
    assert r is None or isinstance(r, str)
    text = text + (r or "")
    assert "blas" in text.lower(), text
    for family, kernels in attnx.cpu_dispatch().items():
        assert f"{family} {kernels}" in text, text
    assert "disabled: none" in text or os.environ.get("ATTNX_DISABLE_CPU_FEATURES"), text
    side = attnx._C.build_info()["softmax_backward_block"]
    assert f"blocks:   softmax backward {side} x {side} (L2 " in text, text
    with dispatched("AVX512F"):
        attnx.show_config()
        text = capsys.readouterr().out
        assert "disabled: AVX512F (ATTNX_DISABLE_CPU_FEATURES)" in text, text
        for family, kernels in attnx.cpu_dispatch().items():
            assert f"{family} {kernels}" in text, text


def test_out_overlapping_an_input_that_needed_a_copy_raises():
    """The overlap check looks at the caller's array, not attnx's copy of it."""
    rng = np.random.default_rng(31)
    base = rng.standard_normal((4, 6))
    q = base.T                      # (6, 4), strided last axis: attnx reads a copy
    k, v = make(rng, (5, 4)), make(rng, (5, 4))
    with pytest.raises(ValueError, match="overlap"):
        attnx.softmax_attention(q, k, v, out=base.reshape(6, 4))
