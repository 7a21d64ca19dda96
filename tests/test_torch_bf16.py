"""bfloat16 <-> float32 conversion (csrc/convert.c, attnx._C._convert_half;
float16's: tests/test_float16.py), which attnx.torch uses for bfloat16
tensors: every path (the avx512_bf16
instruction, the integer rounding in AVX2 or NEON vectors, the portable
rounding) against a reference
written from the definition of round-to-nearest-even, every layout, and the
torch operators built on it."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnx
from helpers import (check_random_narrowing_on_every_path, cpuinfo_field, dispatched, half_value,
                     kernels_here, strided_layouts)

CONVERT = attnx._C._convert_half


def _cpu_flags():
    """The CPU's flags as Linux lists them (None elsewhere)."""
    flags = cpuinfo_field("flags")
    return None if flags is None else set(flags.split())


AVX512_BF16 = "avx512_bf16" in kernels_here("convert")


@pytest.fixture
def path(convert_kernels):
    """Each conversion this CPU has: the portable rounding ("plain"), the same
    integer rounding in vectors ("avx2", "neon") and VCVTNEPS2BF16
    ("avx512_bf16"; tests/conftest.py)."""
    return convert_kernels


# ------------------------------------------------------------- references

def reference_narrow(x):
    """float32 -> bfloat16 bits by the definition: of the two bfloat16
    values around |x| (truncation, and one unit further from zero), the
    nearer, judged in float64; on a tie the one whose last bit is even.
    Infinity stays; NaN gives NaN (checked separately)."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    sign = bits & np.uint32(0x80000000)
    magnitude = bits & np.uint32(0x7fffffff)
    low = magnitude & np.uint32(0xffff0000)
    high = low + np.uint32(0x10000)              # 0x7f800000 = infinity past the largest
    exponent = (low >> np.uint32(23)).astype(np.int64)
    # a bfloat16 unit at low's exponent (denormals share exponent 1's)
    unit = np.ldexp(1.0, np.maximum(exponent, 1) - 127 - 7)
    with np.errstate(invalid="ignore"):     # NaN and infinity, replaced below
        low_value = low.view(np.float32).astype(np.float64)
        target = magnitude.view(np.float32).astype(np.float64)
        below, above = target - low_value, low_value + unit - target
    odd = (low >> np.uint32(16)) & np.uint32(1)
    up = (above < below) | ((above == below) & (odd == 1))
    rounded = np.where(up, high, low)
    rounded = np.where(magnitude == np.uint32(0x7f800000), magnitude, rounded)
    return ((rounded | sign) >> np.uint32(16)).astype(np.uint16)


def reference_widen(bits):
    """bfloat16 bits -> value in float64 from the fields"""
    return half_value(bits, 8)


def narrow(x):
    x = np.asarray(x)
    out = np.empty(x.shape, np.uint16)
    assert CONVERT(x, out) is out
    return out


def widen(bits):
    bits = np.asarray(bits)
    out = np.empty(bits.shape, np.float32)
    CONVERT(bits, out)
    return out


def special_floats():
    """Bit patterns where rounding is decided: zeros, denormals, ties of
    both parities and their neighbours, the largest finite values (some
    round to infinity), infinities, NaNs with payloads."""
    patterns = [0x00000000, 0x00000001, 0x00007fff, 0x00008000, 0x00008001, 0x00018000,
                0x0000ffff, 0x007fffff, 0x007f8000, 0x00800000, 0x3f800000, 0x3f808000,
                0x3f818000, 0x3f807fff, 0x3f808001, 0x3f81ffff, 0x7f7f7fff, 0x7f7f8000,
                0x7f7fffff, 0x7f7effff, 0x7f800000, 0x7f800001, 0x7fc00000, 0x7fffffff,
                0x7f8000ff, 0x7fbf0000, 0x4b7fffff, 0x33800000]
    patterns = np.array(patterns, dtype=np.uint32)
    return np.concatenate([patterns, patterns | np.uint32(0x80000000)]).view(np.float32)


def check_narrow(x, got):
    x = np.asarray(x, np.float32)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], reference_narrow(x[~nan]))
    # NaN stays NaN, quiet, with its sign
    assert np.all((got[nan] & 0x7f80) == 0x7f80) and np.all(got[nan] & 0x0040)
    np.testing.assert_array_equal(got[nan] >> 15, x[nan].view(np.uint32) >> 31)


# ------------------------------------------------------------ the rounding

@pytest.mark.skipif(_cpu_flags() is None, reason="needs Linux's /proc/cpuinfo to know the CPU")
def test_the_instruction_path_is_used_where_the_cpu_has_it():
    flags = _cpu_flags()
    has = {"avx512f", "avx512_bf16"} <= flags
    # without the bfloat16 instructions: the integer rounding in AVX2 vectors
    # where the CPU has AVX2, FMA and F16C (csrc/dispatch.c), plain C otherwise
    without = "avx2" if {"avx2", "fma", "f16c"} <= flags else "plain"
    if not attnx._C.build_info()["disabled_cpu_features"]:
        assert AVX512_BF16 == has
        assert attnx.cpu_dispatch()["convert"] == ("avx512_bf16" if has else without)
    with dispatched("AVX512_BF16") as chosen:
        assert chosen["convert"] != "avx512_bf16"
    with dispatched("AVX512_BF16,AVX2") as chosen:
        assert chosen["convert"] in ("neon", "plain")


def test_reference_narrow_on_hand_checked_values():
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: to even (1); 1 + 3 * 2^-8 to
    # 1 + 2^-6 (even); just above a tie goes up; the largest float32 rounds to
    # infinity, the largest bfloat16 stays
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -1.5, 3.0e38, 3.3895314e38],
                 np.float32)
    expected = [0x3f80, 0x3f82, 0x3f81, 0xbfc0, 0x7f62, 0x7f7f]
    np.testing.assert_array_equal(reference_narrow(x), np.array(expected, np.uint16))
    assert reference_narrow(np.float32(np.finfo(np.float32).max)) == 0x7f80


def test_narrow_special_values(path):
    x = special_floats()
    check_narrow(x, narrow(x))


def test_narrow_random_bit_patterns_both_paths_agree():
    check_random_narrowing_on_every_path(narrow, check_narrow)


def test_narrow_around_every_bfloat16_is_the_plain_paths_bits(path):
    # each bfloat16 pattern with the low halves that decide its rounding:
    # 0 (exact), just under, at and just over a tie, the largest; NaNs
    # with payloads only in the low half among them
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    low = np.array([0, 1, 0x7fff, 0x8000, 0x8001, 0xffff], np.uint32)
    x = (high[:, None] | low[None, :]).ravel().view(np.float32)
    got = narrow(x)
    check_narrow(x, got)
    with dispatched(convert="plain"):
        np.testing.assert_array_equal(got, narrow(x))


@pytest.mark.parametrize("length", [1, 3, 4, 7, 8, 9, 15, 16, 17, 33, 70])
def test_rows_of_every_length_and_offset(path, length):
    # the vector loops' tails and unaligned starts
    values = special_floats()
    for offset in range(3):
        x = np.resize(values, length + offset)[offset:]
        check_narrow(x, narrow(x))
        bits = narrow(x)
        expected = reference_widen(bits)
        nan = np.isnan(expected)
        got = widen(bits).astype(np.float64)
        np.testing.assert_array_equal(got[~nan], expected[~nan])
        assert np.all(np.isnan(got[nan]))


def test_narrow_denormals_are_kept_by_both_paths(path):
    # VCVTNEPS2BF16 alone reads these as zero
    x = np.arange(1, 1 << 23, 997, dtype=np.uint32).view(np.float32)
    x = np.concatenate([x, -x])
    got = narrow(x)
    check_narrow(x, got)
    assert np.count_nonzero(got & 0x7fff) > len(x) // 2


def test_widen_every_bit_pattern_is_exact(path):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):     # signalling NaNs
        got = widen(bits).astype(np.float64)
    expected = reference_widen(bits)
    nan = np.isnan(expected)
    np.testing.assert_array_equal(got[~nan], expected[~nan])
    assert np.all(np.isnan(got[nan]))
    # and back: narrowing a widened value gives its bits (NaN aside)
    np.testing.assert_array_equal(narrow(widen(bits))[~nan], bits[~nan])
    # int16 views of the same bits are read alike
    np.testing.assert_array_equal(widen(bits.view(np.int16)), widen(bits))


# ----------------------------------------------------------------- layouts

@settings(max_examples=150, deadline=None)
@given(layout=strided_layouts(), seed=st.integers(0, 2**32 - 1))
def test_every_layout_converts_like_its_contiguous_copy(layout, seed):
    base_shape, view = layout
    base = np.random.default_rng(seed).standard_normal(base_shape).astype(np.float32)
    x = view(base)
    np.testing.assert_array_equal(narrow(x), reference_narrow(np.ascontiguousarray(x)))
    # the same layout over bfloat16 bits is widened in place
    bits = view(narrow(base))
    np.testing.assert_array_equal(widen(bits), reference_widen(np.ascontiguousarray(bits)))


# ------------------------------------------------------------------ errors

def test_bad_arguments_raise_clear_errors():
    x = np.zeros((3, 4), np.float32)
    with pytest.raises(TypeError, match="bfloat16 bits"):
        CONVERT(x, np.empty((3, 4), np.float64))
    with pytest.raises(TypeError, match="bfloat16 bits"):
        CONVERT(x.astype(np.uint16), np.empty((3, 4), np.uint16))
    with pytest.raises(ValueError, match=r"shape of src \(3, 4\), got \(4, 3\)"):
        CONVERT(x, np.empty((4, 3), np.uint16))
    with pytest.raises(ValueError, match="C-contiguous"):
        CONVERT(x, np.empty((4, 3), np.uint16).T)
    readonly = np.empty((3, 4), np.uint16)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="writable"):
        CONVERT(x, readonly)
    both = np.zeros(24, np.uint16)
    with pytest.raises(ValueError, match="overlap"):
        CONVERT(both[:12].view(np.float32).reshape(3, 2), both[10:16].reshape(3, 2))
    with pytest.raises(ValueError, match="overlap"):
        CONVERT(both.view(np.float32)[2:8], both[0:6])
    with pytest.raises(ValueError, match="native byte order"):
        CONVERT(x.astype(">f4"), np.empty((3, 4), np.uint16))
    with pytest.raises(TypeError):
        CONVERT([1.0], np.empty(1, np.uint16))


def test_inputs_are_not_modified():
    x = np.random.default_rng(1).standard_normal((5, 7)).astype(np.float32)
    before = x.copy()
    bits = narrow(x)
    bits_before = bits.copy()
    widen(bits)
    np.testing.assert_array_equal(x, before)
    np.testing.assert_array_equal(bits, bits_before)


# ------------------------------- keys and values as bfloat16 or float16

HALF_FORMATS = ["bfloat16", "float16"]


def _halved(x, fmt):
    """float32 x in half precision as attnx reads it: bfloat16 bits, or float16"""
    return narrow(x) if fmt == "bfloat16" else x.astype(np.float16)


def _widened(h):
    """half-precision h (bfloat16 bits, or float16) widened to float32, exactly"""
    return h.astype(np.float32) if h.dtype == np.float16 else widen(h)


def _kv_case(seed, n, m, layout, d=32, fmt="bfloat16"):
    """q (float32) and k, v in half precision (`fmt`) for a call of n
    queries against m keys of d features; `layout` "contiguous", "strided"
    (k, v permuted views of one (B, m, 2, H, d) array, as a [B, m, H, d]
    cache is held), or "grouped" (k, v of one head broadcast over four,
    stride 0)"""
    rng = np.random.default_rng(seed)
    B, H = 2, 4
    q = rng.standard_normal((B, H, n, d), dtype=np.float32)
    if layout == "strided":
        kv = _halved(rng.standard_normal((B, m, 2, H, d), dtype=np.float32), fmt)
        k, v = kv.transpose(2, 0, 3, 1, 4)
    elif layout == "grouped":
        k, v = (np.broadcast_to(_halved(rng.standard_normal((B, 1, m, d), dtype=np.float32), fmt),
                                (B, H, m, d)) for _ in range(2))
    else:
        k, v = (_halved(rng.standard_normal((B, H, m, d), dtype=np.float32), fmt)
                for _ in range(2))
    return q, k, v


SOFTMAX_SETS = kernels_here("softmax_forward")


@pytest.mark.parametrize("fmt", HALF_FORMATS)
@pytest.mark.parametrize("held", SOFTMAX_SETS)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "grouped"])
@pytest.mark.parametrize("n, m, d", [(1, 700, 32), (5, 128, 48), (8, 1500, 40), (2, 200, 20),
                                     (9, 300, 32), (3, 100, 32)])
def test_half_keys_and_values_give_the_widened_calls_bits(fmt, held, layout, n, m, d):
    """softmax_attention's private _half_kv (attnx.torch's bfloat16 and
    float16 keys and values, a half-precision KV cache): the same out and
    lse, bit for bit, as the call on the widened arrays, whether the
    decoding path reads them as they are (at most 8 queries, at least 128
    keys; d and e whole vectors or not) or another widens them first (9
    queries; 100 keys); with a causal band, a window, a key-padding mask
    and a bias; the inputs left as they were"""
    q, k, v = _kv_case(n * m, n, m, layout, d, fmt)
    before = k.copy(), v.copy()
    mask = np.ones((2, 1, 1, m), bool)
    mask[1, ..., m // 3:] = False
    bias = np.linspace(-1, 1, m, dtype=np.float32)
    options = [dict(causal=True), dict(window=(40, 3), mask=mask), dict(bias=bias)]
    with dispatched(softmax_forward=held):
        for option in options:
            want = attnx.softmax_attention(q, _widened(k), _widened(v), return_lse=True, **option)
            got = attnx.softmax_attention(q, k, v, return_lse=True, _half_kv=True, **option)
            for a, b in zip(want, got):
                np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(k, before[0])
    np.testing.assert_array_equal(v, before[1])


@pytest.mark.parametrize("fmt", HALF_FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_half_keys_and_values_split_over_threads_as_on_one(fmt, threads):
    q, k, v = _kv_case(11, 2, 5000, "contiguous", fmt=fmt)
    if fmt == "bfloat16":
        k = k.view(np.int16)    # int16 bits are read as uint16 bits
    saved = attnx.get_num_threads()
    try:
        attnx.set_num_threads(threads)
        got = attnx.softmax_attention(q, k, v, _half_kv=True)
    finally:
        attnx.set_num_threads(saved)
    np.testing.assert_array_equal(got, attnx.softmax_attention(q, _widened(k), _widened(v)))


@pytest.mark.parametrize("fmt", HALF_FORMATS)
def test_half_keys_and_values_are_read_in_place_when_decoding(fmt):
    """A decoding call allocates no widened copy of the keys and values
    (numpy's allocations, traced); a call of more queries does"""
    import tracemalloc
    rng = np.random.default_rng(14)
    k, v = (_halved(rng.standard_normal((1, 4, 16384, 32), dtype=np.float32), fmt)
            for _ in range(2))
    wide_bytes = k.size * 4
    peaks = {}
    for n in (1, 64):
        q = rng.standard_normal((1, 4, n, 32), dtype=np.float32)
        tracemalloc.start()
        attnx.softmax_attention(q, k, v, _half_kv=True)
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks[1] < wide_bytes / 4, peaks
    assert peaks[64] >= 2 * wide_bytes, peaks


@pytest.mark.parametrize("held", SOFTMAX_SETS)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "grouped"])
@pytest.mark.parametrize("n, m, d", [(300, 517, 64), (48, 129, 32), (240, 33, 64), (20, 400, 48),
                                     (64, 200, 30), (30, 150, 33)])
def test_bfloat16_keys_and_values_with_bfloat16_products_give_the_widened_calls_bits(
        held, layout, n, m, d):
    """With bfloat16 arithmetic (_bf16_products: attnx.torch's bfloat16
    tensors) the AVX-512 micro-kernels pair bfloat16 keys and values
    straight from their bits, every other set and an odd d widen them
    first: either way the same out and lse, bit for bit, as the call on
    the widened arrays; for bfloat16 queries and others, a causal band, a
    window with a key-padding mask, a mask and a bias per query, dropout,
    and values holding inf and NaN; the inputs left as they were"""
    q, k, v = _kv_case(n + m + d, n, m, layout, d)
    rng = np.random.default_rng(d)
    mask = rng.random((2, 4, n, m)) < 0.8
    padding = np.ones((2, 1, 1, m), bool)
    padding[1, ..., m // 3:] = False
    bias = rng.standard_normal((n, m), dtype=np.float32)
    options = [dict(), dict(causal=True), dict(window=(40, 3), mask=padding),
               dict(mask=mask, bias=bias), dict(dropout_p=0.25, seed=5)]
    nonfinite = v.copy()
    nonfinite[0, 1, m // 2, 3] = 0x7f80                      # inf
    nonfinite[1, 3, m - 1, 0] = np.uint16(0xffc0).view(nonfinite.dtype)   # NaN
    before = k.copy(), v.copy(), nonfinite.copy()
    with dispatched(softmax_forward=held):
        for queries in (_widened(_halved(q, "bfloat16")), q):
            for values in (v, nonfinite):
                for option in options:
                    want = attnx.softmax_attention(queries, _widened(k), _widened(values),
                                                   return_lse=True, _bf16_products=True, **option)
                    got = attnx.softmax_attention(queries, k, values, return_lse=True,
                                                  _bf16_products=True, _half_kv=True, **option)
                    for a, b in zip(want, got):
                        assert a.tobytes() == b.tobytes(), (option, values is v)
    for array, saved in zip((k, v, nonfinite), before):
        np.testing.assert_array_equal(array, saved)


@pytest.mark.parametrize("held", SOFTMAX_SETS)
def test_bfloat16_keys_and_values_are_paired_in_place_on_avx512_bf16(held):
    """The set with the bfloat16 dot products makes no widened copy of the
    keys and values of a call with bfloat16 arithmetic (numpy's
    allocations, traced); any other set does"""
    import tracemalloc
    q, k, v = _kv_case(21, 256, 4096, "contiguous", d=64)
    q = _widened(_halved(q, "bfloat16"))
    out = np.empty(q.shape, np.float32)
    with dispatched(softmax_forward=held):
        tracemalloc.start()
        attnx.softmax_attention(q, k, v, out=out, _bf16_products=True, _half_kv=True)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    if held == "avx512_bf16":
        assert peak < k.size * 4 / 16, peak
    else:
        assert peak >= 2 * k.size * 4, peak


BACKWARD_SETS = kernels_here("softmax_backward")


@pytest.mark.parametrize("fmt", HALF_FORMATS)
@pytest.mark.parametrize("held", BACKWARD_SETS)
@pytest.mark.parametrize("layout", ["contiguous", "strided", "grouped"])
@pytest.mark.parametrize("n, m, d", [(200, 300, 64), (30, 129, 32), (130, 40, 20)])
def test_backward_widens_half_keys_and_values_a_block_at_a_time(fmt, held, layout, n, m, d,
                                                               softmax_backward_side):
    """The softmax backward's private _half_kv (attnx.torch's bfloat16 and
    float16 keys and values): the kernel widens k and v a key block at a
    time, a gaussian call has them widened first; either way dq, dk, dv
    and dbias equal, bit for bit, the gradients of the call on the widened
    arrays, with and without bfloat16 arithmetic, for keys and values
    shared by a group of query heads (their gradients summed), masks,
    windows, a bias, dropout and values holding inf; inputs unchanged"""
    from attnx._softmax import _backward

    q, k, v = _kv_case(n * m + d, n, m, layout, d, fmt)
    q = _widened(_halved(q, "bfloat16"))
    rng = np.random.default_rng(n)
    dout = _widened(_halved(rng.standard_normal(q.shape, dtype=np.float32), "bfloat16"))
    padding = np.ones((2, 1, 1, m), bool)
    padding[1, ..., m // 3:] = False
    bias = rng.standard_normal((n, m), dtype=np.float32)
    nonfinite = v.copy()
    nonfinite[0, 1, m // 2, 3] = np.float16(np.inf) if fmt == "float16" else 0x7f80
    cases = [(v, dict(scale=0.3)), (v, dict(scale=0.3, causal=True)),
             (v, dict(scale=0.3, window=(40, 3), mask=padding)),
             (v, dict(scale=0.3, bias=bias, bias_grad=True)),
             (v, dict(scale=0.3, dropout_p=0.25, seed=5)), (nonfinite, dict(scale=0.3)),
             (v, dict(sigma=1.7, causal=True))]
    before = k.copy(), v.copy(), nonfinite.copy()
    with dispatched(softmax_backward=held):
        for values, option in cases:
            forward = {key: option[key] for key in ("causal", "window", "mask", "bias",
                                                    "dropout_p", "seed") if key in option}
            wide_k, wide_v = _widened(k), _widened(values)
            if "sigma" in option:
                out, lse = attnx.gaussian_attention(q, wide_k, wide_v, option["sigma"],
                                                    return_lse=True, **forward)
            else:
                out, lse = attnx.softmax_attention(q, wide_k, wide_v, scale=option["scale"],
                                                   return_lse=True, **forward)
            backward = dict(dict(mask=None, bias=None, bias_grad=False), **option)
            for products in (False, True):
                want = _backward(dout, q, wide_k, wide_v, out, lse, dq=None, dk=None, dv=None,
                                 _bf16_products=products, **backward)
                got = _backward(dout, q, k, values, out, lse, dq=None, dk=None, dv=None,
                                _bf16_products=products, _half_kv=True, **backward)
                for a, b in zip(want, got):
                    assert (a is None and b is None) or (
                        a.dtype == b.dtype == np.float32 and a.shape == b.shape
                        and a.tobytes() == b.tobytes()), (option, products)
    for array, saved in zip((k, v, nonfinite), before):
        np.testing.assert_array_equal(array, saved)


@pytest.mark.parametrize("fmt", HALF_FORMATS)
def test_backward_makes_no_widened_copy_of_half_keys_and_values(fmt):
    """numpy's allocations, traced: the backward of a call with half keys
    and values allocates no copy of them (its gradients are given)"""
    import tracemalloc
    from attnx._softmax import _backward

    q, k, v = _kv_case(31, 64, 8192, "contiguous", d=64, fmt=fmt)
    out, lse = attnx.softmax_attention(q, _widened(k), _widened(v), return_lse=True)
    grads = [np.empty(x.shape, np.float32) for x in (q, k, v)]
    tracemalloc.start()
    _backward(out, q, k, v, out, lse, mask=None, bias=None, bias_grad=False, dq=grads[0],
              dk=grads[1], dv=grads[2], _half_kv=True)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < k.size * 4 / 8, peak


def test_half_keys_and_values_refuse_other_arrays():
    q, k, v = _kv_case(13, 1, 300, "contiguous")
    for queries in (q.astype(np.float64), q.astype(np.float16), q.tolist()):
        with pytest.raises(TypeError, match="_half_kv takes float32 queries"):
            attnx.softmax_attention(queries, k, v, _half_kv=True)
    with pytest.raises(TypeError, match="k must be float16 or hold bfloat16 bits"):
        attnx.softmax_attention(q, widen(k), v, _half_kv=True)
    with pytest.raises(TypeError, match="v must be float16 or hold bfloat16 bits"):
        attnx.softmax_attention(q, k, v.astype(np.int32), _half_kv=True)
    with pytest.raises(TypeError, match="k and v of one format"):
        attnx.softmax_attention(q, k, widen(v).astype(np.float16), _half_kv=True)
    with pytest.raises(ValueError, match="native byte order"):
        attnx.softmax_attention(q, k.astype(">u2"), v, _half_kv=True)
    with pytest.raises(ValueError, match="native byte order"):
        attnx.softmax_attention(q, widen(k).astype(">f2"), widen(v).astype(np.float16),
                                _half_kv=True)
    with pytest.raises(ValueError, match=r"k has shape \(2, 4, 300, 31\)"):
        attnx.softmax_attention(q, k[..., :31], v, _half_kv=True)
    with pytest.raises(TypeError, match="k must be an array, got None"):
        attnx.softmax_attention(q, None, v, _half_kv=True)


def test_backward_half_keys_and_values_refuse_other_arrays():
    q, k, v = _kv_case(17, 40, 300, "contiguous")
    out, lse = attnx.softmax_attention(q, widen(k), widen(v), return_lse=True)

    def backward(queries, keys, values):
        return attnx._C.softmax_backward(out, queries, keys, values, out, lse, _half_kv=True)

    for queries in (q.astype(np.float64), q.astype(np.float16), q.tolist()):
        with pytest.raises(TypeError, match="_half_kv takes float32 queries"):
            backward(queries, k, v)
    with pytest.raises(TypeError, match="k must be float16 or hold bfloat16 bits"):
        backward(q, widen(k), v)
    with pytest.raises(TypeError, match="_half_kv takes k and v of one format"):
        backward(q, k, widen(v).astype(np.float16))
    with pytest.raises(ValueError, match=r"k has shape \(2, 4, 300, 31\)"):
        backward(q, k[..., :31], v)
    before = k.copy(), v.copy()
    dq, dk, dv, _ = backward(q, k, v)
    np.testing.assert_array_equal(k, before[0])
    np.testing.assert_array_equal(v, before[1])
    assert dk.dtype == dv.dtype == np.float32 and dk.shape == k.shape


# --------------------------------------------------- attnx.torch on bfloat16

@pytest.fixture
def torch():
    torch = pytest.importorskip("torch")
    import attnx.torch  # noqa: F401  (registers the torch.ops.attnx operators)
    return torch


def _randn_half(torch, *shape, seed, dtype=None):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype or torch.bfloat16)


@pytest.mark.parametrize("fmt", HALF_FORMATS)
def test_conversion_ops_match_torch_and_pass_opcheck(torch, path, fmt):
    dtype = getattr(torch, fmt)
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0)) * 1e3
    half = torch.ops.attnx.float32_to_half(x, dtype)
    assert half.dtype == dtype and half.is_contiguous()
    assert torch.equal(half, x.to(dtype))
    wide = torch.ops.attnx.half_to_float32(half.transpose(0, 2))
    assert wide.dtype == torch.float32 and wide.is_contiguous()
    assert torch.equal(wide, half.transpose(0, 2).float())
    # differentiable: each conversion's gradient is the other
    x.requires_grad_()
    grad, = torch.autograd.grad(torch.ops.attnx.float32_to_half(x, dtype).sum(), x)
    assert grad.dtype == torch.float32 and torch.equal(grad, torch.ones_like(x))
    half.requires_grad_()
    grad, = torch.autograd.grad(torch.ops.attnx.half_to_float32(half).sum(), half)
    assert grad.dtype == dtype and torch.equal(grad, torch.ones_like(half))
    torch.library.opcheck(torch.ops.attnx.float32_to_half.default, (x, dtype))
    torch.library.opcheck(torch.ops.attnx.half_to_float32.default, (half,))
    with pytest.raises(ValueError, match="bfloat16 or float16, not torch.float64"):
        torch.ops.attnx.float32_to_half(x, torch.float64)


# the softmax kernels without the bfloat16 dot products: the best of them
# here, and plain C + BLAS
FLOAT32_SOFTMAX = sorted({next(s for s in kernels_here("softmax_backward")
                               if s not in ("avx512_bf16", "amx")), "plain"})


@pytest.mark.parametrize("fmt", HALF_FORMATS)
@pytest.mark.parametrize("held", FLOAT32_SOFTMAX)
def test_sdpa_half_is_the_float32_computation_rounded_once(torch, path, held, fmt):
    """Where the kernels have no bfloat16 dot products (both softmax
    families held to a set without them), and for float16 everywhere, out
    and every gradient equal attnx's float32 computation on the widened
    inputs, rounded once (bit for bit): the only rounding of the
    half-precision path there (bfloat16 with the dot products,
    tests/test_bf16_products.py). Inputs in transformers'
    layout (a permuted view of one (B, n, 3, H, d) tensor, read in place),
    a float mask in bfloat16, and the gradient of out.sum() (an expanded,
    stride-0 dout); a float bias with the causal flag goes through
    softmax_attention (torch's SDPA refuses attn_mask with is_causal)."""
    dtype = getattr(torch, fmt)
    with dispatched(softmax_forward=held, softmax_backward=held, convert=path):
        _check_rounded_once(torch, dtype)
        _check_decoding_rounded_once(torch, dtype)


def _check_decoding_rounded_once(torch, dtype):
    """A decoding step's shapes: two query heads per key head (enable_gqa),
    the cache in a [B, m, H, d] layout read through a permuted view, a
    key-padding mask; forward under no_grad (the keys and values read in
    place) and with gradients"""
    import attnx.torch as at

    B, m, d = 2, 300, 16
    q = _randn_half(torch, B, 4, 1, d, seed=4, dtype=dtype).requires_grad_()
    cache = _randn_half(torch, B, m, 2, 2, d, seed=5, dtype=dtype).requires_grad_()
    k, v = cache.permute(2, 0, 3, 1, 4)
    pad = torch.ones(B, 1, 1, m, dtype=torch.bool)
    pad[0, ..., 250:] = False
    wide_q = q.detach().float().requires_grad_()
    wide_cache = cache.detach().float().requires_grad_()
    wide_k, wide_v = wide_cache.permute(2, 0, 3, 1, 4)
    with torch.no_grad():
        out = at.scaled_dot_product_attention(q, k, v, attn_mask=pad, enable_gqa=True)
        out32 = at.scaled_dot_product_attention(wide_q, wide_k, wide_v, attn_mask=pad,
                                                enable_gqa=True)
    assert out.dtype == dtype
    assert torch.equal(out, out32.to(dtype))
    out = at.scaled_dot_product_attention(q, k, v, attn_mask=pad, enable_gqa=True)
    out32 = at.scaled_dot_product_attention(wide_q, wide_k, wide_v, attn_mask=pad,
                                            enable_gqa=True)
    dout = _randn_half(torch, B, 4, 1, d, seed=6, dtype=dtype)
    grads = torch.autograd.grad(out, (q, cache), dout)
    grads32 = torch.autograd.grad(out32, (wide_q, wide_cache), dout.float())
    assert torch.equal(out, out32.to(dtype))
    for ours, single in zip(grads, grads32):
        assert ours.dtype == dtype
        assert torch.equal(ours, single.to(dtype))


def _check_rounded_once(torch, dtype):
    import attnx.torch as at

    B, n, H, d = 2, 37, 3, 16
    qkv = _randn_half(torch, B, n, 3, H, d, seed=1, dtype=dtype).requires_grad_()
    bias = _randn_half(torch, B, 1, n, n, seed=2, dtype=dtype).requires_grad_()
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    out = at.softmax_attention(q, k, v, bias=bias, causal="upper_left")
    dout = _randn_half(torch, B, H, n, d, seed=3, dtype=dtype)
    dqkv, dbias = torch.autograd.grad(out, (qkv, bias), dout)

    wide = qkv.detach().float().requires_grad_()
    wide_bias = bias.detach().float().requires_grad_()
    q32, k32, v32 = wide.permute(2, 0, 3, 1, 4)
    out32 = at.softmax_attention(q32, k32, v32, bias=wide_bias, causal="upper_left")
    dqkv32, dbias32 = torch.autograd.grad(out32, (wide, wide_bias), dout.float())
    for ours, single in ((out, out32), (dqkv, dqkv32), (dbias, dbias32)):
        assert ours.dtype == dtype
        assert torch.equal(ours, single.to(dtype))

    # the gradient of out.sum(): dout arrives expanded with stride 0
    grads = torch.autograd.grad(at.scaled_dot_product_attention(q, k, v).sum(), qkv)[0]
    grads32 = torch.autograd.grad(at.scaled_dot_product_attention(q32, k32, v32).sum(), wide)[0]
    assert torch.equal(grads, grads32.to(dtype))


def test_linear_bf16_is_the_float32_computation_rounded_once(torch, path):
    import attnx.torch as at

    q, k, v = (_randn_half(torch, 2, 3, 20, 8, seed=s).requires_grad_() for s in (4, 5, 6))
    W = _randn_half(torch, 12, 8, seed=7).requires_grad_()
    dout = _randn_half(torch, 2, 3, 20, 8, seed=8)
    out = at.performer_attention(q, k, v, W, causal=True)
    grads = torch.autograd.grad(out, (q, k, v, W), dout)
    wide = [t.detach().float().requires_grad_() for t in (q, k, v, W)]
    out32 = at.performer_attention(*wide, causal=True)
    grads32 = torch.autograd.grad(out32, wide, dout.float())
    for ours, single in zip((out,) + grads, (out32,) + grads32):
        assert ours.dtype == torch.bfloat16
        assert torch.equal(ours, single.to(torch.bfloat16))


@pytest.mark.parametrize("fmt", HALF_FORMATS)
@pytest.mark.parametrize("n, m", [(1, 300), (3, 200), (50, 64)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_half_sdpa_without_graph_is_the_operators_result(torch, n, m, is_causal, fmt):
    """A bfloat16 or float16 call that builds no graph (the short path: its
    keys and values read as they are) gives the bits of the same call
    through the operator (inputs that require grad), grouped heads
    included"""
    import attnx.torch as at

    dtype = getattr(torch, fmt)
    q = _randn_half(torch, 2, 4, n, 32, seed=n, dtype=dtype)
    k, v = (_randn_half(torch, 2, 2, m, 32, seed=m + s, dtype=dtype) for s in (1, 2))
    with torch.no_grad():
        plain = at.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    graphed = at.scaled_dot_product_attention(*leaves, is_causal=is_causal, enable_gqa=True)
    assert plain.dtype == dtype and graphed.grad_fn is not None
    assert torch.equal(plain, graphed.detach())


@pytest.mark.parametrize("fmt", HALF_FORMATS)
def test_half_sdpa_compiles_without_graph_breaks(torch, fmt):
    import attnx.torch as at

    def attend(q, k, v):
        return at.scaled_dot_product_attention(q, k, v, is_causal=True).float().sum()

    q, k, v = (_randn_half(torch, 1, 2, 9, 8, seed=s, dtype=getattr(torch, fmt)).requires_grad_()
               for s in (1, 2, 3))
    compiled = torch.compile(attend, fullgraph=True, backend="inductor")
    eager = torch.autograd.grad(attend(q, k, v), (q, k, v))
    traced = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(eager, traced):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", HALF_FORMATS)
def test_half_tensors_cross_without_torchs_conversions(torch, fmt, monkeypatch):
    """bfloat16 and float16 tensors are widened and narrowed in attnx's C
    code, forward and backward, in every family's front end: no torch
    conversion op (aten._to_copy, or a copy between a half-precision tensor
    and a float32 one) touches their numbers; attnx's conversion
    (_C._convert_half) runs instead"""
    import attnx.torch as at
    from torch.utils._python_dispatch import TorchDispatchMode

    dtype = getattr(torch, fmt)
    half_and_wide = {dtype, torch.float32}

    class Conversions(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.torchs = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            tensors = [t for t in list(args) + [result] if isinstance(t, torch.Tensor)]
            if (str(func).startswith(("aten._to_copy", "aten.copy_", "aten.to"))
                    and {t.dtype for t in tensors} == half_and_wide
                    and max(t.numel() for t in tensors) > 1):
                self.torchs.append((str(func), [(t.dtype, tuple(t.shape)) for t in tensors]))
            return result

    converted = []
    convert = attnx._C._convert_half

    def recording(src, dst):
        # one array, or a list of them converted together
        converted.extend(s.shape for s in (src if isinstance(src, list) else [src]))
        return convert(src, dst)

    monkeypatch.setattr(attnx._C, "_convert_half", recording)

    def leaves(*shapes, seed):
        return [_randn_half(torch, *shape, seed=seed + i, dtype=dtype).requires_grad_()
                for i, shape in enumerate(shapes)]

    q, k, v = leaves((2, 3, 20, 8), (2, 3, 20, 8), (2, 3, 20, 8), seed=1)
    x = leaves((2, 3, 20, 8), seed=4)[0]
    dq, dk, dv = leaves((1, 20, 2, 8), (1, 20, 2, 8), (1, 20, 2, 8), seed=5)
    g = (-_randn_half(torch, 1, 20, 2, seed=8, dtype=dtype).abs()).requires_grad_()
    beta = _randn_half(torch, 1, 20, 2, seed=9, dtype=dtype).sigmoid().detach().requires_grad_()
    calls = {
        "sdpa": lambda: at.scaled_dot_product_attention(q, k, v, is_causal=True),
        "linear": lambda: at.linear_attention(q, k, v, causal=True),
        "focused": lambda: at.focused_linear_attention(q, k, v),
        "lsh": lambda: at.lsh_attention(q, v, 4, chunk=8),
        "rotary": lambda: at.rotary(x),
        "gated delta rule": lambda: at.chunk_gated_delta_rule(dq, dk, dv, g, beta, chunk_size=8)[0],
    }
    for name, call in calls.items():
        converted.clear()
        with Conversions() as seen:
            out = call()
            assert out.dtype == dtype, name
            out.backward(torch.ones_like(out))
        assert not seen.torchs, (name, seen.torchs)
        assert converted, name
