"""bfloat16 arithmetic for bfloat16 tensors (attnx.torch): where the softmax
kernels have the bfloat16 dot products (the avx512_bf16 set of
csrc/dispatch.c; the forward on AMX too, csrc/softmax_amx.c), attnx.torch asks the C kernels, by a private keyword
(_bf16_products; attnx.h's bf16_products), for what torch's own CPU flash
attention computes for bfloat16: the probabilities p (the forward's P V)
and their gradients dS (the backward's products) rounded to bfloat16 and
multiplied on the dot products, float32 sums. float32 and float64 callers
never take it.

Tested: the rounded results against float64 references computed from the
same bfloat16 inputs, with a bound set by bfloat16's rounding (each p and
dS carries a relative error of at most 2^-9, which averages out over a
row; a wrong index or a lost pair is an error of the size of the results);
that the rounding really happens where the dot products run (the results
differ from float32's); torch's own bfloat16 SDPA as the yardstick; float32
inputs that are no bfloat16 values (the keyword then changes nothing, bit
for bit); float64; and the same calls held to kernels without the dot
products (tests/test_torch_bf16.py: the float32 computation rounded once)."""
import numpy as np
import pytest

import attnx
from attnx._softmax import _backward
from helpers import dispatched, kernel_set_params, kernels_here

torch = pytest.importorskip("torch")
import attnx.torch as at  # noqa: E402
import torch.nn.functional as F  # noqa: E402

DOT = "avx512_bf16" in kernels_here("softmax_backward")
needs_dot = pytest.mark.skipif(not DOT, reason="this CPU has no avx512_bf16 (or no AVX-512)")

# The rounded results against the float64 reference, relative to the
# largest reference entry: bfloat16's unit roundoff 2^-9 = 2e-3 is the
# error of one rounded p or dS; sums over a row average it down (measured:
# 1.5e-3 to 2.1e-3 of the largest entry, as torch's own bfloat16 kernels
# before their final rounding)
ROUNDED_RTOL = 6e-3
# the least error that shows the rounding happened (float32's is ~1e-6)
ROUNDED_AT_LEAST = 2e-5


def bf16_values(rng, *shape, spread=1.0):
    """float32 numbers that are bfloat16 values (as attnx.torch widens them)"""
    x = torch.from_numpy((spread * rng.standard_normal(shape)).astype(np.float32))
    return x.to(torch.bfloat16).float().numpy()


def kernel_results(q, k, v, dout, bf16_products, **options):
    """out and the gradients (q, k, v) of the C kernels, unrounded"""
    out, lse = attnx.softmax_attention(q, k, v, return_lse=True, _bf16_products=bf16_products,
                                       **options)
    g = _backward(dout, q, k, v, out, lse, mask=options.pop("mask", None), bias=None,
                  bias_grad=False, dq=None, dk=None, dv=None, _bf16_products=bf16_products,
                  **options)
    return out, g.q, g.k, g.v


def relative_error(got, want):
    want = np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(np.asarray(got, dtype=np.float64) - want)) /
                 max(float(np.max(np.abs(want))), 1e-30))


# (heads, n, m, d, options): several key and query blocks (the backward's
# 128), odd n and m (a pair's second row 0), n < m, a causal band whose
# blocks start at odd rows, a padding mask; d = 16 and 64 (whole zmm
# vectors: the backward's products on AVX-512), d = 17 (an odd d: the
# plain products, the keyword ignored there); last blocks of 48 rows and
# keys (AMX's products: a 32-row block, a 16-row edge, 8 pairs of depth
# left to VDPBF16PS)
CASES = [
    (2, 300, 300, 64, {}),
    (2, 176, 176, 64, {}),
    (2, 257, 257, 64, {"causal": True}),
    (1, 129, 391, 64, {"causal": True}),
    (3, 130, 129, 16, {}),
    (2, 77, 200, 32, {"mask": "padding"}),
    (1, 45, 45, 17, {"causal": True}),
]


def _case(case, seed=0):
    heads, n, m, d, options = case
    rng = np.random.default_rng(seed)
    q, dout = bf16_values(rng, heads, n, d), bf16_values(rng, heads, n, d)
    k, v = bf16_values(rng, heads, m, d), bf16_values(rng, heads, m, d)
    options = dict(options)
    if options.get("mask") == "padding":
        lengths = rng.integers(m // 2, m + 1, size=heads)
        options["mask"] = (np.arange(m)[None, :] < lengths[:, None])[:, None, :]
    return q, k, v, dout, options


# the sets whose backward takes the pairs: VDPBF16PS, and AMX's tiles
PAIR_SETS = kernel_set_params("softmax_backward", "avx512_bf16", "amx")


@needs_dot
@pytest.mark.parametrize("pair_set", PAIR_SETS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_rounded_products_against_the_float64_reference(case, pair_set, softmax_backward_side):
    q, k, v, dout, options = _case(case)
    with dispatched(softmax_forward=pair_set, softmax_backward=pair_set):
        got = kernel_results(q, k, v, dout, True, **dict(options))
        float32 = kernel_results(q, k, v, dout, False, **dict(options))
    wide = [x.astype(np.float64) for x in (q, k, v, dout)]
    want = kernel_results(*wide, False, **dict(options))
    rounded_products = case[3] % 16 == 0
    for name, g, f, w in zip(("out", "dq", "dk", "dv"), got, float32, want):
        assert relative_error(g, w) < ROUNDED_RTOL, name
        assert relative_error(f, w) < 5e-5, name
        if name != "out" and rounded_products:
            # the backward's products of p and dS took the rounded pairs
            assert relative_error(g, w) > ROUNDED_AT_LEAST, name
        elif name != "out":
            np.testing.assert_array_equal(g, f, err_msg=name)


@needs_dot
def test_float32_numbers_that_are_no_bfloat16_values_are_not_rounded():
    """The keyword on inputs that are not bfloat16 values: the kernels check
    (they would truncate them) and keep float32, bit for bit."""
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((2, 200, 64)).astype(np.float32) for _ in range(4))
    for options in ({}, {"causal": True}):
        got = kernel_results(q, k, v, dout, True, **options)
        want = kernel_results(q, k, v, dout, False, **options)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


def test_float64_ignores_the_keyword():
    rng = np.random.default_rng(4)
    q, k, v, dout = (rng.standard_normal((2, 150, 64)) for _ in range(4))
    got = kernel_results(q, k, v, dout, True, causal=True)
    want = kernel_results(q, k, v, dout, False, causal=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def _sdpa(fn, tensors, dtype, **options):
    q, k, v, dout = (t.to(dtype) for t in tensors)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **options)
    return [out.detach()] + list(torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("causal", [False, True])
def test_torch_bfloat16_within_a_small_multiple_of_torchs_own_error(causal):
    """attnx.torch on bfloat16 tensors (whatever the kernels: with the dot
    products the rounded arithmetic, else float32 rounded once) against
    float64 from the same bfloat16 inputs: out and gradients within twice
    torch's own bfloat16 SDPA error, and float32 tensors keep float32's."""
    g = torch.Generator().manual_seed(5)
    tensors = [torch.randn(2, 3, 260, 64, generator=g).to(torch.bfloat16) for _ in range(4)]
    want = _sdpa(F.scaled_dot_product_attention, tensors, torch.float64, is_causal=causal)
    ours = _sdpa(at.scaled_dot_product_attention, tensors, torch.bfloat16, is_causal=causal)
    theirs = _sdpa(F.scaled_dot_product_attention, tensors, torch.bfloat16, is_causal=causal)
    ours32 = _sdpa(at.scaled_dot_product_attention, tensors, torch.float32, is_causal=causal)
    for name, o, t, o32, w in zip(("out", "dq", "dk", "dv"), ours, theirs, ours32, want):
        assert o.dtype == torch.bfloat16 and o32.dtype == torch.float32
        assert relative_error(o.double(), w) <= 2 * relative_error(t.double(), w), name
        assert relative_error(o32.double(), w) < 5e-5, name


def test_torch_float32_tensors_are_attnx_float32_bit_for_bit():
    """float32 tensors take the numpy entries' float32 computation (no
    keyword), bit for bit."""
    rng = np.random.default_rng(6)
    q, k, v, dout = (bf16_values(rng, 2, 150, 64) for _ in range(4))
    got = _sdpa(at.scaled_dot_product_attention, [torch.from_numpy(x) for x in (q, k, v, dout)],
                torch.float32, is_causal=True)
    want = kernel_results(q, k, v, dout, False, causal=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w)


# The forward's P V (the AVX-512 micro-kernels: e a multiple of 8, 48 rows
# or more). Within one key tile (the kernels' 256 keys) the online softmax
# rounds each p = exp(s - max) against the row's final max, so the float64
# reference from the same inputs with p rounded to bfloat16 is what the
# kernel computes, up to float32: its sums (FP32_RTOL of the sum of |p v|)
# and the float32 scores and exp2, whose relative error of a few 1e-7 can
# round a p that lies within it of a midpoint between two bfloat16 values
# to the other one (an error of one bfloat16 step of that p, allowed for
# those p alone). A wrong value, pair or index, or p left unrounded, is an
# error of the size of bfloat16's rounding, 1e-3 of the results.
FP32_RTOL = 1e-5
P_NEAR_MIDPOINT = 2e-6
# (heads, n, m, d, e, options): one query tile and two (240 rows a tile;
# the float32 path packs the values only for two), odd m and m not a whole
# panel of 8 keys (a pair's second key 0), n < m and n > m, a causal band,
# a padding mask, a per-query mask, an odd d (the scores' pairs padded),
# e of 5 groups of 8 columns
FORWARD_CASES = [
    (2, 300, 256, 64, 64, {}),
    (1, 240, 251, 32, 40, {"causal": True}),
    (2, 64, 131, 17, 16, {"causal": True}),
    (3, 100, 77, 64, 8, {}),
    (2, 48, 250, 33, 24, {"mask": "padding"}),
    (1, 90, 100, 64, 32, {"mask": "per query"}),
]


def _forward_case(case, seed=0):
    heads, n, m, d, e, options = case
    rng = np.random.default_rng(seed)
    q, k, v = bf16_values(rng, heads, n, d), bf16_values(rng, heads, m, d), bf16_values(rng, heads, m, e)
    options = dict(options)
    if options.get("mask") == "padding":
        lengths = rng.integers(m // 2, m + 1, size=heads)
        options["mask"] = (np.arange(m)[None, :] < lengths[:, None])[:, None, :]
    elif options.get("mask") == "per query":
        options["mask"] = rng.random((heads, n, m)) < 0.7
        options["mask"][..., 0] = True
    return q, k, v, options


def _visible(n, m, options):
    """which keys each query sees (True: seen), attnx's causal band aligned
    to the last key"""
    seen = np.ones((n, m), dtype=bool)
    if options.get("causal"):
        seen &= np.tril(seen, m - n)
    if options.get("mask") is not None:
        seen = seen & options["mask"]
    return seen


def _round_bf16(x):
    return torch.from_numpy(np.ascontiguousarray(x)).to(torch.bfloat16).double().numpy()


def rounded_p_reference(q, k, v, options):
    """out with p rounded to bfloat16 against the row's max (float64 from
    the same inputs) and the allowance of each entry (see FP32_RTOL)"""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    s = np.where(_visible(q.shape[-2], k.shape[-2], options), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    total = p.sum(-1, keepdims=True)
    rounded = _round_bf16(p)
    # a p this close to a midpoint may round either way: one step of it
    # (bfloat16 steps by 2^-8 of the power of two under it, 2^-9 below it)
    fraction, exponent = np.frexp(rounded)
    step = np.ldexp(np.where((p < rounded) & (fraction == 0.5), 0.5, 1.0), exponent - 8)
    midpoint = rounded + np.where(p >= rounded, 1, -1) * step / 2
    either_way = np.abs(p - midpoint) <= P_NEAR_MIDPOINT * p
    allowance = (FP32_RTOL * (p @ np.abs(v)) + (either_way * step) @ np.abs(v)) / total
    return rounded @ v / total, p @ v / total, allowance


# the forward's sets that round p: the micro-kernels with the dot
# products, and AMX (its one-plane products, csrc/amx.h)
ROUNDING_SETS = kernel_set_params("softmax_forward", "avx512_bf16", "amx")


@pytest.mark.parametrize("rounding_set", ROUNDING_SETS)
@pytest.mark.parametrize("case", FORWARD_CASES, ids=str)
def test_forward_rounds_p_as_bfloat16_against_the_float64_reference(case, rounding_set):
    q, k, v, options = _forward_case(case)
    with dispatched(softmax_forward=rounding_set):
        got = attnx.softmax_attention(q, k, v, _bf16_products=True, **options)
    want, unrounded, allowance = rounded_p_reference(q, k, v, options)
    excess = np.abs(got - want) - allowance
    assert np.max(excess) <= 0, np.unravel_index(np.argmax(excess), excess.shape)
    # and the rounding happened (p unrounded is off by far more)
    assert relative_error(got, unrounded) > ROUNDED_AT_LEAST


@pytest.mark.parametrize("rounding_set", ROUNDING_SETS)
def test_forward_over_several_key_tiles_rounds_p_within_bfloat16s_error(rounding_set):
    """Past one key tile, p is rounded against the running max (as torch's
    kernel does it per block of keys): within bfloat16's error of the
    unrounded float64 result, and away from float32's."""
    q, k, v, options = _forward_case((2, 260, 1100, 64, 64, {"causal": True}))
    with dispatched(softmax_forward=rounding_set):
        got = attnx.softmax_attention(q, k, v, _bf16_products=True, **options)
    _, unrounded, _ = rounded_p_reference(q, k, v, options)
    assert ROUNDED_AT_LEAST < relative_error(got, unrounded) < ROUNDED_RTOL


@pytest.mark.parametrize("rounding_set", ROUNDING_SETS)
def test_forward_values_that_are_no_bfloat16_values_keep_float32_p_v(rounding_set):
    """Queries and keys bfloat16 values, values not: P V stays float32 (its
    pairs would truncate them), bit for bit the call without the keyword."""
    rng = np.random.default_rng(7)
    q, k = bf16_values(rng, 2, 300, 64), bf16_values(rng, 2, 500, 64)
    v = rng.standard_normal((2, 500, 64)).astype(np.float32)
    with dispatched(softmax_forward=rounding_set):
        got = attnx.softmax_attention(q, k, v, _bf16_products=True)
        want = attnx.softmax_attention(q, k, v)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("case", FORWARD_CASES[:3], ids=str)
def test_forward_without_the_dot_products_is_float32(case):
    """ATTNX_DISABLE_CPU_FEATURES=AVX512_BF16 (as dispatched chooses the
    kernels with it): the keyword changes nothing, bit for bit, and the
    result is float32's."""
    q, k, v, options = _forward_case(case)
    with dispatched(disabled="AVX512_BF16"):
        got = attnx.softmax_attention(q, k, v, _bf16_products=True, **options)
        want = attnx.softmax_attention(q, k, v, **options)
    np.testing.assert_array_equal(got, want)
    _, unrounded, _ = rounded_p_reference(q, k, v, options)
    assert relative_error(got, unrounded) < 5e-6
