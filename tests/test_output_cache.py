"""attnx's results of 1 MiB or more take their memory from the blocks of
its earlier, freed results (csrc/output_cache.c): a training loop's
outputs and gradients are not faulted in and zeroed anew on every call."""
import resource

import numpy as np
import pytest

import attnx
from attnx import _C

MIB = 2 ** 20


@pytest.fixture(autouse=True)
def default_cache():
    """each test starts from an empty cache with the default limit"""
    limit = attnx.set_output_cache(0)
    attnx.set_output_cache(limit)
    yield limit
    attnx.set_output_cache(0)
    attnx.set_output_cache(limit)


def qkv(n, heads=8, d=64, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((heads, n, d)).astype(np.float32) for _ in range(3)]


def test_a_freed_result_is_reused_and_overwritten():
    q, k, v = qkv(1024)  # out: 2 MiB
    first = attnx.linear_attention(q, k, v, causal=True)
    want, address = first.copy(), first.ctypes.data
    first[...] = np.nan  # whatever the block held must not show through
    del first
    assert _C._output_cache_held() == (2 * MIB, 1)
    again = attnx.linear_attention(q, k, v, causal=True)
    assert again.ctypes.data == address and again.flags.owndata
    assert _C._output_cache_held() == (0, 0)
    np.testing.assert_array_equal(again, want)
    # a result of another size does not take it
    del again
    other = attnx.softmax_attention(q[:, :512], k, v)
    assert _C._output_cache_held() == (2 * MIB, 1) and other.ctypes.data != address


def test_small_results_and_foreign_arrays_stay_out():
    q, k, v = qkv(64)
    del q, k, v
    out = attnx.softmax_attention(*qkv(64))
    del out
    big = np.empty(4 * MIB, np.uint8)
    del big
    assert _C._output_cache_held() == (0, 0)


def test_gradients_reuse_blocks_and_stay_right():
    q, k, v = qkv(2048)
    dout = np.ones_like(v)
    want = attnx.linear_attention_backward(dout, q, k, v, causal=True)
    want = [x.copy() for x in want[:3]]
    for _ in range(3):
        got = attnx.linear_attention_backward(dout, q, k, v, causal=True)
        for field, w in zip("qkv", want):
            np.testing.assert_array_equal(getattr(got, field), w)
        del got
        held, blocks = _C._output_cache_held()
        assert blocks == 3 and held == 3 * 4 * MIB


def test_the_limit_and_the_oldest_first(default_cache):
    attnx.set_output_cache(5 * MIB)
    q, k, v = qkv(1024)
    results = [attnx.linear_attention(q, k, v) for _ in range(3)]  # 2 MiB each
    addresses = [r.ctypes.data for r in results]
    del results[:]  # freed in order: the third does not fit beside the first two
    assert _C._output_cache_held() == (4 * MIB, 2)
    again = attnx.linear_attention(q, k, v)
    assert again.ctypes.data in addresses[1:]  # the first, the oldest, was released
    assert attnx.set_output_cache(0) == 5 * MIB
    assert _C._output_cache_held() == (0, 0)
    del again
    assert _C._output_cache_held() == (0, 0)  # off: nothing kept


def test_larger_than_the_limit_is_not_kept(default_cache):
    attnx.set_output_cache(1 * MIB)
    out = attnx.linear_attention(*qkv(1024))
    del out
    assert _C._output_cache_held() == (0, 0)


def test_eight_blocks_at_most():
    q, k, v = qkv(1024)
    results = [attnx.linear_attention(q, k, v) for _ in range(10)]
    del results[:]
    assert _C._output_cache_held() == (16 * MIB, 8)


def test_a_reused_result_pages_nothing_in():
    """40 MiB results: above glibc's largest mmap threshold, each fresh
    one would be mapped and faulted in anew"""
    q = np.ones((8, 20480, 64), np.float32)
    out = attnx.linear_attention(q, q, q)
    del out
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    out = attnx.linear_attention(q, q, q)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 50, f"{faults} page faults for a reused 40 MiB result"  # 532 uncached
    np.testing.assert_allclose(out, 1.0)


def test_resize_of_a_cached_result():
    out = attnx.linear_attention(*qkv(1024))
    head = out[:2].copy()
    out.resize((2, 1024, 64), refcheck=False)  # the handler's realloc
    np.testing.assert_array_equal(out, head)


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (1.5, TypeError), ("1", TypeError),
                                        (2 ** 80, OverflowError)])
def test_bad_limits(bad, error):
    with pytest.raises(error):
        attnx.set_output_cache(bad)
