"""The kernelised front ends' own details: FAVOR+ (random_features, the approximation of softmax, large inputs), efficient attention, cosFormer, and the feature maps (taylor's non-negativity, focused p, callables, identity).

The variants under test, their references and the stated tolerances are
in tests/linear_variants.py.
"""
import math

import numpy as np
import pytest

import attnx

import attnx.reference as ref
from helpers import assert_close, f64, make, qkv, tol, vscale  # noqa: E402
from linear_variants import (METHODS, call, check_state, favor_weights_logspace, fm_callable,  # noqa: E402
                             ref_out, similarity, weights)


def test_logspace_favor_reference_matches_literal():
    """The log-space helper of tests/linear_variants.py is the reference's formula."""
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
    check_state("cosformer", state, k, v, None, M)
    # continuing: positions 13.., the offset shifts them
    q2, k2, v2 = qkv(rng, (2,), 8, 8, 3, 2)
    o2, state2 = attnx.cosformer_attention(q2, k2, v2, causal=True, M=M,
                                           initial_state=state,
                                           return_state=True)
    assert state2.offset == 20
    check_state("cosformer", state2, np.concatenate([k, k2], 1),
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
