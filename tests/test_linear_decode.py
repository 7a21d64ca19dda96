"""In-place decoding: LinearAttentionState.step (docs/linear.md, streaming).

step() must give what the functional streaming call gives (exactly, but
for the rounding of single-token steps, which hold their keys back from S),
update the state's own arrays, and refuse states it cannot update in place."""

import threading

import numpy as np
import pytest

import attnx
from helpers import assert_close, dispatched, f64, kernels_here, qkv, vscale

import attnx.reference as ref

D = 8
PROJECTION = attnx.random_features(12, D, seed=3)

# (front end, options of the call that makes the state)
MAPS = {
    "elu": (attnx.linear_attention, {}),
    "softmax": (attnx.linear_attention, {"feature_map": "softmax"}),
    "favor": (attnx.linear_attention, {"feature_map": "favor", "projection": PROJECTION}),
    "cosformer": (attnx.cosformer_attention, {"M": 64}),
    "focused": (attnx.focused_linear_attention, {"p": 2}),
    "taylor": (attnx.taylor_attention, {"eps": 1e-3}),
    "performer": (attnx.performer_attention, {"seed": 5}),
    "callable": (attnx.linear_attention, {"feature_map": lambda x: np.logaddexp(x, 0)}),
}


def _split(x, steps):
    bounds = np.cumsum([0] + steps)
    return [x[..., a:b, :] for a, b in zip(bounds[:-1], bounds[1:])]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(MAPS))
@pytest.mark.parametrize("steps", [[1] * 6, [3, 1, 2], [2, 4]], ids=["ones", "mixed", "several"])
def test_step_equals_one_causal_call(name, dtype, steps):
    front, options = MAPS[name]
    rng = np.random.default_rng(len(name))
    n0, n = 5, 5 + sum(steps)
    q, k, v = qkv(rng, (2, 3), n, n, D, 6, dtype)
    whole = front(q, k, v, causal=True, **options)
    out0, state = front(q[..., :n0, :], k[..., :n0, :], v[..., :n0, :], causal=True,
                        return_state=True, **options)
    # the functional path alongside, from a copy of the same state
    _, functional = front(q[..., :n0, :], k[..., :n0, :], v[..., :n0, :], causal=True,
                          return_state=True, **options)
    S, z = state.S, state.z
    pieces = [out0]
    for qs, ks, vs in zip(_split(q[..., n0:, :], steps), _split(k[..., n0:, :], steps),
                          _split(v[..., n0:, :], steps)):
        got = state.step(qs, ks, vs)
        want, functional = front(qs, ks, vs, causal=True, initial_state=functional,
                                 return_state=True, **options)
        if qs.shape[-2] > 1:
            np.testing.assert_array_equal(got, want)  # the same kernel on the same numbers
        else:
            # phi S + (phi . psi) v against phi (S + psi v^T): another rounding
            assert_close(got, want, dtype)
        # S once read holds every key, added in order like the RNN form's
        np.testing.assert_array_equal(state.S, functional.S)
        np.testing.assert_array_equal(state.z, functional.z)
        assert state.offset == functional.offset
        pieces.append(got)
    assert state.S is S and state.z is z  # updated in place, not replaced
    assert state.offset == n
    assert got.dtype == dtype
    assert_close(np.concatenate(pieces, axis=-2), whole, dtype)


HELD = 4  # keys a head holds back from S between its turns


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["elu", "favor", "cosformer", "callable"])
@pytest.mark.parametrize("heads", [1, 3, 11])
def test_single_token_steps_hold_keys_back(name, dtype, heads):
    """Many one-token steps without reading S: every output, and S and z at
    the end, against one call over the whole sequence and the functional
    path; S itself lags by the held keys until it is read."""
    front, options = MAPS[name]
    rng = np.random.default_rng(heads)
    n0, steps = 3, 3 * HELD + 5
    q, k, v = qkv(rng, (heads,), n0 + steps, n0 + steps, D, 16, dtype)
    whole = front(q, k, v, causal=True, **options)
    _, state = front(q[:, :n0], k[:, :n0], v[:, :n0], causal=True, return_state=True, **options)
    _, functional = front(q[:, :n0], k[:, :n0], v[:, :n0], causal=True, return_state=True,
                          **options)
    S = state.S
    pieces = []
    for t in range(n0, n0 + steps):
        got = state.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
        want, functional = front(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], causal=True,
                                 initial_state=functional, return_state=True, **options)
        assert_close(got, want, dtype)
        pieces.append(got)
        # z takes each key at once; S only at a head's turn
        np.testing.assert_array_equal(state.z, functional.z)
    assert_close(np.concatenate(pieces, axis=-2), whole[:, n0:], dtype)
    held = [(steps + h) % HELD if steps > HELD - 1 - h % HELD else steps for h in range(heads)]
    lagging = [h for h in range(heads) if held[h]]
    assert lagging and not np.array_equal(S[lagging], functional.S[lagging])
    assert state.S is S  # reading S adds the held keys, into the same array
    # in the RNN form's order; equal up to fused multiply-adds (the float32
    # AVX-512 kernel always fuses, an -O0 build of the RNN loop never does)
    assert_close(S, functional.S, dtype)
    assert state.offset == functional.offset == n0 + steps


def test_held_keys_survive_every_other_use_of_the_state():
    """Between one-token steps: a functional call from the state, a step of
    several tokens, an assignment of S; each sees or keeps every key."""
    rng = np.random.default_rng(7)
    n = 40
    q, k, v = qkv(rng, (5,), n, n, D, 6, np.float32)
    whole = attnx.linear_attention(q, k, v, causal=True)
    _, state = attnx.linear_attention(q[:, :2], k[:, :2], v[:, :2], causal=True,
                                      return_state=True)
    outs = [state.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]) for t in range(2, 13)]
    # initial_state= reads S through the property: nothing held is lost
    side = attnx.linear_attention(q[:, 13:20], k[:, 13:20], v[:, 13:20], causal=True,
                                  initial_state=state)
    assert_close(side, whole[:, 13:20], np.float32)
    outs += [state.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]) for t in range(13, 18)]
    outs.append(state.step(q[:, 18:21], k[:, 18:21], v[:, 18:21]))  # several tokens
    outs += [state.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]) for t in range(21, 30)]
    assert_close(np.concatenate(outs, axis=-2), whole[:, 2:30], np.float32)
    # assigning S replaces the sum over every key so far, held ones included
    _, restart = attnx.linear_attention(q[:, :30], k[:, :30], v[:, :30], causal=True,
                                        return_state=True)
    state.S = restart.S.copy()
    state.z = restart.z.copy()
    outs = [state.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1]) for t in range(30, n)]
    assert_close(np.concatenate(outs, axis=-2), whole[:, 30:], np.float32)


def test_step_refuses_held_keys_changed_by_hand():
    state = _state()
    state.step(*_token())
    state._pending = (state._pending[0][:, :HELD // 2], state._pending[1])
    with pytest.raises(ValueError, match="by hand"):
        state.step(*_token())
    with pytest.raises(ValueError, match="by hand"):
        state.S
    state = _state()
    state.step(*_token())
    state._tick = 2 ** 62  # would index far outside the held keys
    with pytest.raises(ValueError, match="by hand"):
        state.step(*_token())
    state = _state()
    state.step(*_token())
    state._S = state._S[..., ::2]
    with pytest.raises(ValueError, match="by hand"):
        state.S


def test_step_mutates_the_state_and_out():
    rng = np.random.default_rng(0)
    q, k, v = qkv(rng, (4,), 3, 3, D, 5, np.float32)
    _, state = attnx.linear_attention(q, k, v, causal=True, return_state=True)
    S, z, before = state.S, state.z, state.S.copy()
    out = np.full((4, 1, 5), np.nan, np.float32)
    got = state.step(q[:, :1], k[:, :1], v[:, :1], out=out)
    assert got is out and np.all(np.isfinite(out))
    assert state.S is S and state.z is z and state.offset == 4
    assert not np.array_equal(S, before)  # the caller's reference sees the update
    # the functional path still never writes initial_state
    kept = state.S.copy(), state.z.copy()
    attnx.linear_attention(q, k, v, causal=True, initial_state=state, return_state=True)
    np.testing.assert_array_equal(state.S, kept[0])
    np.testing.assert_array_equal(state.z, kept[1])
    assert state.offset == 4


def test_step_float16_inputs_use_float32_state():
    rng = np.random.default_rng(1)
    q, k, v = qkv(rng, (2,), 4, 4, D, 3, np.float16)
    _, state = attnx.linear_attention(q[:, :3], k[:, :3], v[:, :3], causal=True, return_state=True)
    assert state.S.dtype == np.float32
    got = state.step(q[:, 3:], k[:, 3:], v[:, 3:])
    assert got.dtype == np.float16
    assert_close(got, attnx.linear_attention(q, k, v, causal=True)[:, 3:], np.float16)


def _state(dtype=np.float32, causal=True, lead=(2,), **options):
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, lead, 3, 3, D, 5, dtype)
    return attnx.linear_attention(q, k, v, causal=causal, return_state=True, **options)[1]


def _token(dtype=np.float32, lead=(2,), e=5, d=D):
    rng = np.random.default_rng(3)
    return qkv(rng, lead, 1, 1, d, e, dtype)


@pytest.fixture(params=[False, True], ids=["fresh", "stepped"])
def make_state(request):
    """_state, and for "stepped" one single-token step taken: from the
    second step on, a step whose arrays all fit takes the lean binding
    (py_linear.c, lean_step), which must leave every refusal to the
    general one."""
    def make(*args, **options):
        state = _state(*args, **options)
        if request.param:
            state.step(*_token(state.z.dtype))
            assert state._tick == 1
        return state
    return make


def test_step_refuses_non_causal_state():
    state = _state(causal=False)
    with pytest.raises(ValueError, match="causal"):
        state.step(*_token())


def test_step_refuses_a_state_built_by_hand():
    state = _state()
    hand = attnx.LinearAttentionState(state.S, state.z, state.offset)
    with pytest.raises(ValueError, match="return_state=True"):
        hand.step(*_token())


def test_step_refuses_wrong_shapes(make_state):
    state = make_state()
    with pytest.raises(ValueError):
        state.step(*_token(d=D + 1))  # features of another size
    with pytest.raises(ValueError):
        state.step(*_token(e=6))  # another value size
    with pytest.raises(ValueError, match="batch shape"):
        state.step(*_token(lead=(3, 2)))  # would broadcast the state
    before = state.S.copy(), state.offset
    with pytest.raises(ValueError):
        state.step(*_token(), out=np.empty((2, 1, 4), np.float32))
    np.testing.assert_array_equal(state.S, before[0])
    assert state.offset == before[1]


def test_step_refuses_other_dtypes(make_state):
    state = make_state(np.float32)
    with pytest.raises(TypeError, match="dtype"):
        state.step(*_token(np.float64))
    state.S = state.S.astype(np.float64)
    with pytest.raises(TypeError, match="dtype"):
        state.step(*_token(np.float32))


def test_step_refuses_read_only_or_strided_state(make_state):
    state = make_state()
    state.S.setflags(write=False)
    with pytest.raises(ValueError, match="writeable"):
        state.step(*_token())
    state = make_state()
    state.z = np.asfortranarray(np.stack([state.z, state.z], -1))[..., 0]
    assert not state.z.flags.c_contiguous
    with pytest.raises(ValueError, match="C-contiguous"):
        state.step(*_token())


def test_step_refuses_overlap(make_state):
    state = make_state()
    q, k, v = _token()
    with pytest.raises(ValueError, match="overlap"):
        state.step(q, k, state.S[:, :1, :])  # v read from the state being written
    with pytest.raises(ValueError, match="overlap"):
        state.step(q, k, v, out=state.S[:, :1, :])
    # C-ordered views of the state's own memory, shaped as a token's arrays
    with pytest.raises(ValueError, match="overlap"):
        state.step(q, k, state._S.reshape(-1)[:10].reshape(v.shape))
    with pytest.raises(ValueError, match="overlap"):
        state.step(q, k, v, out=state.z.reshape(-1)[:10].reshape(v.shape))


def test_step_is_repeatable_across_threads():
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, (3,), 70, 70, D, 5, np.float64)
    threads = attnx.get_num_threads()
    results = []
    try:
        for count in (1, 2):
            attnx.set_num_threads(count)
            _, state = attnx.linear_attention(q[:, :2], k[:, :2], v[:, :2], causal=True,
                                              return_state=True)
            out = state.step(q[:, 2:], k[:, 2:], v[:, 2:])  # long: chunk method, segments
            results.append((out, state.S.copy()))
    finally:
        attnx.set_num_threads(threads)
    assert_close(results[0][0], attnx.linear_attention(q, k, v, causal=True)[:, 2:], np.float64)
    assert_close(results[1][0], results[0][0], np.float64)
    assert_close(results[1][1], results[0][1], np.float64)


# Single-token steps of float32 states whose r and e are whole AVX-512
# vectors run through one fused kernel per head on CPUs that have it
# (csrc/mk_decode.h, mk_decode_step_w16): S read in one pass, the held keys'
# terms added in registers, and at a head's turn its held keys added into S
# in the same pass. The decoding family held to its plain kernel set
# (dispatched(decode="plain"), csrc/dispatch.c) runs the general
# path, which must agree, and which every other shape and float64 take.
# The kernel's multiply-adds are fused; an optimised build contracts the
# general path's C loops into fused ones too, so both give the same S, z
# and features bit for bit. An -O0 build (ATTNX_DEBUG=1, the sanitizer run)
# rounds each product of the C loops apart: there they agree to float32.
OPTIMIZED = attnx._C.build_info()["optimized"]


def assert_same_sums(got, want):
    if OPTIMIZED:
        np.testing.assert_array_equal(got, want)
    else:
        assert_close(got, want, np.float32, vscale(want))


# the decoding family's kernel sets on this CPU, best first (plain last)
DECODE_KERNELS = kernels_here("decode")
# those with kernels (AVX-512, AVX2, NEON: csrc/mk_decode.h at each width);
# plain alone where there are none
KERNEL_SETS = [name for name in DECODE_KERNELS if name != "plain"] or ["plain"]
_held = {"set": KERNEL_SETS[0]}


@pytest.fixture(params=KERNEL_SETS)
def kernel_set(request):
    """Each kernel set of the decoding family here: decode_kernel(True)
    holds the family to it for the test (the best one without the fixture)."""
    _held["set"] = request.param
    yield request.param
    _held["set"] = KERNEL_SETS[0]


def decode_kernel(enabled):
    """Decoding steps on a kernel set of this CPU (kernel_set), or on the
    general plain C path."""
    return dispatched(decode=_held["set"] if enabled else "plain")


def _decode(front, options, q, k, v, n0, kernel):
    """One-token steps from a state of the first n0 tokens: the outputs,
    and S and z before (held keys pending) and after reading S."""
    with decode_kernel(kernel):
        _, state = front(q[:, :n0], k[:, :n0], v[:, :n0], causal=True, return_state=True,
                         **options)
        outs = [state.step(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1])
                for t in range(n0, q.shape[1])]
        lagging = state._S.copy(), state.z.copy()
        return np.concatenate(outs, axis=1), lagging, (state.S.copy(), state.z.copy())


KERNEL_MAPS = {
    "elu": (attnx.linear_attention, {}, lambda q, k, v: ref.linear_attention(q, k, v, "elu",
                                                                              causal=True)),
    "relu": (attnx.linear_attention, {"feature_map": "relu"},
             lambda q, k, v: ref.linear_attention(q, k, v, "relu", causal=True)),
    "cosformer": (attnx.cosformer_attention, {"M": 64},
                  lambda q, k, v: ref.cosformer_attention(q, k, v, causal=True, M=64)),
}


@pytest.mark.parametrize("name", sorted(KERNEL_MAPS))
@pytest.mark.parametrize("d,e", [(64, 64), (16, 16), (32, 48), (48, 80), (16, 128), (128, 32)])
def test_decode_kernel_equals_general_path_and_reference(name, d, e, kernel_set):
    """Every tick phase of every head (11 heads, 3 turns and more), e in
    1 to 4 vectors and past 64, r from 16 to 256 (cosformer doubles d):
    the outputs against the general path and a float64 reference, S and z
    bit for bit (the same sums in the same order), held keys and all."""
    front, options, reference = KERNEL_MAPS[name]
    rng = np.random.default_rng(d + e)
    n0, steps = 3, 3 * HELD + 5
    q, k, v = qkv(rng, (11,), n0 + steps, n0 + steps, d, e, np.float32)
    got = _decode(front, options, q, k, v, n0, kernel=True)
    general = _decode(front, options, q, k, v, n0, kernel=False)
    want = reference(f64(q), f64(k), f64(v))[:, n0:]
    assert_close(got[0], want, np.float32, vscale(v))
    assert_close(got[0], general[0], np.float32, vscale(v))
    for ours, theirs in zip(got[1] + got[2], general[1] + general[2]):
        assert_same_sums(ours, theirs)
    assert not np.array_equal(got[1][0], got[2][0])  # some keys were still held


@pytest.mark.parametrize("name,d,e,dtype", [("elu", 64, 62, np.float32), ("elu", 26, 64, np.float32),
                                            ("taylor", 64, 64, np.float32),
                                            ("elu", 64, 64, np.float64)])
def test_decode_kernel_falls_back(name, d, e, dtype, kernel_set):
    """r or e not whole vectors of any width (taylor's r = d + 1), or float64: the
    general path, the same numbers whether the kernel is allowed or not."""
    front, options = MAPS[name]
    rng = np.random.default_rng(d * e)
    q, k, v = qkv(rng, (5,), 2 + 2 * HELD, 2 + 2 * HELD, d, e, dtype)
    got = _decode(front, options, q, k, v, 2, kernel=True)
    general = _decode(front, options, q, k, v, 2, kernel=False)
    for ours, theirs in zip((got[0],) + got[1] + got[2], (general[0],) + general[1] + general[2]):
        np.testing.assert_array_equal(ours, theirs)
    want = ref.linear_attention(f64(q), f64(k), f64(v), name, causal=True, **options)
    assert_close(got[0], want[:, 2:], dtype, vscale(v))


def test_decode_kernel_favor_and_nonfinite_values(kernel_set):
    """FAVOR+ (stabilised features, the clamp scaled) through the kernel;
    and a NaN value reaches only its own head, from its step on, on both
    paths."""
    rng = np.random.default_rng(9)
    W = (rng.standard_normal((64, 32)) * 0.5).astype(np.float32)
    n0, n = 2, 2 + 2 * HELD + 3
    q, k, v = qkv(rng, (4,), n, n, 32, 32, np.float32)
    options = {"feature_map": "favor", "projection": W}
    got = _decode(attnx.linear_attention, options, q, k, v, n0, kernel=True)
    general = _decode(attnx.linear_attention, options, q, k, v, n0, kernel=False)
    want = ref.linear_attention(f64(q), f64(k), f64(v), "favor", causal=True,
                                projection=f64(W))[:, n0:]
    assert_close(got[0], want, np.float32, vscale(v))
    assert_close(got[0], general[0], np.float32, vscale(v))
    assert_same_sums(got[2][0], general[2][0])
    v[2, 7, 5] = np.nan
    for kernel in (True, False):
        out = _decode(attnx.linear_attention, {}, q, k, v, n0, kernel=kernel)[0]
        clean = [0, 1, 3]
        assert np.all(np.isfinite(out[clean])) and np.all(np.isfinite(out[2, :7 - n0]))
        assert np.all(np.isnan(out[2, 7 - n0:, 5]))


@pytest.mark.parametrize("d,e", [(64, 64), (32, 80), (16, 128)])
def test_decode_group_equals_single_heads(d, e):
    """Four heads in a row take their steps together, one of them at its
    turn (csrc/mk_decode.h, mk_decode_group_w16): the outputs, S and z of the
    same steps taken one head at a time, bit for bit, over every tick
    phase, both directions of the heads' order (heads 0 and 1 are in a
    group on one step and alone on the next), e past one vector block; a
    row whose denominator is 0 gives zeros, one below eps is divided by
    eps, and a NaN value reaches its own head only."""
    rng = np.random.default_rng(d + e)
    n0, steps, heads = 2, 3 * HELD + 3, 6
    q, k, v = qkv(rng, (heads,), n0 + steps, n0 + steps, d, e, np.float32)
    q[1, n0 + 3] = -100  # phi = 0: den == 0
    q[2, n0 + 5] = -60   # phi ~ 1e-26: den < eps
    v[3, n0 + 6, 2] = np.nan
    together = _decode(attnx.linear_attention, {}, q, k, v, n0, kernel=True)
    single = "avx512" if "avx512" in DECODE_KERNELS else DECODE_KERNELS[-1]
    with dispatched(decode=single):
        alone = _decode(attnx.linear_attention, {}, q, k, v, n0, kernel=True)
    for ours, theirs in zip((together[0],) + together[1] + together[2],
                            (alone[0],) + alone[1] + alone[2]):
        np.testing.assert_array_equal(ours, theirs)
    out = together[0]
    assert np.all(out[1, 3] == 0) and np.all(np.isfinite(out[[0, 1, 2, 4, 5]]))
    assert np.all(np.isnan(out[3, 6:, 2])) and np.all(np.isfinite(out[3, :6]))
    want = ref.linear_attention(f64(q), f64(k), f64(v), "elu", causal=True)[:, n0:]
    finite = np.isfinite(want)
    assert_close(out[finite], want[finite], np.float32, vscale(v))


def test_decode_kernel_elu_features_bit_for_bit(kernel_set):
    """The kernel computes elu + 1 itself: equal to the general path's
    features bit for bit (z sums them), over both branches, the cut to 0
    below -87, signed zeros and inputs far out."""
    rng = np.random.default_rng(12)
    n0, n = 1, 1 + HELD + 3
    q, k, v = qkv(rng, (3,), n, n, 32, 16, np.float32)
    special = np.array([-1e30, -200, -87.5, -87, -86.9, -20, -1e-30, -0.0, 0.0, 1e-30, 3e-8,
                        88.5, 1e30], np.float32)
    k[..., :len(special)] = special
    k[..., len(special):] *= 30
    q[..., :len(special)] = special[::-1]
    got = _decode(attnx.linear_attention, {}, q, k, v, n0, kernel=True)
    general = _decode(attnx.linear_attention, {}, q, k, v, n0, kernel=False)
    assert_same_sums(got[1][1], general[1][1])  # z: the sum of the features
    assert_same_sums(got[2][0], general[2][0])
    assert_close(got[0], general[0], np.float32, vscale(v))


# The functional single-token call (n = m = 1, causal) from a state of
# float32 whose r and e are whole AVX-512 vectors runs one fused pass per
# head too (csrc/mk_decode.h, mk_rnn_step_w16): S = S0 + psi v^T written and
# read in the same pass. Its S and z are the general path's bit for bit in
# an optimised build (one fused multiply-add per entry on both), its
# outputs agree to float32 rounding (the row's sums run in another order).
def _one_token(front, options, q, k, v, n0, kernel, **call):
    """The call on token n0 from a state of the first n0 tokens (None: no
    initial state): the output and the returned state's S and z."""
    with decode_kernel(kernel):
        state = None
        if n0 is not None:
            _, state = front(q[:, :n0], k[:, :n0], v[:, :n0], causal=True, return_state=True,
                             **options)
        t = n0 or 0
        got = front(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], causal=True,
                    initial_state=state, return_state=True, **options, **call)
        return got[0], got[1].S, got[1].z


@pytest.mark.parametrize("name", sorted(MAPS.keys() | KERNEL_MAPS.keys()))
@pytest.mark.parametrize("d,e", [(64, 64), (16, 128), (32, 48), (128, 16)])
def test_step_kernel_functional_equals_general_path(name, d, e, kernel_set):
    """Every feature map (those whose r is not whole vectors fall back),
    e in 1 to 8 vectors: S and z bit for bit, the output to float32
    rounding, against the general path and (maps with a float64 reference
    here) the whole causal call in float64."""
    front, options = MAPS[name][:2] if name in MAPS else KERNEL_MAPS[name][:2]
    if name == "favor":
        options = dict(options, projection=attnx.random_features(32, d, seed=3))
    rng = np.random.default_rng(d * e + len(name))
    n0 = 4
    q, k, v = qkv(rng, (7,), n0 + 1, n0 + 1, d, e, np.float32)
    got = _one_token(front, options, q, k, v, n0, kernel=True)
    general = _one_token(front, options, q, k, v, n0, kernel=False)
    assert_close(got[0], general[0], np.float32, vscale(v))
    assert_same_sums(got[1], general[1])
    assert_same_sums(got[2], general[2])
    if name in KERNEL_MAPS:
        want = KERNEL_MAPS[name][2](f64(q), f64(k), f64(v))[:, n0:]
        assert_close(got[0], want, np.float32, vscale(v))
    if name == "elu" and d == 64 and e == 64 and OPTIMIZED and DECODE_KERNELS[0] != "plain":
        # the table chose a kernel set, and its kernel ran: its row sums
        # round apart from state_pass's somewhere
        assert not np.array_equal(got[0], general[0])


@pytest.mark.parametrize("returns", [True, False])
def test_step_kernel_functional_without_initial_state(returns, kernel_set):
    """No initial state (the zero state, one row for all), with and without
    return_state: the reference of one token."""
    rng = np.random.default_rng(21)
    q, k, v = qkv(rng, (5,), 1, 1, 64, 32, np.float32)
    want = ref.linear_attention(f64(q), f64(k), f64(v), "elu", causal=True)
    for kernel in (True, False):
        with decode_kernel(kernel):
            got = attnx.linear_attention(q, k, v, causal=True, return_state=returns)
        out = got[0] if returns else got
        assert_close(out, want, np.float32, vscale(v))
        if returns:
            psi = np.where(k > 0, k + 1, np.exp(np.minimum(k, 0)))
            assert_close(got[1].z, psi[:, 0], np.float32)
            assert_close(got[1].S, f64(psi[:, 0, :, None]) * f64(v[:, 0, None, :]), np.float32,
                         vscale(v) * 2)


def test_step_kernel_functional_key_mask_and_nonfinite(kernel_set):
    """A key removed by key_mask leaves S0 and z0 as they were and the
    output reads them; a kept key steps as without the mask; a NaN value
    reaches only its own head's S rows and output columns."""
    rng = np.random.default_rng(22)
    n0 = 3
    q, k, v = qkv(rng, (6,), n0 + 1, n0 + 1, 64, 64, np.float32)
    keep = np.array([[True], [False], [True], [False], [True], [True]])
    _, state = attnx.linear_attention(q[:, :n0], k[:, :n0], v[:, :n0], causal=True,
                                      return_state=True)
    results = {}
    for kernel in (True, False):
        with decode_kernel(kernel):
            out, after = attnx.linear_attention(q[:, n0:], k[:, n0:], v[:, n0:], causal=True,
                                                key_mask=keep, initial_state=state,
                                                return_state=True)
            plain = attnx.linear_attention(q[:, n0:], k[:, n0:], v[:, n0:], causal=True,
                                           initial_state=state, return_state=True)
        results[kernel] = out, after.S, after.z
        masked = ~keep[:, 0]
        np.testing.assert_array_equal(after.S[masked], state.S[masked])
        np.testing.assert_array_equal(after.z[masked], state.z[masked])
        # with key_mask the features come from features.c, without from
        # the kernel's elu: the same numbers in an optimised build
        assert_same_sums(after.S[~masked], plain[1].S[~masked])
        assert_same_sums(out[~masked], plain[0][~masked])
        phi = np.where(q[:, n0:] > 0, f64(q[:, n0:]) + 1, np.exp(np.minimum(f64(q[:, n0:]), 0)))
        S0, z0 = f64(state.S[masked]), f64(state.z[masked])
        want = phi[masked] @ S0 / (phi[masked] @ z0[..., None])
        assert_close(out[masked], want, np.float32, vscale(want))
    assert_close(results[True][0], results[False][0], np.float32, vscale(v))
    for ours, theirs in zip(results[True][1:], results[False][1:]):
        assert_same_sums(ours, theirs)
    v[2, n0, 5] = np.nan
    for kernel in (True, False):
        with decode_kernel(kernel):
            out, after = attnx.linear_attention(q[:, n0:], k[:, n0:], v[:, n0:], causal=True,
                                                initial_state=state, return_state=True)
        clean = [0, 1, 3, 4, 5]
        assert np.all(np.isfinite(out[clean])) and np.all(np.isfinite(after.S[clean]))
        assert np.all(np.isnan(out[2, :, 5])) and np.all(np.isnan(after.S[2][:, 5]))
        others = np.arange(64) != 5
        assert np.all(np.isfinite(out[2][:, others])) and np.all(np.isfinite(after.S[2][:, others]))
        assert np.all(np.isfinite(after.z))


@pytest.mark.parametrize("d,e,dtype", [(64, 62, np.float32), (26, 64, np.float32),
                                       (64, 64, np.float64)])
def test_step_kernel_functional_falls_back(d, e, dtype, kernel_set):
    """r or e not whole vectors of any width, or float64: the general path, the same
    numbers whether the kernel is allowed or not, and the reference."""
    rng = np.random.default_rng(d + e)
    q, k, v = qkv(rng, (3,), 3, 3, d, e, dtype)
    got = _one_token(attnx.linear_attention, {}, q, k, v, 2, kernel=True)
    general = _one_token(attnx.linear_attention, {}, q, k, v, 2, kernel=False)
    for ours, theirs in zip(got, general):
        np.testing.assert_array_equal(ours, theirs)
    want = ref.linear_attention(f64(q), f64(k), f64(v), "elu", causal=True)[:, 2:]
    assert_close(got[0], want, dtype, vscale(v))


# A single-token step of many heads splits them over attnx's own helper
# threads (team.c) rather than an OpenMP parallel region, which costs more
# than the step's arithmetic, from the 17th step of a run of steps on (the
# first 16 go to OpenMP); a second caller that finds the team busy uses
# OpenMP. Each head is one thread's work whichever way the heads are split,
# so every split gives the one-thread numbers bit for bit. Runs of 36
# steps here: both ways.
def _decoding_inputs(seed=9, tokens=40, lead=(2, 16)):
    rng = np.random.default_rng(seed)
    # 32 heads of d = 64, e = 48: enough state for the step to use every thread
    return qkv(rng, lead, tokens, tokens, 64, 48, np.float32)


def _decode_tokens(q, k, v, first=4, contiguous=True):
    """The outputs of single-token steps after a state of `first` tokens,
    and the state (S read at the end)"""
    _, state = attnx.linear_attention(q[..., :first, :], k[..., :first, :], v[..., :first, :],
                                      causal=True, return_state=True)
    token = np.ascontiguousarray if contiguous else (lambda x: x)
    outs = [state.step(token(q[..., t:t + 1, :]), token(k[..., t:t + 1, :]),
                       token(v[..., t:t + 1, :])) for t in range(first, q.shape[-2])]
    return np.concatenate(outs, axis=-2), state


def _one_thread(call, *args, **kwargs):
    threads = attnx.get_num_threads()
    attnx.set_num_threads(1)
    try:
        return call(*args, **kwargs)
    finally:
        attnx.set_num_threads(threads)


@pytest.mark.parametrize("lead", [(2, 16), (5, 16)], ids=["32 heads", "80 heads"])
def test_lean_and_general_step_bindings_agree(lead):
    """Contiguous tokens take the lean binding; strided views of the same
    numbers (each head's row not where a C-ordered array puts it) take the
    general one: the same outputs, S, z, offset and held keys (80 heads:
    past the lean binding's offset table on the stack)"""
    q, k, v = _decoding_inputs(lead=lead)
    lean, lean_state = _decode_tokens(q, k, v, contiguous=True)
    general, general_state = _decode_tokens(q, k, v, contiguous=False)
    assert not q[..., 5:6, :].flags.c_contiguous
    np.testing.assert_array_equal(lean, general)
    assert lean_state._tick == general_state._tick and lean_state.offset == general_state.offset
    for a, b in zip(lean_state._pending, general_state._pending):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(lean_state.S, general_state.S)
    np.testing.assert_array_equal(lean_state.z, general_state.z)
    assert_close(lean, attnx.linear_attention(q, k, v, causal=True)[..., 4:, :], np.float32)


def test_step_output_memory_reused_only_when_free():
    """A step without out= returns its output in the memory of the last
    step's output when nothing holds that any more (no name, view or
    buffer): the lean binding's saving. An output still held is never
    written again, and every output is what the steps with all outputs
    kept give."""
    q, k, v = _decoding_inputs()
    want, _ = _decode_tokens(q, k, v)  # every output kept in a list: none reused
    _, state = attnx.linear_attention(q[..., :4, :], k[..., :4, :], v[..., :4, :], causal=True,
                                      return_state=True)
    holders = {14: lambda out: out, 15: lambda out: out[0], 16: memoryview}
    address, copies, kept = {}, [], {}
    for t in range(4, q.shape[-2]):
        out = state.step(*(np.ascontiguousarray(x[..., t:t + 1, :]) for x in (q, k, v)))
        address[t] = out.__array_interface__["data"][0]
        copies.append(out.copy())
        if t in holders:
            kept[t] = holders[t](out)
        del out
    np.testing.assert_array_equal(np.concatenate(copies, axis=-2), want)
    # token 4 is the state's first single-token step (the general binding);
    # from token 5 on the lean one, in one array's memory while nothing holds it
    assert len({address[t] for t in range(5, 15)}) == 1
    # held by name (14), through a view (15), through a buffer (16): new memory
    assert len({address[14], address[15], address[16], address[17]}) == 4
    assert {address[t] for t in range(17, q.shape[-2])} == {address[17]}
    np.testing.assert_array_equal(kept[14], copies[14 - 4])
    np.testing.assert_array_equal(kept[15], copies[15 - 4][0])
    np.testing.assert_array_equal(np.asarray(kept[16]), copies[16 - 4])


def test_steps_of_states_with_other_options_interleaved():
    """The lean binding keeps the parse of the last state's options: states
    made with other feature maps and eps (one eps a numpy scalar, parsed
    every time) stepping in turn each keep their own, equal to stepping
    each alone."""
    q, k, v = _decoding_inputs(tokens=12)
    made = [dict(feature_map="elu"), dict(feature_map="relu", eps=0.5),
            dict(feature_map="elu", eps=np.float64(1e7)), dict(feature_map="softmax")]

    def start(options):
        return attnx.linear_attention(q[..., :4, :], k[..., :4, :], v[..., :4, :], causal=True,
                                      return_state=True, **options)[1]

    def token(t):
        return [np.ascontiguousarray(x[..., t:t + 1, :]) for x in (q, k, v)]

    alone = [np.concatenate([state.step(*token(t)) for t in range(4, 12)], -2)
             for state in map(start, made)]
    states = [start(options) for options in made]
    together = [[] for _ in made]
    for t in range(4, 12):
        for outs, state in zip(together, states):
            outs.append(state.step(*token(t)))
    for want, got, options in zip(alone, together, made):
        np.testing.assert_array_equal(np.concatenate(got, -2), want)
        assert_close(want, attnx.linear_attention(q, k, v, causal=True, **options)[..., 4:, :],
                     np.float32)
    assert not np.allclose(alone[0], alone[2])  # eps = 1e7 clamps


def test_step_keywords_and_subclass():
    """step takes q, k, v and out by keyword too, with Python's errors for
    wrong arguments; a subclass of LinearAttentionState (the C type of
    csrc/py_linear.c, its fields with it) given the options of a state
    steps as the class's own steps do."""
    q, k, v = _decoding_inputs(tokens=8)

    class Subclass(attnx.LinearAttentionState):
        pass

    _, state = attnx.linear_attention(q[..., :4, :], k[..., :4, :], v[..., :4, :], causal=True,
                                      return_state=True)
    sub = Subclass(state.S.copy(), state.z.copy(), state.offset)
    sub._options = state._options
    outs, sub_outs = [], []
    for t in range(4, 8):
        token = [np.ascontiguousarray(x[..., t:t + 1, :]) for x in (q, k, v)]
        out = np.empty_like(token[2])
        outs.append(state.step(v=token[2], q=token[0], k=token[1], out=out))
        assert outs[-1] is out
        sub_outs.append(sub.step(*token))
    np.testing.assert_array_equal(np.concatenate(outs, -2), np.concatenate(sub_outs, -2))
    assert state.offset == sub.offset == 8
    np.testing.assert_array_equal(state.S, sub.S)
    token = [x[..., 8 - 1:8, :] for x in (q, k, v)]
    for args, kwargs, message in [
            (token, {"w": 1}, "unexpected keyword argument 'w'"),
            (token, {"q": token[0]}, "multiple values for argument 'q'"),
            (token[:2], {}, "missing required argument 'v'"),
            (token + [None, None], {}, r"takes q, k, v and optionally out \(5 given\)")]:
        with pytest.raises(TypeError, match=message):
            state.step(*args, **kwargs)


@pytest.mark.parametrize("threads", [2, 3, 1, 2])
def test_step_threads_equal_one_thread(threads):
    """Any thread count (three helpers on two cores, a team larger than
    the next call's, none) gives the one-thread steps"""
    q, k, v = _decoding_inputs()
    want, want_state = _one_thread(_decode_tokens, q, k, v)
    before = attnx.get_num_threads()
    attnx.set_num_threads(threads)
    try:
        got, state = _decode_tokens(q, k, v)
    finally:
        attnx.set_num_threads(before)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(state.S, want_state.S)


@pytest.mark.parametrize("leads", [[(2, 16)] * 4, [(2, 16), (1, 8), (3, 4), (1, 40)]],
                         ids=["one shape", "four shapes"])
def test_steps_from_several_python_threads_at_once(leads):
    """Four Python threads decode their own states together (the GIL is
    released in the kernel): one holds the team, the others run on
    OpenMP, and each gets its one-thread numbers; states of one shape share
    the offset table kept between steps, and a step of another shape while
    it is in use makes its own (py_linear.c, kept_table)"""
    inputs = [_decoding_inputs(seed, tokens=150, lead=lead) for seed, lead in enumerate(leads)]
    want = [_one_thread(_decode_tokens, *qkv_)[0] for qkv_ in inputs]
    got = [None] * 4
    before = attnx.get_num_threads()
    attnx.set_num_threads(2)
    try:
        threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _decode_tokens(*inputs[i])[0]))
                   for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        attnx.set_num_threads(before)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
