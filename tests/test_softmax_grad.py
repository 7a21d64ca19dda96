"""Gradients of softmax and gaussian attention (attnx.softmax_attention_backward,
attnx.gaussian_attention_backward, attnx.vjp) against the numpy float64
references of attnx/reference.py, torch autograd and finite
differences."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnx
import attnx.reference as ref
from helpers import (assert_interrupted_quickly, dispatched, hypothesis_settings, kernels_here,
                     run_isolated, traced_peak)
from attnx.reference import (dropout_keep, gaussian_attention_grads, philox4x32_10, reduce_to,
                            softmax_attention_grads)

# float32 gradients are compared relative to the largest reference entry
RTOL = {np.float32: 5e-5, np.float64: 1e-10}


def assert_grad_close(got, want, dtype, what=""):
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    size = max(float(np.max(np.abs(want))), 1.0) if want.size else 1.0
    rtol = RTOL[dtype]
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=rtol * size,
                               err_msg=what)


def inputs(rng, q_shape, k_shape, v_shape, dtype):
    q = rng.standard_normal(q_shape).astype(dtype)
    k = rng.standard_normal(k_shape).astype(dtype)
    v = rng.standard_normal(v_shape).astype(dtype)
    return q, k, v


def check_softmax(q, k, v, dtype, rng, bias_grad=False, **options):
    out, lse = attnx.softmax_attention(q, k, v, return_lse=True, **options)
    dout = rng.standard_normal(out.shape).astype(dtype)
    g = attnx.softmax_attention_backward(dout, q, k, v, out, lse, bias_grad=bias_grad, **options)
    dq, dk, dv, dbias = softmax_attention_grads(dout, q, k, v, **options)
    for name, got, want, x in (("q", g.q, dq, q), ("k", g.k, dk, k), ("v", g.v, dv, v)):
        assert got.dtype == x.dtype
        assert_grad_close(got, reduce_to(want, x.shape), dtype, name)
    if bias_grad:
        assert_grad_close(g.bias, reduce_to(dbias, np.shape(options["bias"])), dtype, "bias")
    else:
        assert g.bias is None
    assert g.projection is None and g.state is None
    return g


# the backward's products (csrc/mk_backward.h) take rows (queries of a
# block; keys, for dK and dV) in blocks of 8 (AVX-512, NEON) or 6 (AVX2),
# then of 4, then the 1 to 3 left: blocks of 64 or 128 (softmax_backward_side)
# with 0 to 11 rows left over (137 = 128 + 6 + 3 or + 8 + 1; 139 = 128 + 6 + 4
# + 1 or + 8 + 3; with blocks of 64, 9 and 11 rows over two full blocks)
SIZES = [(1, 1, 4, 4), (5, 7, 4, 3), (130, 260, 16, 16), (257, 129, 32, 16), (200, 200, 64, 64),
         (137, 139, 32, 16)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n, m, d, e", SIZES)
@pytest.mark.parametrize("causal", [False, True, "upper_left"])
def test_softmax_grads_match_reference(dtype, n, m, d, e, causal, softmax_backward_side):
    rng = np.random.default_rng(n * 1000 + m)
    q, k, v = inputs(rng, (2, n, d), (2, m, d), (2, m, e), dtype)
    check_softmax(q, k, v, dtype, rng, causal=causal)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("window", [3, (40, 0), (None, 5), (0, None), (2, 7)])
def test_softmax_grads_windows(dtype, window, softmax_backward_side):
    rng = np.random.default_rng(1)
    q, k, v = inputs(rng, (1, 2, 300, 16), (1, 2, 290, 16), (1, 2, 290, 16), dtype)
    check_softmax(q, k, v, dtype, rng, window=window)
    check_softmax(q, k, v, dtype, rng, window=window, causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mask_shape", [(1, 150), (140, 150), (2, 1, 140, 150), (2, 3, 1, 150)])
def test_softmax_grads_masks(dtype, mask_shape, softmax_backward_side):
    rng = np.random.default_rng(2)
    q, k, v = inputs(rng, (2, 3, 140, 16), (2, 3, 150, 16), (2, 3, 150, 32), dtype)
    mask = rng.random(mask_shape) < 0.7
    check_softmax(q, k, v, dtype, rng, mask=mask)
    check_softmax(q, k, v, dtype, rng, mask=mask, causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias_shape", [(1, 150), (140, 150), (3, 140, 150), (2, 3, 140, 1),
                                        (2, 1, 1, 150)])
def test_softmax_grads_bias(dtype, bias_shape, softmax_backward_side):
    rng = np.random.default_rng(3)
    q, k, v = inputs(rng, (2, 3, 140, 16), (2, 3, 150, 16), (2, 3, 150, 16), dtype)
    bias = rng.standard_normal(bias_shape).astype(dtype)
    g = check_softmax(q, k, v, dtype, rng, bias=bias, bias_grad=True)
    assert g.bias.shape == bias.shape and g.bias.dtype == bias.dtype
    check_softmax(q, k, v, dtype, rng, bias=bias, causal=True, bias_grad=True,
                  mask=rng.random((140, 150)) < 0.8)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_grouped_query_grads_are_summed_over_the_group(dtype):
    # q (B, Hkv, g, n, d) against k, v (B, Hkv, 1, m, d): each key/value head
    # serves g query heads, and its gradient is the sum of theirs
    rng = np.random.default_rng(4)
    q, k, v = inputs(rng, (2, 2, 3, 140, 32), (2, 2, 1, 133, 32), (2, 2, 1, 133, 16), dtype)
    g = check_softmax(q, k, v, dtype, rng, causal=True)
    assert g.k.shape == k.shape and g.v.shape == v.shape


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("sigma", [0.7, 2.0])
def test_gaussian_grads_match_reference(dtype, sigma, softmax_backward_side):
    rng = np.random.default_rng(5)
    q, k, v = inputs(rng, (2, 150, 16), (2, 170, 16), (2, 170, 16), dtype)
    bias = rng.standard_normal((150, 170)).astype(dtype)
    for options in ({}, {"causal": True}, {"window": (20, 3)}, {"bias": bias},
                    {"mask": rng.random((1, 170)) < 0.6}):
        out, lse = attnx.gaussian_attention(q, k, v, sigma, return_lse=True, **options)
        dout = rng.standard_normal(out.shape).astype(dtype)
        g = attnx.gaussian_attention_backward(dout, q, k, v, out, lse, sigma,
                                              bias_grad="bias" in options, **options)
        dq, dk, dv, dbias = gaussian_attention_grads(dout, q, k, v, sigma, **options)
        assert_grad_close(g.q, dq, dtype, "q")
        assert_grad_close(g.k, dk, dtype, "k")
        assert_grad_close(g.v, dv, dtype, "v")
        if "bias" in options:
            assert_grad_close(g.bias, reduce_to(dbias, bias.shape), dtype, "bias")


def test_rows_that_see_nothing_have_zero_gradients():
    rng = np.random.default_rng(6)
    q, k, v = inputs(rng, (1, 200, 16), (1, 200, 16), (1, 200, 16), np.float64)
    mask = np.ones((200, 200), bool)
    mask[17] = False
    mask[150:] = False
    out, lse = attnx.softmax_attention(q, k, v, mask=mask, return_lse=True)
    dout = rng.standard_normal(out.shape)
    g = attnx.softmax_attention_backward(dout, q, k, v, out, lse, mask=mask)
    assert np.all(np.isfinite(g.q)) and np.all(np.isfinite(g.k)) and np.all(np.isfinite(g.v))
    assert np.all(g.q[0, 17] == 0) and np.all(g.q[0, 150:] == 0)
    # keys no row sees get nothing either
    mask[:, 30] = False
    out, lse = attnx.softmax_attention(q, k, v, mask=mask, return_lse=True)
    g = attnx.softmax_attention_backward(dout, q, k, v, out, lse, mask=mask)
    assert np.all(g.k[0, 30] == 0) and np.all(g.v[0, 30] == 0)


def test_hidden_nonfinite_keys_do_not_reach_other_rows():
    rng = np.random.default_rng(7)
    for d in (16, 5):  # the AVX-512 products and BLAS
        q, k, v = inputs(rng, (1, 160, d), (1, 160, d), (1, 160, 16), np.float64)
        mask = np.ones((1, 160), bool)
        mask[0, [100, 120]] = False
        k_bad, v_bad = k.copy(), v.copy()
        k_bad[0, 100] = np.nan
        v_bad[0, 120] = np.inf
        out, lse = attnx.softmax_attention(q, k_bad, v_bad, causal=True, mask=mask,
                                           return_lse=True)
        dout = rng.standard_normal(out.shape)
        g = attnx.softmax_attention_backward(dout, q, k_bad, v_bad, out, lse, causal=True,
                                             mask=mask)
        want = softmax_attention_grads(dout, q, k, v, causal=True, mask=mask)
        for got, ref in zip(g[:3], want[:3]):
            assert np.all(np.isfinite(got))
            assert_grad_close(got, ref, np.float64)


def test_float16_gradients_come_back_in_float16():
    rng = np.random.default_rng(8)
    q, k, v = inputs(rng, (1, 40, 16), (1, 50, 16), (1, 50, 16), np.float16)
    out, lse = attnx.softmax_attention(q, k, v, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float16)
    g = attnx.softmax_attention_backward(dout, q, k, v, out, lse)
    dq, dk, dv, _ = softmax_attention_grads(dout, q, k, v)
    for got, want in ((g.q, dq), (g.k, dk), (g.v, dv)):
        assert got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-2,
                                   atol=2e-2 * np.max(np.abs(want)))


def test_strided_views_are_read_in_place_and_equal_contiguous():
    rng = np.random.default_rng(9)
    x = rng.standard_normal((2, 150, 3, 3 * 16))   # (B, n, H, 3d) as a fused projection
    q, k, v = (x[..., i * 16:(i + 1) * 16].transpose(0, 2, 1, 3) for i in range(3))
    out, lse = attnx.softmax_attention(q, k, v, causal=True, return_lse=True)
    dout = rng.standard_normal(out.shape)
    g = attnx.softmax_attention_backward(dout, q, k, v, out, lse, causal=True)
    qc, kc, vc = (np.ascontiguousarray(a) for a in (q, k, v))
    gc = attnx.softmax_attention_backward(dout, qc, kc, vc, out, lse, causal=True)
    for a, b in zip(g[:3], gc[:3]):
        np.testing.assert_array_equal(a, b)


def test_results_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(10)
    q, k, v = inputs(rng, (1, 1, 700, 32), (1, 1, 900, 32), (1, 1, 900, 32), np.float32)
    out, lse = attnx.softmax_attention(q, k, v, causal=True, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    before = attnx.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            attnx.set_num_threads(threads)
            results.append(attnx.softmax_attention_backward(dout, q, k, v, out, lse, causal=True))
    finally:
        attnx.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0][:3], other[:3]):
            np.testing.assert_array_equal(a, b)


def test_preallocated_gradients_are_filled():
    rng = np.random.default_rng(11)
    q, k, v = inputs(rng, (2, 30, 8), (1, 40, 8), (1, 40, 4), np.float64)
    out, lse = attnx.softmax_attention(q, k, v, return_lse=True)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    g = attnx.softmax_attention_backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv)
    assert g.q is dq and g.k is dk and g.v is dv
    want = softmax_attention_grads(dout, q, k, v)
    assert_grad_close(dk, reduce_to(want[1], k.shape), np.float64)
    with pytest.raises(ValueError, match="dk must have shape"):
        attnx.softmax_attention_backward(dout, q, k, v, out, lse, dk=np.empty((2, 40, 8)))


def test_preallocated_gradients_written_in_place():
    """gradients of the call's whole batch go straight into dq, dk, dv
    (strided rows included): no gradient-sized temporary"""
    rng = np.random.default_rng(12)
    q, k, v = inputs(rng, (2, 1024, 32), (2, 1024, 32), (2, 1024, 32), np.float32)
    out, lse = attnx.softmax_attention(q, k, v, causal=True, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    want = attnx.softmax_attention_backward(dout, q, k, v, out, lse, causal=True)
    wide = np.full((2, 1024, 48), np.nan, np.float32)
    dk = wide[..., 8:40]
    dq, dv = np.empty_like(q), np.empty_like(v)
    g, peak = traced_peak(lambda: attnx.softmax_attention_backward(
        dout, q, k, v, out, lse, causal=True, dq=dq, dk=dk, dv=dv))
    assert g.q is dq and g.k is dk and g.v is dv
    assert peak < q.nbytes / 4, peak
    for got, ref in zip(g[:3], want[:3]):
        np.testing.assert_array_equal(got, ref)
    assert np.isnan(wide[..., :8]).all() and np.isnan(wide[..., 40:]).all()
    with pytest.raises(ValueError, match="overlap"):
        attnx.softmax_attention_backward(dout, q, k, v, out, lse, causal=True, dv=out)


def test_bad_input_is_refused_clearly():
    rng = np.random.default_rng(12)
    q, k, v = inputs(rng, (2, 30, 8), (2, 40, 8), (2, 40, 4), np.float64)
    out, lse = attnx.softmax_attention(q, k, v, return_lse=True)
    dout = np.ones_like(out)
    with pytest.raises(ValueError, match="lse"):
        attnx.softmax_attention_backward(dout, q, k, v, out, lse[:, :-1])
    with pytest.raises(ValueError, match="dout"):
        attnx.softmax_attention_backward(dout[:, :, :3], q, k, v, out, lse)
    with pytest.raises(ValueError, match="bias_grad=True needs a bias"):
        attnx.softmax_attention_backward(dout, q, k, v, out, lse, bias_grad=True)
    with pytest.raises(ValueError, match="scale"):
        attnx.softmax_attention_backward(dout, q, k, v, out, lse, scale=-1.0)
    with pytest.raises(TypeError):
        attnx.softmax_attention_backward(dout, q, k, v, out, lse, window="wide")
    before = [a.copy() for a in (dout, q, k, v, out, lse)]
    attnx.softmax_attention_backward(dout, q, k, v, out, lse)
    for a, b in zip((dout, q, k, v, out, lse), before):
        np.testing.assert_array_equal(a, b)


def test_empty_inputs():
    q, k, v = np.zeros((2, 0, 4)), np.ones((2, 5, 4)), np.ones((2, 5, 3))
    out, lse = attnx.softmax_attention(q, k, v, return_lse=True)
    g = attnx.softmax_attention_backward(np.zeros_like(out), q, k, v, out, lse)
    assert g.q.shape == q.shape and np.all(g.k == 0) and np.all(g.v == 0)
    q, k, v = np.ones((2, 3, 4)), np.zeros((2, 0, 4)), np.zeros((2, 0, 3))
    out, lse = attnx.softmax_attention(q, k, v, return_lse=True)
    g = attnx.softmax_attention_backward(np.ones_like(out), q, k, v, out, lse)
    assert np.all(g.q == 0) and g.k.shape == k.shape


def test_vjp_rules():
    rng = np.random.default_rng(13)
    q, k, v = inputs(rng, (2, 20, 8), (2, 25, 8), (2, 25, 8), np.float64)
    bias = rng.standard_normal((20, 25))
    out, pullback = attnx.vjp(attnx.softmax_attention, q, k, v, causal=True, bias=bias)
    np.testing.assert_array_equal(out, attnx.softmax_attention(q, k, v, causal=True, bias=bias))
    dout = rng.standard_normal(out.shape)
    g = pullback(dout)
    want = softmax_attention_grads(dout, q, k, v, causal=True, bias=bias)
    assert_grad_close(g.q, want[0], np.float64)
    assert_grad_close(g.bias, reduce_to(want[3], bias.shape), np.float64)
    out, pullback = attnx.vjp(attnx.gaussian_attention, q, k, v, 1.5, window=4)
    g = pullback(dout)
    want = gaussian_attention_grads(dout, q, k, v, 1.5, window=4)
    assert_grad_close(g.k, want[1], np.float64)
    with pytest.raises(TypeError, match="return_lse"):
        attnx.vjp(attnx.softmax_attention, q, k, v, return_lse=True)


def test_against_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(14)
    q, k, v = inputs(rng, (2, 3, 140, 16), (2, 3, 150, 16), (2, 3, 150, 16), np.float64)
    mask = rng.random((2, 1, 140, 150)) < 0.8
    bias = rng.standard_normal((3, 140, 150))
    out, lse = attnx.softmax_attention(q, k, v, mask=mask, bias=bias, return_lse=True)
    dout = rng.standard_normal(out.shape)
    g = attnx.softmax_attention_backward(dout, q, k, v, out, lse, mask=mask, bias=bias,
                                         bias_grad=True)
    tq, tk, tv, tb = (torch.tensor(a, requires_grad=True) for a in (q, k, v, bias))
    attn_mask = torch.where(torch.tensor(mask), tb, torch.tensor(-np.inf, dtype=torch.float64))
    o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=attn_mask)
    o.backward(torch.tensor(dout))
    for got, want in ((g.q, tq.grad), (g.k, tk.grad), (g.v, tv.grad), (g.bias, tb.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-11)


def test_finite_differences():
    rng = np.random.default_rng(15)
    q, k, v = inputs(rng, (1, 6, 5), (1, 7, 5), (1, 7, 3), np.float64)
    bias = rng.standard_normal((6, 7))
    dout = rng.standard_normal((1, 6, 3))
    options = dict(causal=True, bias=bias)

    def loss(q_, k_, v_, b_):
        return np.sum(dout * attnx.softmax_attention(q_, k_, v_, causal=True, bias=b_))

    out, lse = attnx.softmax_attention(q, k, v, return_lse=True, **options)
    g = attnx.softmax_attention_backward(dout, q, k, v, out, lse, bias_grad=True, **options)
    step = 1e-6
    for which, (x, grad) in enumerate(((q, g.q), (k, g.k), (v, g.v), (bias, g.bias))):
        numeric = np.zeros_like(x)
        for index in np.ndindex(x.shape):
            args = [q, k, v, bias]
            plus, minus = x.copy(), x.copy()
            plus[index] += step
            minus[index] -= step
            args[which] = plus
            up = loss(*args)
            args[which] = minus
            numeric[index] = (up - loss(*args)) / (2 * step)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


@hypothesis_settings(40)
@given(n=st.integers(1, 40), m=st.integers(1, 40), seed=st.integers(0, 2**31 - 1),
       causal=st.sampled_from([False, True, "upper_left"]))
def test_property_masked_keys_get_zero_and_permutations(n, m, seed, causal):
    rng = np.random.default_rng(seed)
    q, k, v = inputs(rng, (2, n, 8), (2, m, 8), (2, m, 8), np.float64)
    key_mask = rng.random((2, 1, m)) < 0.7
    out, lse = attnx.softmax_attention(q, k, v, mask=key_mask, return_lse=True)
    dout = rng.standard_normal(out.shape)
    g = attnx.softmax_attention_backward(dout, q, k, v, out, lse, mask=key_mask)
    hidden = ~key_mask[:, 0, :]
    assert np.all(g.k[hidden] == 0) and np.all(g.v[hidden] == 0)
    # permuting key/value pairs (and the mask) permutes their gradients
    perm = rng.permutation(m)
    out_p, lse_p = attnx.softmax_attention(q, k[:, perm], v[:, perm], mask=key_mask[..., perm],
                                           return_lse=True)
    g_p = attnx.softmax_attention_backward(dout, q, k[:, perm], v[:, perm], out_p, lse_p,
                                           mask=key_mask[..., perm])
    np.testing.assert_allclose(g_p.k, g.k[:, perm], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(g_p.q, g.q, rtol=1e-9, atol=1e-12)
    # a broadcast call's gradients equal the summed loop over its slices
    kb, vb = k[:1], v[:1]
    out_b, lse_b = attnx.softmax_attention(q, kb, vb, causal=causal, return_lse=True)
    g_b = attnx.softmax_attention_backward(dout, q, kb, vb, out_b, lse_b, causal=causal)
    dk_sum = np.zeros_like(kb)
    for b in range(2):
        o_s, l_s = attnx.softmax_attention(q[b], kb[0], vb[0], causal=causal, return_lse=True)
        g_s = attnx.softmax_attention_backward(dout[b], q[b], kb[0], vb[0], o_s, l_s,
                                               causal=causal)
        np.testing.assert_allclose(g_b.q[b], g_s.q, rtol=1e-12, atol=1e-14)
        dk_sum[0] += g_s.k
    np.testing.assert_allclose(g_b.k, dk_sum, rtol=1e-9, atol=1e-12)


# --------------------------------------------------------------------------
# Every kernel set of the backward this CPU has (the AVX-512, AVX2+FMA or
# NEON products, with the bfloat16 dot products where it has them, and BLAS)
# --------------------------------------------------------------------------

BACKENDS_HERE = kernels_here("softmax_backward")


def held_to(backend):
    """The backward held to kernel set `backend`; for plain, the forward too
    (its plain C code, with dropout, is then checked here as well)."""
    limits = {"softmax_backward": backend}
    if backend == "plain":
        limits["softmax_forward"] = "plain"
    return dispatched(**limits)


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_grads_on_every_backend(backend, dtype, causal, softmax_backward_side):
    rng = np.random.default_rng(16)
    q, k, v = inputs(rng, (2, 200, 32), (2, 300, 32), (2, 300, 16), dtype)
    with held_to(backend):
        check_softmax(q, k, v, dtype, rng, causal=causal, mask=rng.random((1, 300)) < 0.8)


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("causal", [False, True])
def test_probabilities_at_the_extremes_on_every_backend(backend, causal, softmax_backward_side):
    """The backward's probabilities 2^(s - lse) (csrc/microkernel.h:
    mk_probabilities_w16 on AVX-512, mk_probabilities_w8 on AVX2, vexp2
    elsewhere) where they are most fragile: scores spread over a hundred
    log2 units, so that many fall under 2^-125 (taken as 0) or just above
    it, keys masked out (-inf terms, whatever their scores), rows of 1 to
    7 keys past whole vectors (m = 300, causal), on every backward kernel
    set against the float64 reference."""
    rng = np.random.default_rng(72)
    # small integers: exact float32 dot products, so the scores' rounding
    # is not at issue; scores of std ~27 log2 units
    q, k = (rng.integers(-7, 8, (2, count, 64)).astype(np.float32) for count in (200, 300))
    v = rng.standard_normal((2, 300, 64)).astype(np.float32)
    mask = rng.random((2, 1, 300)) < 0.8
    with held_to(backend):
        g = check_softmax(q, k, v, np.float32, rng, causal=causal, mask=mask)
    assert np.all(g.k[~mask[:, 0]] == 0) and np.all(g.v[~mask[:, 0]] == 0)


# --------------------------------------------------------------------------
# Dropout
# --------------------------------------------------------------------------

def test_philox_reference_known_answers():
    # the published known-answer vectors of Philox4x32-10 (Random123)
    cases = [((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
             ((0xffffffff,) * 4, (0xffffffff,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
             ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
              (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1))]
    for counter, key, want in cases:
        assert tuple(int(w) for w in philox4x32_10(counter, key)) == want


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_forward_and_weights_match_reference(backend, dtype, p):
    rng = np.random.default_rng(17)
    seed = 2**40 + 12345
    q, k, v = inputs(rng, (2, 3, 150, 16), (2, 3, 290, 16), (2, 3, 290, 16), dtype)
    keep = dropout_keep(seed, p, (2, 3), 150, 290)
    with held_to(backend):
        for causal in (False, True):
            w = ref.softmax_weights(q, k, causal=causal)
            want = np.matmul(w * keep / (1 - p), v.astype(np.float64))
            out, lse = attnx.softmax_attention(q, k, v, causal=causal, dropout_p=p, seed=seed,
                                               return_lse=True)
            assert_grad_close(out, want, dtype, "out")
            # lse is that of the undropped weights, summed by the same kernels:
            # AMX takes no dropout, so there the undropped call is held below it
            forward = attnx.cpu_dispatch()["softmax_forward"]
            limits = {"softmax_backward": backend, "softmax_forward": forward}
            if forward == "amx":
                limits["softmax_forward"] = "avx512"
            with dispatched(**limits):
                _, lse0 = attnx.softmax_attention(q, k, v, causal=causal, return_lse=True)
            np.testing.assert_array_equal(lse, lse0)
            weights = attnx.attention_weights(q, k, causal=causal, dropout_p=p, seed=seed)
            assert_grad_close(weights, w * keep / (1 - p), dtype, "weights")


@pytest.mark.parametrize("backend", BACKENDS_HERE)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dropout_gradients_match_reference(backend, dtype, softmax_backward_side):
    rng = np.random.default_rng(18)
    p, seed = 0.25, 7
    q, k, v = inputs(rng, (2, 2, 170, 32), (2, 1, 260, 32), (2, 1, 260, 16), dtype)
    keep = dropout_keep(seed, p, (2, 2), 170, 260)
    with held_to(backend):
        out, lse = attnx.softmax_attention(q, k, v, causal=True, dropout_p=p, seed=seed,
                                           return_lse=True)
        dout = rng.standard_normal(out.shape).astype(dtype)
        g = attnx.softmax_attention_backward(dout, q, k, v, out, lse, causal=True, dropout_p=p,
                                             seed=seed)
        out_v, pullback = attnx.vjp(attnx.softmax_attention, q, k, v, causal=True, dropout_p=p,
                                    seed=seed)
        np.testing.assert_array_equal(out_v, out)
        np.testing.assert_array_equal(pullback(dout).q, g.q)
    dq, dk, dv, _ = softmax_attention_grads(dout, q, k, v, causal=True, dropout_keep=keep,
                                            dropout_p=p)
    assert_grad_close(g.q, dq, dtype, "q")
    assert_grad_close(g.k, reduce_to(dk, k.shape), dtype, "k")
    assert_grad_close(g.v, reduce_to(dv, v.shape), dtype, "v")


def test_dropout_keeps_about_one_minus_p():
    rng = np.random.default_rng(19)
    q, k = inputs(rng, (4, 300, 8), (4, 300, 8), (4, 300, 8), np.float64)[:2]
    weights = attnx.attention_weights(q, k, dropout_p=0.3, seed=3)
    kept = np.mean(weights != 0)
    # 360000 Bernoulli(0.7) draws: 5 standard deviations are 0.004
    assert abs(kept - 0.7) < 0.004
    other = attnx.attention_weights(q, k, dropout_p=0.3, seed=4)
    assert np.mean((weights != 0) == (other != 0)) < 0.65


def test_dropout_options_are_checked():
    q = np.ones((1, 4, 4))
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="dropout_p must be in"):
            attnx.softmax_attention(q, q, q, dropout_p=bad, seed=0)
    with pytest.raises(ValueError, match="needs seed"):
        attnx.softmax_attention(q, q, q, dropout_p=0.5)
    with pytest.raises(ValueError, match="seed must be in"):
        attnx.gaussian_attention(q, q, q, dropout_p=0.5, seed=-1)
    with pytest.raises(TypeError, match="seed must be an int"):
        attnx.softmax_attention(q, q, q, dropout_p=0.5, seed=1.5)
    np.testing.assert_array_equal(attnx.softmax_attention(q, q, q, dropout_p=0.0),
                                  attnx.softmax_attention(q, q, q))


# --------------------------------------------------------------------------
# Ctrl-C
# --------------------------------------------------------------------------

SETUP = """
attnx.set_num_threads({threads})
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((4, 8, 8192, 64), dtype=np.float32) for _ in range(3))
small = (q[:, :, :512], k[:, :, :512], v[:, :, :512])
"""
USABLE = "assert np.array_equal(attnx.softmax_attention(*small), attnx.softmax_attention(*small))"

FORWARD = "attnx.softmax_attention(q, k, v)"
BACKWARD = ("out, lse = attnx.softmax_attention(q[:, :, :16], k, v, return_lse=True); "
            "attnx.softmax_attention_backward(np.ones((4, 8, 8192, 64), np.float32), q, k, v, "
            "np.zeros_like(q), np.zeros((4, 8, 8192), np.float32))")


# the kernelised family: the quadratic form (explicit similarities in tiles)
# and the chunk method with many FAVOR+ features, forward, and the backward
# over many short heads (it stops between heads; each takes about 0.1 s)
LINEAR_QUADRATIC = 'attnx.linear_attention(q, k, v, method="quadratic")'
FAVOR = 'feature_map="favor", projection=attnx.random_features(1024, 64, seed=0)'
LINEAR_CHUNK = "attnx.linear_attention(q, k, v, causal=True, %s)" % FAVOR
HEADS = "x = lambda a: a.reshape(512, 512, 64); "
LINEAR_BACKWARD_QUADRATIC = (HEADS + "attnx.linear_attention_backward(x(q), x(q), x(k), x(v), "
                             "method='quadratic')")
LINEAR_BACKWARD_CHUNK = (HEADS + "attnx.linear_attention_backward(x(q), x(q), x(k), x(v), "
                         "causal=True, %s)" % FAVOR)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("call", [FORWARD, BACKWARD, LINEAR_QUADRATIC, LINEAR_CHUNK,
                                  LINEAR_BACKWARD_QUADRATIC, LINEAR_BACKWARD_CHUNK],
                         ids=["forward", "backward", "linear quadratic", "linear chunk",
                              "linear backward quadratic", "linear backward chunk"])
def test_ctrl_c_interrupts_a_long_call_within_half_a_second(threads, call):
    assert_interrupted_quickly(SETUP.format(threads=threads), call, USABLE)
