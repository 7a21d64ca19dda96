"""Tests of the numpy reference itself (attnx/reference.py), so that the
attnx tests can trust it. Nothing here imports attnx."""

import math

import numpy as np
import pytest

import attnx.reference as ref

EXACT = dict(rtol=1e-10, atol=1e-12)


def rnd(rng, *shape, scale=1.0):
    return rng.standard_normal(shape) * scale


# --------------------------------------------------------------------------
# visibility
# --------------------------------------------------------------------------

def _vis_loop(n, m, causal, window):
    out = np.zeros((n, m), dtype=bool)
    if isinstance(window, tuple):
        left, right = window
    else:
        left = right = window
    for i in range(n):
        for j in range(m):
            ok = True
            if causal in (True, "lower_right"):
                ok &= j <= i + (m - n)
            elif causal == "upper_left":
                ok &= j <= i
            ip = i + (m - n)
            if window is not None:
                if left is not None:
                    ok &= ip - left <= j
                if right is not None:
                    ok &= j <= ip + right
            out[i, j] = ok
    return out


@pytest.mark.parametrize("n,m", [(1, 1), (5, 5), (3, 7), (7, 3), (1, 9), (9, 1)])
@pytest.mark.parametrize("causal", [False, True, "lower_right", "upper_left"])
@pytest.mark.parametrize("window", [None, 0, 2, (1, None), (None, 0), (0, 3),
                                    (3, 1)])
def test_visibility_matches_loop(n, m, causal, window):
    got = ref.visibility(n, m, causal=causal, window=window)
    assert got.shape == (n, m)
    np.testing.assert_array_equal(got, _vis_loop(n, m, causal, window))


def test_visibility_known_values():
    # n == m: lower_right == upper_left == tril
    np.testing.assert_array_equal(ref.visibility(4, 4, causal=True),
                                  np.tril(np.ones((4, 4), bool)))
    np.testing.assert_array_equal(ref.visibility(4, 4, causal="upper_left"),
                                  np.tril(np.ones((4, 4), bool)))
    # n < m, lower right: last query sees everything
    v = ref.visibility(2, 4, causal=True)
    np.testing.assert_array_equal(v, [[1, 1, 1, 0], [1, 1, 1, 1]])
    v = ref.visibility(2, 4, causal="upper_left")
    np.testing.assert_array_equal(v, [[1, 0, 0, 0], [1, 1, 0, 0]])
    # n > m, lower right: the first rows see nothing
    v = ref.visibility(4, 2, causal=True)
    np.testing.assert_array_equal(v, [[0, 0], [0, 0], [1, 0], [1, 1]])
    # window 1 on a square: tridiagonal band
    v = ref.visibility(4, 4, window=1)
    np.testing.assert_array_equal(
        v, [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]])
    # window (None, 0) == causal lower right
    for n, m in [(3, 5), (5, 3), (4, 4)]:
        np.testing.assert_array_equal(ref.visibility(n, m, window=(None, 0)),
                                      ref.visibility(n, m, causal=True))


def test_visibility_mask_broadcasts():
    rng = np.random.default_rng(0)
    mask = rng.random((2, 1, 1, 5)) < 0.5          # key padding (..., 1, m)
    v = ref.visibility(3, 5, causal=True, mask=mask)
    assert v.shape == (2, 1, 3, 5)
    np.testing.assert_array_equal(v, mask & np.tril(np.ones((3, 5), bool), 2))
    with pytest.raises(TypeError):
        ref.visibility(3, 5, mask=np.ones((3, 5)))


# --------------------------------------------------------------------------
# softmax vs torch
# --------------------------------------------------------------------------

def _torch():
    return pytest.importorskip("torch")


@pytest.mark.parametrize("n,m,d,e", [(1, 1, 1, 1), (5, 7, 3, 4), (8, 8, 16, 16),
                                     (13, 4, 5, 2)])
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("is_causal", [False, True])
def test_softmax_vs_torch(n, m, d, e, scale, is_causal):
    torch = _torch()
    F = torch.nn.functional
    rng = np.random.default_rng(n * 100 + m)
    q, k, v = rnd(rng, 2, 3, n, d), rnd(rng, 2, 3, m, d), rnd(rng, 2, 3, m, e)
    want = F.scaled_dot_product_attention(
        torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
        is_causal=is_causal, scale=scale).numpy()
    got = ref.softmax_attention(q, k, v, scale=scale,
                                causal="upper_left" if is_causal else False)
    np.testing.assert_allclose(got, want, **EXACT)
    if is_causal and n == m:
        got = ref.softmax_attention(q, k, v, scale=scale, causal=True)
        np.testing.assert_allclose(got, want, **EXACT)


def test_softmax_lower_right_vs_torch_mask():
    torch = _torch()
    F = torch.nn.functional
    rng = np.random.default_rng(1)
    n, m, d = 5, 9, 4
    q, k, v = rnd(rng, n, d), rnd(rng, m, d), rnd(rng, m, 3)
    tm = torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n)
    want = F.scaled_dot_product_attention(
        torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
        attn_mask=tm).numpy()
    np.testing.assert_allclose(ref.softmax_attention(q, k, v, causal=True),
                               want, **EXACT)


@pytest.mark.parametrize("seed", range(4))
def test_softmax_bool_mask_and_bias_vs_torch(seed):
    torch = _torch()
    F = torch.nn.functional
    rng = np.random.default_rng(seed)
    B, H, n, m, d, e = 2, 3, 6, 11, 8, 5
    q, k, v = rnd(rng, B, H, n, d), rnd(rng, B, H, m, d), rnd(rng, B, H, m, e)
    mask = rng.random((B, 1, n, m)) < 0.6
    mask[..., 0] = True  # no fully masked row (torch gives NaN there)
    tq, tk, tv = map(torch.from_numpy, (q, k, v))
    want = F.scaled_dot_product_attention(tq, tk, tv,
                                          attn_mask=torch.from_numpy(mask),
                                          scale=0.7).numpy()
    got = ref.softmax_attention(q, k, v, scale=0.7, mask=mask)
    np.testing.assert_allclose(got, want, **EXACT)

    bias = rnd(rng, H, n, m)
    want = F.scaled_dot_product_attention(tq, tk, tv,
                                          attn_mask=torch.from_numpy(bias)
                                          ).numpy()
    got = ref.softmax_attention(q, k, v, bias=bias)
    np.testing.assert_allclose(got, want, **EXACT)


def test_softmax_lse_vs_torch_logsumexp():
    torch = _torch()
    rng = np.random.default_rng(2)
    n, m, d = 7, 10, 6
    q, k, v = rnd(rng, n, d), rnd(rng, m, d), rnd(rng, m, 2)
    bias = rnd(rng, n, m)
    mask = rng.random((n, m)) < 0.5
    mask[3] = False  # a row that sees nothing
    _, lse = ref.softmax_attention(q, k, v, scale=0.5, bias=bias, mask=mask,
                                   return_lse=True)
    logits = 0.5 * q @ k.T + bias
    logits = np.where(mask, logits, -np.inf)
    want = torch.logsumexp(torch.from_numpy(logits), dim=-1).numpy()
    assert lse.shape == (n,)
    assert lse[3] == -np.inf
    np.testing.assert_allclose(lse, want, **EXACT)


def test_softmax_similarity_and_weights():
    rng = np.random.default_rng(3)
    n, m, d = 6, 8, 5
    q, k = rnd(rng, 2, n, d), rnd(rng, 2, m, d)
    s = ref.softmax_similarity(q, k, causal=True)
    explicit = np.exp(q @ np.swapaxes(k, -1, -2) / math.sqrt(d))
    explicit *= np.tril(np.ones((n, m)), m - n)
    np.testing.assert_allclose(s, explicit, **EXACT)
    w = ref.softmax_weights(q, k, causal=True)
    np.testing.assert_allclose(w, explicit / explicit.sum(-1, keepdims=True),
                               **EXACT)


def test_softmax_stable_with_huge_logits():
    q = np.array([[1000.0, 0.0]])
    k = np.array([[1.0, 0.0], [0.999, 0.0], [-1.0, 0.0]])
    v = np.array([[1.0], [2.0], [3.0]])
    o, lse = ref.softmax_attention(q, k, v, scale=1.0, return_lse=True)
    w1 = 1.0 / (1.0 + math.exp(-1.0) + math.exp(-2000.0))
    w2 = math.exp(-1.0) * w1
    np.testing.assert_allclose(o[0, 0], w1 * 1 + w2 * 2, rtol=1e-13)
    np.testing.assert_allclose(lse[0], 1000.0 + math.log1p(math.exp(-1.0)),
                               rtol=1e-14)


def test_softmax_empty_rows_and_sizes():
    rng = np.random.default_rng(4)
    q, k, v = rnd(rng, 4, 3), rnd(rng, 2, 3), rnd(rng, 2, 5)
    o, lse = ref.softmax_attention(q, k, v, causal=True, return_lse=True)
    # n > m lower-right: rows 0, 1 see nothing
    assert np.all(o[:2] == 0) and np.all(lse[:2] == -np.inf)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(lse[2:]))
    # m == 0 -> zeros; n == 0 -> empty
    o, lse = ref.softmax_attention(q, k[:0], v[:0], return_lse=True)
    assert o.shape == (4, 5) and np.all(o == 0) and np.all(lse == -np.inf)
    o = ref.softmax_attention(q[:0], k, v)
    assert o.shape == (0, 5)


def test_softmax_nan_row_isolated():
    rng = np.random.default_rng(5)
    q, k, v = rnd(rng, 5, 4), rnd(rng, 6, 4), rnd(rng, 6, 3)
    q[2, 1] = np.nan
    o, lse = ref.softmax_attention(q, k, v, return_lse=True)
    assert np.all(np.isnan(o[2])) and np.isnan(lse[2])
    clean = np.delete(np.arange(5), 2)
    np.testing.assert_allclose(o[clean],
                               ref.softmax_attention(q[clean], k, v), **EXACT)


def test_nan_value_of_invisible_key_stays_out():
    rng = np.random.default_rng(55)
    q, k, v = rnd(rng, 4, 3), rnd(rng, 4, 3), rnd(rng, 4, 2)
    v2 = v.copy()
    v2[3] = np.nan
    v2[2, 0] = np.inf
    o = ref.softmax_attention(q, k, v2, causal=True)
    np.testing.assert_allclose(o[:2], ref.softmax_attention(q, k, v,
                                                            causal=True)[:2],
                               **EXACT)
    assert np.isposinf(o[2, 0]) or np.isneginf(o[2, 0])
    assert np.isfinite(o[2, 1]) and np.all(np.isnan(o[3]))
    o = ref.linear_attention(q, k, v2, "elu", causal=True)
    np.testing.assert_allclose(o[:2], ref.linear_attention(q, k, v, "elu",
                                                           causal=True)[:2],
                               **EXACT)


# --------------------------------------------------------------------------
# gaussian
# --------------------------------------------------------------------------

@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
@pytest.mark.parametrize("causal", [False, True])
def test_gaussian_vs_softmax_rewrite(sigma, causal):
    rng = np.random.default_rng(6)
    n, m, d = 7, 9, 4
    q, k, v = rnd(rng, 2, n, d), rnd(rng, 2, m, d), rnd(rng, 2, m, 3)
    kb = -np.sum(k * k, axis=-1)[..., None, :] / (2 * sigma ** 2)
    want = ref.softmax_attention(q, k, v, scale=1 / sigma ** 2, bias=kb,
                                 causal=causal)
    got = ref.gaussian_attention(q, k, v, sigma=sigma, causal=causal)
    np.testing.assert_allclose(got, want, **EXACT)
    np.testing.assert_allclose(
        ref.gaussian_weights(q, k, sigma=sigma, causal=causal),
        ref.softmax_weights(q, k, scale=1 / sigma ** 2, bias=kb, causal=causal),
        **EXACT)


def test_gaussian_similarity_and_lse():
    rng = np.random.default_rng(7)
    q, k, v = rnd(rng, 3, 2), rnd(rng, 4, 2), rnd(rng, 4, 1)
    s = ref.gaussian_similarity(q, k, sigma=1.5)
    for i in range(3):
        for j in range(4):
            want = math.exp(-np.sum((q[i] - k[j]) ** 2) / (2 * 1.5 ** 2))
            assert s[i, j] == pytest.approx(want, rel=1e-14)
    _, lse = ref.gaussian_attention(q, k, v, sigma=1.5, return_lse=True)
    np.testing.assert_allclose(lse, np.log(s.sum(-1)), **EXACT)
    with pytest.raises(ValueError):
        ref.gaussian_attention(q, k, v, sigma=0.0)


def test_gaussian_far_queries_stable():
    # every key is very far: the unstabilised similarity underflows to 0
    # but the stabilised weights must still be the nearest-key softmax
    q = np.array([[100.0]])
    k = np.array([[0.0], [1.0]])
    v = np.array([[0.0], [1.0]])
    o = ref.gaussian_attention(q, k, v, sigma=0.1)
    # a_0 = -5e5, a_1 = -99^2*50 = -490050; diff 9950 -> weight 1 on key 1
    np.testing.assert_allclose(o, [[1.0]], rtol=1e-14)


# --------------------------------------------------------------------------
# rows sum to one
# --------------------------------------------------------------------------

def _all_weights(q, k, rng, mask=None, causal=False):
    d = q.shape[-1]
    W = rng.standard_normal((32, d))
    out = {
        "softmax": ref.softmax_weights(q, k, causal=causal, mask=mask),
        "gaussian": ref.gaussian_weights(q, k, sigma=1.3, causal=causal,
                                         mask=mask),
        "cosformer": ref.cosformer_weights(q, k, causal=causal, mask=mask),
    }
    for fm in ["elu", "relu", "softmax", "taylor", "focused", "favor"]:
        out["linear-" + fm] = ref.linear_weights(q, k, fm, causal=causal,
                                                 mask=mask, projection=W)
    if not causal and mask is None:
        out["efficient"] = ref.efficient_weights(q, k)
    return out


@pytest.mark.parametrize("causal", [False, True])
def test_weights_rows_sum_to_one(causal):
    rng = np.random.default_rng(8)
    q, k = rnd(rng, 2, 6, 5), rnd(rng, 2, 6, 5)
    q[0, 0] = 0.0  # zero vectors for taylor/focused
    mask = rng.random((6, 6)) < 0.7
    mask[:, 0] = True
    mask[4] = False  # row 4 sees nothing
    for name, w in _all_weights(q, k, rng, causal=causal).items():
        assert np.all(w >= 0), name
        sums = w.sum(-1)
        # relu/focused rows can have zero mass; the others must be exactly 1
        if name in ("linear-relu", "linear-focused", "cosformer"):
            sums = sums[sums > 0]
        np.testing.assert_allclose(sums, 1.0, rtol=1e-12, err_msg=name)
    for name, w in _all_weights(q, k, rng, mask=mask, causal=causal).items():
        assert np.all(w >= 0), name
        assert np.all(w[:, 4] == 0), name
        assert np.all(w[..., ~mask] == 0) if w.ndim == 3 else True


# --------------------------------------------------------------------------
# feature maps
# --------------------------------------------------------------------------

def test_elu_relu_softmax_identity_features():
    x = np.array([[-2.0, -0.5, 0.0, 0.5, 3.0]])
    np.testing.assert_allclose(ref.apply_feature_map(x, "elu"),
                               [[math.exp(-2), math.exp(-.5), 1.0, 1.5, 4.0]],
                               rtol=1e-15)
    np.testing.assert_array_equal(ref.apply_feature_map(x, "relu"),
                                  [[0, 0, 0, 0.5, 3.0]])
    sm = ref.apply_feature_map(x, "softmax")
    np.testing.assert_allclose(sm, np.exp(x) / np.exp(x).sum(), rtol=1e-14)
    np.testing.assert_array_equal(ref.apply_feature_map(np.abs(x), "identity"),
                                  np.abs(x))
    with pytest.raises(ValueError):
        ref.apply_feature_map(x, "identity")


def test_taylor_similarity_is_one_plus_cosine():
    rng = np.random.default_rng(9)
    q, k = rnd(rng, 3, 5, 7), rnd(rng, 3, 6, 7)
    s = ref.linear_similarity(q, k, "taylor")
    qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
    kn = k / np.linalg.norm(k, axis=-1, keepdims=True)
    np.testing.assert_allclose(s, 1.0 + qn @ np.swapaxes(kn, -1, -2), **EXACT)
    assert np.all(s >= 0)
    # zero vector -> [1, 0, ...] -> similarity 1
    q[0, 0] = 0
    s = ref.linear_similarity(q, k, "taylor")
    np.testing.assert_allclose(s[0, 0], 1.0, rtol=0, atol=0)
    f = ref.apply_feature_map(np.zeros((1, 4)), "taylor")
    np.testing.assert_array_equal(f, [[1, 0, 0, 0, 0]])


def test_focused_features():
    rng = np.random.default_rng(10)
    x = rnd(rng, 20, 6)
    x[0] = -np.abs(x[0])  # relu -> zero vector -> 0 features
    for p in (1, 2, 3, 5):
        f = ref.apply_feature_map(x, "focused", p=p)
        r = np.maximum(x, 0)
        assert np.all(f >= 0)
        # norm preserved: |f(x)| == |relu(x)|
        np.testing.assert_allclose(np.linalg.norm(f, axis=-1),
                                   np.linalg.norm(r, axis=-1), **EXACT)
        # direction: relu(x)**p normalised
        for row in range(1, 20):
            rp = r[row] ** p
            want = np.linalg.norm(r[row]) * rp / np.linalg.norm(rp)
            np.testing.assert_allclose(f[row], want, **EXACT)
        np.testing.assert_array_equal(f[0], 0)
    # p = 1 is the identity on relu(x)
    np.testing.assert_allclose(ref.apply_feature_map(x, "focused", p=1),
                               np.maximum(x, 0), **EXACT)


def test_favor_features_exact_formula():
    rng = np.random.default_rng(11)
    d, r = 5, 7
    x, W = rnd(rng, 3, d), rnd(rng, r, d)
    f = ref.apply_feature_map(x, "favor", projection=W)
    for a in range(3):
        xt = x[a] * d ** -0.25
        for b in range(r):
            want = r ** -0.5 * math.exp(W[b] @ xt - 0.5 * xt @ xt)
            assert f[a, b] == pytest.approx(want, rel=1e-14)


def test_favor_approximates_softmax_kernel():
    """With r = 4096 iid Gaussian rows, phi(q).phi(k) is an unbiased
    estimate of exp(q.k/sqrt(d)) whose relative standard deviation is
    sqrt((exp(|q~ + k~|^2) - 1) / r)  (Choromanski et al., Lemma 2), about
    2.5% here. Stated tolerance: every entry within 5 of those standard
    deviations, the mean ratio within 1%, the normalised weights within
    0.02 absolute of the softmax weights."""
    rng = np.random.default_rng(12)
    d, r = 16, 4096
    q, k = rnd(rng, 8, d, scale=0.4), rnd(rng, 10, d, scale=0.4)
    W = rng.standard_normal((r, d))
    s = ref.linear_similarity(q, k, "favor", projection=W)
    exact = np.exp(q @ k.T / math.sqrt(d))
    ratio = s / exact
    xs = (q[:, None, :] + k[None, :, :]) * d ** -0.25
    rel_std = np.sqrt((np.exp(np.sum(xs * xs, -1)) - 1) / r)
    assert np.all(np.abs(ratio - 1) < 5 * rel_std), np.max(
        np.abs(ratio - 1) / rel_std)
    assert abs(np.mean(ratio) - 1) < 0.01
    w = ref.linear_weights(q, k, "favor", projection=W)
    np.testing.assert_allclose(w, ref.softmax_weights(q, k), atol=0.02)
    # a finite r with a *wrong* kernel (no |x|^2/2 term) must fail the check:
    # guards against the test being vacuous
    xt_q, xt_k = q * d ** -0.25, k * d ** -0.25
    bad = (np.exp(xt_q @ W.T) @ np.exp(xt_k @ W.T).T) / r
    assert not np.all(np.abs(bad / exact - 1) < 5 * rel_std)


# --------------------------------------------------------------------------
# linear attention
# --------------------------------------------------------------------------

@pytest.mark.parametrize("fm", ["elu", "relu", "softmax", "taylor", "focused",
                                "favor"])
def test_linear_causal_equals_recurrent_form(fm):
    """o_i = phi(q_i) S_i / max(phi(q_i).z_i, eps), S_i, z_i prefix sums --
    the RNN form written independently of the weights form."""
    rng = np.random.default_rng(13)
    n, d, e = 9, 4, 3
    q, k, v = rnd(rng, n, d), rnd(rng, n, d), rnd(rng, n, e)
    W = rng.standard_normal((6, d))
    got = ref.linear_attention(q, k, v, fm, causal=True, projection=W)
    fq = ref.apply_feature_map(q, fm, projection=W)
    fk = ref.apply_feature_map(k, fm, projection=W)
    r = fq.shape[-1]
    S = np.zeros((r, e))
    z = np.zeros(r)
    want = np.zeros((n, e))
    for i in range(n):
        S += np.outer(fk[i], v[i])
        z += fk[i]
        want[i] = fq[i] @ S / max(fq[i] @ z, 1e-6)
    np.testing.assert_allclose(got, want, **EXACT)
    # non-causal: two products
    got = ref.linear_attention(q, k, v, fm, projection=W)
    den = np.maximum(fq @ fk.sum(0), 1e-6)[:, None]
    np.testing.assert_allclose(got, fq @ (fk.T @ v) / den, **EXACT)


def test_linear_eps_clamp_and_key_mask():
    q = np.array([[1.0, 0.0], [-1.0, -1.0], [1e-9, 0.0]])
    k = np.array([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]])
    v = np.array([[1.0], [2.0], [3.0]])
    o = ref.linear_attention(q, k, v, "relu")
    # row 0: s = [1, 2, 0] -> (1 + 4) / 3
    np.testing.assert_allclose(o[0], [5 / 3], rtol=1e-15)
    # row 1: zero mass -> zeros
    assert np.all(o[1] == 0)
    # row 2: mass 3e-9 < eps -> clamped: (1e-9 + 4e-9) / 1e-6
    np.testing.assert_allclose(o[2], [5e-9 / 1e-6], rtol=1e-12)
    o = ref.linear_attention(q, k, v, "relu", key_mask=np.array([True, False,
                                                                 True]))
    np.testing.assert_allclose(o[0], [1.0], rtol=1e-15)
    with pytest.raises(TypeError):
        ref.linear_attention(q, k, v, "relu", key_mask=np.ones(3))


def test_linear_callable_feature_map():
    rng = np.random.default_rng(14)
    q, k, v = rnd(rng, 4, 3), rnd(rng, 5, 3), rnd(rng, 5, 2)
    got = ref.linear_attention(q, k, v, feature_map=lambda x: x * x)
    s = (q * q) @ (k * k).T
    np.testing.assert_allclose(got, s @ v / s.sum(-1, keepdims=True), **EXACT)


# --------------------------------------------------------------------------
# cosFormer
# --------------------------------------------------------------------------

COSFORMER_SHAPES = [(6, 6, None, 0), (4, 9, None, 0), (9, 4, None, 0), (5, 5, 20, 7)]


# causal cosFormer is defined for n == m only
@pytest.mark.parametrize("n,m,M,offset,causal",
                         [shape + (False,) for shape in COSFORMER_SHAPES]
                         + [shape + (True,) for shape in COSFORMER_SHAPES if shape[0] == shape[1]])
def test_cosformer_equals_reweighted_relu(n, m, M, offset, causal):
    rng = np.random.default_rng(15)
    q, k, v = rnd(rng, 2, n, 4), rnd(rng, 2, m, 4), rnd(rng, 2, m, 3)
    Mv = max(n, m) if M is None else M
    # explicit loop over positions of the defining formula
    s = np.zeros((2, n, m))
    for i in range(n):
        for j in range(m):
            if causal and j > i:
                continue
            c = math.cos(math.pi / 2 * ((i + 1) - (j + 1)) / Mv)
            s[:, i, j] = np.sum(np.maximum(q[:, i], 0) * np.maximum(k[:, j], 0),
                                -1) * c
    got = ref.cosformer_similarity(q, k, causal=causal, M=M, offset=offset)
    np.testing.assert_allclose(got, s, **EXACT)
    assert np.all(got >= 0)
    # the 2d decomposition [relu(x) sin(theta), relu(x) cos(theta)]
    tq = math.pi / 2 * (offset + np.arange(1, n + 1)) / Mv
    tk = math.pi / 2 * (offset + np.arange(1, m + 1)) / Mv
    rq, rk = np.maximum(q, 0), np.maximum(k, 0)
    fq = np.concatenate([rq * np.sin(tq)[:, None], rq * np.cos(tq)[:, None]], -1)
    fk = np.concatenate([rk * np.sin(tk)[:, None], rk * np.cos(tk)[:, None]], -1)
    want = ref.linear_attention(fq, fk, v, "identity", causal=causal)
    np.testing.assert_allclose(
        ref.cosformer_attention(q, k, v, causal=causal, M=M, offset=offset),
        want, **EXACT)


# --------------------------------------------------------------------------
# efficient attention
# --------------------------------------------------------------------------

def test_efficient_attention_formula():
    rng = np.random.default_rng(16)
    n, m, d, e = 5, 7, 4, 3
    q, k, v = rnd(rng, n, d), rnd(rng, m, d), rnd(rng, m, e)
    rq = np.exp(q) / np.exp(q).sum(1, keepdims=True)
    rk = np.exp(k) / np.exp(k).sum(0, keepdims=True)
    np.testing.assert_allclose(ref.efficient_attention(q, k, v),
                               rq @ (rk.T @ v), **EXACT)
    w = ref.efficient_weights(q, k)
    np.testing.assert_allclose(w, rq @ rk.T, **EXACT)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-14)
    np.testing.assert_allclose(w @ v, ref.efficient_attention(q, k, v), **EXACT)
    # key mask: equal to dropping the keys
    km = np.array([True, False, True, True, False, True, True])
    np.testing.assert_allclose(ref.efficient_attention(q, k, v, key_mask=km),
                               ref.efficient_attention(q, k[km], v[km]), **EXACT)
    wm = ref.efficient_weights(q, k, key_mask=km)
    assert np.all(wm[:, ~km] == 0)
    np.testing.assert_allclose(wm.sum(-1), 1.0, rtol=1e-14)
    # all masked -> zeros
    assert np.all(ref.efficient_attention(q, k, v, key_mask=np.zeros(m, bool))
                  == 0)
