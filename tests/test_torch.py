"""attnx.torch: the operators against torch's own SDPA and against plain torch
float64 references written from the formulas, gradients included."""
import inspect
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import attnx  # noqa: E402
import attnx.torch as at  # noqa: E402
from helpers import grads_of  # noqa: E402


TOL = {torch.float64: dict(rtol=1e-12, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=2e-6)}


def randn(*shape, dtype=torch.float64, grad=True, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else hash(shape) % 2**31)
    return torch.randn(*shape, dtype=dtype, generator=g).requires_grad_(grad)


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual, expected, **TOL[dtype])


# ------------------------------------------------------------- SDPA parity

def _masks(B, H, n, m, dtype):
    g = torch.Generator().manual_seed(7)
    padding = torch.rand(B, 1, 1, m, generator=g) > 0.3
    padding[..., 0] = True
    full = torch.rand(B, H, n, m, generator=g) > 0.4
    bias = torch.randn(B, H, n, m, generator=g, dtype=dtype)
    key_bias = torch.randn(B, 1, 1, m, generator=g, dtype=dtype)
    return {
        "none": None,
        "bool key padding (B,1,1,m)": padding,
        "bool key padding expanded (stride 0)": padding.expand(B, 1, n, m),
        "bool full (some rows see nothing)": full,
        "bool 2-d": full[0, 0],
        "float full": bias,
        "float key padding expanded": key_bias.expand(B, H, n, m),
        "float -inf padding": torch.where(padding, 0.0, float("-inf")).to(dtype),
    }


def _refuses_mask_with_causal(call):
    """torch's SDPA contract: an explicit attn_mask with is_causal=True is a
    RuntimeError (attnx raises it on every path; torch's own CPU kernels
    only on some)."""
    with pytest.raises(RuntimeError, match="Explicit attn_mask should not be set"):
        call()


MASK_KINDS = list(_masks(1, 1, 1, 1, torch.float64))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("n,m", [(9, 9), (5, 12), (12, 5)])
def test_sdpa_matches_torch(dtype, kind, is_causal, n, m):
    B, H, d, e = 2, 3, 8, 5
    q, k, v = randn(B, H, n, d, dtype=dtype), randn(B, H, m, d, dtype=dtype), randn(B, H, m, e, dtype=dtype)
    mask = _masks(B, H, n, m, dtype)[kind]
    if mask is not None and mask.is_floating_point():
        mask = mask.clone().requires_grad_() if mask.stride(-2) else mask.detach().requires_grad_()
    dout = randn(B, H, n, e, dtype=dtype, grad=False, seed=3)
    inputs = [q, k, v] + ([mask] if mask is not None and mask.requires_grad else [])
    if mask is not None and is_causal:
        _refuses_mask_with_causal(
            lambda: at.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True))
        return
    ours, our_grads = grads_of(
        lambda: at.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal), inputs, dout)
    ref, ref_grads = grads_of(lambda: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal), inputs, dout)
    assert ours.dtype == dtype and ours.shape == ref.shape
    assert_close(ours, ref, dtype)
    for a, b in zip(our_grads, ref_grads):
        assert_close(a, b, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mask_heads", [None, 1, 8])
def test_sdpa_gqa_and_scale(dtype, mask_heads):
    B, Hq, Hkv, n, m, d = 2, 8, 2, 7, 10, 16
    q, k, v = randn(B, Hq, n, d, dtype=dtype), randn(B, Hkv, m, d, dtype=dtype), randn(B, Hkv, m, d, dtype=dtype)
    mask = None if mask_heads is None else torch.rand(B, mask_heads, n, m) > 0.3
    dout = randn(B, Hq, n, d, dtype=dtype, grad=False, seed=5)
    kw = dict(attn_mask=mask, scale=0.37, enable_gqa=True)
    ours, our_grads = grads_of(lambda: at.scaled_dot_product_attention(q, k, v, **kw), [q, k, v], dout)
    ref, ref_grads = grads_of(lambda: F.scaled_dot_product_attention(q, k, v, **kw), [q, k, v], dout)
    assert_close(ours, ref, dtype)
    for a, b in zip(our_grads, ref_grads):
        assert a.shape == b.shape
        assert_close(a, b, dtype)


def test_sdpa_signature_is_torchs():
    ours = inspect.signature(at.scaled_dot_product_attention)
    assert list(ours.parameters) == ["query", "key", "value", "attn_mask", "dropout_p", "is_causal",
                                     "scale", "enable_gqa"]
    for name, param in ours.parameters.items():
        if param.default is not inspect.Parameter.empty:
            assert param.default in (None, 0.0, False)


def test_query_constant_masks_reach_the_kernel_as_key_padding(monkeypatch):
    seen = []
    real = attnx.softmax_attention

    def spy(*args, **kwargs):
        for name in ("mask", "bias"):
            if kwargs.get(name) is not None:
                seen.append((name, kwargs[name].shape, kwargs[name].strides))
        return real(*args, **kwargs)

    monkeypatch.setattr(attnx, "softmax_attention", spy)
    B, H, n, m, d = 2, 4, 64, 48, 8
    q, k, v = (randn(B, H, s, d, grad=False) for s in (n, m, m))
    padding = torch.rand(B, m) > 0.2
    expanded = padding[:, None, None, :].expand(B, 1, n, m)
    float_expanded = torch.where(padding, 0.0, -1e9).to(torch.float64)[:, None, None, :].expand(B, 1, n, m)
    at.scaled_dot_product_attention(q, k, v, attn_mask=expanded)
    at.scaled_dot_product_attention(q, k, v, attn_mask=float_expanded)
    at.scaled_dot_product_attention(q, k, v, attn_mask=padding[:, None, None, :])
    assert [(name, shape) for name, shape, _ in seen] == [
        ("mask", (B, 1, 1, m)), ("bias", (B, 1, 1, m)), ("mask", (B, 1, 1, m))]
    # a mask that differs between queries is passed whole
    seen.clear()
    at.scaled_dot_product_attention(q, k, v, attn_mask=torch.rand(n, m) > 0.5)
    assert seen[0][1] == (n, m)


def test_float_mask_gradient_reduced_to_its_shape():
    B, H, n, m, d = 2, 3, 6, 9, 4
    q, k, v = randn(B, H, n, d), randn(B, H, m, d), randn(B, H, m, d)
    for shape in [(B, 1, 1, m), (1, H, n, m), (n, m), (m,)]:
        bias = randn(*shape, seed=11)
        dout = randn(B, H, n, d, grad=False, seed=12)
        ours, ga = grads_of(lambda: at.scaled_dot_product_attention(q, k, v, attn_mask=bias), [q, bias], dout)
        ref, gb = grads_of(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias), [q, bias], dout)
        assert ga[1].shape == bias.shape
        assert_close(ours, ref, torch.float64)
        assert_close(ga[1], gb[1], torch.float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_end_to_end(dtype):
    B, H, n, m, d = 2, 2, 33, 40, 16
    q, k, v = (randn(B, H, s, d, dtype=torch.float32, grad=False, seed=seed).to(dtype).requires_grad_()
               for s, seed in ((n, 1), (m, 2), (m, 3)))
    mask = (torch.rand(B, 1, 1, m) > 0.2) & torch.ones(n, m, dtype=torch.bool).tril()
    dout = randn(B, H, n, d, dtype=torch.float32, grad=False, seed=9).to(dtype)
    ours, grads = grads_of(
        lambda: at.scaled_dot_product_attention(q, k, v, attn_mask=mask), [q, k, v], dout)
    assert ours.dtype == dtype and all(g.dtype == dtype for g in grads)
    # the same computation in float32 on the same (rounded) values, rounded once at the end
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref, ref_grads = grads_of(
        lambda: F.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask),
        [q32, k32, v32], dout.float())
    eps = torch.finfo(dtype).eps
    # bfloat16 with the bfloat16 dot products: also the error of the
    # probabilities and their gradients rounded to bfloat16 in the backward
    # (tests/test_bf16_products.py), relative to the largest entry; the
    # forward rounds p only in its micro-kernel tiles, which 33 query rows
    # do not fill, so out keeps the float32 bound
    rounded = dtype == torch.bfloat16 and attnx.cpu_dispatch()["softmax_backward"] in (
        "avx512_bf16", "amx")
    for a, b in [(ours, ref)] + list(zip(grads, ref_grads)):
        # the float32 result rounded once to the half dtype: within half an
        # ulp of it, plus float32's own rounding
        err = (a.float() - b).abs()
        slack = 6e-3 if rounded and a is not ours else 1e-5
        assert torch.all(err <= eps / 2 * b.abs() + slack * b.abs().max()), err.max()


def test_bad_inputs_raise_clear_errors():
    q = randn(2, 4, 8, grad=False)
    with pytest.raises(ValueError, match="device meta"):
        at.scaled_dot_product_attention(q.to("meta"), q, q)
    with pytest.raises(TypeError, match="share one dtype"):
        at.scaled_dot_product_attention(q, q.float(), q)
    with pytest.raises(TypeError, match="int64"):
        at.softmax_attention(q.long(), q.long(), q.long())
    with pytest.raises(ValueError, match="same last size"):
        at.scaled_dot_product_attention(q, randn(2, 4, 7, grad=False), q)
    with pytest.raises(TypeError, match="attn_mask has dtype torch.int32; it must be bool"):
        at.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="dropout_p"):
        at.scaled_dot_product_attention(q, q, q, dropout_p=1.01)
    with pytest.raises(ValueError, match="dropout_p"):
        at.softmax_attention(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match="causal"):
        at.softmax_attention(q, q, q, causal="sideways")
    with pytest.raises(ValueError, match="window"):
        at.softmax_attention(q, q, q, window=-2)


def test_inputs_are_not_modified():
    q, k, v = randn(2, 5, 4), randn(2, 6, 4), randn(2, 6, 3)
    mask = torch.rand(2, 5, 6) > 0.5
    copies = [t.detach().clone() for t in (q, k, v, mask)]
    at.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
    for t, c in zip((q, k, v, mask), copies):
        assert torch.equal(t.detach(), c)


# ------------------------------------------- front ends, references in torch

def softmax_reference(q, k, v, scale=None, causal=False, mask=None, bias=None, window=None):
    n, m = q.shape[-2], k.shape[-2]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * q @ k.transpose(-1, -2)
    if bias is not None:
        s = s + bias
    visible = torch.ones(n, m, dtype=torch.bool)
    i, j = torch.arange(n)[:, None], torch.arange(m)[None, :]
    shift = 0 if causal == "upper_left" else m - n
    if causal:
        visible = visible & (j <= i + shift)
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        if left is not None:
            visible = visible & (j >= i + m - n - left)
        if right is not None:
            visible = visible & (j <= i + m - n + right)
    if mask is not None:
        visible = visible & mask
    s = s.masked_fill(~visible, float("-inf"))
    w = torch.softmax(s, -1).nan_to_num(0.0)
    return w @ v


@pytest.mark.parametrize("options", [
    {}, {"causal": True}, {"causal": "upper_left"}, {"scale": 0.2, "window": (2, 1)},
    {"window": (None, 0)}, {"window": 3},
])
def test_softmax_front_end_matches_reference(options):
    q, k, v = randn(2, 2, 7, 6), randn(2, 2, 9, 6), randn(2, 2, 9, 3)
    bias = randn(2, 1, 7, 9, seed=21)
    mask = torch.rand(2, 1, 7, 9) > 0.3
    dout = randn(2, 2, 7, 3, grad=False, seed=22)
    inputs = [q, k, v, bias]
    ours, ga = grads_of(lambda: at.softmax_attention(q, k, v, mask=mask, bias=bias, **options), inputs, dout)
    ref, gb = grads_of(lambda: softmax_reference(q, k, v, mask=mask, bias=bias, **options), inputs, dout)
    assert_close(ours, ref, torch.float64)
    for a, b in zip(ga, gb):
        assert_close(a, b, torch.float64)


def test_gaussian_front_end_matches_reference():
    q, k, v = randn(3, 5, 4), randn(3, 8, 4), randn(3, 8, 2)
    sigma = 1.7
    dout = randn(3, 5, 2, grad=False, seed=1)

    def reference():
        s = -((q[..., :, None, :] - k[..., None, :, :]) ** 2).sum(-1) / (2 * sigma**2)
        s = s.masked_fill(~torch.ones(5, 8, dtype=torch.bool).tril(3), float("-inf"))
        return torch.softmax(s, -1) @ v

    ours, ga = grads_of(lambda: at.gaussian_attention(q, k, v, sigma, causal=True), [q, k, v], dout)
    ref, gb = grads_of(reference, [q, k, v], dout)
    assert_close(ours, ref, torch.float64)
    for a, b in zip(ga, gb):
        assert_close(a, b, torch.float64)


def test_return_lse_and_attention_weights():
    q, k, v = randn(2, 6, 4), randn(2, 8, 4), randn(2, 8, 3)
    out, lse = at.softmax_attention(q, k, v, return_lse=True)
    s = q @ k.transpose(-1, -2) / 2
    assert_close(lse, torch.logsumexp(s, -1).detach(), torch.float64)
    assert not lse.requires_grad
    dout = randn(2, 6, 8, grad=False, seed=4)
    ours, ga = grads_of(lambda: at.attention_weights(q, k, causal=True), [q, k], dout)
    ref, gb = grads_of(lambda: softmax_reference(q, k, torch.eye(8, dtype=torch.float64), causal=True),
                       [q, k], dout)
    assert_close(ours, ref, torch.float64)
    for a, b in zip(ga, gb):
        assert_close(a, b, torch.float64)
    np.testing.assert_allclose(at.attention_weights(q, k, "cosformer").detach().numpy(),
                               attnx.attention_weights(q.detach().numpy(), k.detach().numpy(), "cosformer"),
                               rtol=1e-12, atol=1e-15)


def test_softmax_gradcheck_float64():
    q, k, v = randn(2, 4, 3), randn(2, 5, 3), randn(2, 5, 2)
    bias = randn(4, 5, seed=2)
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: at.softmax_attention(q, k, v, bias=b, causal=True, window=(3, None)),
        (q, k, v, bias))
    assert torch.autograd.gradcheck(lambda q, k, v: at.gaussian_attention(q, k, v, 0.8), (q, k, v))
    assert torch.autograd.gradcheck(
        lambda q, k, v: at.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v))


def test_opcheck_softmax_ops():
    q, k, v = randn(2, 4, 3), randn(2, 5, 3), randn(2, 5, 2)
    mask = torch.rand(2, 1, 5) > 0.3
    bias = randn(2, 4, 5, seed=8)
    for args in [(q, k, v, None, None, "softmax", None, "none", None, 0.0, None),
                 (q, k, v, mask, bias, "softmax", 0.5, "lower_right", [2, -1], 0.0, None),
                 (q, k, v, mask, None, "gaussian", 1.3, "upper_left", [1], 0.0, None)]:
        torch.library.opcheck(torch.ops.attnx.softmax_attention.default, args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["plain", "mask, bias, window", "gaussian, causal", "dropout"])
def test_eager_autograd_is_the_operators(dtype, case):
    """A call that builds a graph runs the operator's computation eagerly
    (_SoftmaxFunction, without the custom operator's dispatch): its output
    and every gradient, the bias's included, are the operator's bit for
    bit, and a second derivative is refused as the operator refuses it"""
    from attnx.torch._softmax import _encode_causal, _SoftmaxFunction

    q, k, v = (randn(2, 3, 5, 8, seed=s).to(dtype).detach().requires_grad_() for s in (1, 2, 3))
    mask = bias = seed = None
    variant, param, causal, window, dropout_p = "softmax", None, False, None, 0.0
    if case == "mask, bias, window":
        mask = torch.rand(2, 1, 5, 5, generator=torch.Generator().manual_seed(4)) > 0.3
        bias = randn(1, 3, 5, 5, seed=5).to(dtype).detach().requires_grad_()
        param, window = 0.7, [2, 1]
    elif case == "gaussian, causal":
        variant, param, causal = "gaussian", 1.3, "upper_left"
    elif case == "dropout":
        dropout_p, seed = 0.3, torch.tensor([12345], dtype=torch.int64)
    args = (q, k, v, mask, bias, variant, param, _encode_causal(causal), window, dropout_p, seed)
    inputs = [t for t in (q, k, v, bias) if t is not None]
    dout = randn(2, 3, 5, 8, seed=6).to(dtype)

    through_op, _, _ = torch.ops.attnx.softmax_attention(*args)
    if variant == "gaussian":
        eager = at.gaussian_attention(q, k, v, sigma=param, causal=causal)
    else:
        eager = at.softmax_attention(q, k, v, scale=param, mask=mask, bias=bias, window=window,
                                     dropout_p=dropout_p,
                                     seed=None if seed is None else int(seed))
    assert type(eager.grad_fn).__name__ == _SoftmaxFunction.__name__ + "Backward"
    assert eager.dtype == through_op.dtype == dtype
    assert torch.equal(eager, through_op)
    for got, want in zip(torch.autograd.grad(eager, inputs, dout, retain_graph=True),
                         torch.autograd.grad(through_op, inputs, dout, retain_graph=True)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    for out in (eager, through_op):
        first, = torch.autograd.grad((out * dout).sum(), q, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable|no autograd formula"):
            first.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_jit_trace_records_the_operator(dtype):
    """torch.jit.trace of a call that builds no graph records the operator,
    not numpy arrays baked in as constants: the trace gives new inputs'
    results"""
    def sdpa(q, k, v):
        return at.scaled_dot_product_attention(q, k, v)

    def causal(q, k, v):
        return at.softmax_attention(q, k, v, causal=True)

    q, k, v = (randn(1, 2, 5, 8, seed=s, grad=False).to(dtype) for s in (1, 2, 3))
    fresh = [randn(1, 2, 5, 8, seed=s, grad=False).to(dtype) for s in (4, 5, 6)]
    for function in (sdpa, causal):
        with torch.no_grad():
            traced = torch.jit.trace(function, (q, k, v), check_trace=False)
        assert "attnx::softmax_attention" in str(traced.graph)
        assert torch.equal(traced(*fresh), function(*fresh))


def test_nothing_saved_without_grad():
    q, k, v = randn(2, 4, 3), randn(2, 5, 3), randn(2, 5, 2)
    with torch.no_grad():
        out = at.scaled_dot_product_attention(q, k, v)
    assert out.grad_fn is None and not out.requires_grad
    with torch.inference_mode():
        out = at.softmax_attention(q, k, v)
    assert out.grad_fn is None and out.is_inference()
    out = at.softmax_attention(q, k, v)
    assert out.grad_fn is not None


class TinyBlock(torch.nn.Module):
    def __init__(self, dim=16, heads=2, attention="softmax"):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, padding):
        B, n, dim = x.shape
        q, k, v = self.qkv(x).view(B, n, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        if self.attention == "softmax":
            mask = padding[:, None, None, :].expand(B, 1, n, n)
            y = at.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = at.cosformer_attention(q, k, v, key_mask=padding[:, None, :])
        return self.proj(y.transpose(1, 2).reshape(B, n, dim))


@pytest.mark.parametrize("attention", ["softmax", "cosformer"])
def test_torch_compile_fullgraph(attention):
    torch.manual_seed(0)
    model = TinyBlock(attention=attention).double()
    x = randn(2, 12, 16, seed=1)
    padding = torch.rand(2, 12) > 0.2
    padding[:, 0] = True
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    eager_out, eager_grads = grads_of(lambda: model(x, padding), [x] + list(model.parameters()),
                                      randn(2, 12, 16, grad=False, seed=2))
    out, grads = grads_of(lambda: compiled(x, padding), [x] + list(model.parameters()),
                          randn(2, 12, 16, grad=False, seed=2))
    assert_close(out, eager_out, torch.float64)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------ linear family

def phi_elu(x):
    return F.elu(x) + 1


def linear_reference(q, k, v, features, causal=False, key_mask=None, eps=1e-6, positions=None):
    n, m = q.shape[-2], k.shape[-2]
    s = features(q) @ features(k).transpose(-1, -2)
    if positions is not None:
        s = s * positions
    i, j = torch.arange(n)[:, None], torch.arange(m)[None, :]
    if causal:
        s = s * (j <= i + m - n)
    if key_mask is not None:
        s = s * key_mask[..., None, :]
    return (s @ v) / s.sum(-1, keepdim=True).clamp_min(eps)


@pytest.mark.parametrize("causal", [False, True])
def test_linear_front_end_matches_reference(causal):
    q, k, v = randn(2, 2, 6, 4), randn(2, 2, 6, 4), randn(2, 2, 6, 3)
    key_mask = torch.rand(2, 1, 6) > 0.2
    dout = randn(2, 2, 6, 3, grad=False, seed=31)
    ours, ga = grads_of(lambda: at.linear_attention(q, k, v, causal=causal, key_mask=key_mask), [q, k, v], dout)
    ref, gb = grads_of(lambda: linear_reference(q, k, v, phi_elu, causal, key_mask), [q, k, v], dout)
    assert_close(ours, ref, torch.float64)
    for a, b in zip(ga, gb):
        assert_close(a, b, torch.float64)


def test_cosformer_front_end_matches_reference():
    n = 7
    q, k, v = randn(2, n, 4), randn(2, n, 4), randn(2, n, 3)
    dout = randn(2, n, 3, grad=False, seed=32)
    t = torch.arange(n, dtype=torch.float64)
    positions = torch.cos(math.pi / 2 * (t[:, None] - t[None, :]) / n)
    ours, ga = grads_of(lambda: at.cosformer_attention(q, k, v, causal=True), [q, k, v], dout)
    ref, gb = grads_of(lambda: linear_reference(q, k, v, F.relu, True, positions=positions),
                       [q, k, v], dout)
    assert_close(ours, ref, torch.float64)
    for a, b in zip(ga, gb):
        assert_close(a, b, torch.float64)


def test_linear_forward_matches_numpy_every_front_end():
    q, k, v = randn(2, 6, 4, grad=False), randn(2, 6, 4, grad=False), randn(2, 6, 3, grad=False)
    qn, kn, vn = (t.numpy() for t in (q, k, v))
    W = attnx.random_features(8, 4, seed=0)
    cases = [(at.linear_attention, attnx.linear_attention, {"feature_map": "relu", "causal": True}),
             (at.cosformer_attention, attnx.cosformer_attention, {"causal": True}),
             (at.focused_linear_attention, attnx.focused_linear_attention, {"p": 2}),
             (at.taylor_attention, attnx.taylor_attention, {}),
             (at.efficient_attention, attnx.efficient_attention, {})]
    for ours, theirs, kw in cases:
        np.testing.assert_array_equal(ours(q, k, v, **kw).numpy(), theirs(qn, kn, vn, **kw))
    np.testing.assert_array_equal(at.performer_attention(q, k, v, torch.from_numpy(W)).numpy(),
                                  attnx.performer_attention(qn, kn, vn, W))


def test_opcheck_linear_forward():
    q, k, v = randn(2, 5, 3, grad=False), randn(2, 5, 3, grad=False), randn(2, 5, 2, grad=False)
    key_mask = torch.rand(2, 5) > 0.2
    args = (q, k, v, key_mask, None, None, "cosformer", "elu", "lower_right", None, None, None,
            1e-6, 3.0, None)
    torch.library.opcheck(torch.ops.attnx.linear_attention.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_opcheck_and_gradcheck_linear():
    q, k, v = randn(2, 5, 3), randn(2, 5, 3), randn(2, 5, 2)
    key_mask = torch.rand(2, 5) > 0.2
    args = (q, k, v, key_mask, None, None, "linear", "elu", "lower_right", None, None, None,
            1e-6, 3.0, None)
    torch.library.opcheck(torch.ops.attnx.linear_attention.default, args)
    assert torch.autograd.gradcheck(lambda q, k, v: at.linear_attention(q, k, v, causal=True), (q, k, v))
    W = randn(6, 3, seed=3)
    assert torch.autograd.gradcheck(lambda q, k, v, W: at.performer_attention(q, k, v, W), (q, k, v, W))


def test_callable_feature_map_trains_through_autograd():
    torch.manual_seed(0)
    learned = torch.nn.Linear(4, 6).double()  # a learned map (T2R / Hedgehog style)

    def feature_map(x):
        return torch.exp(learned(x).clamp(max=20))

    q, k, v = randn(2, 6, 4), randn(2, 6, 4), randn(2, 6, 3)
    dout = randn(2, 6, 3, grad=False, seed=41)
    params = [q, k, v] + list(learned.parameters())
    ours, ga = grads_of(lambda: at.linear_attention(q, k, v, feature_map=feature_map, causal=True),
                        params, dout)
    ref, gb = grads_of(lambda: linear_reference(q, k, v, feature_map, causal=True), params, dout)
    assert_close(ours, ref, torch.float64)
    for a, b in zip(ga, gb):
        assert_close(a, b, torch.float64)


def test_callable_feature_map_forward_and_errors():
    q, k, v = randn(2, 6, 4, grad=False), randn(2, 6, 4, grad=False), randn(2, 6, 3, grad=False)
    out = at.linear_attention(q, k, v, feature_map=torch.relu, key_mask=torch.rand(2, 6) > 0.3)
    assert out.shape == (2, 6, 3)
    with pytest.raises(ValueError, match="feature_map callable returned shape"):
        at.linear_attention(q, k, v, feature_map=lambda x: x[..., 0])
    with pytest.raises(TypeError, match="torch.Tensor"):
        at.linear_attention(q, k, v, feature_map=lambda x: x.numpy())
    with pytest.raises(ValueError, match="non-negative"):
        at.linear_attention(q, k, v, feature_map=lambda x: x - 10)


def test_sdpa_dropout_repeatable_and_differentiable():
    q, k, v = randn(2, 5, 4), randn(2, 7, 4), randn(2, 7, 3)
    torch.manual_seed(3)
    a = at.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(3)
    b = at.scaled_dot_product_attention(q, k, v, dropout_p=0.4)
    assert torch.equal(a, b)
    out = at.softmax_attention(q, k, v, dropout_p=0.4, seed=5)
    weights = attnx.attention_weights(q.detach().numpy(), k.detach().numpy(), dropout_p=0.4, seed=5)
    np.testing.assert_allclose(out.detach().numpy(), weights @ v.detach().numpy(), rtol=1e-12, atol=1e-14)
    assert torch.autograd.gradcheck(lambda q, k, v: at.softmax_attention(q, k, v, dropout_p=0.4, seed=5),
                                    (q, k, v))


# ------------------------------------------------------------- properties

from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), H=st.integers(1, 3), n=st.integers(1, 12), m=st.integers(1, 12),
       d=st.integers(1, 9), e=st.integers(1, 6), is_causal=st.booleans(),
       mask_kind=st.sampled_from(["none", "padding", "full", "float", "float padding"]),
       scale=st.one_of(st.none(), st.floats(0.05, 2.0)), seed=st.integers(0, 2**16))
def test_sdpa_matches_torch_property(B, H, n, m, d, e, is_causal, mask_kind, scale, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, s, f, generator=g, dtype=torch.float64).requires_grad_()
               for s, f in ((n, d), (m, d), (m, e)))
    mask = {"none": None,
            "padding": (torch.rand(B, 1, 1, m, generator=g) > 0.3).expand(B, 1, n, m),
            "full": torch.rand(B, H, n, m, generator=g) > 0.3,
            "float": torch.randn(H, n, m, generator=g, dtype=torch.float64),
            "float padding": torch.randn(B, 1, 1, m, generator=g, dtype=torch.float64)}[mask_kind]
    inputs = [q, k, v]
    if mask is not None and mask.is_floating_point():
        mask.requires_grad_()
        inputs.append(mask)
    dout = torch.randn(B, H, n, e, generator=g, dtype=torch.float64)
    if mask is not None and is_causal:
        _refuses_mask_with_causal(lambda: at.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=True, scale=scale))
        return
    ours, ga = grads_of(lambda: at.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale), inputs, dout)
    ref, gb = grads_of(lambda: F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale), inputs, dout)
    assert_close(ours, ref, torch.float64)
    for a, b in zip(ga, gb):
        assert_close(a, b, torch.float64)


def test_empty_inputs():
    q, k, v = randn(2, 0, 4), randn(2, 5, 4), randn(2, 5, 3)
    out = at.scaled_dot_product_attention(q, k, v)
    assert out.shape == (2, 0, 3)
    out.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k))
    q, k, v = randn(2, 4, 4), randn(2, 0, 4), randn(2, 0, 3)
    out = at.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, torch.zeros(2, 4, 3, dtype=torch.float64))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


W_FIXED = torch.from_numpy(attnx.random_features(6, 3, seed=1))


@pytest.mark.parametrize("name,call", [
    ("linear_attention_backward", lambda q, k, v: at.linear_attention(q, k, v, feature_map="relu")),
    ("linear_attention_backward",
     lambda q, k, v: at.linear_attention(q, k, v, causal=True, mask=torch.rand(5, 5, generator=torch.Generator().manual_seed(0)) > 0.3)),
    ("linear_attention_backward", lambda q, k, v: at.linear_attention(q, k, v, feature_map="softmax", window=(2, 0))),
    ("cosformer_attention_backward", lambda q, k, v: at.cosformer_attention(q, k, v, M=9)),
    ("focused_linear_attention_backward", lambda q, k, v: at.focused_linear_attention(q, k, v, p=2, causal=True)),
    ("taylor_attention_backward", lambda q, k, v: at.taylor_attention(q, k, v, causal=True)),
    ("performer_attention_backward", lambda q, k, v: at.performer_attention(q, k, v, W_FIXED, causal=True)),
    ("efficient_attention_backward", lambda q, k, v: at.efficient_attention(q, k, v)),
    ("linear_attention_backward", lambda q, k, v: at.attention_weights(q, k, "linear")),
])
def test_linear_family_gradcheck(name, call):
    q, k, v = randn(2, 5, 3, seed=1), randn(2, 5, 3, seed=2), randn(2, 5, 2, seed=3)
    assert torch.autograd.gradcheck(call, (q, k, v))


def test_performer_projection_gets_its_gradient():
    q, k, v = randn(2, 5, 3, seed=1), randn(2, 5, 3, seed=2), randn(2, 5, 2, seed=3)
    W = W_FIXED.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda W: at.performer_attention(q, k, v, W), (W,))


def test_strided_tensors_read_in_place_and_output_written_in_place(monkeypatch):
    seen = {}
    real = attnx.softmax_attention

    def spy(q, k, v, **kwargs):
        seen["pointers"] = [a.__array_interface__["data"][0] for a in (q, k, v)]
        seen["out"] = kwargs["out"].__array_interface__["data"][0]
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(attnx, "softmax_attention", spy)
    B, n, H, d = 2, 9, 3, 8
    qkv = randn(B, n, 3, H, d, dtype=torch.float32)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)       # (B, H, n, d) views, last axis contiguous
    out = at.scaled_dot_product_attention(q, k, v)
    assert seen["pointers"] == [t.data_ptr() for t in (q, k, v)]
    assert seen["out"] == out.data_ptr()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=2e-5, atol=2e-6)
    # a non-contiguous last axis is copied (by attnx) and still right
    qt = randn(B, H, d, n, dtype=torch.float32).transpose(-1, -2)
    torch.testing.assert_close(at.scaled_dot_product_attention(qt, k, v),
                               F.scaled_dot_product_attention(qt, k, v), rtol=2e-5, atol=2e-6)


def test_bool_bias_is_refused():
    q = randn(2, 4, 8, grad=False)
    with pytest.raises(TypeError, match="bias must be floating point"):
        at.softmax_attention(q, q, q, bias=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be bool"):
        at.softmax_attention(q, q, q, mask=torch.ones(4, 4, dtype=torch.float64))
