"""The bfloat16 dot products of float32 softmax attention
(the avx512_bf16 kernel sets of csrc/dispatch.c): where every number of a block of queries and keys
(of output gradients and values, in the backward's dP = dO V^T) is a
bfloat16 value, as for tensors widened from bfloat16, those products run
on VDPBF16PS, whose products of bfloat16 numbers are exact and whose sums
are float32. The results are the float32 computation's up to the order of
its sums.

Tested on both settings against the float64 references, the instruction's
results against the float32 path forced off on the same inputs, float32
inputs that are no bfloat16 values (which must never take the instruction:
it would truncate them), and attnx.torch on bfloat16 tensors against
torch's float32 SDPA of the same values."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnx
import attnx.reference as ref
from helpers import dispatched, hypothesis_settings, kernel_set_params, kernels_here, tol
from attnx.reference import (dropout_keep, gaussian_attention_grads, reduce_to,
                            softmax_attention_grads)


DOT = "avx512_bf16" in kernels_here("softmax_forward")
NO_DOT = "this CPU has no avx512_bf16 (or no AVX-512 micro-kernels)"
AMX = "amx" in kernels_here("softmax_backward")
# the sets whose products take the pairs: VDPBF16PS, and AMX's tiles
ON_SETS = kernel_set_params("softmax_backward", "avx512_bf16", "amx")
SETTINGS = ["off"] + kernel_set_params("softmax_forward", "avx512_bf16", "amx")
needs_dot = pytest.mark.skipif(not DOT, reason=NO_DOT)

# float32 results against the float64 references, relative to the largest
# reference entry (as tests/test_softmax_grad.py)
GRAD_RTOL = 5e-5
# the instruction against the float32 path: the same numbers summed in
# another order
PATH_RTOL = 2e-5
# attnx.torch's bfloat16 tensors with the dot products: p and dS rounded to
# bfloat16 (tests/test_bf16_products.py), relative to the largest entry
ROUNDED_RTOL = 6e-3


def bf16_dot(name):
    """Both softmax families with the bfloat16 dot products ("avx512_bf16"),
    on AMX ("amx"), or held to the float32 AVX-512 kernels ("off"; with the
    forward on AMX, "amx_off": what "amx" does on float32 numbers)."""
    if name in ("avx512_bf16", "amx"):
        return dispatched(softmax_forward=name, softmax_backward=name)
    if name == "amx_off":
        return dispatched(softmax_forward="amx", softmax_backward="avx512")
    return dispatched(softmax_forward="avx512", softmax_backward="avx512")


@pytest.fixture(params=SETTINGS)
def setting(request):
    with bf16_dot(request.param):
        yield request.param


def bf16_values(x):
    """x rounded to the nearest bfloat16 value (ties to even), as float32:
    the low 16 bits of every number 0."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7fff + ((bits >> 16) & 1)) >> 16 << 16
    return rounded.astype(np.uint32).view(np.float32)


def is_bf16(x):
    return not np.any(np.asarray(x, np.float32).view(np.uint32) & 0xffff)


def bf16_inputs(rng, *shapes, spread=1.0):
    return [bf16_values(spread * rng.standard_normal(shape)) for shape in shapes]


def assert_close(got, want, rtol, what=""):
    want = np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    size = max(float(np.max(np.abs(want))), 1.0) if want.size else 1.0
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=rtol * size,
                               err_msg=what)


def run(q, k, v, dout, family="softmax", bias_grad=False, **options):
    """out and the gradients (q, k, v, bias) of one forward and backward"""
    if family == "gaussian":
        out, lse = attnx.gaussian_attention(q, k, v, return_lse=True, **options)
        g = attnx.gaussian_attention_backward(dout, q, k, v, out, lse, bias_grad=bias_grad,
                                              **options)
    else:
        out, lse = attnx.softmax_attention(q, k, v, return_lse=True, **options)
        g = attnx.softmax_attention_backward(dout, q, k, v, out, lse, bias_grad=bias_grad,
                                             **options)
    return out, g.q, g.k, g.v, g.bias


def reference(q, k, v, dout, family="softmax", bias_grad=False, dropout_p=0.0, seed=None,
              **options):
    """the same from the float64 references"""
    if family == "gaussian":
        out = ref.gaussian_attention(q, k, v, **options)
        dq, dk, dv, dbias = gaussian_attention_grads(dout, q, k, v, **options)
    else:
        keep = None
        if dropout_p:
            heads = q.shape[:-2]
            keep = dropout_keep(seed, dropout_p, heads, q.shape[-2], k.shape[-2])
            weights = ref.softmax_weights(q, k, causal=options.get("causal", False))
            out = np.einsum("...ij,...jc->...ic", weights * keep / (1 - dropout_p),
                            v.astype(np.float64))
        else:
            out = ref.softmax_attention(q, k, v, **options)
        dq, dk, dv, dbias = softmax_attention_grads(dout, q, k, v, dropout_keep=keep,
                                                    dropout_p=dropout_p, **options)
    bias = options.get("bias")
    return (out, reduce_to(dq, q.shape), reduce_to(dk, k.shape), reduce_to(dv, v.shape),
            reduce_to(dbias, np.shape(bias)) if bias_grad else None)


NAMES = ("out", "dq", "dk", "dv", "dbias")


def check_against_reference(q, k, v, dout, **options):
    got = run(q, k, v, dout, **options)
    want = reference(q, k, v, dout, **options)
    assert_close(got[0], want[0], tol(np.float32)["rtol"], "out")
    for name, g, w in zip(NAMES[1:], got[1:], want[1:]):
        if w is None:
            assert g is None
        else:
            assert_close(g, w, GRAD_RTOL, name)
    return got


# Shapes where both products run on AVX-512 (the forward's micro-kernels
# need n >= 48 and e a multiple of 8; the backward's zmm products d and e
# multiples of 16): several query tiles (240 rows) and key tiles (256), a
# last panel part full (m % 8 != 0), a last query strip of one or two vectors.
N, M = 290, 541


def _cases():
    rng = np.random.default_rng(0)
    return {
        "plain": {},
        "causal": {"causal": True},
        "upper_left": {"causal": "upper_left"},
        "scale": {"scale": 0.3},
        "window": {"window": 3},
        "window_band": {"window": (40, 7), "causal": False},
        "window_causal": {"window": (100, 0)},
        "key_padding": {"mask": rng.random((2, 1, 1, M)) < 0.7},
        "full_mask": {"mask": rng.random((N, M)) < 0.8, "causal": True},
        "bias_per_key": {"bias": rng.standard_normal((1, M)).astype(np.float32),
                         "bias_grad": True},
        "bias_full": {"bias": rng.standard_normal((2, 1, N, M)).astype(np.float32),
                      "bias_grad": True, "causal": True},
        "gaussian": {"family": "gaussian", "sigma": 2.0, "window": (60, 20)},
        "dropout": {"dropout_p": 0.2, "seed": 11, "causal": True},
    }


CASES = _cases()


@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_values_match_the_float64_reference(setting, case, softmax_backward_side):
    rng = np.random.default_rng(1)
    q, k, v = bf16_inputs(rng, (2, 2, N, 32), (2, 2, M, 32), (2, 2, M, 16))
    dout = bf16_values(rng.standard_normal((2, 2, N, 16)))
    check_against_reference(q, k, v, dout, **CASES[case])


@pytest.mark.parametrize("setting_name", SETTINGS)
def test_grouped_query_heads(setting_name):
    # q (B, Hkv, g, n, d) against k, v (B, Hkv, 1, m, d)
    rng = np.random.default_rng(2)
    q, k, v = bf16_inputs(rng, (1, 2, 3, 200, 64), (1, 2, 1, 333, 64), (1, 2, 1, 333, 32))
    dout = bf16_values(rng.standard_normal((1, 2, 3, 200, 32)))
    with bf16_dot(setting_name):
        check_against_reference(q, k, v, dout, causal=True)


@needs_dot
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("on_set", ON_SETS)
def test_the_instruction_is_the_float32_path_up_to_summation_order(case, on_set):
    """On bfloat16 values, out and every gradient agree with the float32
    path forced off within float32 rounding; and they are not the same bits,
    so the instruction did run."""
    rng = np.random.default_rng(3)
    q, k, v = bf16_inputs(rng, (2, 2, N, 64), (2, 2, M, 64), (2, 2, M, 32), spread=2.0)
    dout = bf16_values(rng.standard_normal((2, 2, N, 32)))
    with bf16_dot("off"):
        off = run(q, k, v, dout, **CASES[case])
    with bf16_dot(on_set):
        on = run(q, k, v, dout, **CASES[case])
    for name, a, b in zip(NAMES, off, on):
        if a is None:
            assert b is None
            continue
        assert_close(b, a, PATH_RTOL, name)
    # the scores, and through them every result, come from the other sums
    # (on AMX, the backward's: its forward leaves two-sided windows, dropout
    # and the gaussian form to the FMAs, dispatch.h)
    if on_set == "avx512_bf16":
        assert not np.array_equal(off[0], on[0])
    assert not np.array_equal(off[1], on[1])


@pytest.mark.parametrize("d", [1, 7, 33, 66])
def test_feature_counts_the_pairs_do_not_divide(setting, d):
    """The forward pairs the features (an odd count gets a 0 partner); the
    backward's products need whole vectors (d % 16 == 0) and take BLAS
    otherwise. e stays a multiple of 8 so that the micro-kernels run."""
    rng = np.random.default_rng(4)
    q, k, v = bf16_inputs(rng, (2, 150, d), (2, 170, d), (2, 170, 16))
    dout = bf16_values(rng.standard_normal((2, 150, 16)))
    check_against_reference(q, k, v, dout, causal=True)


@needs_dot
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(48, 300), m=st.integers(1, 300),
       d=st.sampled_from([16, 32, 48, 64]), causal=st.booleans(),
       spread=st.sampled_from([1e-3, 1.0, 30.0]))
@hypothesis_settings(25)
def test_float32_values_never_take_the_instruction(seed, n, m, d, causal, spread):
    """float32 inputs that are no bfloat16 values give the float32 path's
    bits exactly: the instruction would have truncated them (on AMX, the
    backward's; its forward splits float32 into planes either way)."""
    rng = np.random.default_rng(seed)
    q, k, v, dout = (spread * rng.standard_normal(shape).astype(np.float32)
                     for shape in ((2, n, d), (2, m, d), (2, m, 16), (2, n, 16)))
    for on_set, off_set in (("avx512_bf16", "off"), ("amx", "amx_off"))[:1 + AMX]:
        with bf16_dot(off_set):
            off = run(q, k, v, dout, causal=causal)
        with bf16_dot(on_set):
            on = run(q, k, v, dout, causal=causal)
        for name, a, b in zip(NAMES[:4], off[:4], on[:4]):
            np.testing.assert_array_equal(a, b, err_msg=f"{on_set} {name}")


def _one_number_off(rng, which):
    """bfloat16 inputs of one head but for one number of `which` (q, k, v or
    dout): 64.25, a quarter above the bfloat16 value 64, which the
    instruction would read as 64. Its row also holds -64 beside it, and
    their partners across the product are equal (-2, 0 or 2 by key or
    row), so that the pair contributes 0.25 times the partner in float32
    and nothing once truncated: scores (or dP) off by up to 0.5."""
    n, m, d, e = 100, 16, 32, 32
    q, k, v = bf16_inputs(rng, (1, n, d), (1, m, d), (1, m, e), spread=0.5)
    dout = bf16_values(0.5 * rng.standard_normal((1, n, e)))
    x = {"q": q, "k": k, "v": v, "dout": dout}
    partner = {"q": k, "k": q, "v": dout, "dout": v}[which]
    x[which][0, 5, 3:5] = (64.25, -64)
    partner[0, :, 3] = partner[0, :, 4] = 2 * (np.arange(partner.shape[1]) % 3 - 1)
    assert is_bf16(partner) and not is_bf16(x[which])
    return x


@needs_dot
@pytest.mark.parametrize("on_set", ON_SETS)
@pytest.mark.parametrize("which", ["q", "k", "v", "dout"])
def test_one_number_that_is_no_bf16_value_keeps_its_block_on_float32(which, on_set):
    rng = np.random.default_rng(5)
    x = _one_number_off(rng, which)
    with bf16_dot(on_set):
        got = run(x["q"], x["k"], x["v"], x["dout"], scale=1.0)
    want = reference(x["q"], x["k"], x["v"], x["dout"], scale=1.0)
    for name, g, w in zip(NAMES[:4], got[:4], want[:4]):
        assert_close(g, w, GRAD_RTOL, name)
    # the test can fail: with the number truncated, as the instruction would
    # read it, some result is far outside the tolerance
    truncated = {name: a.copy() for name, a in x.items()}
    truncated[which][0, 5, 3] = 64
    wrong = reference(truncated["q"], truncated["k"], truncated["v"], truncated["dout"],
                      scale=1.0)
    errors = [np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1.0)
              for a, b in zip(wrong[:4], want[:4])]
    assert max(errors) > 100 * GRAD_RTOL


def test_setting_and_dispatch():
    info = attnx.cpu_dispatch()
    # on from import where available, but on Intel's cores, where VDPBF16PS
    # does half the FMAs' flops (csrc/dispatch.c); AMX, Intel's too, uses FMAs
    # where its tiles do not run
    pays = DOT and attnx._C.build_info()["cpu_vendor"] != "intel"
    if pays:
        assert info["softmax_forward"] in ("avx512_bf16", "amx")
    else:
        assert info["softmax_forward"] != "avx512_bf16"
    assert (info["softmax_backward"] == "avx512_bf16") == pays
    with bf16_dot("off"):
        assert attnx.cpu_dispatch()["softmax_forward"] != "avx512_bf16"
    assert attnx.cpu_dispatch() == info
    with dispatched("AVX512_BF16") as chosen:
        assert "avx512_bf16" not in (chosen["softmax_forward"], chosen["softmax_backward"])


def test_inputs_are_not_modified():
    rng = np.random.default_rng(6)
    q, k, v = bf16_inputs(rng, (2, 100, 32), (2, 90, 32), (2, 90, 16))
    dout = bf16_values(rng.standard_normal((2, 100, 16)))
    copies = [a.copy() for a in (q, k, v, dout)]
    run(q, k, v, dout, causal=True)
    for a, b in zip((q, k, v, dout), copies):
        np.testing.assert_array_equal(a, b)


# ----------------------------------------------- attnx.torch on bfloat16

@pytest.mark.parametrize("setting_name", SETTINGS)
@pytest.mark.parametrize("options", [{}, {"is_causal": True}, {"mask": True}, {"gqa": True}])
def test_torch_bf16_sdpa_is_torch_float32_sdpa_rounded(setting_name, options):
    """attnx.torch on bfloat16 tensors against torch's float32 SDPA of the
    same values: out and every gradient within one rounding to bfloat16
    (half a unit of the float32 result) plus float32 tolerance; with the
    dot products, plus the error of the rounded probabilities and their
    gradients that bfloat16 tensors ask for (tests/test_bf16_products.py),
    on VDPBF16PS or on AMX."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    import attnx.torch as at

    g = torch.Generator().manual_seed(7)
    B, H, n, m, d = 2, 4, 130, 150, 64
    kv_heads = 2 if options.get("gqa") else H
    q = torch.randn(B, H, n, d, generator=g).to(torch.bfloat16)
    k = torch.randn(B, kv_heads, m, d, generator=g).to(torch.bfloat16)
    v = torch.randn(B, kv_heads, m, d, generator=g).to(torch.bfloat16)
    dout = torch.randn(B, H, n, d, generator=g).to(torch.bfloat16)
    kwargs = {"is_causal": options.get("is_causal", False), "enable_gqa": "gqa" in options}
    if options.get("mask"):
        lengths = torch.tensor([150, 97])
        kwargs["attn_mask"] = (torch.arange(m)[None, :] < lengths[:, None])[:, None, None, :]
    half = [t.clone().requires_grad_() for t in (q, k, v)]
    wide = [t.float().requires_grad_() for t in (q, k, v)]
    with bf16_dot(setting_name):
        out = at.scaled_dot_product_attention(*half, **kwargs)
        grads = torch.autograd.grad(out, half, dout)
    out32 = F.scaled_dot_product_attention(*wide, **kwargs)
    grads32 = torch.autograd.grad(out32, wide, dout.float())
    for name, got, want in zip(NAMES, (out,) + grads, (out32,) + grads32):
        assert got.dtype == torch.bfloat16
        got, want = got.detach().float().numpy(), want.detach().numpy().astype(np.float64)
        # attnx's float32 result is within `close` of want, and its rounding
        # to bfloat16 moves it by at most 2^-8 of itself
        close = GRAD_RTOL * max(float(np.max(np.abs(want))), 1.0)
        if setting_name in ("avx512_bf16", "amx"):
            close += ROUNDED_RTOL * float(np.max(np.abs(want)))
        bound = 2.0**-8 * (np.abs(want) + close) + close
        assert np.all(np.abs(got - want) <= bound), (name, np.max(np.abs(got - want) - bound))


def test_show_config_names_the_setting(capsys):
    with bf16_dot("off") as chosen:
        attnx.show_config()
    assert chosen["softmax_forward"] != "avx512_bf16"
    assert f"softmax_forward {chosen['softmax_forward']}," in capsys.readouterr().out
    if DOT:
        with bf16_dot("avx512_bf16"):
            attnx.show_config()
        assert "softmax_forward avx512_bf16," in capsys.readouterr().out
