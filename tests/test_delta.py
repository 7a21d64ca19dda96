"""attnx.delta_rule_attention and its backward (csrc/delta.c) against the
token-by-token numpy reference (attnx/reference.py), a float64 torch
recurrence under autograd, transformers' own torch functions, and the
properties the chunk form must keep."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import attnx
from attnx.reference import delta_rule as reference

RTOL64 = 1e-10


def make(rng, H=2, n=23, dk=8, dv=5, gate="scalar", dtype=np.float64):
    q = rng.standard_normal((H, n, dk))
    k = rng.standard_normal((H, n, dk))
    v = rng.standard_normal((H, n, dv))
    beta = rng.uniform(0, 1, (H, n))
    g = {None: None, "scalar": -rng.uniform(0, 0.5, (H, n)),
         "channel": -rng.uniform(0, 0.5, (H, n, dk))}[gate]
    cast = (lambda x: x if x is None else x.astype(dtype))
    return [cast(x) for x in (q, k, v, beta, g)]


def close(a, b, rtol=RTOL64):
    scale = max(np.abs(b).max(), 1e-300) if np.size(b) else 1
    np.testing.assert_allclose(a, b, rtol=0, atol=rtol * scale)


@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("method,chunk", [("recurrent", 64), ("chunk", 64), ("chunk", 5)])
def test_matches_reference(gate, l2, method, chunk):
    rng = np.random.default_rng(0)
    q, k, v, beta, g = make(rng, gate=gate)
    S0 = rng.standard_normal((2, 8, 5))
    ref, S_ref = reference(q, k, v, beta, g, qk_l2norm=l2, initial_state=S0)
    out, state = attnx.delta_rule_attention(q, k, v, beta, g, qk_l2norm=l2, initial_state=S0,
                                            method=method, chunk=chunk, return_state=True)
    close(out, ref)
    close(state.S, S_ref)


def test_scale_and_float32():
    rng = np.random.default_rng(1)
    q, k, v, beta, g = make(rng, n=70, dk=16, dv=16)
    ref, _ = reference(q, k, v, beta, g, scale=0.3, qk_l2norm=True)
    out = attnx.delta_rule_attention(*(x.astype(np.float32) for x in (q, k, v, beta, g)),
                                     scale=0.3, qk_l2norm=True)
    assert out.dtype == np.float32
    close(out, ref, 1e-5)
    out16 = attnx.delta_rule_attention(*(x.astype(np.float16) for x in (q, k, v, beta, g)),
                                       qk_l2norm=True)
    assert out16.dtype == np.float16


gates = st.sampled_from([None, "scalar", "channel"])


@settings(max_examples=30, deadline=None)
@given(n=st.integers(0, 40), chunk=st.integers(1, 70), gate=gates, l2=st.booleans(),
       seed=st.integers(0, 2**16))
def test_chunk_equals_recurrent(n, chunk, gate, l2, seed):
    rng = np.random.default_rng(seed)
    q, k, v, beta, g = make(rng, n=n, dk=4, dv=3, gate=gate)
    S0 = rng.standard_normal((2, 4, 3))
    a, sa = attnx.delta_rule_attention(q, k, v, beta, g, qk_l2norm=l2, chunk=chunk,
                                       initial_state=S0, return_state=True)
    b, sb = attnx.delta_rule_attention(q, k, v, beta, g, qk_l2norm=l2, method="recurrent",
                                       initial_state=S0, return_state=True)
    assert a.shape == (2, n, 3)
    close(a, b, 1e-9)
    close(sa.S, sb.S, 1e-9)


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(0, 30), min_size=1, max_size=3), chunk=st.integers(1, 20),
       gate=gates, seed=st.integers(0, 2**16))
def test_pieces_equal_one_call(cuts, chunk, gate, seed):
    rng = np.random.default_rng(seed)
    n = 30
    q, k, v, beta, g = make(rng, n=n, dk=4, dv=3, gate=gate)
    whole, S_whole = attnx.delta_rule_attention(q, k, v, beta, g, qk_l2norm=True, chunk=chunk,
                                                return_state=True)
    bounds = [0] + sorted(cuts) + [n]
    state, pieces = None, []
    for a, b in zip(bounds, bounds[1:]):
        gp = None if g is None else g[:, a:b]
        o, state = attnx.delta_rule_attention(q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b], gp,
                                              qk_l2norm=True, chunk=chunk, initial_state=state,
                                              return_state=True)
        pieces.append(o)
    close(np.concatenate(pieces, axis=1), whole, 1e-12)
    close(state.S, S_whole.S, 1e-12)


def test_step_decodes_in_place():
    rng = np.random.default_rng(2)
    for gate in (None, "scalar", "channel"):
        q, k, v, beta, g = make(rng, n=12, gate=gate)
        whole = attnx.delta_rule_attention(q, k, v, beta, g, qk_l2norm=True)
        _, state = attnx.delta_rule_attention(q[:, :5], k[:, :5], v[:, :5], beta[:, :5],
                                              None if g is None else g[:, :5], qk_l2norm=True,
                                              return_state=True)
        S = state.S
        for t in range(5, 12):
            o = state.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], beta[:, t:t + 1],
                           None if g is None else g[:, t:t + 1])
            close(o, whole[:, t:t + 1], 1e-12)
        assert state.S is S  # updated where it lies


@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
def test_token_loop_on_threads_from_a_strided_state(gate):
    # states big enough (540 KB) for the token loop to split its heads over
    # two threads (a one-token step on attnx's team, several tokens on
    # OpenMP), d_k not a multiple of the 4 rows read at once, and an
    # initial state read in place through a row stride
    rng = np.random.default_rng(6)
    q, k, v, beta, g = make(rng, H=16, n=3, dk=66, dv=64, gate=gate)
    padded = rng.standard_normal((16, 66, 67)) * 0.1
    S0 = padded[:, :, :64]
    original = S0.copy()
    before = attnx.get_num_threads()
    attnx.set_num_threads(2)
    try:
        for n in (1, 3):
            args = [x if x is None else x[:, :n] for x in (q, k, v, beta, g)]
            for _ in range(20):  # past the calls that go to OpenMP before the team
                o, state = attnx.delta_rule_attention(*args, qk_l2norm=True, method="recurrent",
                                                      initial_state=S0, return_state=True)
            ref_o, ref_S = reference(*args, qk_l2norm=True, initial_state=S0)
            close(o, ref_o, 1e-12)
            close(state.S, ref_S, 1e-12)
            stepped = attnx.DeltaRuleState(S0.copy(), qk_l2norm=True)
            close(stepped.step(*args), ref_o, 1e-12)
            close(stepped.S, ref_S, 1e-12)
        np.testing.assert_array_equal(S0, original)
    finally:
        attnx.set_num_threads(before)


@pytest.mark.parametrize("dtype,tol", [(np.float32, 2e-6), (np.float64, 1e-12)])
@pytest.mark.parametrize("dv", [1, 64, 100, 129])
def test_step_over_blocks_of_columns(dtype, tol, dv):
    # a decoding step takes the state's columns in blocks of 256 bytes (64
    # float32 or 32 float64 numbers) and what is left: every block count
    # with and without a rest, from an initial state read through a row
    # stride, then in place
    rng = np.random.default_rng(7)
    q, k, v, beta, g = make(rng, H=3, n=4, dk=17, dv=dv, gate="channel", dtype=dtype)
    S0 = (rng.standard_normal((3, 17, dv + 3)) * 0.1).astype(dtype)[:, :, :dv]
    ref_o, ref_S = reference(q, k, v, beta, g, qk_l2norm=True, initial_state=S0)
    o, state = attnx.delta_rule_attention(q[:, :1], k[:, :1], v[:, :1], beta[:, :1], g[:, :1],
                                          qk_l2norm=True, method="recurrent", initial_state=S0,
                                          return_state=True)
    steps = [o] + [state.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], beta[:, t:t + 1],
                              g[:, t:t + 1]) for t in range(1, 4)]
    assert state.S.dtype == dtype
    close(np.concatenate(steps, axis=1), ref_o, tol)
    close(state.S, ref_S, tol)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 30))
def test_gate_special_cases(seed, n):
    rng = np.random.default_rng(seed)
    q, k, v, beta, g = make(rng, n=n, dk=4, dv=3)
    plain = attnx.delta_rule_attention(q, k, v, beta, qk_l2norm=True, chunk=7)
    close(attnx.delta_rule_attention(q, k, v, beta, np.zeros_like(g), qk_l2norm=True, chunk=7),
          plain, 1e-12)
    channel = np.repeat(g[..., None], 4, axis=-1)
    close(attnx.delta_rule_attention(q, k, v, beta, channel, qk_l2norm=True, chunk=7),
          attnx.delta_rule_attention(q, k, v, beta, g, qk_l2norm=True, chunk=7), 1e-12)


@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
def test_grouped_heads_equal_repeated(gate):
    rng = np.random.default_rng(3)
    B, Hk, G, n, dk, dv = 2, 2, 3, 9, 4, 3
    q = rng.standard_normal((B, Hk, n, dk))
    k = rng.standard_normal((B, Hk, n, dk))
    v = rng.standard_normal((B, Hk * G, n, dv))
    beta = rng.uniform(0, 1, (B, Hk * G, n))
    g = {None: None, "scalar": -rng.uniform(0, 1, (B, Hk * G, n)),
         "channel": -rng.uniform(0, 1, (B, Hk * G, n, dk))}[gate]
    S0 = rng.standard_normal((B, Hk * G, dk, dv))
    rq, rk = np.repeat(q, G, axis=1), np.repeat(k, G, axis=1)
    out, state = attnx.delta_rule_attention(q, k, v, beta, g, initial_state=S0, qk_l2norm=True,
                                            return_state=True, chunk=4)
    ref, ref_state = attnx.delta_rule_attention(rq, rk, v, beta, g, initial_state=S0,
                                                qk_l2norm=True, return_state=True, chunk=4)
    close(out, ref, 1e-13)
    close(state.S, ref_state.S, 1e-13)
    dout = rng.standard_normal(out.shape)
    grads = attnx.delta_rule_attention_backward(dout, q, k, v, beta, g, initial_state=S0,
                                                qk_l2norm=True, chunk=4)
    rgrads = attnx.delta_rule_attention_backward(dout, rq, rk, v, beta, g, initial_state=S0,
                                                 qk_l2norm=True, chunk=4)
    close(grads.q, rgrads.q.reshape(B, Hk, G, n, dk).sum(2), 1e-12)
    close(grads.k, rgrads.k.reshape(B, Hk, G, n, dk).sum(2), 1e-12)
    for name in ("v", "beta", "g", "state"):
        if getattr(rgrads, name) is not None:
            close(getattr(grads, name), getattr(rgrads, name), 1e-12)
    # decoding a grouped state
    _, state = attnx.delta_rule_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], beta[:, :, :5],
                                          None if g is None else g[:, :, :5], initial_state=S0,
                                          qk_l2norm=True, return_state=True)
    o = state.step(q[:, :, 5:6], k[:, :, 5:6], v[:, :, 5:6], beta[:, :, 5:6],
                   None if g is None else g[:, :, 5:6])
    close(o, ref[:, :, 5:6], 1e-12)


def test_strided_broadcast_and_inputs_untouched():
    rng = np.random.default_rng(4)
    B, n, H, dk, dv = 2, 11, 3, 4, 5
    q = rng.standard_normal((B, n, H, dk)).transpose(0, 2, 1, 3)
    k = rng.standard_normal((B, n, H, dk)).transpose(0, 2, 1, 3)
    v = rng.standard_normal((B, n, H, dv)).transpose(0, 2, 1, 3)
    beta = rng.uniform(0, 1, (B, n, H)).transpose(0, 2, 1)
    g = -rng.uniform(0, 1, (B, n, H)).transpose(0, 2, 1)
    copies = [x.copy() for x in (q, k, v, beta, g)]
    out = attnx.delta_rule_attention(q, k, v, beta, g)
    for x, c in zip((q, k, v, beta, g), copies):
        np.testing.assert_array_equal(x, c)
    ref = np.stack([reference(q[b], k[b], v[b], beta[b], g[b])[0] for b in range(B)])
    close(out, ref)
    # k shared by every batch entry (broadcast, stride 0)
    out = attnx.delta_rule_attention(q, k[:1], v, beta, g)
    ref = np.stack([reference(q[b], k[0], v[b], beta[b], g[b])[0] for b in range(B)])
    close(out, ref)
    given_out = np.empty((B, H, n, dv))
    assert attnx.delta_rule_attention(q, k, v, beta, g, out=given_out) is given_out


def test_bad_arguments():
    rng = np.random.default_rng(5)
    q, k, v, beta, g = make(rng)
    with pytest.raises(ValueError, match="method"):
        attnx.delta_rule_attention(q, k, v, beta, method="quadratic")
    with pytest.raises(ValueError, match="chunk"):
        attnx.delta_rule_attention(q, k, v, beta, chunk=0)
    with pytest.raises(TypeError, match="chunk"):
        attnx.delta_rule_attention(q, k, v, beta, chunk=2.5)
    with pytest.raises(ValueError, match="scale"):
        attnx.delta_rule_attention(q, k, v, beta, scale=-1)
    with pytest.raises(ValueError, match="beta"):
        attnx.delta_rule_attention(q, k, v, beta[:, :5])
    with pytest.raises(ValueError, match="g"):
        attnx.delta_rule_attention(q, k, v, beta, g[..., None].repeat(3, -1))
    with pytest.raises(ValueError, match="k"):
        attnx.delta_rule_attention(q, k[..., :3], v, beta)
    with pytest.raises(ValueError, match="initial_state"):
        attnx.delta_rule_attention(q, k, v, beta, initial_state=np.zeros((2, 8, 4)))
    with pytest.raises(ValueError, match="heads"):
        attnx.delta_rule_attention(q[None], k[None], np.zeros((1, 3, 23, 5)), np.zeros((1, 3, 23)))
    with pytest.raises(TypeError, match="q"):
        attnx.delta_rule_attention(q.astype(complex), k, v, beta)
    with pytest.raises(TypeError, match="qk_l2norm"):
        attnx.delta_rule_attention(q, k, v, beta, qk_l2norm="yes")
    with pytest.raises(ValueError, match="overlap"):
        attnx.delta_rule_attention(q, k, v, beta, out=v)


# ---------------------------------------------------------------- gradients

torch = pytest.importorskip("torch")


def torch_recurrence(q, k, v, beta, g, S0, l2, scale=None):
    """the recurrence in torch float64, for autograd"""
    H, n, dk = q.shape
    if l2:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (dk ** -0.5 if scale is None else scale)
    S = S0 if S0 is not None else torch.zeros(H, dk, v.shape[-1], dtype=q.dtype)
    outs = []
    for t in range(n):
        if g is not None:
            a = torch.exp(g[:, t])
            S = S * (a[:, :, None] if a.dim() == 2 else a[:, None, None])
        u = beta[:, t, None] * (v[:, t] - torch.einsum("hkv,hk->hv", S, k[:, t]))
        S = S + k[:, t, :, None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, q[:, t]))
    return torch.stack(outs, 1), S


@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
@pytest.mark.parametrize("l2", [False, True])
@pytest.mark.parametrize("chunk", [64, 6])
def test_gradients_match_autograd(gate, l2, chunk):
    rng = np.random.default_rng(6)
    q, k, v, beta, g = make(rng, n=29, gate=gate)
    S0 = rng.standard_normal((2, 8, 5))
    dout, dS = rng.standard_normal((2, 29, 5)), rng.standard_normal((2, 8, 5))
    leaves = [torch.tensor(x, requires_grad=True) if x is not None else None
              for x in (q, k, v, beta, g, S0)]
    out, S = torch_recurrence(*leaves, l2)
    ((out * torch.tensor(dout)).sum() + (S * torch.tensor(dS)).sum()).backward()
    grads = attnx.delta_rule_attention_backward(dout, q, k, v, beta, g, qk_l2norm=l2, chunk=chunk,
                                                initial_state=S0, grad_state=dS)
    for mine, leaf in zip(grads, leaves):
        if leaf is None:
            assert mine is None
        else:
            close(mine, leaf.grad.numpy(), 1e-11)


@settings(max_examples=15, deadline=None)
@given(cut=st.integers(0, 20), gate=gates, seed=st.integers(0, 2**16))
def test_backward_through_pieces(cut, gate, seed):
    rng = np.random.default_rng(seed)
    n = 20
    q, k, v, beta, g = make(rng, n=n, dk=4, dv=3, gate=gate)
    dout = rng.standard_normal((2, n, 3))
    whole = attnx.delta_rule_attention_backward(dout, q, k, v, beta, g, qk_l2norm=True, chunk=3)
    gp = (lambda a, b: None if g is None else g[:, a:b])
    _, state = attnx.delta_rule_attention(q[:, :cut], k[:, :cut], v[:, :cut], beta[:, :cut],
                                          gp(0, cut), qk_l2norm=True, return_state=True)
    second = attnx.delta_rule_attention_backward(
        dout[:, cut:], q[:, cut:], k[:, cut:], v[:, cut:], beta[:, cut:], gp(cut, n),
        qk_l2norm=True, chunk=3, initial_state=state)
    first = attnx.delta_rule_attention_backward(
        dout[:, :cut], q[:, :cut], k[:, :cut], v[:, :cut], beta[:, :cut], gp(0, cut),
        qk_l2norm=True, chunk=3, grad_state=second.state)
    for name in ("q", "k", "v", "beta", "g"):
        if getattr(whole, name) is None:
            continue
        joined = np.concatenate([getattr(first, name), getattr(second, name)], axis=1)
        close(joined, getattr(whole, name), 1e-11)



def test_vjp():
    rng = np.random.default_rng(7)
    q, k, v, beta, g = make(rng, gate="channel")
    out, pullback = attnx.vjp(attnx.delta_rule_attention, q, k, v, beta, g, qk_l2norm=True,
                              chunk=8)
    dout = rng.standard_normal(out.shape)
    grads = pullback(dout)
    direct = attnx.delta_rule_attention_backward(dout, q, k, v, beta, g, qk_l2norm=True, chunk=8)
    for a, b in zip(grads, direct):
        if b is not None:
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- transformers

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


@pytest.mark.parametrize("n", [1, 50, 130])
def test_matches_transformers_gated_delta_rule(n):
    """transformers' torch functions compute in float32, whatever the input"""
    rng = np.random.default_rng(8)
    B, Hk, G, dk, dv = 1, 2, 2, 16, 8
    q = rng.standard_normal((B, n, Hk, dk)).astype(np.float32)
    k = rng.standard_normal((B, n, Hk, dk)).astype(np.float32)
    v = rng.standard_normal((B, n, Hk * G, dv)).astype(np.float32)
    beta = rng.uniform(0, 1, (B, n, Hk * G)).astype(np.float32)
    g = -rng.uniform(0, 1, (B, n, Hk * G)).astype(np.float32)
    S0 = rng.standard_normal((B, Hk * G, dk, dv)).astype(np.float32)
    T = [torch.from_numpy(x) for x in (q, k, v, g, beta, S0)]
    heads = (lambda x: x.swapaxes(1, 2))
    out, state = attnx.delta_rule_attention(heads(q), heads(k), heads(v), heads(beta), heads(g),
                                            qk_l2norm=True, initial_state=S0, return_state=True)
    for fn in (qwen3_next.torch_chunk_gated_delta_rule, qwen3_next.torch_recurrent_gated_delta_rule):
        ref, ref_state = fn(*T[:5], initial_state=T[5], output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
        close(heads(out), ref.numpy(), 2e-5)
        close(state.S, ref_state.numpy(), 2e-5)


def test_matches_transformers_kda():
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    rng = np.random.default_rng(9)
    B, n, H, dk, dv = 1, 70, 2, 16, 8
    q, k = (rng.standard_normal((B, n, H, dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, n, H, dv)).astype(np.float32)
    beta = rng.uniform(0, 1, (B, n, H)).astype(np.float32)
    g = -rng.uniform(0, 1, (B, n, H, dk)).astype(np.float32)
    heads = (lambda x: x.swapaxes(1, 2))
    out, state = attnx.delta_rule_attention(heads(q), heads(k), heads(v), heads(beta), heads(g),
                                            qk_l2norm=True, return_state=True)
    T = [torch.from_numpy(x) for x in (q, k, v, g, beta)]
    for fn in (kimi.chunk_kimi_delta_attention, kimi.recurrent_kimi_delta_attention):
        ref, ref_state = fn(*T, initial_state=None, output_final_state=True,
                            use_qk_l2norm_in_kernel=True)
        close(heads(out), ref.numpy(), 2e-5)
        close(state.S, ref_state.numpy(), 2e-5)
