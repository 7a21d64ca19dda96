"""attnx.torch's operators for the other systems (attnx/torch/_systems.py,
_dwc.py and _multihead.py): rotary and the sinusoidal table, block-sparse, pooled and Linformer
attention, FLatten's depthwise convolution, and MultiheadAttention, against
the numpy functions, against torch formulations differentiated by torch's
autograd, and torch.nn.MultiheadAttention; opcheck and gradcheck."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import attnx  # noqa: E402
import attnx.torch as at  # noqa: E402
from helpers import grads_of, hypothesis_settings  # noqa: E402

TOL = {torch.float64: dict(rtol=1e-11, atol=1e-12), torch.float32: dict(rtol=2e-5, atol=5e-6)}


def randn(*shape, dtype=torch.float64, grad=True, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, dtype=dtype, generator=g) * scale).requires_grad_(grad)


def assert_close(actual, expected, dtype=torch.float64):
    torch.testing.assert_close(actual, expected, **TOL[dtype])


def assert_matches(reference, inputs, dout, out, grads, dtype=torch.float64):
    """out and the gradients `grads` of `inputs` equal those of the
    `reference` (a gradient None where the reference's is None)"""
    want, want_grads = grads_of(reference, inputs, dout)
    assert_close(out, want, dtype)
    for ours, theirs in zip(grads, want_grads):
        if theirs is None:
            assert ours is None
        else:
            assert ours.dtype == theirs.dtype
            assert_close(ours, theirs, dtype)


def numpy(t):
    return t.detach().numpy()


def expanded_mask(layout, bs, n, m):
    return torch.kron(layout.to(torch.int8), torch.ones(bs, bs, dtype=torch.int8)).bool()[..., :n, :m]


# ---------------------------------------------------------------- positions

@pytest.mark.parametrize("n, d, base", [(7, 6, 10000), (5, 5, 100.0), (1, 1, 10000), (0, 4, 10)])
def test_sinusoidal_positions_match_numpy(n, d, base):
    got = at.sinusoidal_positions(n, d, base)
    assert got.dtype == torch.float64 and got.shape == (n, d)
    np.testing.assert_allclose(got.numpy(), attnx.sinusoidal_positions(n, d, base), rtol=1e-13, atol=1e-13)
    assert at.sinusoidal_positions(n, d, base, dtype=torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="base"):
        at.sinusoidal_positions(3, 4, base=0)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("positions", [None, "explicit"])
def test_rotary_matches_numpy_and_torch_formula(interleaved, positions):
    x = randn(2, 3, 6, 8, seed=1)
    pos = None if positions is None else torch.tensor([[5, 0, 2, 9, 1, 3]]).expand(3, 6)
    got = at.rotary(x, pos, base=500.0, interleaved=interleaved)
    want = attnx.rotary(numpy(x), None if pos is None else pos.numpy(), 500.0, interleaved)
    np.testing.assert_allclose(numpy(got), want, rtol=1e-13, atol=1e-13)
    # a torch formulation by complex multiplication, differentiated by autograd
    p = torch.arange(6.0, dtype=torch.float64) if pos is None else pos.to(torch.float64)
    theta = p[..., None] * 500.0 ** (-2.0 * torch.arange(4, dtype=torch.float64) / 8)

    def reference():
        a, b = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :4], x[..., 4:])
        z = torch.complex(a, b) * torch.polar(torch.ones_like(theta), theta)
        if interleaved:
            return torch.stack([z.real, z.imag], -1).flatten(-2)
        return torch.cat([z.real, z.imag], -1)

    dout = randn(2, 3, 6, 8, grad=False, seed=2)
    got, (grad,) = grads_of(lambda: at.rotary(x, pos, 500.0, interleaved), [x], dout)
    want, (want_grad,) = grads_of(reference, [x], dout)
    assert_close(got, want)
    assert_close(grad, want_grad)


def test_rotary_gradcheck_opcheck_and_double_backward():
    x = randn(2, 5, 4, seed=3)
    pos = torch.tensor([3, 1, 4, 1, 5])
    assert torch.autograd.gradcheck(lambda x: at.rotary(x, pos, interleaved=True), (x,))
    assert torch.autograd.gradgradcheck(lambda x: at.rotary(x), (x,))
    torch.library.opcheck(torch.ops.attnx.rotary.default, (x, None, 10000.0, False))
    torch.library.opcheck(torch.ops.attnx.rotary.default, (x, pos, 77.0, True))
    torch.library.opcheck(torch.ops.attnx.rotary_backward.default, (x, pos, 77.0, False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rotary_dtypes(dtype):
    x = randn(3, 6, 8, seed=4).detach().to(dtype).requires_grad_()
    out = at.rotary(x)
    assert out.dtype == dtype
    want = attnx.rotary(x.detach().float().numpy())
    np.testing.assert_allclose(out.detach().float().numpy(), want, rtol=1e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-6, atol=1e-2 if dtype != torch.float32 else 1e-6)
    out.sum().backward()
    assert x.grad.dtype == dtype


def test_rotary_bad_arguments():
    with pytest.raises(ValueError, match="d even"):
        at.rotary(torch.ones(3, 5))
    with pytest.raises(ValueError, match="must broadcast"):
        at.rotary(torch.ones(3, 4), positions=torch.arange(4))
    with pytest.raises(TypeError, match="floating point"):
        at.rotary(torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="positions must hold"):
        at.rotary(torch.ones(3, 4), positions=torch.ones(3, dtype=torch.bool))


# ------------------------------------------------------------ block-sparse

def dense_reference(q, k, v, visible, bias=None, scale=None):
    """Softmax attention under a boolean mask, by torch operations."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q @ k.transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~visible, float("-inf"))
    w = torch.softmax(scores, -1).nan_to_num(0.0)
    return w @ v


@pytest.mark.parametrize("n, m, bs", [(12, 12, 4), (10, 13, 3), (5, 5, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_block_sparse_matches_numpy_and_dense_autograd(n, m, bs, causal):
    q, k, v = randn(2, 3, n, 4, seed=5), randn(2, 3, m, 4, seed=6), randn(2, 3, m, 5, seed=7)
    bias = randn(n, m, seed=8)
    g = torch.Generator().manual_seed(9)
    layout = torch.rand(3, -(-n // bs), -(-m // bs), generator=g) < 0.6
    layout[..., 0] = True
    dout = randn(2, 3, n, 5, grad=False, seed=10)
    out, grads = grads_of(lambda: at.block_sparse_attention(q, k, v, layout, bs, causal=causal, bias=bias),
                          [q, k, v, bias], dout)
    np.testing.assert_allclose(numpy(out), attnx.block_sparse_attention(
        numpy(q), numpy(k), numpy(v), layout.numpy(), bs, causal=causal, bias=numpy(bias)), rtol=1e-13, atol=1e-13)
    visible = expanded_mask(layout, bs, n, m)
    if causal:
        visible = visible & torch.ones(n, m, dtype=torch.bool).tril(m - n)
    assert_matches(lambda: dense_reference(q, k, v, visible, bias), [q, k, v, bias], dout, out, grads)


def test_block_sparse_gradcheck_and_opcheck():
    q, k, v = randn(2, 6, 3, seed=11), randn(2, 7, 3, seed=12), randn(2, 7, 2, seed=13)
    bias = randn(6, 7, seed=14)
    layout = torch.tensor([[True, False, True], [True, True, False]])
    assert torch.autograd.gradcheck(
        lambda q, k, v, b: at.block_sparse_attention(q, k, v, layout, 3, bias=b, window=(4, None)),
        (q, k, v, bias))
    mask = torch.rand(2, 1, 7, generator=torch.Generator().manual_seed(0)) > 0.3
    args = (q, k, v, layout, None, None, mask, bias, "block_sparse", 3, "mean", 0.7, "lower_right",
            None, 0.0, None)
    torch.library.opcheck(torch.ops.attnx.softmax_system.default, args)


def test_block_sparse_layout_from_attnx_layouts_and_float32():
    q, k, v = (randn(2, 32, 8, dtype=torch.float32, seed=s) for s in (15, 16, 17))
    layout = attnx.layouts.longformer(4, 1, [0])
    got = at.block_sparse_attention(q, k, v, layout, 8, causal=True)
    want = attnx.block_sparse_attention(numpy(q), numpy(k), numpy(v), layout, 8, causal=True)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(numpy(got), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="boolean"):
        at.block_sparse_attention(q, k, v, layout.astype(np.int8), 8)


# ------------------------------------------------------------------ pooled

def torch_pool(x, stride, mode):
    """Pooling along axis -2 by torch's own pooling (ceil mode for the last
    window: mean over what remains)."""
    lead, m, c = x.shape[:-2], x.shape[-2], x.shape[-1]
    flat = x.reshape(-1, m, c).transpose(1, 2)
    if mode == "mean":
        pooled = torch.cat([flat[..., i:i + stride].mean(-1, keepdim=True) for i in range(0, m, stride)], -1)
    else:
        pooled = F.max_pool1d(flat, stride, stride, ceil_mode=True)
    return pooled.transpose(1, 2).reshape(lead + (pooled.shape[-1], c))


@pytest.mark.parametrize("mode", ["mean", "max"])
@pytest.mark.parametrize("m, stride", [(12, 3), (11, 4), (5, 1)])
def test_pooled_matches_numpy_and_torch_pooling(mode, m, stride):
    q, k, v = randn(2, 2, 7, 4, seed=18), randn(2, 2, m, 4, seed=19), randn(2, 2, m, 3, seed=20)
    mp = -(-m // stride)
    bias = randn(7, mp, seed=21)
    dout = randn(2, 2, 7, 3, grad=False, seed=22)
    out, grads = grads_of(lambda: at.pooled_attention(q, k, v, stride, mode, bias=bias, causal=True),
                          [q, k, v, bias], dout)
    np.testing.assert_allclose(numpy(out), attnx.pooled_attention(
        numpy(q), numpy(k), numpy(v), stride, mode, bias=numpy(bias), causal=True), rtol=1e-13, atol=1e-13)
    visible = torch.ones(7, mp, dtype=torch.bool).tril(mp - 7)
    assert_matches(
        lambda: dense_reference(q, torch_pool(k, stride, mode), torch_pool(v, stride, mode), visible, bias),
        [q, k, v, bias], dout, out, grads)


def test_pooled_gradcheck_opcheck_and_errors():
    q, k, v = randn(2, 5, 3, seed=23), randn(2, 9, 3, seed=24), randn(2, 9, 2, seed=25)
    assert torch.autograd.gradcheck(lambda q, k, v: at.pooled_attention(q, k, v, 2), (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: at.pooled_attention(q, k, v, 4, "max"), (q, k, v))
    args = (q, k, v, None, None, None, None, None, "pooled", 4, "max", None, "none", [1], 0.0, None)
    torch.library.opcheck(torch.ops.attnx.softmax_system.default, args)
    with pytest.raises(ValueError, match="mode must be"):
        at.pooled_attention(q, k, v, 2, "median")
    with pytest.raises(ValueError, match="stride"):
        at.pooled_attention(q, k, v, 0)


def test_pooled_and_linformer_dropout_repeatable_and_differentiable():
    q, k, v = randn(2, 6, 4, seed=26), randn(2, 8, 4, seed=27), randn(2, 8, 3, seed=28)
    E = randn(5, 8, seed=29, scale=0.3)
    for call in (lambda q, k, v: at.pooled_attention(q, k, v, 2, dropout_p=0.3, seed=4),
                 lambda q, k, v: at.linformer_attention(q, k, v, E, dropout_p=0.3, seed=4)):
        a, b = call(q, k, v), call(q, k, v)
        assert torch.equal(a, b)
        assert torch.autograd.gradcheck(call, (q, k, v))


# --------------------------------------------------------------- Linformer

@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_linformer_matches_torch_autograd(shared, dtype):
    q, k, v = (randn(2, 3, 7, 4, dtype=dtype, seed=30), randn(2, 3, 10, 4, dtype=dtype, seed=31),
               randn(2, 3, 10, 5, dtype=dtype, seed=32))
    E, Fp = randn(3, 4, 10, dtype=dtype, seed=33, scale=0.3), randn(4, 10, dtype=dtype, seed=34, scale=0.3)
    bias = randn(7, 4, dtype=dtype, seed=35)
    dout = randn(2, 3, 7, 5, dtype=dtype, grad=False, seed=36)
    inputs = [q, k, v, E, Fp, bias]
    out, grads = grads_of(lambda: at.linformer_attention(q, k, v, E, None if shared else Fp, bias=bias),
                          inputs, dout)
    assert_matches(lambda: F.scaled_dot_product_attention(
        q, E @ k, (E if shared else Fp) @ v, attn_mask=bias), inputs, dout, out, grads, dtype)
    if dtype == torch.float64:
        np.testing.assert_allclose(numpy(out), attnx.linformer_attention(
            numpy(q), numpy(k), numpy(v), numpy(E), None if shared else numpy(Fp), bias=numpy(bias)),
            rtol=1e-13, atol=1e-13)


def test_linformer_gradcheck_opcheck_and_errors():
    q, k, v = randn(2, 4, 3, seed=37), randn(2, 6, 3, seed=38), randn(2, 6, 2, seed=39)
    E, Fp = randn(3, 6, seed=40, scale=0.4), randn(3, 6, seed=41, scale=0.4)
    assert torch.autograd.gradcheck(lambda q, k, v, E, Fp: at.linformer_attention(q, k, v, E, Fp, causal=True),
                                    (q, k, v, E, Fp))
    assert torch.autograd.gradcheck(lambda E: at.linformer_attention(q, k, v, E), (E,))
    for args in [(q, k, v, None, E, Fp, None, None, "linformer", 1, "mean", None, "none", None, 0.0, None),
                 (q, k, v, None, E, None, None, randn(4, 3, seed=42), "linformer", 1, "mean", 0.5,
                  "upper_left", None, 0.0, None)]:
        torch.library.opcheck(torch.ops.attnx.softmax_system.default, args)
    with pytest.raises(ValueError, match=r"E must be a tensor of shape \(..., r, m\) with m = 6"):
        at.linformer_attention(q, k, v, torch.ones(3, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="needs the projection E"):
        at.linformer_attention(q, k, v, None)


# ------------------------------------------------ FLatten's convolution

@pytest.mark.parametrize("spatial, kernel", [(None, (3,)), ((3, 4), (3, 3)), ((2, 6), (1, 5))])
def test_focused_dwc_matches_torch_convolution(spatial, kernel):
    n, e = 12, 4
    q, k, v = randn(2, n, 3, seed=43), randn(2, n, 3, seed=44), randn(2, n, e, seed=45)
    weight = randn(e, *kernel, seed=46)
    dout = randn(2, n, e, grad=False, seed=47)
    inputs = [q, k, v, weight]
    out, grads = grads_of(lambda: at.focused_linear_attention(q, k, v, 2, causal=True, dwc_weight=weight,
                                                              spatial=spatial), inputs, dout)

    def reference():
        x = v.reshape(2, *(spatial or (n,)), e).movedim(-1, 1)
        conv = F.conv1d if spatial is None else F.conv2d
        term = conv(x, weight.unsqueeze(1), padding=tuple(s // 2 for s in kernel), groups=e)
        return at.focused_linear_attention(q, k, v, 2, causal=True) + term.movedim(1, -1).reshape(2, n, e)

    assert_matches(reference, inputs, dout, out, grads)
    np.testing.assert_allclose(numpy(out), attnx.focused_linear_attention(
        numpy(q), numpy(k), numpy(v), 2, causal=True, dwc_weight=numpy(weight), spatial=spatial),
        rtol=1e-12, atol=1e-12)


def test_focused_dwc_gradcheck_opcheck_and_errors():
    q, k, v = randn(2, 6, 3, seed=48), randn(2, 6, 3, seed=49), randn(2, 6, 2, seed=50)
    weight = randn(2, 3, seed=51)
    assert torch.autograd.gradcheck(lambda v, w: at.focused_linear_attention(q, k, v, dwc_weight=w),
                                    (v, weight))
    torch.library.opcheck(torch.ops.attnx.depthwise_convolution.default, (v, weight, None))
    torch.library.opcheck(torch.ops.attnx.depthwise_convolution.default, (v, randn(2, 1, 3, seed=52), [2, 3]))
    with pytest.raises(ValueError, match="spatial is given but dwc_weight is None"):
        at.focused_linear_attention(q, k, v, spatial=(2, 3))
    with pytest.raises(ValueError, match="n must equal m"):
        at.focused_linear_attention(q[:, :4], k, v, dwc_weight=weight)
    np.testing.assert_allclose(numpy(at.focused_linear_attention(q, k, v)),
                               attnx.focused_linear_attention(numpy(q), numpy(k), numpy(v)), rtol=1e-12, atol=1e-13)


# ------------------------------------------------------ MultiheadAttention

def copy_from_torch(layer, E):
    """An at.MultiheadAttention with the weights of nn.MultiheadAttention `layer`."""
    ours = at.MultiheadAttention(E, layer.num_heads, dtype=layer.in_proj_weight.dtype)
    with torch.no_grad():
        for i, proj in enumerate((ours.q_proj, ours.k_proj, ours.v_proj)):
            proj.weight.copy_(layer.in_proj_weight[i * E:(i + 1) * E])
            proj.bias.copy_(layer.in_proj_bias[i * E:(i + 1) * E])
        ours.out_proj.weight.copy_(layer.out_proj.weight)
        ours.out_proj.bias.copy_(layer.out_proj.bias)
    return ours


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cross", [False, True])
def test_multihead_equals_torch_multihead_attention(dtype, causal, cross):
    E, H, n, B = 16, 4, 9, 3
    torch.manual_seed(0)
    layer = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=dtype)
    ours = copy_from_torch(layer, E)
    m = 11 if cross else n
    x = randn(B, n, E, dtype=dtype, seed=53)
    kv = randn(B, m, E, dtype=dtype, seed=54) if cross else x
    val = randn(B, m, E, dtype=dtype, seed=55) if cross else x
    padding = torch.zeros(B, m, dtype=torch.bool)
    padding[1, 6:] = True
    padding[2, 3:5] = True
    # is_causal is torch's upper-left rule: query i sees keys j <= i
    causal_mask = torch.ones(n, m, dtype=torch.bool).triu(1) if causal else None
    dout = randn(B, n, E, dtype=dtype, grad=False, seed=56)
    inputs = [x, kv, val] if cross else [x]
    out, grads = grads_of(lambda: ours(x, kv, val, key_padding_mask=padding, is_causal=causal),
                          inputs + list(ours.parameters()), dout)
    want, want_grads = grads_of(lambda: layer(x, kv, val, key_padding_mask=padding, attn_mask=causal_mask,
                                              need_weights=False)[0], inputs + list(layer.parameters()), dout)
    assert_close(out, want, dtype)
    for a, b in zip(grads[:len(inputs)], want_grads[:len(inputs)]):
        assert_close(a, b, dtype)
    ours_grads = dict(zip([name for name, _ in ours.named_parameters()], grads[len(inputs):]))
    theirs = dict(zip([name for name, _ in layer.named_parameters()], want_grads[len(inputs):]))
    packed_w = torch.cat([ours_grads[f"{p}_proj.weight"] for p in "qkv"])
    packed_b = torch.cat([ours_grads[f"{p}_proj.bias"] for p in "qkv"])
    assert_close(packed_w, theirs["in_proj_weight"], dtype)
    assert_close(packed_b, theirs["in_proj_bias"], dtype)
    assert_close(ours_grads["out_proj.weight"], theirs["out_proj.weight"], dtype)
    assert_close(ours_grads["out_proj.bias"], theirs["out_proj.bias"], dtype)


def torch_gqa_layer(module, x, causal):
    """The grouped-query layer written with torch's SDPA (enable_gqa)."""
    B, n, _ = x.shape
    H, Hkv, hd = module.num_heads, module.num_kv_heads, module.head_dim
    q = module.q_proj(x).view(B, n, H, hd).transpose(1, 2)
    k = module.k_proj(x).view(B, n, Hkv, hd).transpose(1, 2)
    v = module.v_proj(x).view(B, n, Hkv, hd).transpose(1, 2)
    if module.positions == "rotary":
        q, k = rotate_half_reference(q), rotate_half_reference(k)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    return module.out_proj(y.transpose(1, 2).reshape(B, n, H * hd))


def rotate_half_reference(x):
    """Llama's rotate-half RoPE at positions 0..n-1 along -2, in torch."""
    n, d = x.shape[-2], x.shape[-1]
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("positions", [None, "rotary"])
def test_multihead_grouped_query_matches_sdpa_enable_gqa(positions):
    torch.manual_seed(1)
    module = at.MultiheadAttention(24, 6, num_kv_heads=2, positions=positions, dtype=torch.float64)
    x = randn(2, 10, 24, seed=57)
    dout = randn(2, 10, 24, grad=False, seed=58)
    params = [x] + list(module.parameters())
    assert module.k_proj.weight.shape == (8, 24)
    out, grads = grads_of(lambda: module(x, is_causal=True), params, dout)
    assert_matches(lambda: torch_gqa_layer(module, x, True), params, dout, out, grads)


def numpy_layer_arguments(module):
    w = {p: getattr(module, f"{p}_proj").weight.detach().numpy().T for p in "qkvo" if p != "o"}
    w["o"] = module.out_proj.weight.detach().numpy().T
    b = {p: getattr(module, f"{p}_proj").bias.detach().numpy() for p in "qkv"}
    b["o"] = module.out_proj.bias.detach().numpy()
    return (w["q"], w["k"], w["v"], w["o"], module.num_heads), dict(
        b_q=b["q"], b_k=b["k"], b_v=b["v"], b_o=b["o"], num_kv_heads=module.num_kv_heads)


VARIANTS = [
    ("softmax", dict(scale=0.4), True),
    ("gaussian", dict(sigma=1.5), True),
    ("linear", dict(feature_map="relu"), True),
    ("cosformer", {}, True),
    ("focused", dict(p=2), True),
    ("taylor", {}, True),
    ("performer", dict(projection=attnx.random_features(6, 4, seed=3)), True),
    ("efficient", {}, True),
    ("block_sparse", dict(layout=np.tril(np.ones((3, 3), bool)), block_size=4), True),
    ("pooled", dict(stride=3), False),
    ("linformer", dict(E=np.random.default_rng(5).standard_normal((4, 12)) / 4), False),
]


@pytest.mark.parametrize("variant, options, padding", VARIANTS)
@pytest.mark.parametrize("positions", [None, "sinusoidal", "rotary"])
def test_multihead_every_variant_matches_the_numpy_layer(variant, options, padding, positions):
    torch.manual_seed(2)
    module = at.MultiheadAttention(16, 4, num_kv_heads=2, variant=variant, positions=positions,
                                   dtype=torch.float64, **options)
    x = randn(2, 12, 16, seed=59, scale=0.5)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[0, 9:] = True
    kwargs = dict(key_padding_mask=pad) if padding else {}
    out = module(x, **kwargs)
    args, np_kwargs = numpy_layer_arguments(module)
    extra = dict(options)
    if padding:
        keep = ~pad.numpy()
        if variant in ("linear", "cosformer", "focused", "taylor", "performer", "efficient"):
            extra["key_mask"] = keep[:, None, :]  # (batch, heads, m)
        else:
            extra["mask"] = keep[:, None, None, :]  # (batch, heads, n, m)
    want = attnx.multi_head_attention(numpy(x), None, *args, variant=variant, positions=positions,
                                      **np_kwargs, **extra)
    np.testing.assert_allclose(numpy(out), want, rtol=1e-11, atol=1e-11)
    out.sum().backward()
    assert all(p.grad is not None for p in module.parameters())


def test_multihead_learned_options_are_parameters_and_buffers():
    layout = attnx.layouts.local(3, 1)
    module = at.MultiheadAttention(8, 2, variant="block_sparse", layout=layout, block_size=4)
    assert dict(module.named_buffers())["layout"].dtype == torch.bool
    E = np.ones((3, 10)) / 10
    module = at.MultiheadAttention(8, 2, variant="linformer", E=E, dtype=torch.float64)
    assert isinstance(module.E, torch.nn.Parameter)
    x = randn(2, 10, 8, seed=60)
    module(x).sum().backward()
    assert module.E.grad is not None and module.E.grad.shape == (3, 10)
    module = at.MultiheadAttention(8, 2, variant="focused", dwc_weight=torch.zeros(4, 3), dtype=torch.float64)
    module(x).sum().backward()
    assert module.dwc_weight.grad.abs().sum() > 0


def test_multihead_dropout_only_in_training():
    torch.manual_seed(3)
    module = at.MultiheadAttention(8, 2, dropout_p=0.5, dtype=torch.float64)
    x = randn(2, 6, 8, seed=61)
    module.eval()
    a, b = module(x), module(x)
    assert torch.equal(a, b)
    module.train()
    torch.manual_seed(0)
    c = module(x)
    assert not torch.allclose(a, c)


def test_multihead_compiles_without_graph_breaks():
    torch.manual_seed(4)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = at.MultiheadAttention(16, 4, num_kv_heads=2, positions="rotary",
                                                   dtype=torch.float64)
            self.cross = at.MultiheadAttention(16, 4, variant="block_sparse", layout=attnx.layouts.local(3, 1),
                                               block_size=4, dtype=torch.float64)

        def forward(self, x, padding):
            y = self.attention(x, key_padding_mask=padding, is_causal=True)
            return self.cross(y, x)

    model = Model()
    x = randn(2, 12, 16, seed=62)
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, 10:] = True
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    dout = randn(2, 12, 16, grad=False, seed=63)
    params = [x] + list(model.parameters())
    out, grads = grads_of(lambda: compiled(x, padding), params, dout)
    assert_matches(lambda: model(x, padding), params, dout, out, grads)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_heads=3), ValueError, r"num_heads \(3\) must divide embed_dim \(8\)"),
    (dict(num_kv_heads=3), ValueError, r"num_kv_heads \(3\) must divide num_heads \(4\)"),
    (dict(variant="nope"), ValueError, "unknown variant"),
    (dict(positions="learned"), ValueError, "positions must be"),
    (dict(return_lse=True), TypeError, "takes no return_lse"),
])
def test_multihead_bad_construction(kwargs, error, match):
    arguments = dict(embed_dim=8, num_heads=4)
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        at.MultiheadAttention(**arguments)


def test_multihead_bad_key_padding_mask():
    module = at.MultiheadAttention(8, 2)
    x = torch.randn(2, 5, 8)
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
        module(x, key_padding_mask=torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"shape \(..., m\) with m = 5"):
        module(x, key_padding_mask=torch.zeros(2, 4, dtype=torch.bool))
    pooled = at.MultiheadAttention(8, 2, variant="pooled", stride=2)
    with pytest.raises(ValueError, match="pooled or projected keys"):
        pooled(x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))


@pytest.mark.parametrize("variant, options, padding", VARIANTS)
def test_multihead_gradients_equal_the_numpy_backward(variant, options, padding):
    """The module's autograd (torch's chain rule around attnx's operators)
    against attnx.multi_head_attention_backward (numpy's), every variant."""
    torch.manual_seed(5)
    module = at.MultiheadAttention(16, 4, num_kv_heads=2, variant=variant, positions="rotary",
                                   dtype=torch.float64, **options)
    x = randn(2, 12, 16, seed=64, scale=0.5)
    dout = randn(2, 12, 16, grad=False, seed=65)
    _, grads = grads_of(lambda: module(x, is_causal=variant not in ("efficient",)), [x] + list(module.parameters()),
                        dout)
    args, np_kwargs = numpy_layer_arguments(module)
    causal = {} if variant == "efficient" else dict(causal="upper_left")
    g = attnx.multi_head_attention_backward(numpy(dout), numpy(x), None, *args, variant=variant, positions="rotary",
                                            **np_kwargs, **options, **causal)
    names = [name for name, _ in module.named_parameters()]
    want = dict(zip(["x"] + names, grads))
    np.testing.assert_allclose(g.x_q, want["x"].numpy(), rtol=1e-10, atol=1e-11)
    for p in "qkv":
        np.testing.assert_allclose(getattr(g, f"w_{p}"), want[f"{p}_proj.weight"].numpy().T, rtol=1e-10, atol=1e-11)
        np.testing.assert_allclose(getattr(g, f"b_{p}"), want[f"{p}_proj.bias"].numpy(), rtol=1e-10, atol=1e-11)
    np.testing.assert_allclose(g.w_o, want["out_proj.weight"].numpy().T, rtol=1e-10, atol=1e-11)
    np.testing.assert_allclose(g.b_o, want["out_proj.bias"].numpy(), rtol=1e-10, atol=1e-11)
    if variant == "linformer":
        np.testing.assert_allclose(g.projection[0], want["E"].numpy(), rtol=1e-10, atol=1e-11)


def test_multihead_per_head_options_match_the_numpy_layer():
    torch.manual_seed(6)
    rng = np.random.default_rng(66)
    mask = rng.random((4, 12, 12)) < 0.7
    mask[..., 0] = True
    layout = rng.random((4, 3, 3)) < 0.6
    layout[..., 0] = True
    x = randn(2, 12, 16, seed=67)
    for variant, options in (("softmax", dict(mask=mask)), ("block_sparse", dict(layout=layout, block_size=4))):
        module = at.MultiheadAttention(16, 4, num_kv_heads=2, variant=variant, dtype=torch.float64, **options)
        args, np_kwargs = numpy_layer_arguments(module)
        want = attnx.multi_head_attention(numpy(x), None, *args, variant=variant, **np_kwargs, **options)
        np.testing.assert_allclose(numpy(module(x)), want, rtol=1e-11, atol=1e-11)
    module = at.MultiheadAttention(16, 4, mask=np.ones((3, 12, 12), bool))
    with pytest.raises(ValueError, match="head axis"):
        module(x.float())


@pytest.mark.parametrize("n, m", [(0, 6), (5, 0)])
def test_systems_empty_inputs(n, m):
    q, k, v = randn(2, n, 4, seed=68), randn(2, m, 4, seed=69), randn(2, m, 3, seed=70)
    layout = torch.ones(max(1, -(-n // 2)), max(1, -(-m // 2)), dtype=torch.bool)
    for call in (lambda: at.block_sparse_attention(q, k, v, layout, 2), lambda: at.pooled_attention(q, k, v, 2),
                 lambda: at.linformer_attention(q, k, v, torch.ones(3, m, dtype=torch.float64))):
        out, grads = grads_of(call, [q, k, v], torch.ones(2, n, 3, dtype=torch.float64))
        assert torch.equal(out, torch.zeros(2, n, 3, dtype=torch.float64))
        assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_systems_half_precision(dtype):
    q, k, v = (randn(2, 8, 4, seed=s).detach() for s in (71, 72, 73))
    E = torch.full((3, 8), 0.2, dtype=torch.float64)
    layout = attnx.layouts.local(4, 1)
    for call in (lambda q, k, v: at.block_sparse_attention(q, k, v, layout, 2),
                 lambda q, k, v: at.pooled_attention(q, k, v, 3, "max"),
                 lambda q, k, v: at.linformer_attention(q, k, v, E.to(q.dtype))):
        half = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = call(*half)
        assert out.dtype == dtype
        want = call(*(t.to(dtype).double() for t in (q, k, v)))
        torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)
        out.sum().backward()
        assert all(t.grad.dtype == dtype for t in half)


def test_systems_save_nothing_without_grad():
    q, k, v = randn(2, 6, 4, seed=74), randn(2, 6, 4, seed=75), randn(2, 6, 3, seed=76)
    with torch.no_grad():
        out = at.pooled_attention(q, k, v, 2)
    assert out.grad_fn is None
    with torch.inference_mode():
        out = at.rotary(q)
    assert out.is_inference()


@hypothesis_settings(25)
@given(heads=st.sampled_from([(1, 1), (2, 1), (4, 2), (6, 3), (3, 3)]), head_dim=st.sampled_from([2, 4]),
       n=st.integers(1, 9), m=st.integers(1, 9), causal=st.booleans(),
       positions=st.sampled_from([None, "rotary", "sinusoidal"]),
       variant=st.sampled_from(["softmax", "gaussian", "linear", "cosformer"]), seed=st.integers(0, 2**16))
def test_multihead_matches_the_numpy_layer_property(heads, head_dim, n, m, causal, positions, variant, seed):
    torch.manual_seed(seed)
    if variant == "cosformer" and causal:
        m = n  # attnx refuses causal cosFormer with n != m (a clear ValueError)
    num_heads, kv_heads = heads
    E = num_heads * head_dim
    module = at.MultiheadAttention(E, num_heads, num_kv_heads=kv_heads, variant=variant, positions=positions,
                                   dtype=torch.float64)
    x, y = randn(2, n, E, seed=seed, scale=0.5), randn(2, m, E, seed=seed + 1, scale=0.5)
    out = module(x, y, is_causal=causal)
    args, np_kwargs = numpy_layer_arguments(module)
    want = attnx.multi_head_attention(numpy(x), numpy(y), *args, variant=variant, positions=positions,
                                      causal="upper_left" if causal else False, **np_kwargs)
    np.testing.assert_allclose(numpy(out), want, rtol=1e-10, atol=1e-11)
    dout = randn(2, n, E, grad=False, seed=seed + 2)
    _, grads = grads_of(lambda: module(x, y, is_causal=causal), [x, y], dout)
    g = attnx.multi_head_attention_backward(numpy(dout), numpy(x), numpy(y), *args, variant=variant,
                                            positions=positions, causal="upper_left" if causal else False,
                                            **np_kwargs)
    np.testing.assert_allclose(g.x_q, grads[0].numpy(), rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(g.x_kv, grads[1].numpy(), rtol=1e-9, atol=1e-10)


# ------------------------------------------- attention_weights of the systems

def softmax_weights(q, keys, visible=None):
    scores = q @ keys.transpose(-1, -2) / keys.shape[-1] ** 0.5
    if visible is None:
        return torch.softmax(scores, -1)
    # a finite fill keeps rows that see nothing finite (attnx gives them 0)
    weights = torch.softmax(scores.masked_fill(~visible, torch.finfo(scores.dtype).min), -1)
    return torch.where(visible, weights, 0)


@pytest.mark.parametrize("causal", [False, True])
def test_system_weights_match_numpy_and_torch_softmax(causal):
    q, k = randn(2, 9, 4, seed=40), randn(2, 11, 4, seed=41)
    layout = torch.tensor([[1, 0, 1], [0, 1, 0], [1, 1, 1]], dtype=torch.bool)
    E = randn(2, 5, 11, seed=42)
    mp = -(-11 // 3)
    cases = {
        "block_sparse": (dict(layout=layout, block_size=4),
                         lambda: softmax_weights(q, k, expanded_mask(layout, 4, 9, 11)
                                                 & torch.ones(9, 11, dtype=torch.bool).tril(2 if causal else 11))),
        "pooled": (dict(stride=3, mode="max"),
                   lambda: softmax_weights(q, torch_pool(k, 3, "max"),
                                           torch.ones(9, mp, dtype=torch.bool).tril(mp - 9 if causal else mp))),
        "linformer": (dict(E=E), lambda: softmax_weights(
            q, E @ k, torch.ones(9, 5, dtype=torch.bool).tril(5 - 9 if causal else 5))),
    }
    for variant, (options, reference) in cases.items():
        inputs = [q, k] + ([E] if variant == "linformer" else [])
        dout = randn(*reference().shape, grad=False, seed=43)
        weights, grads = grads_of(lambda: at.attention_weights(q, k, variant, causal=causal, **options),
                                  inputs, dout)
        numpy_options = {name: numpy(t) if isinstance(t, torch.Tensor) else t for name, t in options.items()}
        np.testing.assert_allclose(numpy(weights), attnx.attention_weights(
            numpy(q), numpy(k), variant, causal=causal, **numpy_options), rtol=1e-12, atol=1e-14)
        assert_matches(reference, inputs, dout, weights, grads)


def test_system_weights_times_values_give_the_output():
    q, k, v = randn(2, 8, 4, seed=44), randn(2, 8, 4, seed=45), randn(2, 8, 3, seed=46)
    E = randn(5, 8, seed=47)
    pooled_v = torch_pool(v, 3, "mean")
    cases = [
        (at.attention_weights(q, q, "lsh", n_buckets=2, chunk=4, seed=3) @ v,
         at.lsh_attention(q, v, 2, chunk=4, seed=3)),
        (at.attention_weights(q, k, "pooled", stride=3) @ pooled_v, at.pooled_attention(q, k, v, 3)),
        (at.attention_weights(q, k, "linformer", E=E, F=E) @ (E @ v), at.linformer_attention(q, k, v, E)),
    ]
    for product, out in cases:
        assert_close(product, out)
    assert torch.autograd.gradcheck(
        lambda q: at.attention_weights(q, q, "lsh", n_buckets=2, chunk=4, causal=True), (q,))
    np.testing.assert_allclose(
        numpy(at.attention_weights(q, q, "lsh", n_buckets=2, chunk=4, causal=True)),
        attnx.attention_weights(numpy(q), numpy(q), "lsh", n_buckets=2, chunk=4, causal=True),
        rtol=1e-12, atol=1e-14)


def test_system_weights_bad_arguments():
    q, k = randn(2, 6, 4, seed=48), randn(2, 6, 4, seed=49)
    with pytest.raises(ValueError, match="pass k = q"):
        at.attention_weights(q, k, "lsh", n_buckets=2)
    with pytest.raises(ValueError, match=r"E must be a tensor of shape \(\.\.\., r, m\)"):
        at.attention_weights(q, k, "linformer")
    with pytest.raises(ValueError, match=r"E must be .* m = 6"):
        at.attention_weights(q, k, "linformer", E=randn(3, 5, seed=50))
    with pytest.raises(TypeError, match="stride must be an integer"):
        at.attention_weights(q, k, "pooled")
    with pytest.raises(ValueError, match="'lsh'"):
        at.attention_weights(q, k, "nonesuch")
