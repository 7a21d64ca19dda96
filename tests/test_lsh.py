"""Reformer LSH attention (attnx.lsh_attention) against a float64 numpy
reference written from the definition (the union of the rounds' visibility,
then plain softmax), against full attention where the definition reduces to
it, and its gradients against torch float64 autograd of that reference; at
every kernel set of the family here (csrc/dispatch.c: the chunk products on
register-blocked kernels of each vector width, or plain C + BLAS), each
against the plain path too."""

import contextlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnx

from helpers import assert_close, assert_interrupted_quickly, dispatched, hypothesis_settings, kernels_here, run_isolated, vscale  # noqa: E402

HYP = hypothesis_settings(60)

# the family's kernel sets on this CPU and build, best first, plain last
LSH_KERNELS = kernels_here("lsh")


@contextlib.contextmanager
def held_to(kernel):
    """The LSH family held to `kernel` (the table says it chose it)."""
    with dispatched(lsh=kernel) as chosen:
        assert chosen["lsh"] == kernel
        yield


# --------------------------------------------------------------------------
# the reference, straight from the definition
# --------------------------------------------------------------------------

def visibility(buckets, chunk, causal):
    """(n, n) bool: query i sees key j when some round puts j in i's bucket
    and in i's chunk of the sorted order or the chunk before; never itself,
    causal only j < i; a row with nothing sees itself."""
    buckets = np.asarray(buckets)
    n = buckets.shape[-1]
    vis = np.zeros((n, n), dtype=bool)
    for b in buckets:
        order = np.lexsort((np.arange(n), b))  # by bucket, then position
        place = np.empty(n, dtype=int)
        place[order] = np.arange(n)
        chunk_of = place // chunk
        behind = chunk_of[:, None] - chunk_of[None, :]  # chunk(i) - chunk(j)
        vis |= (b[:, None] == b[None, :]) & ((behind == 0) | (behind == 1))
    vis &= ~np.eye(n, dtype=bool)
    if causal:
        vis &= np.tri(n, n, -1, dtype=bool)
    alone = ~vis.any(axis=1)
    vis[alone, alone] = True
    return vis


def masked_attention(q, v, vis):
    """softmax over the visible keys of the logits q_i . q_j / |q_j| / sqrt(d):
    (out, lse), float64, one head."""
    q = np.asarray(q, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    d = q.shape[-1]
    norm = np.linalg.norm(q, axis=-1, keepdims=True)
    keys = np.divide(q, norm, out=np.zeros_like(q), where=norm > 0)
    s = q @ keys.T / np.sqrt(d) if d else np.zeros((len(q), len(q)))
    s = np.where(vis, s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    p = np.exp(s - top)
    total = p.sum(axis=-1, keepdims=True)
    return p / total @ v, (top + np.log(total))[:, 0]


def reference(q, v, buckets, chunk, causal):
    """Any leading axes (q, v, buckets already of the broadcast batch shape)."""
    lead = q.shape[:-2]
    out = np.zeros(lead + (q.shape[-2], v.shape[-1]))
    lse = np.zeros(lead + (q.shape[-2],))
    for index in np.ndindex(*lead):
        out[index], lse[index] = masked_attention(
            q[index], v[index], visibility(buckets[index], chunk, causal))
    return out, lse


def numpy_buckets(q, n_buckets, n_hashes, seed):
    """The hashing in float64 from the documented recipe, and each token's
    margin between its best and second-best score (small: a near-tie that
    rounding may decide either way)."""
    R = np.random.default_rng(seed).standard_normal((n_hashes, q.shape[-1], n_buckets // 2))
    proj = np.einsum("...nd,hdb->...hnb", np.asarray(q, np.float64), R)
    both = np.concatenate([proj, -proj], axis=-1)
    ranked = np.sort(both, axis=-1)
    return np.argmax(both, axis=-1), ranked[..., -1] - ranked[..., -2]


def one_bucket_queries(rng, n, d, n_hashes, seed, margin=0.05):
    """Queries whose every round's rotation (n_buckets = 2: one column r)
    puts them in bucket 0: q . r > 0 for each round's r."""
    R = attnx.lsh_rotations(d, 2, n_hashes, seed)[..., 0]  # (H, d)
    rows = []
    while len(rows) < n:
        x = rng.standard_normal(d)
        if np.all(R @ x > margin * np.linalg.norm(R, axis=1) * np.linalg.norm(x)):
            rows.append(x)
    return np.array(rows)


# --------------------------------------------------------------------------
# forward against the reference
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kernel", LSH_KERNELS)
@HYP
@given(n=st.integers(1, 40), d=st.integers(1, 6), e=st.integers(1, 5),
       n_buckets=st.sampled_from([2, 4, 6, 8, 16]), n_hashes=st.integers(1, 4),
       chunk=st.integers(1, 12), causal=st.booleans(), lead=st.sampled_from([(), (2,), (2, 3)]),
       dtype=st.sampled_from([np.float64, np.float32]), seed=st.integers(0, 2**16))
def test_equals_the_reference(kernel, n, d, e, n_buckets, n_hashes, chunk, causal, lead, dtype,
                              seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(lead + (n, d)).astype(dtype)
    v = rng.standard_normal(lead + (n, e)).astype(dtype)
    with held_to(kernel):
        out, lse = attnx.lsh_attention(q, v, n_buckets, n_hashes, chunk, causal, seed=seed,
                                       return_lse=True)
        buckets = attnx.lsh_buckets(q, n_buckets, n_hashes, seed=seed)
    assert out.dtype == dtype and lse.dtype == dtype
    assert buckets.shape == lead + (n_hashes, n)
    want_out, want_lse = reference(q, v, buckets, chunk, causal)
    assert_close(out, want_out, dtype, scale=vscale(v))
    assert_close(lse, want_lse, dtype, scale=vscale(want_lse))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_hashes", [1, 3])
def test_one_bucket_one_chunk_is_full_attention_over_the_other_tokens(causal, n_hashes):
    """Every token in bucket 0 in every round, one chunk over the sequence:
    full softmax attention of q against q / |q| without the diagonal
    (causal: keys before the query; the first token sees only itself). With
    several rounds every pair meets in each, and is still counted once."""
    rng = np.random.default_rng(7)
    n, d, e, seed = 50, 8, 5, 11
    q = one_bucket_queries(rng, n, d, n_hashes, seed)
    v = rng.standard_normal((n, e))
    assert not attnx.lsh_buckets(q, 2, n_hashes, seed=seed).any()
    out, lse = attnx.lsh_attention(q, v, 2, n_hashes, chunk=n, causal=causal, seed=seed,
                                   return_lse=True)
    keys = q / np.linalg.norm(q, axis=1, keepdims=True)
    allowed = np.tri(n, n, -1, dtype=bool) if causal else ~np.eye(n, dtype=bool)
    if causal:
        allowed[0, 0] = True
    full = attnx.softmax_attention(q, keys, v, mask=allowed, return_lse=True)
    np.testing.assert_allclose(out, full[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, full[1], rtol=1e-12, atol=1e-12)
    # and by hand, not through another attnx kernel
    s = np.where(allowed, q @ keys.T / np.sqrt(d), -np.inf)
    w = np.exp(s - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out, w / w.sum(axis=1, keepdims=True) @ v, rtol=1e-12, atol=1e-12)
    # a chunk longer than the sequence is the same single chunk
    np.testing.assert_array_equal(
        out, attnx.lsh_attention(q, v, 2, n_hashes, chunk=10 * n, causal=causal, seed=seed))


def test_a_token_alone_attends_to_itself():
    """Causal: the first token has no earlier key; n = 1 has no other key;
    chunk 1 with one round: a token's chunk is itself and the chunk before
    holds the previous place, so tokens first in their bucket see nobody."""
    rng = np.random.default_rng(3)
    q, v = rng.standard_normal((9, 4)), rng.standard_normal((9, 3))
    out, lse = attnx.lsh_attention(q, v, 4, causal=True, return_lse=True)
    np.testing.assert_array_equal(out[0], v[0])
    np.testing.assert_allclose(lse[0], np.linalg.norm(q[0]) / 2, rtol=1e-15)
    out1 = attnx.lsh_attention(q[:1], v[:1], 2)
    np.testing.assert_array_equal(out1, v[:1])
    buckets = attnx.lsh_buckets(q, 8, 1, seed=0)[0]
    out_c1 = attnx.lsh_attention(q, v, 8, 1, chunk=1)
    order = np.lexsort((np.arange(9), buckets))
    first_in_bucket = [order[p] for p in range(9) if p == 0 or buckets[order[p - 1]] != buckets[order[p]]]
    for i in first_in_bucket:
        np.testing.assert_array_equal(out_c1[i], v[i])


def test_rounds_count_a_pair_once():
    """Several rounds with the same rotation (the same seed is not possible
    across rounds, so: rounds whose hashing agrees because every token is in
    one bucket) give the one-round result, not a re-weighted one."""
    rng = np.random.default_rng(5)
    q = one_bucket_queries(rng, 30, 6, 4, seed=2)
    v = rng.standard_normal((30, 3))
    for chunk in (1, 4, 7, 30):
        one = attnx.lsh_attention(q, v, 2, 1, chunk, seed=2)
        four = attnx.lsh_attention(q, v, 2, 4, chunk, seed=2)
        np.testing.assert_allclose(four, one, rtol=1e-13, atol=1e-13)


def test_zero_query_is_the_zero_key():
    rng = np.random.default_rng(2)
    q, v = rng.standard_normal((12, 4)), rng.standard_normal((12, 2))
    q[3] = 0
    out, lse = attnx.lsh_attention(q, v, 2, 2, 5, return_lse=True, seed=1)
    want, want_lse = reference(q, v, attnx.lsh_buckets(q, 2, 2, seed=1), 5, False)
    assert_close(out, want, np.float64)
    assert_close(lse, want_lse, np.float64)


# --------------------------------------------------------------------------
# hashing
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_buckets_follow_the_documented_recipe(dtype):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 200, 16)).astype(dtype)
    got = attnx.lsh_buckets(q, 12, 3, seed=42)
    want, margin = numpy_buckets(q, 12, 3, seed=42)
    assert got.dtype == np.int32 and got.shape == (3, 3, 200)
    clear = margin > (1e-4 if dtype == np.float32 else 1e-10) * np.abs(q).max() * 16
    assert clear.mean() > 0.95
    np.testing.assert_array_equal(got[clear], want[clear])
    assert got.min() >= 0 and got.max() < 12
    # deterministic, the seed matters, every head hashes with the same rotations
    np.testing.assert_array_equal(attnx.lsh_buckets(q, 12, 3, seed=42), got)
    assert (attnx.lsh_buckets(q, 12, 3, seed=43) != got).any()
    np.testing.assert_array_equal(attnx.lsh_buckets(q[1], 12, 3, seed=42), got[1])
    R = attnx.lsh_rotations(16, 12, 3, seed=42)
    np.testing.assert_array_equal(R, np.random.default_rng(42).standard_normal((3, 16, 6)))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_buckets_ties_and_non_finite_rows(dtype):
    """The first maximum, as numpy's argmax: a zero row (every score 0) in
    bucket 0, a row with one inf (scores +-inf: ties, the first of them), a
    row with NaN (every score NaN) in bucket 0."""
    q = np.random.default_rng(6).standard_normal((7, 8))
    q[1] = 0
    q[2] = 0
    q[2, 3] = np.inf
    q[3] = 0
    q[3, 1] = -np.inf
    q[4] = np.nan
    q[5, 0] = np.nan
    q = q.astype(dtype)
    got = attnx.lsh_buckets(q, 10, 2, seed=3)
    R = attnx.lsh_rotations(8, 10, 2, seed=3)
    with np.errstate(invalid="ignore"):
        proj = np.einsum("nd,hdb->hnb", q.astype(np.float64), R)
    both = np.concatenate([proj, -proj], axis=-1)
    want = np.where(np.isnan(both).any(axis=-1), 0, np.argmax(np.nan_to_num(both, nan=0), axis=-1))
    np.testing.assert_array_equal(got, want)
    assert (got[:, 1] == 0).all() and (got[:, 4:6] == 0).all()


def test_rounds_differ_and_buckets_balance():
    """A sanity check of the hash, not of its probabilities: the rounds use
    different rotations and every bucket gets tokens on Gaussian inputs."""
    q = np.random.default_rng(1).standard_normal((4000, 8))
    b = attnx.lsh_buckets(q, 8, 2, seed=0)
    assert (b[0] != b[1]).mean() > 0.5
    assert set(np.unique(b[0])) == set(range(8))


# --------------------------------------------------------------------------
# threads, broadcasting, dtypes, the conventions
# --------------------------------------------------------------------------

def with_threads(count, fn):
    before = attnx.get_num_threads()
    attnx.set_num_threads(count)
    try:
        return fn()
    finally:
        attnx.set_num_threads(before)


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_threads_do_not_change_a_bit(heads, dtype, lsh_kernels):
    """heads 1: a head's rounds and chunks over the threads; 4: heads over
    the threads. Forward and backward."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((heads, 700, 16)).astype(dtype)
    v = rng.standard_normal((heads, 700, 16)).astype(dtype)
    dout = rng.standard_normal((heads, 700, 16)).astype(dtype)

    def run():
        out, pullback = attnx.vjp(attnx.lsh_attention, q, v, 16, 3, 32, seed=9)
        g = pullback(dout)
        return out, g.q, g.v

    one, two = with_threads(1, run), with_threads(2, run)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)
    if heads > 1:
        # one head at a time (its rounds in parallel) equals the batch (heads in parallel)
        for h in range(heads):
            out, pullback = with_threads(2, lambda: attnx.vjp(attnx.lsh_attention, q[h], v[h], 16, 3,
                                                              32, seed=9))
            g = pullback(dout[h])
            np.testing.assert_array_equal(out, one[0][h])
            np.testing.assert_array_equal(g.q, one[1][h])
            np.testing.assert_array_equal(g.v, one[2][h])


def run_lsh(kernel, q, v, dout, n_buckets, n_hashes, chunk, causal):
    """buckets, out, lse and the gradients on one kernel set"""
    with held_to(kernel):
        buckets = attnx.lsh_buckets(q, n_buckets, n_hashes, seed=5)
        out, lse = attnx.lsh_attention(q, v, n_buckets, n_hashes, chunk, causal, seed=5,
                                       return_lse=True)
        g = attnx.lsh_attention_backward(dout, q, v, out, lse, n_buckets, n_hashes, chunk, causal,
                                         seed=5)
    return buckets, out, lse, g.q, g.v


@pytest.mark.parametrize("d, e", [(64, 64), (13, 7), (32, 40)])
@pytest.mark.parametrize("n_buckets, chunk", [(4, 64), (38, 32)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_kernel_sets_equal_the_plain_path(lsh_kernels, d, e, n_buckets, chunk, causal, dtype):
    """Shapes the kernels tile: d and e whole vectors of every width (64),
    or not (rows padded with zeros), chunks of many vectors of keys in
    few or many buckets. The same buckets as plain C + BLAS (the data keep
    every token's best hashing score clear of its second), and the results
    to rounding: float32 within 2e-5 (relative, and absolute times the
    scale), float64 1e-10; and the float64 reference."""
    rng = np.random.default_rng(d + e + n_buckets)
    q = rng.standard_normal((2, 333, d)).astype(dtype)
    v = rng.standard_normal((2, 333, e)).astype(dtype)
    dout = rng.standard_normal((2, 333, e)).astype(dtype)
    _, margin = numpy_buckets(q, n_buckets, 2, seed=5)
    assert margin.min() > 1e-4
    got = run_lsh(lsh_kernels, q, v, dout, n_buckets, 2, chunk, causal)
    plain = run_lsh("plain", q, v, dout, n_buckets, 2, chunk, causal)
    np.testing.assert_array_equal(got[0], plain[0])
    scales = [vscale(v), vscale(plain[2]), vscale(plain[3]), vscale(dout)]
    for ours, theirs, scale in zip(got[1:], plain[1:], scales):
        assert_close(ours, theirs, dtype, scale)
    want_out, want_lse = reference(q, v, got[0], chunk, causal)
    assert_close(got[1], want_out, dtype, scale=vscale(v))
    assert_close(got[2], want_lse, dtype, scale=vscale(want_lse))


def test_leading_axes_broadcast():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((2, 1, 20, 4))
    v = rng.standard_normal((1, 3, 20, 5))
    out = attnx.lsh_attention(q, v, 4, 2, 6, seed=1)
    assert out.shape == (2, 3, 20, 5)
    for a in range(2):
        for b in range(3):
            np.testing.assert_array_equal(out[a, b], attnx.lsh_attention(q[a, 0], v[0, b], 4, 2, 6,
                                                                         seed=1))
    # gradients summed over the axes an input was broadcast along
    dout = rng.standard_normal(out.shape)
    _, pullback = attnx.vjp(attnx.lsh_attention, q, v, 4, 2, 6, seed=1)
    g = pullback(dout)
    assert g.q.shape == q.shape and g.v.shape == v.shape
    want_q = np.zeros_like(q)
    want_v = np.zeros_like(v)
    for a in range(2):
        for b in range(3):
            _, pb = attnx.vjp(attnx.lsh_attention, q[a, 0], v[0, b], 4, 2, 6, seed=1)
            part = pb(dout[a, b])
            want_q[a, 0] += part.q
            want_v[0, b] += part.v
    np.testing.assert_allclose(g.q, want_q, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(g.v, want_v, rtol=1e-12, atol=1e-12)


def test_dtypes_out_and_inputs_untouched():
    rng = np.random.default_rng(8)
    q, v = rng.standard_normal((16, 4)), rng.standard_normal((16, 3))
    q0, v0 = q.copy(), v.copy()
    want = attnx.lsh_attention(q, v, 4, 2, 4)
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(v, v0)
    half = attnx.lsh_attention(q.astype(np.float16), v.astype(np.float16), 4, 2, 4)
    assert half.dtype == np.float16
    ints = attnx.lsh_attention((q * 4).astype(int), (v * 4).astype(int), 4, 2, 4)
    assert ints.dtype == np.float64
    np.testing.assert_array_equal(ints, attnx.lsh_attention((q * 4).astype(int).astype(float),
                                                            (v * 4).astype(int).astype(float),
                                                            4, 2, 4))
    out = np.empty((16, 3))
    assert attnx.lsh_attention(q, v, 4, 2, 4, out=out) is out
    np.testing.assert_array_equal(out, want)
    # a strided view is read in place and gives the same result
    wide = np.zeros((16, 8))
    wide[:, :4] = q
    np.testing.assert_array_equal(attnx.lsh_attention(wide[:, :4], v, 4, 2, 4), want)


def test_empty_inputs():
    assert attnx.lsh_attention(np.zeros((0, 4)), np.zeros((0, 3)), 4).shape == (0, 3)
    assert attnx.lsh_attention(np.zeros((2, 0, 5, 4)), np.zeros((5, 3)), 4).shape == (2, 0, 5, 3)
    assert attnx.lsh_buckets(np.zeros((0, 4)), 4, 2).shape == (2, 0)
    g = attnx.lsh_attention_backward(np.zeros((0, 3)), np.zeros((0, 4)), np.zeros((0, 3)),
                                     np.zeros((0, 3)), np.zeros(0), 4)
    assert g.q.shape == (0, 4) and g.v.shape == (0, 3)


def test_nan_stays_in_the_rows_that_see_it(lsh_kernels):
    rng = np.random.default_rng(10)
    q, v = rng.standard_normal((40, 4)), rng.standard_normal((40, 3))
    v[7] = np.nan
    out = attnx.lsh_attention(q, v, 4, 2, 5, seed=3)
    vis = visibility(attnx.lsh_buckets(q, 4, 2, seed=3), 5, False)
    sees = vis[:, 7]
    assert np.isnan(out[sees]).all()
    assert np.isfinite(out[~sees]).all()
    clean = v.copy()
    clean[7] = 0
    np.testing.assert_allclose(out[~sees], attnx.lsh_attention(q, clean, 4, 2, 5, seed=3)[~sees],
                               rtol=1e-13, atol=1e-13)
    # the gradients: dv does not depend on v; dq is NaN for the rows that saw
    # token 7 (their D_i) and the keys they saw, finite everywhere else
    _, pullback = attnx.vjp(attnx.lsh_attention, q, v, 4, 2, 5, seed=3)
    g = pullback(np.ones_like(v))
    assert np.isfinite(g.v).all()
    tainted = sees | vis[sees].any(axis=0)
    assert not tainted.all()
    assert np.isfinite(g.q[~tainted]).all()
    assert np.isnan(g.q[sees & ~np.eye(40, dtype=bool)[7]]).all()


@pytest.mark.parametrize("call, error, words", [
    (lambda q, v: attnx.lsh_attention(q, v, 5), ValueError, "n_buckets must be even"),
    (lambda q, v: attnx.lsh_attention(q, v, 0), ValueError, "n_buckets must be at least 2"),
    (lambda q, v: attnx.lsh_attention(q, v, 4.0), TypeError, "n_buckets must be an integer"),
    (lambda q, v: attnx.lsh_attention(q, v, True), TypeError, "n_buckets must be an integer"),
    (lambda q, v: attnx.lsh_attention(q, v, 4, 0), ValueError, "n_hashes must be at least 1"),
    (lambda q, v: attnx.lsh_attention(q, v, 4, chunk=0), ValueError, "chunk must be at least 1"),
    (lambda q, v: attnx.lsh_attention(q, v, 4, chunk=2.5), TypeError, "chunk must be an integer"),
    (lambda q, v: attnx.lsh_attention(q, v, 4, seed=-1), ValueError, "seed must be at least 0"),
    (lambda q, v: attnx.lsh_attention(q, v, 4, causal="sideways"), ValueError, "causal"),
    (lambda q, v: attnx.lsh_attention(q, v[:5], 4), ValueError, "v has shape"),
    (lambda q, v: attnx.lsh_attention(q[0], v, 4), ValueError, "q has shape"),
    (lambda q, v: attnx.lsh_attention(q.astype(complex), v, 4), TypeError, "q must hold real"),
    (lambda q, v: attnx.lsh_attention(q, v.astype(object), 4), TypeError, "v must hold real"),
    (lambda q, v: attnx.lsh_attention(q, None, 4), TypeError, "v must be an array"),
    (lambda q, v: attnx.lsh_attention(q[None].repeat(2, 0), v[None].repeat(3, 0), 4), ValueError,
     "do not broadcast"),
    (lambda q, v: attnx.lsh_attention(q, v, 4, out=np.empty((6, 2))), ValueError, "out"),
    (lambda q, v: attnx.lsh_buckets(q, 3), ValueError, "n_buckets must be even"),
    (lambda q, v: attnx.lsh_attention_backward(v, q, v, v, np.zeros(7), 4), ValueError, "lse has shape"),
])
def test_bad_input_raises_a_clear_error(call, error, words):
    rng = np.random.default_rng(0)
    q, v = rng.standard_normal((6, 4)), rng.standard_normal((6, 3))
    with pytest.raises(error, match=words):
        call(q, v)


# --------------------------------------------------------------------------
# gradients
# --------------------------------------------------------------------------

def torch_reference(q, v, vis):
    """masked_attention in torch, for autograd: q (n, d), v (n, e) tensors."""
    import torch
    d = q.shape[-1]
    keys = q / q.norm(dim=-1, keepdim=True)
    s = (q @ keys.T) / d ** 0.5
    s = s.masked_fill(~torch.from_numpy(vis), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("kernel", LSH_KERNELS)
@HYP
@given(n=st.integers(1, 30), d=st.integers(1, 6), e=st.integers(1, 4),
       n_buckets=st.sampled_from([2, 4, 8]), n_hashes=st.integers(1, 3),
       chunk=st.integers(1, 9), causal=st.booleans(),
       dtype=st.sampled_from([np.float64, np.float32]), seed=st.integers(0, 2**16))
def test_gradients_equal_torch_autograd(kernel, n, d, e, n_buckets, n_hashes, chunk, causal,
                                        dtype, seed):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, d)).astype(dtype)
    v = rng.standard_normal((n, e)).astype(dtype)
    dout = rng.standard_normal((n, e)).astype(dtype)
    with held_to(kernel):
        out, pullback = attnx.vjp(attnx.lsh_attention, q, v, n_buckets, n_hashes, chunk, causal,
                                  seed=seed)
        g = pullback(dout)
        buckets = attnx.lsh_buckets(q, n_buckets, n_hashes, seed=seed)
    assert g.q.dtype == dtype and g.v.dtype == dtype and g.k is None
    vis = visibility(buckets, chunk, causal)
    tq = torch.tensor(q, dtype=torch.float64, requires_grad=True)
    tv = torch.tensor(v, dtype=torch.float64, requires_grad=True)
    tout = torch_reference(tq, tv, vis)
    (tout * torch.from_numpy(dout.astype(np.float64))).sum().backward()
    scale = vscale(v) * vscale(dout) * max(1.0, vscale(q))
    assert_close(out, tout.detach().numpy(), dtype, scale=vscale(v))
    assert_close(g.q, tq.grad.numpy(), dtype, scale=scale)
    assert_close(g.v, tv.grad.numpy(), dtype, scale=vscale(dout))


def test_backward_function_and_preallocated_gradients():
    rng = np.random.default_rng(12)
    q, v, dout = (rng.standard_normal((2, 25, 4)) for _ in range(3))
    out, lse = attnx.lsh_attention(q, v, 6, 2, 5, True, 4, return_lse=True)
    dq, dv = np.empty_like(q), np.empty_like(v)
    g = attnx.lsh_attention_backward(dout, q, v, out, lse, 6, 2, 5, True, 4, dq=dq, dv=dv)
    assert g.q is dq and g.v is dv
    _, pullback = attnx.vjp(attnx.lsh_attention, q, v, 6, 2, 5, True, 4)
    g2 = pullback(dout)
    np.testing.assert_array_equal(g2.q, dq)
    np.testing.assert_array_equal(g2.v, dv)


def test_gradient_of_a_token_alone_goes_to_its_value_only():
    rng = np.random.default_rng(13)
    q, v, dout = rng.standard_normal((1, 4)), rng.standard_normal((1, 3)), rng.standard_normal((1, 3))
    _, pullback = attnx.vjp(attnx.lsh_attention, q, v, 2)
    g = pullback(dout)
    np.testing.assert_array_equal(g.q, 0)
    np.testing.assert_array_equal(g.v, dout)


# --------------------------------------------------------------------------
# attnx.torch.lsh_attention
# --------------------------------------------------------------------------

def test_torch_operator_opcheck_and_gradcheck():
    torch = pytest.importorskip("torch")
    import attnx.torch as at

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 18, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(1, 18, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    for causal in (False, True):
        args = (q, v, 4, 2, 5, causal, 3)
        torch.library.opcheck(torch.ops.attnx.lsh_attention.default, args)
        out, lse = torch.ops.attnx.lsh_attention(*args)
        dout = torch.randn(out.shape, dtype=torch.float64, generator=gen)
        torch.library.opcheck(torch.ops.attnx.lsh_attention_backward.default,
                              (dout, q.detach(), v.detach(), out.detach(), lse, 4, 2, 5, causal, 3))
        assert torch.autograd.gradcheck(lambda a, b: at.lsh_attention(a, b, 4, 2, 5, causal, 3),
                                        (q, v))
        np.testing.assert_array_equal(
            at.lsh_attention(q, v, 4, 2, 5, causal, 3).detach().numpy(),
            attnx.lsh_attention(q.detach().numpy(), v.detach().numpy(), 4, 2, 5, causal, 3))


def test_torch_operator_gradients_dtypes_and_compile():
    torch = pytest.importorskip("torch")
    import attnx.torch as at

    rng = np.random.default_rng(1)
    q = rng.standard_normal((3, 24, 8))
    v, dout = rng.standard_normal((3, 24, 5)), rng.standard_normal((3, 24, 5))
    tq = torch.tensor(q, requires_grad=True)
    tv = torch.tensor(v, requires_grad=True)
    out = at.lsh_attention(tq, tv, 6, 3, 4, seed=2)
    (out * torch.from_numpy(dout)).sum().backward()
    _, pullback = attnx.vjp(attnx.lsh_attention, q, v, 6, 3, 4, seed=2)
    g = pullback(dout)
    np.testing.assert_array_equal(tq.grad.numpy(), g.q)
    np.testing.assert_array_equal(tv.grad.numpy(), g.v)
    compiled = torch.compile(lambda a, b: at.lsh_attention(a, b, 6, 3, 4, seed=2), fullgraph=True)
    np.testing.assert_array_equal(compiled(tq, tv).detach().numpy(), out.detach().numpy())
    half = at.lsh_attention(tq.detach().to(torch.bfloat16), tv.detach().to(torch.bfloat16), 6, 3, 4)
    assert half.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="n_buckets must be even"):
        at.lsh_attention(tq, tv, 5)
    with pytest.raises(ValueError, match="causal"):
        at.lsh_attention(tq, tv, 4, causal="sideways")
    with pytest.raises(TypeError, match="chunk must be an integer"):
        at.lsh_attention(tq, tv, 4, chunk=2.0)


def test_random_wrong_calls_raise_documented_errors_and_never_crash():
    """Mostly wrong calls (shapes, dtypes, layouts, options) in a child
    process, so that a crash is a failure rather than the end of the run."""
    run_isolated("""
        import itertools
        rng = np.random.default_rng(0)
        pick = lambda options: options[rng.integers(len(options))]
        expected = (ValueError, TypeError, MemoryError)
        succeeded = 0
        for index in range(400):
            lead = tuple(pick([1, 2, 3]) for _ in range(rng.integers(0, 3)))
            n, n2, d, e = (pick([0, 1, 2, 5, 17, 70]) for _ in range(4))
            dtype = pick([np.float32, np.float64, np.float16, np.int32, np.bool_, np.complex64])
            q = rng.standard_normal(pick([lead + (n, d), lead + (n, d), (d,), lead + (n, d, 1)]))
            v = rng.standard_normal(pick([lead + (n, e), lead + (n, e), lead + (n2, e), (2, 2, 2, n, e)]))
            q, v = q.astype(dtype), v.astype(pick([dtype, np.float32, np.float64]))
            if rng.random() < 0.2:
                q = np.repeat(q, 2, axis=-1)[..., ::2]   # a strided last axis: copied once
            options = dict(n_buckets=pick([2, 4, 6, 8, 3, 0, -2, 2.0, True, "4", 2**40]),
                           n_hashes=pick([1, 2, 3, 0, -1, 1.5, 2**40]),
                           chunk=pick([1, 3, 64, 0, -1, 2**62, 2.5, None]),
                           causal=pick([False, True, "upper_left", "sideways", None, 1]),
                           seed=pick([0, 5, -1, 2**63, 1.5]))
            if rng.random() < 0.6:  # valid options, so that the arrays are what is wrong
                options.update(n_buckets=pick([2, 4, 8]), n_hashes=pick([1, 2, 3]),
                               chunk=pick([1, 3, 64, 2**62]), causal=pick([False, True]), seed=5)
            fn = pick(["forward", "buckets", "backward"])
            try:
                if fn == "forward":
                    attnx.lsh_attention(q, v, **options, return_lse=bool(rng.integers(2)))
                elif fn == "buckets":
                    del options["chunk"], options["causal"]
                    attnx.lsh_buckets(q, **options)
                else:
                    out = np.zeros(np.broadcast_shapes(q.shape[:-1], v.shape[:-1]) + v.shape[-1:])
                    attnx.lsh_attention_backward(out, q, v, out, out.sum(axis=-1), **options)
                succeeded += 1
            except expected:
                pass
        assert succeeded > 20, succeeded  # the valid calls are exercised too
        print("done")
    """)


SETUP = """
attnx.set_num_threads({threads})
rng = np.random.default_rng(0)
q, v = (rng.standard_normal(({heads}, 65536, 64), dtype=np.float32) for _ in range(2))
small = (q[:2, :300], v[:2, :300])
"""
USABLE = ("assert np.array_equal(attnx.lsh_attention(*small, 8, 2, 16), "
          "attnx.lsh_attention(*small, 8, 2, 16))")


@pytest.mark.parametrize("threads, heads, call", [
    (1, 8, "attnx.lsh_attention(q, v, 64, 8, 128)"),
    (2, 8, "attnx.lsh_attention(q, v, 64, 8, 128)"),
    (2, 1, "attnx.lsh_attention(q, v, 64, 8, 128)"),
    (2, 8, "attnx.lsh_attention_backward(v, q, v, v, np.zeros(v.shape[:-1], np.float32), 64, 8, 128)"),
], ids=["forward-1-thread", "forward-heads", "forward-rounds", "backward"])
def test_ctrl_c_interrupts_a_long_call_within_half_a_second(threads, heads, call):
    """The whole call takes several seconds; SIGINT 0.3 s in ends it with
    KeyboardInterrupt within 0.5 s (the best of three tries, on a loaded
    machine), leaving attnx usable."""
    assert_interrupted_quickly(SETUP.format(threads=threads, heads=heads), call, USABLE)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_weights(causal):
    """the weight matrix is the reference's softmax over the visibility the
    rounds give (zero elsewhere), and out = weights @ v"""
    rng = np.random.default_rng(41)
    q = rng.standard_normal((2, 40, 8))
    v = rng.standard_normal((2, 40, 5))
    options = dict(n_buckets=4, n_hashes=2, chunk=8, causal=causal, seed=3)
    weights = attnx.attention_weights(q, q, "lsh", **options)
    buckets = attnx.lsh_buckets(q, 4, 2, seed=3)
    for h in range(2):
        vis = visibility(buckets[h], 8, causal)
        want, _ = masked_attention(q[h], np.eye(40), vis)
        np.testing.assert_allclose(weights[h], want, rtol=1e-12, atol=1e-15)
        assert (weights[h][~vis] == 0).all()
    np.testing.assert_allclose(weights @ v, attnx.lsh_attention(q, v, **options), rtol=1e-12,
                               atol=1e-14)
    with pytest.raises(ValueError, match="k = q"):
        attnx.attention_weights(q, q + 1, "lsh", **options)
