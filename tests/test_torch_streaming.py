"""attnx.torch linear front ends streaming a state (initial_state=,
return_state=True), differentiably: pieces chained through the state equal
one call, outputs and gradients, and the state's own gradient passes
gradcheck."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attnx  # noqa: E402
import attnx.torch as at  # noqa: E402

F64 = dict(rtol=1e-12, atol=1e-12)
W_FIXED = torch.from_numpy(attnx.random_features(7, 3, seed=5))


def randn(*shape, seed, dtype=torch.float64, grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_(grad)


# (name, call(q, k, v, **streaming) with the front end's own options)
FRONT_ENDS = [
    ("linear elu", lambda q, k, v, **s: at.linear_attention(q, k, v, causal=True, **s)),
    ("linear relu chunk 2", lambda q, k, v, **s: at.linear_attention(
        q, k, v, feature_map="relu", causal=True, chunk_size=2, eps=1e-3, **s)),
    ("linear recurrent", lambda q, k, v, **s: at.linear_attention(
        q, k, v, causal=True, method="recurrent", **s)),
    ("linear callable", lambda q, k, v, **s: at.linear_attention(
        q, k, v, feature_map=lambda x: torch.nn.functional.softplus(x) ** 2, causal=True, **s)),
    ("cosformer", lambda q, k, v, **s: at.cosformer_attention(q, k, v, causal=True, M=40, **s)),
    ("focused", lambda q, k, v, **s: at.focused_linear_attention(q, k, v, 2.5, causal=True, **s)),
    ("taylor", lambda q, k, v, **s: at.taylor_attention(q, k, v, causal=True, **s)),
    ("performer", lambda q, k, v, **s: at.performer_attention(q, k, v, W_FIXED, causal=True, **s)),
]
PIECES = [3, 1, 0, 5, 2]      # 11 positions, one empty piece


def streamed(call, q, k, v, pieces, initial_state=None):
    """out over the pieces chained through the state, and the last state"""
    outs, state, start = [], initial_state, 0
    for length in pieces:
        part = slice(start, start + length)
        out, state = call(q[..., part, :], k[..., part, :], v[..., part, :],
                          initial_state=state, return_state=True)
        outs.append(out)
        start += length
    return torch.cat(outs, dim=-2), state


@pytest.mark.parametrize("name,call", FRONT_ENDS, ids=[f[0] for f in FRONT_ENDS])
def test_pieces_equal_one_call_outputs_and_gradients(name, call):
    B, H, n, d, e = 2, 2, sum(PIECES), 3, 4
    q, k, v = randn(B, H, n, d, seed=1), randn(B, H, n, d, seed=2), randn(B, H, n, e, seed=3)
    dout = randn(B, H, n, e, seed=4, grad=False)
    whole = call(q, k, v)
    pieces, state = streamed(call, q, k, v, PIECES)
    torch.testing.assert_close(pieces, whole, **F64)
    assert state.offset == n
    assert state.S.shape[-1] == e and state.S.shape[:-1] == state.z.shape
    expected = torch.autograd.grad(whole, (q, k, v), dout)
    got = torch.autograd.grad(pieces, (q, k, v), dout)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **F64)


def test_state_matches_the_numpy_front_end():
    q, k, v = randn(2, 6, 3, seed=1), randn(2, 6, 3, seed=2), randn(2, 6, 4, seed=3)
    out, state = at.cosformer_attention(q, k, v, causal=True, M=20, return_state=True)
    ref_out, ref_state = attnx.cosformer_attention(*(t.detach().numpy() for t in (q, k, v)),
                                                   causal=True, M=20, return_state=True)
    np.testing.assert_allclose(out.detach().numpy(), ref_out, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(state.S.detach().numpy(), ref_state.S, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(state.z.detach().numpy(), ref_state.z, rtol=1e-13, atol=1e-14)
    assert state.offset == ref_state.offset == 6
    # a numpy state continues a torch call, and the reverse
    q2, k2, v2 = randn(2, 4, 3, seed=4), randn(2, 4, 3, seed=5), randn(2, 4, 4, seed=6)
    from_numpy = at.cosformer_attention(q2, k2, v2, causal=True, M=20, initial_state=ref_state)
    from_torch = at.cosformer_attention(q2, k2, v2, causal=True, M=20, initial_state=state)
    expected = attnx.cosformer_attention(*(t.detach().numpy() for t in (q2, k2, v2)), causal=True,
                                         M=20, initial_state=ref_state)
    np.testing.assert_allclose(from_numpy.detach().numpy(), expected, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(from_torch, from_numpy, **F64)


def test_state_reference_from_the_formula():
    # S = sum_j phi(k_j) v_j^T, z = sum_j phi(k_j) over every key, phi = elu + 1
    q, k, v = randn(3, 5, 2, seed=1), randn(3, 5, 2, seed=2), randn(3, 5, 3, seed=3)
    S0, z0 = randn(3, 2, 3, seed=4), randn(3, 2, seed=5).detach().abs().requires_grad_()
    out, state = at.linear_attention(q, k, v, causal=True, return_state=True,
                                     initial_state=at.LinearAttentionState(S0, z0, 7))
    phi_q, phi_k = (torch.nn.functional.elu(t) + 1 for t in (q, k))
    prefix_S = S0[:, None] + torch.cumsum(phi_k[..., :, None] * v[..., None, :], dim=1)
    prefix_z = z0[:, None] + torch.cumsum(phi_k, dim=1)
    ref = (torch.einsum("bnr,bnre->bne", phi_q, prefix_S)
           / torch.einsum("bnr,bnr->bn", phi_q, prefix_z).clamp_min(1e-6)[..., None])
    torch.testing.assert_close(out, ref, **F64)
    torch.testing.assert_close(state.S, prefix_S[:, -1], **F64)
    torch.testing.assert_close(state.z, prefix_z[:, -1], **F64)
    assert state.offset == 12


@pytest.mark.parametrize("name,call", [FRONT_ENDS[i] for i in (0, 4, 7)],
                         ids=[FRONT_ENDS[i][0] for i in (0, 4, 7)])
def test_gradcheck_through_the_initial_state(name, call):
    q, k, v = randn(2, 4, 3, seed=1), randn(2, 4, 3, seed=2), randn(2, 4, 2, seed=3)
    # a state the front end itself made: its z keeps denominators positive
    _, made = call(randn(2, 3, 3, seed=4, grad=False), randn(2, 3, 3, seed=5, grad=False),
                   randn(2, 3, 2, seed=6, grad=False), return_state=True)
    S0, z0 = made.S.clone().requires_grad_(), made.z.clone().requires_grad_()

    def run(q, k, v, S0, z0):
        out, state = call(q, k, v, initial_state=at.LinearAttentionState(S0, z0, made.offset),
                          return_state=True)
        return out, state.S, state.z

    assert torch.autograd.gradcheck(run, (q, k, v, S0, z0))


def test_learned_projection_gets_its_gradient_through_pieces():
    q, k, v = randn(2, 6, 3, seed=1), randn(2, 6, 3, seed=2), randn(2, 6, 2, seed=3)
    W = W_FIXED.clone().requires_grad_()

    def pieces(W):
        first, state = at.performer_attention(q[:, :2], k[:, :2], v[:, :2], W, causal=True,
                                              return_state=True)
        rest = at.performer_attention(q[:, 2:], k[:, 2:], v[:, 2:], W, causal=True,
                                      initial_state=state)
        return torch.cat([first, rest], dim=1)

    torch.testing.assert_close(pieces(W), at.performer_attention(q, k, v, W, causal=True), **F64)
    assert torch.autograd.gradcheck(pieces, (W,))


def test_half_precision_streams_with_a_float32_state():
    q, k, v = (randn(2, 8, 4, seed=s, dtype=torch.float32).to(torch.bfloat16) for s in (1, 2, 3))
    for t in (q, k, v):
        t.requires_grad_()
    out, state = at.linear_attention(q[:, :5], k[:, :5], v[:, :5], causal=True, return_state=True)
    assert out.dtype == torch.bfloat16 and state.S.dtype == state.z.dtype == torch.float32
    rest = at.linear_attention(q[:, 5:], k[:, 5:], v[:, 5:], causal=True, initial_state=state)
    whole32 = at.linear_attention(*(t.detach().float() for t in (q, k, v)), causal=True)
    # each output is the float32 result rounded once
    torch.testing.assert_close(torch.cat([out, rest], 1).float(), whole32, rtol=2**-8, atol=1e-6)
    grads = torch.autograd.grad(torch.cat([out, rest], 1).float().sum(), (q, k, v))
    assert all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads)


def test_no_grad_saves_nothing_and_state_has_no_graph():
    q, k, v = randn(2, 4, 3, seed=1), randn(2, 4, 3, seed=2), randn(2, 4, 2, seed=3)
    with torch.no_grad():
        out, state = at.linear_attention(q, k, v, causal=True, return_state=True)
    assert out.grad_fn is None and state.S.grad_fn is None and state.z.grad_fn is None
    out, state = at.linear_attention(q, k, v, causal=True, return_state=True)
    assert state.S.grad_fn is not None and state.z.requires_grad


def test_streaming_errors_are_clear():
    q = randn(2, 4, 3, seed=1)
    with pytest.raises(ValueError, match="cannot be combined with initial_state"):
        at.linear_attention(q, q, q, causal=True, window=2, return_state=True)
    with pytest.raises(ValueError, match="cannot be combined with initial_state"):
        at.linear_attention(q, q, q, mask=torch.ones(4, 4, dtype=torch.bool), return_state=True)
    with pytest.raises(TypeError, match="initial_state must be the state"):
        at.linear_attention(q, q, q, causal=True, initial_state=(q, q))
    with pytest.raises(ValueError, match="initial_state.offset must be an int >= 0"):
        at.linear_attention(q, q, q, causal=True,
                            initial_state=at.LinearAttentionState(q[:, :3, :3], q[:, 0], -1))
    with pytest.raises(ValueError, match="fixed M="):
        at.cosformer_attention(q, q, q, causal=True, return_state=True)
    with pytest.raises(TypeError, match="initial_state="):
        at.attention_weights(q, q, "linear", return_state=True)
    _, state = at.linear_attention(q, q, q, causal=True, return_state=True)
    with pytest.raises(ValueError, match="initial_state.S"):
        at.linear_attention(q, q, randn(2, 4, 5, seed=2), causal=True, initial_state=state)


def test_opcheck_streaming_ops():
    q, k, v = randn(2, 4, 3, seed=1), randn(2, 4, 3, seed=2), randn(2, 4, 2, seed=3)
    _, state = at.linear_attention(q.detach(), k.detach(), v.detach(), causal=True,
                                   return_state=True)
    S0, z0 = state.S.requires_grad_(), state.z.requires_grad_()
    key_mask = torch.tensor([[True, False, True, True], [True, True, True, False]])
    for args in [(q, k, v, None, None, None, None, 0, "linear", "elu", "lower_right", None, None,
                  1e-6, 3.0, None),
                 (q, k, v, key_mask, None, S0, z0, 4, "cosformer", "elu", "lower_right", "chunk",
                  2, 1e-6, 3.0, 20.0),
                 (q, k, v, None, W_FIXED.clone().requires_grad_(), None, None, 0, "performer",
                  "favor", "none", None, None, 1e-6, 3.0, None)]:
        if args[8] == "cosformer":
            _, cos_state = at.cosformer_attention(q.detach(), k.detach(), v.detach(), causal=True,
                                                  M=20, return_state=True)
            args = args[:5] + (cos_state.S.requires_grad_(), cos_state.z.requires_grad_()) + args[7:]
        torch.library.opcheck(torch.ops.attnx.linear_attention_state.default, args)


def test_streaming_compiles_without_graph_breaks():
    q, k, v = randn(1, 6, 3, seed=1), randn(1, 6, 3, seed=2), randn(1, 6, 2, seed=3)

    def two_pieces(q, k, v):
        first, state = at.linear_attention(q[:, :4], k[:, :4], v[:, :4], causal=True,
                                           return_state=True)
        rest, state = at.linear_attention(q[:, 4:], k[:, 4:], v[:, 4:], causal=True,
                                          initial_state=state, return_state=True)
        return torch.cat([first, rest], 1).sum() + state.S.sum()

    compiled = torch.compile(two_pieces, fullgraph=True, backend="inductor")
    eager = torch.autograd.grad(two_pieces(q, k, v), (q, k, v))
    traced = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(traced, eager):
        torch.testing.assert_close(a, b, **F64)
