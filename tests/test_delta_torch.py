"""attnx.torch's delta rule operators (attnx/torch/_delta.py) against
transformers' torch functions, autograd and torch.compile."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
import attnx.torch as at  # noqa: E402

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def make(B=2, n=19, Hk=2, G=2, dk=8, dv=6, channel=False, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    H = Hk * G
    q = torch.randn(B, n, Hk, dk, dtype=dtype, generator=gen)
    k = torch.randn(B, n, Hk, dk, dtype=dtype, generator=gen)
    v = torch.randn(B, n, H, dv, dtype=dtype, generator=gen)
    g = -torch.rand(B, n, H, *((dk,) if channel else ()), dtype=dtype, generator=gen)
    beta = torch.rand(B, n, H, dtype=dtype, generator=gen)
    S0 = torch.randn(B, H, dk, dv, dtype=dtype, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta, S0)]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("ours,theirs", [
    (at.chunk_gated_delta_rule, "torch_chunk_gated_delta_rule"),
    (at.fused_recurrent_gated_delta_rule, "torch_recurrent_gated_delta_rule")])
def test_gated_delta_rule_matches_transformers_with_gradients(ours, theirs):
    """transformers computes in float32: compare there, gradients included"""
    inputs = make(dtype=torch.float32)
    out, S = ours(*inputs[:5], initial_state=inputs[5], output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
    ((out * out).sum() + (S * S).sum()).backward()
    mine = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    ref, ref_S = getattr(qwen3_next, theirs)(*inputs[:5], initial_state=inputs[5],
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    ((ref * ref).sum() + (ref_S * ref_S).sum()).backward()
    assert rel(out, ref) < 1e-5 and rel(S, ref_S) < 1e-5
    for a, t in zip(mine, inputs):
        assert rel(a, t.grad) < 1e-4


@pytest.mark.parametrize("gate", ["scalar", "channel", None])
@pytest.mark.parametrize("with_state", [True, False])
def test_gradients_one_key_head_per_value_head(gate, with_state):
    """Without grouped heads, every gate kind, with and without an initial
    state: transformers' reference autograd (float32) gives the same
    gradients, in the inputs' shapes; no gate is a gate of zeros there."""
    q, k, v, g, beta, S0 = make(G=1, channel=gate == "channel", dtype=torch.float32, n=70)
    state = S0 if with_state else None
    ours = at.chunk_kda if gate == "channel" else at.chunk_gated_delta_rule
    out, S = ours(q, k, v, None if gate is None else g, beta, initial_state=state,
                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    ((out * out).sum() + (S * S).sum()).backward()
    mine = [t.grad for t in (q, k, v, g, beta, S0)]
    for t in (q, k, v, g, beta, S0):
        t.grad = None
    if gate == "channel":
        kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
        theirs = kimi.chunk_kimi_delta_attention
    else:
        theirs = qwen3_next.torch_chunk_gated_delta_rule
    ref, ref_S = theirs(q, k, v, g * 0 if gate is None else g, beta, initial_state=state,
                        output_final_state=True, use_qk_l2norm_in_kernel=True)
    ((ref * ref).sum() + (ref_S * ref_S).sum()).backward()
    assert rel(out, ref) < 1e-5 and rel(S, ref_S) < 1e-5
    for name, a, t in zip("q k v g beta S0".split(), mine, (q, k, v, g, beta, S0)):
        if (name == "g" and gate is None) or (name == "S0" and not with_state):
            assert a is None
            continue
        assert a.shape == t.shape, name
        assert rel(a, t.grad) < 1e-4, name


def test_kda_matches_transformers():
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    inputs = make(G=1, channel=True, dtype=torch.float32)
    for ours, theirs in ((at.chunk_kda, kimi.chunk_kimi_delta_attention),
                         (at.fused_recurrent_kda, kimi.recurrent_kimi_delta_attention)):
        out, S = ours(*inputs[:5], initial_state=inputs[5], output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
        ref, ref_S = theirs(*inputs[:5], initial_state=inputs[5], output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
        assert rel(out, ref) < 1e-5 and rel(S, ref_S) < 1e-5


@pytest.mark.parametrize("channel", [False, True])
def test_gradcheck(channel):
    inputs = [t.detach()[:1, :7].requires_grad_() if t.dim() > 3 and t.shape[1] == 19
              else t.detach()[:1, :7].requires_grad_() if t.dim() == 3
              else t.detach()[:1].requires_grad_() for t in make(channel=channel, n=19)]
    fn = at.chunk_kda if channel else at.chunk_gated_delta_rule

    def call(q, k, v, g, beta, S0):
        return fn(q, k, v, g, beta, initial_state=S0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True, chunk_size=3)
    assert torch.autograd.gradcheck(call, inputs)


def test_opcheck():
    q, k, v, g, beta, S0 = (t.detach() for t in make(n=9))
    q, k, v, g, beta, S0 = (t.float() for t in (q, k, v, g, beta, S0))
    torch.library.opcheck(torch.ops.attnx.delta_rule.default,
                          (q, k, v, beta, g, S0, 0.3, True, False, 4))


def test_compile_fullgraph_and_half_precision():
    q, k, v, g, beta, S0 = (t.detach().float() for t in make())

    @torch.compile(fullgraph=True)
    def step(q, k, v, g, beta, S0):
        return at.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=S0,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, S = step(q, k, v, g, beta, S0)
    ref, ref_S = at.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=S0,
                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(S, ref_S)
    for dtype in (torch.bfloat16, torch.float16):
        xs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = at.chunk_gated_delta_rule(*xs, g, beta, use_qk_l2norm_in_kernel=True)[0]
        assert out.dtype == dtype
        rounded = at.chunk_gated_delta_rule(*(x.detach().float() for x in xs), g, beta,
                                            use_qk_l2norm_in_kernel=True)[0]
        torch.testing.assert_close(out, rounded.to(dtype))
        out.float().sum().backward()
        assert all(x.grad.dtype == dtype for x in xs)


def test_bad_arguments():
    q, k, v, g, beta, S0 = (t.detach() for t in make())
    with pytest.raises(NotImplementedError, match="cu_seqlens"):
        at.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="query"):
        at.chunk_gated_delta_rule(q[0], k, v, g, beta)
    with pytest.raises(TypeError, match="dtype"):
        at.chunk_gated_delta_rule(q.float(), k, v, g, beta)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_bias,activation", [(True, "silu"), (False, None)])
def test_conv1d_update_equals_transformers(dtype, with_bias, activation):
    original = qwen3_next.causal_conv1d_update
    at.register_delta_rule()
    try:
        ours = qwen3_next.causal_conv1d_update
        assert ours is not original and ours.attnx_replaces is original
        gen = torch.Generator().manual_seed(1)
        D, W = 12, 4
        weight = torch.randn(D, W, dtype=dtype, generator=gen)
        bias = torch.randn(D, dtype=dtype, generator=gen) if with_bias else None
        state = torch.randn(2, D, W, dtype=dtype, generator=gen)
        their_state = state.clone()
        for L in (1, 3):  # a decoding step, then several tokens; x strided as the layers' is
            x = torch.randn(2, L, D, dtype=dtype, generator=gen).transpose(1, 2)
            with torch.no_grad():
                out = ours(x, state, weight, bias, activation)
                ref = original(x, their_state, weight, bias, activation)
            tol = 1e-6 if dtype == torch.float32 else 1e-13
            torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
            assert torch.equal(state, their_state)
        # a call that builds a graph goes to transformers' function
        w = weight.clone().requires_grad_()
        out = ours(x, state.clone(), w, bias, activation)
        assert out.grad_fn is not None
        torch.testing.assert_close(out, original(x, state.clone(), w, bias, activation))
    finally:
        at.unregister_delta_rule()
    assert qwen3_next.causal_conv1d_update is original


def test_calls_without_graph_decline_what_numpy_cannot_view():
    """The shorter path takes tensors through numpy(): a tensor that
    requires grad (under no_grad), one with its negative bit set, and a
    second dtype go the general way, with the same results or its error."""
    q, k, v, g, beta, S0 = (t.detach().float() for t in make(n=5, G=1))
    options = dict(initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want, want_S = at.fused_recurrent_gated_delta_rule(q, k, v, g, beta, **options)
    negated = torch._neg_view(-v)
    assert negated.is_neg()
    for inputs in ((q.clone().requires_grad_(), k, v, g, beta),
                   (q, k, negated, g, beta)):
        with torch.no_grad():
            out, S = at.fused_recurrent_gated_delta_rule(*inputs, **options)
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        torch.testing.assert_close(S, want_S, rtol=0, atol=0)
    with torch.no_grad(), pytest.raises(TypeError, match="dtype"):
        at.fused_recurrent_gated_delta_rule(q, k.double(), v, g, beta, **options)


@pytest.mark.parametrize("op,channel", [(at.chunk_gated_delta_rule, False),
                                        (at.fused_recurrent_gated_delta_rule, False),
                                        (at.chunk_kda, True), (at.fused_recurrent_kda, True)])
@pytest.mark.parametrize("n", [1, 19])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_calls_without_graph_equal_the_differentiable_path(op, channel, n, dtype):
    """A call with nothing to differentiate (a decoding step) takes a
    shorter path: the same results as the operator, with a given scale or
    the default, from a state or from zeros, and inputs untouched."""
    inputs = [t.detach() for t in make(n=n, G=1, channel=channel, dtype=dtype)]
    copies = [t.clone() for t in inputs]
    for options in ({"initial_state": inputs[5]}, {"scale": 0.7}):
        with torch.no_grad():
            out, S = op(*inputs[:5], output_final_state=True, use_qk_l2norm_in_kernel=True,
                        **options)
        differentiable = [t.clone().requires_grad_() for t in inputs]
        if "initial_state" in options:
            options = {"initial_state": differentiable[5]}
        want, want_S = op(*differentiable[:5], output_final_state=True,
                          use_qk_l2norm_in_kernel=True, **options)
        assert out.dtype == dtype and S.dtype == dtype and out.shape == want.shape
        torch.testing.assert_close(out, want.detach(), rtol=0, atol=0)
        torch.testing.assert_close(S, want_S.detach(), rtol=0, atol=0)
    for t, copy in zip(inputs, copies):
        assert torch.equal(t, copy)
    with torch.no_grad():
        assert op(*inputs[:5])[1] is None
