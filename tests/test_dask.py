"""attnx.dask: the attention functions on dask arrays.

Every chunking of the leading axes, the queries and the keys must give the
single-machine call's result (float64 within 1e-10, the suite's tolerance),
and that call is itself checked here against the numpy float64 reference
(attnx/reference.py) for the mask modes the splitting touches. Most tests
run on dask's synchronous scheduler; a few run on a LocalCluster of two
worker processes.
"""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

da = pytest.importorskip("dask.array", reason="attnx.dask needs the dask extra")
import dask  # noqa: E402

import attnx  # noqa: E402
import attnx.dask as ad  # noqa: E402

import attnx.reference as ref
from helpers import assert_close, hypothesis_settings, make, qkv  # noqa: E402

HYP = hypothesis_settings(40)
CAUSAL = [False, True, "upper_left"]
WINDOWS = [None, 3, (0, 2), (4, None), (None, 1), (0, 0), (2, 0)]


def compute(*arrays, scheduler="sync"):
    for x in arrays:
        assert isinstance(x, da.Array), type(x)
    result = dask.compute(*arrays, scheduler=scheduler)
    return result if len(result) > 1 else result[0]


def chunked(x, chunks):
    return da.from_array(x, chunks=chunks)


def split(q, k, v, lead_chunks, n_chunk, m_chunk):
    """q, k, v as dask arrays: leading axes in chunks of lead_chunks,
    queries in chunks of n_chunk, keys of m_chunk"""
    return (chunked(q, lead_chunks + (n_chunk, -1)), chunked(k, lead_chunks + (m_chunk, -1)),
            chunked(v, lead_chunks + (m_chunk, -1)))


def lse_equal(got, want):
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    assert_close(got[finite], want[finite], np.float64)


def part_tasks(array, front):
    """the names of the per-block kernel calls in array's graph"""
    return [key for key in dict(array.__dask_graph__())
            if isinstance(key, tuple) and key[0].startswith(f"{front}-part-")]


# --------------------------------------------------------------------------
# softmax and gaussian: every chunking, every mask mode
# --------------------------------------------------------------------------

@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("n, m", [(13, 13), (9, 20), (20, 9)])
@pytest.mark.parametrize("n_chunk, m_chunk", [(13, 4), (4, 20), (3, 5), (1, 7), (20, 1)])
def test_softmax_every_chunking(causal, n, m, n_chunk, m_chunk):
    rng = np.random.default_rng(n * 100 + m)
    q, k, v = qkv(rng, (3, 2), n, m, 8, 5)
    want, want_lse = attnx.softmax_attention(q, k, v, causal=causal, return_lse=True)
    got, got_lse = compute(*ad.softmax_attention(*split(q, k, v, (2, 1), n_chunk, m_chunk),
                                                 causal=causal, return_lse=True))
    assert_close(got, want, np.float64)
    lse_equal(got_lse, want_lse)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("n, m", [(16, 16), (7, 18), (18, 7)])
def test_softmax_windows(window, causal, n, m):
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, (2,), n, m, 4, 3)
    want, want_lse = ref.softmax_attention(q, k, v, causal=causal, window=window, return_lse=True)
    assert_close(attnx.softmax_attention(q, k, v, causal=causal, window=window), want, np.float64)
    for n_chunk, m_chunk in [(3, 4), (5, 2), (1, 3)]:
        got, got_lse = compute(*ad.softmax_attention(*split(q, k, v, (1,), n_chunk, m_chunk),
                                                     causal=causal, window=window,
                                                     return_lse=True))
        assert_close(got, want, np.float64)
        lse_equal(got_lse, want_lse)


@pytest.mark.parametrize("mask_shape", [(2, 3, 11, 17), (1, 3, 1, 17), (11, 17), (17,), (2, 1, 11, 1)])
@pytest.mark.parametrize("as_dask", [False, True])
def test_softmax_mask_and_bias_sliced_with_blocks(mask_shape, as_dask):
    rng = np.random.default_rng(3)
    q, k, v = qkv(rng, (2, 3), 11, 17, 6, 4)
    mask = rng.random(mask_shape) < 0.6
    bias = make(rng, mask_shape)
    want, want_lse = ref.softmax_attention(q, k, v, mask=mask, bias=bias, causal=True,
                                           window=(5, None), return_lse=True)
    if as_dask:  # chunked like q, k along the axes they share
        chunks = tuple({11: 4, 17: 6, 3: 2}.get(size, 1) if size > 1 else 1 for size in mask_shape)
        mask, bias = chunked(mask, chunks), chunked(bias, chunks)
    got, got_lse = compute(*ad.softmax_attention(*split(q, k, v, (1, 2), 4, 6), mask=mask,
                                                 bias=bias, causal=True, window=(5, None),
                                                 return_lse=True))
    assert_close(got, want, np.float64)
    lse_equal(got_lse, want_lse)


def test_block_geometry_gives_exactly_the_band():
    """every block of small sequences under every band of j - i: the
    trimmed block holds every visible pair, and a call on it alone with
    the window given (centred on i' + m' - n') sees exactly those pairs"""
    from attnx.dask import _block_geometry

    sides = [None, -3, -1, 0, 1, 2, 5]
    for low in sides:
        for high in sides:
            for a in range(5):
                for b in range(a + 1, 6):
                    for ka in range(5):
                        for kb in range(ka + 1, 6):
                            visible = {(i, j) for i in range(a, b) for j in range(ka, kb)
                                       if (low is None or j - i >= low) and
                                       (high is None or j - i <= high)}
                            found = _block_geometry((a, b), (ka, kb), low, high)
                            if found is None:
                                assert not visible, (low, high, a, b, ka, kb)
                                continue
                            ga, gb, gka, gkb, left, right = found
                            assert (left is None or left >= 0) and (right is None or right >= 0)
                            centre = (gkb - gka) - (gb - ga)
                            seen = {(i, j) for i in range(ga, gb) for j in range(gka, gkb)
                                    if (left is None or j - gka >= i - ga + centre - left) and
                                    (right is None or j - gka <= i - ga + centre + right)}
                            assert seen == visible, (low, high, a, b, ka, kb, found)


def test_upper_left_with_a_window_past_the_diagonal_sees_nothing():
    rng = np.random.default_rng(19)
    q, k, v = qkv(rng, (1,), 4, 8, 3, 2)  # keys from i + 1 on, but j <= i: none
    for chunks in [(4, 8), (2, 3)]:
        got, lse = compute(*ad.softmax_attention(*split(q, k, v, (1,), *chunks), window=3,
                                                 causal="upper_left", return_lse=True))
        assert np.all(got == 0) and np.all(np.isneginf(lse))
        got = compute(ad.linear_attention(*split(q, k, v, (1,), *chunks), window=3,
                                          causal="upper_left"))
        assert np.all(got == 0)


def test_rows_that_see_nothing_in_some_or_all_key_chunks():
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, (2,), 8, 12, 4, 3)
    mask = np.ones((2, 8, 12), bool)
    mask[:, 1, :] = False     # sees nothing at all
    mask[:, 2, 4:] = False    # only the first key chunk
    mask[:, 3, :8] = False    # only the last one
    want, want_lse = attnx.softmax_attention(q, k, v, mask=mask, return_lse=True)
    got, got_lse = compute(*ad.softmax_attention(*split(q, k, v, (1,), 3, 4), mask=mask,
                                                 return_lse=True))
    assert not np.isnan(got).any()
    assert np.all(got[:, 1] == 0) and np.all(np.isneginf(got_lse[:, 1]))
    assert_close(got, want, np.float64)
    lse_equal(got_lse, want_lse)


@pytest.mark.parametrize("causal", CAUSAL)
def test_gaussian_every_chunking(causal):
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, (2, 2), 10, 14, 5, 3)
    bias = make(rng, (2, 1, 10, 14))
    want, want_lse = ref.gaussian_attention(q, k, v, sigma=1.7, causal=causal, bias=bias,
                                            return_lse=True)
    for chunks in [((1, 2), 10, 14), ((2, 1), 3, 4), ((1, 1), 1, 5)]:
        got, got_lse = compute(*ad.gaussian_attention(*split(q, k, v, *chunks), 1.7,
                                                      causal=causal, bias=bias, return_lse=True))
        assert_close(got, want, np.float64)
        lse_equal(got_lse, attnx.gaussian_attention(q, k, v, 1.7, causal=causal, bias=bias,
                                                    return_lse=True)[1])


def test_grouped_query_broadcast():
    """GQA: q (B, Hkv, g, n, d) against k, v (B, Hkv, 1, m, d), chunked
    along the shared heads, the group axis (q only), queries and keys"""
    rng = np.random.default_rng(6)
    q = make(rng, (2, 4, 3, 9, 8))
    k, v = make(rng, (2, 4, 1, 15, 8)), make(rng, (2, 4, 1, 15, 6))
    want = ref.softmax_attention(q, k, v, causal=True)
    got = compute(ad.softmax_attention(chunked(q, (1, 2, 2, 4, 8)), chunked(k, (1, 2, 1, 5, 8)),
                                       chunked(v, (1, 2, 1, 5, 6)), causal=True))
    assert got.shape == (2, 4, 3, 9, 6)
    assert_close(got, want, np.float64)
    # fewer leading axes on k, v broadcast too (numpy's rules)
    got = compute(ad.softmax_attention(chunked(q, (1, 2, 2, 4, 8)), k[0, 0, 0], v[0, 0, 0]))
    assert_close(got, attnx.softmax_attention(q, k[0, 0, 0], v[0, 0, 0]), np.float64)


def test_unseen_key_chunks_are_never_computed():
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, (1,), 32, 32, 4, 4)
    # causal, 4 x 4 chunks of 8: only the 10 blocks on or below the diagonal
    out = ad.softmax_attention(*split(q, k, v, (1,), 8, 8), causal=True)
    assert len(part_tasks(out, "softmax_attention")) == 10
    assert_close(compute(out), attnx.softmax_attention(q, k, v, causal=True), np.float64)
    # a window of 4 to the left: the diagonal blocks and the ones just before it
    out = ad.softmax_attention(*split(q, k, v, (1,), 8, 8), window=(4, 0))
    assert len(part_tasks(out, "softmax_attention")) == 7
    assert_close(compute(out), attnx.softmax_attention(q, k, v, window=(4, 0)), np.float64)
    # a query chunk that sees no key at all (upper-left, n > m) is zeros, no call
    q2 = make(rng, (1, 40, 4))
    out = ad.softmax_attention(chunked(q2, (1, 8, 4)), chunked(k, (1, 8, 4)),
                               chunked(v, (1, 8, 4)), causal=True)
    assert len(part_tasks(out, "softmax_attention")) == 10
    got = compute(out)
    assert np.all(got[:, :8] == 0)
    assert_close(got, attnx.softmax_attention(q2, k, v, causal=True), np.float64)


def test_many_key_chunks_merge_as_a_tree():
    """20 key chunks: partials merged a few at a time, same result"""
    rng = np.random.default_rng(18)
    q, k, v = qkv(rng, (2,), 6, 100, 4, 3)
    mask = rng.random((2, 6, 100)) < 0.3
    out, lse = ad.softmax_attention(*split(q, k, v, (1,), 3, 5), mask=mask, return_lse=True)
    combines = [key for key in dict(out.__dask_graph__()) if "-combine-" in key[0]]
    assert len(combines) == 2 * 2 * 3  # per block: 20 partials -> 3 groups
    want, want_lse = ref.softmax_attention(q, k, v, mask=mask, return_lse=True)
    got, got_lse = compute(out, lse)
    assert_close(got, want, np.float64)
    lse_equal(got_lse, want_lse)


def test_one_array_as_queries_keys_and_values():
    """self-attention: the same dask array as q, k and v, whose blocks serve
    as query blocks and as key blocks"""
    rng = np.random.default_rng(16)
    x_np = make(rng, (2, 12, 6))
    x = chunked(x_np, (1, 5, 6))
    for causal in CAUSAL:
        assert_close(compute(ad.softmax_attention(x, x, x, causal=causal)),
                     attnx.softmax_attention(x_np, x_np, x_np, causal=causal), np.float64)
        assert_close(compute(ad.linear_attention(x, x, x, causal=causal)),
                     attnx.linear_attention(x_np, x_np, x_np, causal=causal), np.float64)
    assert_close(compute(ad.cosformer_attention(x, x, x)),
                 attnx.cosformer_attention(x_np, x_np, x_np), np.float64)


def test_nan_stays_in_its_rows():
    rng = np.random.default_rng(17)
    q, k, v = qkv(rng, (1,), 8, 12, 4, 3)
    q[0, 2, 1] = np.nan
    got, lse = compute(*ad.softmax_attention(*split(q, k, v, (1,), 4, 4), return_lse=True))
    assert np.isnan(got[0, 2]).all() and np.isnan(lse[0, 2])
    rows = np.arange(8) != 2
    assert_close(got[:, rows], attnx.softmax_attention(q, k, v)[:, rows], np.float64)


@given(data=st.data())
@HYP
def test_softmax_chunkings_hypothesis(data):
    n = data.draw(st.integers(1, 24), label="n")
    m = data.draw(st.integers(1, 24), label="m")
    causal = data.draw(st.sampled_from(CAUSAL), label="causal")
    window = data.draw(st.sampled_from(WINDOWS + [(2, 7), (9, 1)]), label="window")
    n_chunk = data.draw(st.integers(1, n), label="n_chunk")
    m_chunk = data.draw(st.integers(1, m), label="m_chunk")
    b_chunk = data.draw(st.integers(1, 3), label="b_chunk")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    q, k, v = qkv(rng, (3,), n, m, 4, 2)
    want, want_lse = attnx.softmax_attention(q, k, v, causal=causal, window=window,
                                             return_lse=True)
    got, got_lse = compute(*ad.softmax_attention(*split(q, k, v, (b_chunk,), n_chunk, m_chunk),
                                                 causal=causal, window=window, return_lse=True))
    assert_close(got, want, np.float64)
    lse_equal(got_lse, want_lse)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_softmax_lower_precision_with_key_chunks(dtype):
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, (2,), 12, 20, 8, 4, dtype)
    want = ref.softmax_attention(q, k, v, causal=True)
    got, lse = compute(*ad.softmax_attention(*split(q, k, v, (1,), 5, 6), causal=True,
                                             return_lse=True))
    assert got.dtype == dtype and lse.dtype == np.float32
    assert_close(got, want, dtype)


def test_integer_inputs_compute_in_float64():
    rng = np.random.default_rng(10)
    q, k, v = (rng.integers(-2, 3, shape) for shape in [(2, 6, 3), (2, 9, 3), (2, 9, 2)])
    got = compute(ad.softmax_attention(*split(q, k, v, (1,), 2, 4)))
    assert got.dtype == np.float64
    assert_close(got, ref.softmax_attention(q, k, v), np.float64)


def test_empty_sequences():
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, (2,), 5, 0, 3, 2)
    got = compute(ad.softmax_attention(q, k, v))
    assert got.shape == (2, 5, 2) and np.all(got == 0)
    q, k, v = qkv(rng, (2,), 0, 4, 3, 2)
    assert compute(ad.softmax_attention(q, k, v)).shape == (2, 0, 2)


def test_results_are_lazy_until_computed():
    calls = []

    def noted(block):
        calls.append(block.shape)
        return block

    rng = np.random.default_rng(12)
    q, k, v = split(*qkv(rng, (2,), 8, 8, 4, 4), (1,), 4, 4)
    q = q.map_blocks(noted, meta=np.empty((0, 0, 0)))  # meta given: no trial call
    results = [ad.softmax_attention(q, k, v, causal=True),
               ad.gaussian_attention(q, k, v, return_lse=True)[1],
               ad.linear_attention(q, k, v, causal=True),
               ad.cosformer_attention(q, k, v),
               ad.efficient_attention(q, k, v)]
    assert all(isinstance(x, da.Array) for x in results)
    assert calls == []
    compute(results[0])
    assert len(calls) == 4  # q's blocks, only now


def test_numpy_inputs_give_dask_results():
    rng = np.random.default_rng(13)
    q, k, v = qkv(rng, (2,), 6, 7, 3, 2)
    out = ad.softmax_attention(q, k, v, causal=True)
    assert isinstance(out, da.Array)
    assert_close(compute(out), attnx.softmax_attention(q, k, v, causal=True), np.float64)
    # numpy k, v follow the chunks of a dask q along the axes they share
    out = ad.linear_attention(chunked(q, (1, 2, 3)), k, v)
    assert out.chunks == ((1, 1), (2, 2, 2), (2,))
    assert_close(compute(out), attnx.linear_attention(q, k, v), np.float64)


# --------------------------------------------------------------------------
# bad input: clear errors when the graph is built
# --------------------------------------------------------------------------

def test_mismatched_chunks_are_refused():
    rng = np.random.default_rng(14)
    q, k, v = qkv(rng, (4,), 6, 6, 3, 2)
    with pytest.raises(ValueError, match=r"q and k are chunked differently along leading axis 0"):
        ad.softmax_attention(chunked(q, (2, 6, 3)), chunked(k, (1, 6, 3)), chunked(v, (1, 6, 3)))
    with pytest.raises(ValueError, match=r"k and v are chunked differently along the m axis"):
        ad.linear_attention(q, chunked(k, (4, 3, 3)), chunked(v, (4, 2, 2)))
    with pytest.raises(ValueError, match=r"q and mask are chunked differently along the n axis"):
        ad.softmax_attention(chunked(q, (4, 3, 3)), k, v,
                             mask=chunked(np.ones((6, 6), bool), (2, 6)))


def test_unknown_chunk_sizes_are_refused():
    rng = np.random.default_rng(32)
    q, k, v = qkv(rng, (4,), 6, 6, 3, 2)
    qd = chunked(q, (2, 3, 3))
    unknown = qd[qd[:, 0, 0] > -10]  # boolean indexing: sizes known only when computed
    with pytest.raises(ValueError, match=r"q has chunks of unknown size .*compute_chunk_sizes"):
        ad.softmax_attention(unknown, k, v)


def test_bad_shapes_and_options_are_refused_at_once():
    rng = np.random.default_rng(15)
    q, k, v = qkv(rng, (4,), 6, 7, 3, 2)
    with pytest.raises(ValueError, match=r"k must have shape \(\.\.\., m, d\) with d = 3"):
        ad.softmax_attention(q, k[..., :2], v)
    with pytest.raises(ValueError, match=r"v must have shape \(\.\.\., m, e\) with m = 7"):
        ad.softmax_attention(q, k, v[:, :5])
    with pytest.raises(ValueError, match=r"leading \(batch\) axes of the inputs do not broadcast"):
        ad.softmax_attention(q, k[:3], v[:3])
    with pytest.raises(ValueError, match=r"mask must broadcast to \(\.\.\., n, m\)"):
        ad.softmax_attention(q, k, v, mask=np.ones((6, 6), bool))
    with pytest.raises(ValueError, match=r"q must have at least 2 dimensions"):
        ad.softmax_attention(q[0, 0], k, v)
    with pytest.raises(ValueError, match=r"causal"):
        ad.softmax_attention(q, k, v, causal="diagonal")
    with pytest.raises(ValueError, match=r"window"):
        ad.softmax_attention(q, k, v, window=-1)
    with pytest.raises(ValueError, match=r"scale"):
        ad.softmax_attention(q, k, v, scale=0.0)
    with pytest.raises(TypeError, match=r"mask"):
        ad.softmax_attention(q, k, v, mask=np.ones((6, 7)))
    with pytest.raises(TypeError):
        ad.softmax_attention(q.astype(complex), k, v)
    with pytest.raises(ValueError, match=r"feature_map"):
        ad.linear_attention(q, k, v, feature_map="cosine")
    with pytest.raises(ValueError, match=r"efficient_attention is non-causal only"):
        ad.efficient_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match=r"causal cosformer_attention needs as many queries"):
        ad.cosformer_attention(q, k, v, causal=True)
    with pytest.raises(ValueError, match=r"M=4 is smaller than the largest position 7"):
        ad.cosformer_attention(q, k, v, M=4)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'initial_state'"):
        ad.linear_attention(q, k, v, causal=True, initial_state=object())


# --------------------------------------------------------------------------
# the kernelised family
# --------------------------------------------------------------------------

W = attnx.random_features(12, 6, seed=0)
LINEAR_FRONTS = [
    ("linear_attention", {}),
    ("linear_attention", {"feature_map": "softmax"}),
    ("linear_attention", {"feature_map": lambda x: np.abs(x) + 0.5}),
    ("cosformer_attention", {}),
    ("cosformer_attention", {"M": 40}),
    ("focused_linear_attention", {"p": 2}),
    ("taylor_attention", {}),
    ("performer_attention", {"projection": W}),
    ("efficient_attention", {}),
]
FRONT_IDS = [f"{name}-{'-'.join(map(str, options))}" for name, options in LINEAR_FRONTS]


def both(name):
    return getattr(attnx, name), getattr(ad, name)


@pytest.mark.parametrize("name, options", LINEAR_FRONTS, ids=FRONT_IDS)
@pytest.mark.parametrize("n_chunk, m_chunk", [(17, 23), (5, 4), (1, 23), (17, 1), (6, 7)])
def test_linear_non_causal_every_chunking(name, options, n_chunk, m_chunk):
    rng = np.random.default_rng(20)
    q, k, v = qkv(rng, (2, 3), 17, 23, 6, 4)
    key_mask = rng.random((2, 1, 23)) < 0.7
    single, distributed = both(name)
    want = single(q, k, v, key_mask=key_mask, **options)
    got = compute(distributed(*split(q, k, v, (1, 2), n_chunk, m_chunk), key_mask=key_mask,
                              **options))
    assert_close(got, want, np.float64)


CAUSAL_CASES = [(name, options, causal, n, m)
                for name, options in LINEAR_FRONTS if name != "efficient_attention"
                for causal in [True, "upper_left"]
                for n, m in [(21, 21), (13, 21), (21, 13)]
                if name != "cosformer_attention" or n == m]  # causal cosFormer: n == m only


@pytest.mark.parametrize("name, options, causal, n, m", CAUSAL_CASES)
def test_causal_linear_over_sequence_chunks_equals_one_call(name, options, causal, n, m):
    rng = np.random.default_rng(21)
    q, k, v = qkv(rng, (2, 2), n, m, 6, 4)
    key_mask = rng.random((2, 1, m)) < 0.8
    single, distributed = both(name)
    want = single(q, k, v, causal=causal, key_mask=key_mask, **options)
    for n_chunk, m_chunk in [(4, 5), (2, 3), (7, m)]:
        got = compute(distributed(*split(q, k, v, (1, 2), n_chunk, m_chunk), causal=causal,
                                  key_mask=key_mask, **options))
        assert_close(got, want, np.float64)


@pytest.mark.parametrize("method", ["chunk", "recurrent", "cumsum", "quadratic"])
def test_causal_linear_methods_over_sequence_chunks(method):
    rng = np.random.default_rng(22)
    q, k, v = qkv(rng, (2,), 40, 40, 5, 3)
    want = ref.linear_attention(q, k, v, causal=True)
    got = compute(ad.linear_attention(*split(q, k, v, (1,), 9, 9), causal=True, method=method,
                                      chunk_size=4))
    assert_close(got, want, np.float64)


def test_cosformer_blocks_use_global_positions():
    rng = np.random.default_rng(23)
    q, k, v = qkv(rng, (2,), 12, 12, 4, 3)
    for causal in [False, True]:
        want = ref.cosformer_attention(q, k, v, causal=causal)
        got = compute(ad.cosformer_attention(*split(q, k, v, (1,), 5, 5), causal=causal))
        assert_close(got, want, np.float64)


@pytest.mark.parametrize("window", [None, 2, (3, 0), (None, 1)])
@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("name", ["linear_attention", "cosformer_attention", "taylor_attention"])
def test_linear_mask_and_window_keep_their_alignment(window, causal, name):
    rng = np.random.default_rng(24)
    q, k, v = qkv(rng, (2,), 11, 14, 4, 3)
    if name == "cosformer_attention":
        k, v = k[:, :11], v[:, :11]
    mask = rng.random((2, 11, k.shape[1])) < 0.8
    single, distributed = both(name)
    want = single(q, k, v, causal=causal, window=window, mask=mask)
    got = compute(distributed(*split(q, k, v, (1,), 3, 4), causal=causal, window=window,
                              mask=chunked(mask, (1, 3, 4))))
    assert_close(got, want, np.float64)
    if name == "linear_attention":
        assert_close(got, ref.linear_attention(q, k, v, causal=causal, window=window, mask=mask),
                     np.float64)


def test_linear_against_the_reference():
    rng = np.random.default_rng(25)
    q, k, v = qkv(rng, (2, 2), 15, 15, 4, 3)
    key_mask = rng.random((2, 2, 15)) < 0.7
    for causal in [False, True, "upper_left"]:
        want = ref.linear_attention(q, k, v, feature_map="elu", causal=causal, key_mask=key_mask)
        got = compute(ad.linear_attention(*split(q, k, v, (1, 2), 4, 6), causal=causal,
                                          key_mask=chunked(key_mask, (1, 2, 6))))
        assert_close(got, want, np.float64)
    want = ref.efficient_attention(q, k, v, key_mask=key_mask)
    got = compute(ad.efficient_attention(*split(q, k, v, (1, 2), 4, 6), key_mask=key_mask))
    assert_close(got, want, np.float64)


def test_performer_draws_one_projection_for_every_block():
    rng = np.random.default_rng(26)
    q, k, v = qkv(rng, (2,), 10, 10, 4, 3)
    want = attnx.performer_attention(q, k, v, num_features=9, seed=3, causal=True)
    got = compute(ad.performer_attention(*split(q, k, v, (1,), 3, 3), num_features=9, seed=3,
                                         causal=True))
    assert_close(got, want, np.float64)


@given(data=st.data())
@HYP
def test_causal_linear_chunkings_hypothesis(data):
    n = data.draw(st.integers(1, 30), label="n")
    m = data.draw(st.integers(1, 30), label="m")
    causal = data.draw(st.sampled_from([False, True, "upper_left"]), label="causal")
    feature_map = data.draw(st.sampled_from(["elu", "relu", "taylor", "focused"]), label="map")
    n_chunk = data.draw(st.integers(1, n), label="n_chunk")
    m_chunk = data.draw(st.integers(1, m), label="m_chunk")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    q, k, v = qkv(rng, (2,), n, m, 3, 2)
    key_mask = rng.random((2, m)) < 0.8
    want = attnx.linear_attention(q, k, v, causal=causal, feature_map=feature_map,
                                  key_mask=key_mask)
    got = compute(ad.linear_attention(*split(q, k, v, (1,), n_chunk, m_chunk), causal=causal,
                                      feature_map=feature_map, key_mask=key_mask))
    assert_close(got, want, np.float64)


def test_causal_linear_graph_runs_chunks_in_parallel():
    """every chunk's output task depends on its own blocks and one incoming
    state, not on the outputs of the chunks before it"""
    rng = np.random.default_rng(27)
    q, k, v = split(*qkv(rng, (1,), 16, 16, 4, 4), (1,), 4, 4)
    out = ad.linear_attention(q, k, v, causal=True)
    graph = dict(out.__dask_graph__())
    outputs = [key for key in graph if key[0] == out.name]
    assert len(outputs) == 4
    summaries = [key for key in graph if "-summary-" in key[0]]
    assert len(summaries) == 4  # the keys before the first chunk (none) and 3 chunks
    deps = out.__dask_graph__().get_all_dependencies()
    for key in outputs:
        assert not any(dep[0] == out.name for dep in deps[key])


def test_linear_summaries_are_shared_by_query_groups():
    """GQA: the key summaries and states of a (B, Hkv) block are computed
    once for all the query-group chunks that use them"""
    rng = np.random.default_rng(29)
    q = make(rng, (1, 2, 4, 12, 4))
    k, v = make(rng, (1, 2, 1, 12, 4)), make(rng, (1, 2, 1, 12, 3))
    for causal in [False, True]:
        out = ad.linear_attention(chunked(q, (1, 1, 1, 4, 4)), chunked(k, (1, 1, 1, 4, 4)),
                                  chunked(v, (1, 1, 1, 4, 3)), causal=causal)
        summaries = [key for key in dict(out.__dask_graph__()) if "-summary-" in key[0]]
        assert len(summaries) == 2 * 3  # 2 key heads x 3 key chunks (causal: 3 segments)
        assert_close(compute(out), attnx.linear_attention(q, k, v, causal=causal), np.float64)


def test_linear_float32_with_key_chunks():
    rng = np.random.default_rng(28)
    q, k, v = qkv(rng, (2,), 12, 20, 8, 4, np.float32)
    for causal in [False, True]:
        got = compute(ad.linear_attention(*split(q, k, v, (1,), 5, 6), causal=causal))
        assert got.dtype == np.float32
        assert_close(got, ref.linear_attention(q, k, v, causal=causal), np.float32)


# --------------------------------------------------------------------------
# on a cluster of two worker processes
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("dask.distributed", reason="needs dask[distributed]")
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as cluster, \
            distributed.Client(cluster) as client:
        yield client


def test_cluster_softmax_key_chunks(client):
    rng = np.random.default_rng(30)
    q, k, v = qkv(rng, (2, 4), 64, 96, 16, 8)
    mask = rng.random((2, 1, 64, 96)) < 0.9
    want, want_lse = attnx.softmax_attention(q, k, v, causal=True, mask=mask, window=(40, None),
                                             return_lse=True)
    out, lse = ad.softmax_attention(*split(q, k, v, (1, 2), 16, 24), causal=True, mask=mask,
                                    window=(40, None), return_lse=True)
    got, got_lse = client.compute([out, lse], sync=True)
    assert_close(got, want, np.float64)
    lse_equal(got_lse, want_lse)
    # both workers took part
    assert len(client.run(lambda: 1)) == 2


def test_cluster_causal_linear_and_gaussian(client):
    rng = np.random.default_rng(31)
    q, k, v = qkv(rng, (2, 2), 80, 80, 8, 8)
    want = attnx.cosformer_attention(q, k, v, causal=True)
    got = client.compute(ad.cosformer_attention(*split(q, k, v, (1, 1), 20, 20), causal=True),
                         sync=True)
    assert_close(got, want, np.float64)
    want = attnx.gaussian_attention(q, k, v, 2.0)
    got = client.compute(ad.gaussian_attention(*split(q, k, v, (1, 2), 40, 16), 2.0), sync=True)
    assert_close(got, want, np.float64)
