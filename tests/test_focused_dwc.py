"""focused_linear_attention(..., dwc_weight=, spatial=): FLatten's
depthwise-convolution term added to the output, and its gradients, against
torch's depthwise convolutions and autograd of the whole layer."""
import numpy as np
import pytest

import attnx

torch = pytest.importorskip("torch")


def torch_focused(q, k, v, p=3):
    """focused linear attention from its formula, in torch float64"""
    def features(x):
        x = torch.relu(x)
        powered = x**p
        norm_x = x.norm(dim=-1, keepdim=True)
        norm_p = powered.norm(dim=-1, keepdim=True)
        return torch.where(norm_p > 0, norm_x * powered / torch.where(norm_p > 0, norm_p, 1), 0)
    fq, fk = features(q), features(k)
    s = fq @ fk.transpose(-1, -2)
    return (s @ v) / torch.clamp(s.sum(-1, keepdim=True), min=1e-6)


@pytest.mark.parametrize("spatial, kernel", [(None, (3,)), ((4, 6), (3, 5))])
def test_forward_and_gradients_match_torch(spatial, kernel):
    rng = np.random.default_rng(0)
    B, H, n, d, e = 2, 3, 24, 8, 8
    q, k, v = (rng.standard_normal((B, H, n, x)) for x in (d, d, e))
    weight = rng.standard_normal((e,) + kernel)
    out = attnx.focused_linear_attention(q, k, v, dwc_weight=weight, spatial=spatial)
    tq, tk, tv, tw = (torch.tensor(x, requires_grad=True) for x in (q, k, v, weight))
    vv = tv.reshape(B * H, n, e).transpose(1, 2)                    # (B H, e, n)
    if spatial is None:
        conv = torch.nn.functional.conv1d(vv, tw[:, None], padding=kernel[0] // 2, groups=e)
    else:
        conv = torch.nn.functional.conv2d(vv.reshape(B * H, e, *spatial), tw[:, None],
                                          padding=(kernel[0] // 2, kernel[1] // 2), groups=e)
    conv = conv.reshape(B * H, e, n).transpose(1, 2).reshape(B, H, n, e)
    want = torch_focused(tq, tk, tv) + conv
    np.testing.assert_allclose(out, want.detach().numpy(), rtol=1e-10, atol=1e-12)
    dout = rng.standard_normal(out.shape)
    want.backward(torch.tensor(dout))
    g = attnx.focused_linear_attention_backward(dout, q, k, v, dwc_weight=weight, spatial=spatial)
    for got, ref in ((g.q, tq), (g.k, tk), (g.v, tv), (g.projection, tw)):
        np.testing.assert_allclose(got, ref.grad.numpy(), rtol=1e-9, atol=1e-11)
    out_v, pullback = attnx.vjp(attnx.focused_linear_attention, q, k, v, dwc_weight=weight,
                                spatial=spatial)
    np.testing.assert_array_equal(out_v, out)
    np.testing.assert_allclose(pullback(dout).projection, g.projection, rtol=1e-12)


def test_shared_values_get_the_summed_gradient():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 3, 10, 4))
    k, v = rng.standard_normal((2, 1, 10, 4)), rng.standard_normal((2, 1, 10, 4))
    weight = rng.standard_normal((4, 3))
    dout = rng.standard_normal((2, 3, 10, 4))
    g = attnx.focused_linear_attention_backward(dout, q, k, v, dwc_weight=weight)
    v_full = np.broadcast_to(v, (2, 3, 10, 4)).copy()
    k_full = np.broadcast_to(k, (2, 3, 10, 4)).copy()
    g_full = attnx.focused_linear_attention_backward(dout, q, k_full, v_full, dwc_weight=weight)
    np.testing.assert_allclose(g.v, g_full.v.sum(axis=1, keepdims=True), rtol=1e-10, atol=1e-12)


def test_bad_options():
    q = np.ones((1, 6, 4))
    with pytest.raises(ValueError, match="spatial is given but dwc_weight is None"):
        attnx.focused_linear_attention(q, q, q, spatial=(2, 3))
    with pytest.raises(ValueError, match="streaming"):
        attnx.focused_linear_attention(q, q, q, dwc_weight=np.ones((4, 3)), return_state=True)
    with pytest.raises(ValueError):
        attnx.focused_linear_attention(q, q, q, dwc_weight=np.ones((4, 2)))    # even kernel
