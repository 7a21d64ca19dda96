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


@pytest.mark.parametrize("threads", [1, 2])
def test_conversions_together_equal_each_alone(threads):
    # a list of conversions (as attnx.torch converts a training step's
    # inputs or gradients): both directions, both formats, strided and
    # broadcast sources, and together above the size at which a second
    # thread starts; each result the same bits as its conversion alone
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 1 << 18), dtype=np.float32) * 300
    halves = CONVERT(x, np.empty(x.shape, np.float16))
    bits = CONVERT(x, np.empty(x.shape, np.uint16))
    sources = [x[:, ::-1], halves.T, bits[::2], np.broadcast_to(bits[1, :7], (5, 7)),
               np.full((), 2.5, np.float32), halves[:, :0]]
    kinds = [np.uint16, np.float32, np.float32, np.float32, np.float16, np.float32]
    originals = [s.copy() for s in sources]
    alone = [CONVERT(s, np.empty(s.shape, kind)) for s, kind in zip(sources, kinds)]
    before = attnx.get_num_threads()
    try:
        attnx.set_num_threads(threads)
        destinations = [np.empty(s.shape, kind) for s, kind in zip(sources, kinds)]
        assert CONVERT(sources, destinations) is destinations
        destinations_tuple = tuple(np.empty(s.shape, kind) for s, kind in zip(sources, kinds))
        assert CONVERT(tuple(sources), destinations_tuple) is destinations_tuple
    finally:
        attnx.set_num_threads(before)
    for one, together, again in zip(alone, destinations, destinations_tuple):
        assert one.tobytes() == together.tobytes() == again.tobytes()
    # and each the independent reference's (numpy's float16 casts round to
    # nearest even; bfloat16 is the top half of a float32, rounded on the
    # integer bits for these finite numbers)
    def bf16_rounded(wide):
        u = np.ascontiguousarray(wide, np.float32).view(np.uint32).astype(np.uint64)
        return ((u + 0x7fff + ((u >> 16) & 1)) >> 16).astype(np.uint16)

    def bf16_widened(b):
        return (np.asarray(b, np.uint16).astype(np.uint32) << 16).view(np.float32)

    expected = [bf16_rounded(sources[0]), sources[1].astype(np.float32), bf16_widened(sources[2]),
                bf16_widened(sources[3]), sources[4].astype(np.float16),
                sources[5].astype(np.float32)]
    for want, together in zip(expected, destinations):
        assert want.dtype == together.dtype and want.tobytes() == together.tobytes()
    for source, original in zip(sources, originals):
        assert source.tobytes() == original.tobytes()
    assert CONVERT([], []) == []


def test_conversions_together_refuse_bad_lists():
    x = np.ones((4, 6), np.float32)
    wide = np.empty((4, 6), np.float32)
    half = np.empty((4, 6), np.float16)
    with pytest.raises(ValueError, match="as many sources as destinations, at most 8"):
        CONVERT([x, x], [half])
    with pytest.raises(ValueError, match="as many sources as destinations, at most 8"):
        CONVERT([x] * 9, [np.empty((4, 6), np.float16) for _ in range(9)])
    with pytest.raises(TypeError, match="takes numpy arrays"):
        CONVERT([x, [1.0]], [half, np.empty(1, np.float16)])
    with pytest.raises(TypeError, match="two numpy arrays, or two tuples or lists"):
        CONVERT(x, [half])
    with pytest.raises(ValueError, match="shape of src"):
        CONVERT([x, x], [half, np.empty((6, 4), np.float16)])
    # one conversion's destination over another's source or destination
    with pytest.raises(ValueError, match="must not overlap another conversion's src or dst"):
        CONVERT([half, x], [wide, half.view(np.uint16)])
    with pytest.raises(ValueError, match="must not overlap another conversion's src or dst"):
        CONVERT([x, x], [half, half])
    with pytest.raises(ValueError, match="must not overlap another conversion's src or dst"):
        CONVERT([x[:2], half], [half[:2], wide])
    # sources may share memory: they are only read
    first, second = np.empty((4, 6), np.float16), np.empty((4, 6), np.float16)
    CONVERT([x, x], [first, second])
    np.testing.assert_array_equal(first, second)
