"""Softmax attention for a few query rows against many keys (decoding with a
KV cache, csrc/softmax_decode.c): n <= 8 rows per head and m >= 128 keys
split the keys into fixed chunks across threads and merge the partials by
log-sum-exp; heads that share their keys and values (grouped-query
attention) are scored together. Checked on every kernel set of the softmax
forward (the fixture `kernels`) against the float64 numpy reference
(tests/reference.py) and torch's scaled_dot_product_attention, with the
options that reach it, and beside the query-tile path it falls back to
(dropout, gaussian attention, n > 8, m < 128)."""

import math

import numpy as np
import pytest

import attnx
import attnx.reference as R
from helpers import assert_close, make, vscale


@pytest.fixture
def kernels(softmax_forward_kernels):
    return softmax_forward_kernels


@pytest.fixture
def threads():
    """attnx's thread count, put back after the test"""
    before = attnx.get_num_threads()
    yield
    attnx.set_num_threads(before)


def operands(rng, lead_q, lead_kv, n, m, d, e, dtype):
    return (make(rng, lead_q + (n, d), dtype), make(rng, lead_kv + (m, d), dtype),
            make(rng, lead_kv + (m, e), dtype))


def check(q, k, v, dtype, **options):
    out, lse = attnx.softmax_attention(q, k, v, return_lse=True, **options)
    want, want_lse = R.softmax_attention(q, k, v, return_lse=True, **options)
    assert_close(out, want, dtype, vscale(v))
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    seen = np.isfinite(want_lse)
    assert_close(lse[seen], want_lse[seen], dtype, np.abs(want_lse[seen]).max(initial=1))
    return out, lse


# m: a block (32) and a chunk (512) of keys, primes, past them by one, and
# tens of thousands; d and e: multiples of every vector width, and not
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n, m, d, e", [(1, 128, 64, 64), (1, 4099, 64, 64), (2, 513, 17, 9),
                                        (3, 1031, 128, 128), (4, 512, 33, 65),
                                        (5, 30011, 16, 24), (7, 32768, 128, 128),
                                        (8, 1024, 8, 5), (1, 20000, 3, 1)])
def test_matches_reference(kernels, dtype, n, m, d, e):
    rng = np.random.default_rng(n * 7 + m)
    q, k, v = operands(rng, (2,), (2,), n, m, d, e, dtype)
    check(q, k, v, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, "upper_left"])
def test_causal_both_alignments(kernels, dtype, causal):
    rng = np.random.default_rng(1)
    q, k, v = operands(rng, (3,), (3,), 6, 777, 32, 16, dtype)
    check(q, k, v, dtype, causal=causal)
    # upper left: row i sees keys 0 .. i, most chunks hold none of them
    check(q, k, v, dtype, causal=causal, window=(3, None))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("window", [5, (700, 0), (0, 2), (None, 40), (200, None)])
def test_window(kernels, dtype, window):
    rng = np.random.default_rng(2)
    q, k, v = operands(rng, (2,), (2,), 4, 1500, 24, 32, dtype)
    check(q, k, v, dtype, window=window)
    check(q, k, v, dtype, window=window, causal=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mask_and_bias(kernels, dtype):
    rng = np.random.default_rng(3)
    n, m = 3, 2000
    q, k, v = operands(rng, (2, 4), (2, 4), n, m, 32, 32, dtype)
    padding = np.arange(m)[None, :] < np.array([1500, 2000])[:, None]   # per key
    per_key = padding[:, None, None, :]
    per_query = rng.random((2, 4, n, m)) < 0.7
    per_query[0, 0, 1] = False                                          # a row seeing nothing
    bias_key = make(rng, (2, 1, 1, m), dtype)
    bias_query = make(rng, (2, 4, n, m), dtype)
    for mask in (per_key, per_query):
        for bias in (None, bias_key, bias_query):
            out, lse = check(q, k, v, dtype, mask=mask, bias=bias, scale=0.3)
    assert np.all(out[0, 0, 1] == 0) and np.isneginf(lse[0, 0, 1])
    check(q, k, v, dtype, mask=per_query, causal=True, window=(900, 0))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("group, n", [(4, 1), (8, 1), (4, 3), (8, 5), (6, 2)])
def test_grouped_query_heads(kernels, dtype, group, n):
    """q (B, Hkv, g, n, d) against k, v (B, Hkv, 1, m, d): query heads that
    share a kv head (up to 32 rows at once, more in several groups)"""
    rng = np.random.default_rng(group * 10 + n)
    q, k, v = operands(rng, (2, 3, group), (2, 3, 1), n, 1234, 64, 48, dtype)
    check(q, k, v, dtype)
    check(q, k, v, dtype, causal=True, bias=make(rng, (2, 3, group, n, 1234), dtype))
    # the kv heads broadcast over the batch instead: heads far apart share them
    check(q, k[:1], v[:1], dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_strided_inputs(kernels, dtype):
    """rows further apart than d: a (B, m, H, d) cache seen as (B, H, m, d),
    queries and values sliced out of wider arrays"""
    rng = np.random.default_rng(4)
    m = 3000
    k = make(rng, (2, m, 4, 64), dtype).transpose(0, 2, 1, 3)
    v = make(rng, (2, m, 4, 96), dtype).transpose(0, 2, 1, 3)[..., 16:80]
    q = make(rng, (2, 4, 3, 80), dtype)[..., 8:72]
    out = check(q, k, v, dtype)[0]
    np.testing.assert_array_equal(out, attnx.softmax_attention(*(np.ascontiguousarray(x)
                                                                 for x in (q, k, v))))


def test_nan_reaches_only_the_rows_that_see_it(kernels):
    rng = np.random.default_rng(5)
    n, m = 4, 1000
    q, k, v = operands(rng, (2,), (2,), n, m, 16, 8, np.float64)
    q[0, 1, 3] = np.nan                # head 0, row 1 only
    k[1, m - 1, 0] = np.nan            # causal: only the last row of head 1 sees key m - 1
    v[1, m - 2] = np.inf               # ... and key m - 2, with the row before it
    v[0, 600] = np.nan                 # masked for every row of head 0
    mask = np.ones((2, 1, m), bool)
    mask[0, 0, 600] = False
    out, lse = attnx.softmax_attention(q, k, v, causal=True, mask=mask, return_lse=True)
    assert np.all(np.isnan(out[0, 1])) and np.isnan(lse[0, 1])
    assert np.all(np.isnan(out[1, 3])) and np.isnan(lse[1, 3])
    assert not np.all(np.isfinite(out[1, 2]))
    clean = [(0, 0), (0, 2), (0, 3), (1, 0), (1, 1)]
    qc, kc, vc = q.copy(), k.copy(), v.copy()
    qc[0, 1] = 0
    kc[1, m - 1] = 0
    vc[1, m - 2] = vc[0, 600] = 0
    want, want_lse = R.softmax_attention(qc, kc, vc, causal=True, mask=mask, return_lse=True)
    for h, i in clean:
        assert_close(out[h, i], want[h, i], np.float64, vscale(vc))
        assert_close(lse[h, i], want_lse[h, i], np.float64, 10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_same_result_on_any_threads_and_call(kernels, threads, dtype):
    """the chunks and the order of the merge depend on the shape only: one
    and two threads, and repeated calls, give the same numbers bit for bit"""
    rng = np.random.default_rng(6)
    cases = [operands(rng, (1, 1), (1, 1), 1, 32768, 128, 128, dtype),
             operands(rng, (1, 8, 4), (1, 8, 1), 1, 8192, 64, 64, dtype),
             operands(rng, (1, 8), (1, 8), 3, 4097, 64, 64, dtype)]
    for q, k, v in cases:
        results = []
        for count in (1, 2, 1, 2):
            attnx.set_num_threads(count)
            results.append(attnx.softmax_attention(q, k, v, return_lse=True, causal=True))
        for out, lse in results[1:]:
            np.testing.assert_array_equal(out, results[0][0])
            np.testing.assert_array_equal(lse, results[0][1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_beside_the_query_tile_path(kernels, dtype):
    """the shapes next to decoding's (n = 9, m = 127) and the options it
    leaves to the query tiles (gaussian, dropout) agree with it"""
    rng = np.random.default_rng(7)
    q, k, v = operands(rng, (2,), (2,), 9, 3000, 32, 32, dtype)
    check(q, k, v, dtype, causal=True)
    check(q[:, :8], k, v, dtype, causal=True)
    check(q, k[:, :127], v[:, :127], dtype)
    check(q[:, :1], k[:, :128], v[:, :128], dtype)
    out = attnx.gaussian_attention(q[:, :2], k, v, sigma=4.0)
    assert_close(out, R.gaussian_attention(q[:, :2], k, v, sigma=4.0), dtype, vscale(v))
    # dropout's decisions are Philox's of (seed, head, i, j): a decoding
    # call's rows are the first rows of a longer one's
    few = attnx.softmax_attention(q[:, :2], k, v, dropout_p=0.3, seed=11)
    many = attnx.softmax_attention(q, k, v, dropout_p=0.3, seed=11)
    assert_close(few, many[:, :2], dtype, vscale(v))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("shape_q, shape_kv, gqa", [((1, 8, 1, 64), (1, 8, 4096, 64), False),
                                                     ((1, 1, 3, 128), (1, 1, 5000, 128), False),
                                                     ((2, 32, 1, 128), (2, 8, 2053, 128), True),
                                                     ((1, 12, 4, 64), (1, 4, 777, 64), True)])
def test_torch_sdpa(kernels, dtype, shape_q, shape_kv, gqa):
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    import attnx.torch as at

    g = torch.Generator().manual_seed(8)
    dt = getattr(torch, dtype)
    q = torch.randn(shape_q, generator=g, dtype=dt)
    k = torch.randn(shape_kv, generator=g, dtype=dt)
    v = torch.randn(shape_kv, generator=g, dtype=dt)
    m = shape_kv[2]
    mask = torch.rand((shape_q[0], 1, shape_q[2], m), generator=g) < 0.8
    for options in ({}, {"is_causal": True}, {"attn_mask": mask}, {"scale": 0.05},
                    {"attn_mask": torch.randn((shape_q[2], m), generator=g, dtype=dt)}):
        got = at.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **options)
        want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=gqa,
                                              **{key: (x.double() if torch.is_tensor(x) and
                                                       x.is_floating_point() else x)
                                                 for key, x in options.items()})
        tolerance = 2e-5 if dtype == "float32" else 1e-10
        np.testing.assert_allclose(got.double().numpy(), want.numpy(), rtol=tolerance,
                                   atol=tolerance * math.sqrt(4))
