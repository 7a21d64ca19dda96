"""float16 <-> float32 conversion (csrc/convert.c, attnx._C._convert_half),
which attnx.torch uses for float16 tensors: every path (F16C's
instructions, NEON's, the portable rounding) against a reference written
from the definition of round-to-nearest-even over the float16 values, every
layout, several threads. (bfloat16's: tests/test_torch_bf16.py; float16
keys and values read in place by the decoding kernels: there too.)"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnx
from helpers import check_random_narrowing_on_every_path, dispatched, half_value, strided_layouts

CONVERT = attnx._C._convert_half


@pytest.fixture
def path(convert_kernels):
    """Each conversion this CPU has: the portable rounding ("plain"),
    F16C's VCVTPH2PS / VCVTPS2PH ("avx2", and "avx512_bf16", whose float16
    rows are the AVX2 set's) or NEON's FCVTL / FCVTN ("neon")."""
    return convert_kernels


# ------------------------------------------------------------- references

def reference_widen(bits):
    """float16 bits -> value in float64 from the fields"""
    return half_value(bits, 5)


# the finite non-negative float16 values, in the order of their bits
FINITE = reference_widen(np.arange(0x7c00))


def reference_narrow(x):
    """float32 -> float16 bits by the definition: of the two finite float16
    values around |x|, the nearer, judged in float64; on a tie the one
    whose last bit is even. From 65520 (half way from the largest, 65504,
    to 2^16) up: infinity. NaN is checked separately."""
    x = np.asarray(x, dtype=np.float32).astype(np.float64)
    magnitude = np.abs(x)
    high = np.searchsorted(FINITE, magnitude, side="left")     # FINITE[high] >= magnitude
    high = np.minimum(high, len(FINITE) - 1)
    low = np.where(FINITE[high] > magnitude, high - 1, high)
    low = np.maximum(low, 0)
    below, above = magnitude - FINITE[low], FINITE[high] - magnitude
    up = (above < below) | ((above == below) & (low % 2 == 1))
    rounded = np.where(up, high, low)
    rounded = np.where(magnitude >= 65520, 0x7c00, rounded)
    return (rounded | np.where(np.signbit(x), 0x8000, 0)).astype(np.uint16)


def narrow(x):
    x = np.asarray(x)
    out = np.empty(x.shape, np.float16)
    assert CONVERT(x, out) is out
    return out.view(np.uint16)


def widen(bits):
    bits = np.asarray(bits).view(np.float16)
    out = np.empty(bits.shape, np.float32)
    assert CONVERT(bits, out) is out
    return out


def check_narrow(x, got):
    x = np.asarray(x, np.float32)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got[~nan], reference_narrow(x[~nan]))
    # NaN stays NaN, quiet, with its sign
    assert np.all((got[nan] & 0x7c00) == 0x7c00) and np.all(got[nan] & 0x0200)
    np.testing.assert_array_equal(got[nan] >> 15, x[nan].view(np.uint32) >> 31)


def check_widen(bits, got):
    expected = reference_widen(bits)
    nan = np.isnan(expected)
    got = got.astype(np.float64)
    np.testing.assert_array_equal(got[~nan], expected[~nan])
    assert np.all(np.isnan(got[nan]))
    np.testing.assert_array_equal(np.signbit(got), np.asarray(bits) >> 15 == 1)


# ------------------------------------------------------------ the rounding

def test_reference_narrow_on_hand_checked_values():
    # 1 + 2^-11 is a tie between 1 and 1 + 2^-10: to even (1); 1 + 3 * 2^-11
    # to 1 + 2^-9 (even); just above a tie goes up; 65504 is the largest,
    # 65520 a tie that rounds to infinity; 2^-25 a tie with zero, just above
    # it the smallest subnormal; 1.5 * 2^-24 a tie of subnormals, to even
    x = np.array([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-11 + 2**-20, -1.5, 65504, 65519.996,
                  65520, 2**-25, 2**-25 * (1 + 2**-20), 1.5 * 2**-24, 2.5 * 2**-24, 6.1035156e-05,
                  -0.0, 1e-30], np.float32)
    expected = [0x3c00, 0x3c02, 0x3c01, 0xbe00, 0x7bff, 0x7bff, 0x7c00, 0x0000, 0x0001,
                0x0002, 0x0002, 0x0400, 0x8000, 0x0000]
    np.testing.assert_array_equal(reference_narrow(x), np.array(expected, np.uint16))


def test_widen_every_bit_pattern_is_exact(path):
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):     # signalling NaNs
        got = widen(bits)
    check_widen(bits, got)
    # and back: narrowing a widened value gives its bits (NaN aside)
    nan = np.isnan(got)
    np.testing.assert_array_equal(narrow(got)[~nan], bits[~nan])


def test_narrow_around_every_float16(path):
    # each finite float16 value, the midpoints to the next one up (ties:
    # a float16 has 11 significant bits, so they are exact in float32) and
    # the float32 numbers either side of each midpoint; both signs
    values = FINITE.astype(np.float32)
    mid = ((FINITE[:-1] + FINITE[1:]) / 2).astype(np.float32)
    x = np.concatenate([values, mid, np.nextafter(mid, np.float32(0)),
                        np.nextafter(mid, np.float32(np.inf)),
                        np.float32([65520, np.nextafter(np.float32(65520), np.float32(0)),
                                    np.inf, 3.4e38])])
    x = np.concatenate([x, -x])
    got = narrow(x)
    check_narrow(x, got)
    with dispatched(convert="plain"):
        np.testing.assert_array_equal(got, narrow(x))


def test_narrow_random_bit_patterns_every_path_agrees():
    check_random_narrowing_on_every_path(narrow, check_narrow)


@pytest.mark.parametrize("length", [1, 3, 4, 7, 8, 9, 15, 16, 17, 33, 70])
def test_rows_of_every_length_and_offset(path, length):
    # the vector loops' tails and unaligned starts
    values = np.float32([0, -0.0, 1, -2.5, 65504, 65520, 1e-7, -3e-8, np.inf, np.nan, 0.1,
                         1 + 2**-11, 6e-5, -1e5])
    for offset in range(3):
        x = np.resize(values, length + offset)[offset:]
        got = narrow(x)
        check_narrow(x, got)
        check_widen(got, widen(got))


@settings(max_examples=150, deadline=None)
@given(layout=strided_layouts(), seed=st.integers(0, 2**32 - 1))
def test_every_layout_converts_like_its_contiguous_copy(layout, seed):
    base_shape, view = layout
    base = (np.random.default_rng(seed).standard_normal(base_shape) * 100).astype(np.float32)
    x = view(base)
    np.testing.assert_array_equal(narrow(x), reference_narrow(np.ascontiguousarray(x)))
    # the same layout over float16 is widened in place
    halves = view(narrow(base).view(np.float16))
    np.testing.assert_array_equal(widen(halves), halves.astype(np.float32))


@pytest.mark.parametrize("half", [np.float16, np.uint16], ids=["float16", "bfloat16"])
def test_large_arrays_on_several_threads_match_one_thread(half):
    # above the size from which the conversion starts a second thread; both
    # formats (bfloat16 as its bits)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2, 4, 1 << 20), dtype=np.float32) * 1e3)[:, ::-1, :]

    def both_ways():
        halves = CONVERT(x, np.empty(x.shape, half))
        return halves, CONVERT(halves[:, :, ::2], np.empty((2, 4, 1 << 19), np.float32))

    threads = attnx.get_num_threads()
    try:
        attnx.set_num_threads(1)
        one = both_ways()
        attnx.set_num_threads(max(2, threads))
        many = both_ways()
    finally:
        attnx.set_num_threads(threads)
    for a, b in zip(one, many):
        np.testing.assert_array_equal(a, b)
    if half == np.float16:
        check_narrow(x.ravel(), one[0].view(np.uint16).ravel())


def test_bad_arguments_raise_clear_errors():
    x = np.zeros((3, 4), np.float16)
    with pytest.raises(TypeError, match="float32 and a half-precision array"):
        CONVERT(x, np.empty((3, 4), np.float64))
    with pytest.raises(TypeError, match="float32 and a half-precision array"):
        CONVERT(x, np.empty((3, 4), np.float16))
    with pytest.raises(ValueError, match="native byte order"):
        CONVERT(x.astype(">f2"), np.empty((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"shape of src \(3, 4\), got \(4, 3\)"):
        CONVERT(x, np.empty((4, 3), np.float32))
    before = x.copy()
    widen(x)
    np.testing.assert_array_equal(x, before)
