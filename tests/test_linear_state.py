"""LinearAttentionState as a C type (csrc/py_linear.c): copies and pickles
that step as the original does, its reference cycles collected, and the
private kernels' arguments taken by name (attnx/_C.pyi)."""
import copy
import gc
import pickle

import numpy as np
import pytest

import attnx
from attnx import _C


def _decoding(feature_map="elu", tokens=12, heads=3, d=8, e=5):
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((heads, tokens, width)).astype(np.float32)
               for width in (d, d, e))
    _, state = attnx.linear_attention(q[:, :4], k[:, :4], v[:, :4], causal=True,
                                      feature_map=feature_map, return_state=True)
    return state, [tuple(np.ascontiguousarray(x[:, t:t + 1]) for x in (q, k, v))
                   for t in range(4, tokens)]


@pytest.mark.parametrize("duplicate", [copy.copy, copy.deepcopy,
                                       lambda s: pickle.loads(pickle.dumps(s))],
                         ids=["copy", "deepcopy", "pickle"])
@pytest.mark.parametrize("feature_map", ["elu", np.exp], ids=["elu", "callable"])
def test_a_duplicate_steps_as_the_original(duplicate, feature_map):
    """Duplicated between single-token steps (keys held back from S), a
    state keeps its options, held keys and offset; a deep copy or a
    pickle owns its arrays, so the original steps on undisturbed."""
    state, tokens = _decoding(feature_map)
    for token in tokens[:3]:
        state.step(*token)
    assert state._tick == 3
    twin = duplicate(state)
    assert type(twin) is attnx.LinearAttentionState
    assert twin._tick == 3 and twin.offset == state.offset == 7
    assert twin._options[:4] == state._options[:4]
    got = [twin.step(*token) for token in tokens[3:]]
    if duplicate is copy.copy:  # shares S and the held keys: steps one state only
        return
    want = [state.step(*token) for token in tokens[3:]]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(twin.S, state.S)
    assert twin.S is not state.S


def test_repr_and_a_state_built_by_hand():
    state, tokens = _decoding()
    state.step(*tokens[0])
    assert repr(state) == "LinearAttentionState(S: float32(3, 8, 5), z: float32(3, 8), offset=5)"
    hand = attnx.LinearAttentionState(state.S.copy(), state.z.copy(), 2)
    assert hand._options is None and hand._tick == 0 and hand._pending is None
    assert repr(hand) == "LinearAttentionState(S: float32(3, 8, 5), z: float32(3, 8), offset=2)"
    hand._options = state._options  # what the state's steps repeat
    np.testing.assert_array_equal(hand.step(*tokens[1]), state.step(*tokens[1]))
    assert hand.offset == 3
    with pytest.raises(ValueError, match="options are"):
        hand._options = ("linear",)
    with pytest.raises(TypeError):
        attnx.LinearAttentionState(state.S, state.z)


def test_a_cycle_through_the_feature_map_is_collected():
    collected = []

    class FeatureMap:
        def __call__(self, x):
            return np.exp(x)

        def __del__(self):
            collected.append(True)

    feature_map = FeatureMap()
    state, tokens = _decoding(feature_map)
    state.step(*tokens[0])
    feature_map.state = state  # state -> its feature map -> state
    del feature_map, state
    gc.collect()
    assert collected == [True]


def test_private_kernels_take_options_by_name():
    q = np.ones((2, 3, 4))
    with pytest.raises(TypeError, match=r"takes at most 3 positional arguments \(4 given\)"):
        _C.linear_attention(q, q, q, "linear")
    with pytest.raises(TypeError, match="missing required argument 'variant'"):
        _C.linear_attention(q, q, q)
    with pytest.raises(TypeError, match="unexpected keyword argument 'normalize'"):
        _C.linear_attention(q, q, q, variant="linear", normalize=False)
    with pytest.raises(TypeError, match="multiple values for argument 'k'"):
        _C.linear_attention(q, q, q, variant="linear", k=q)
    np.testing.assert_array_equal(_C.linear_attention(q, q, q, variant="linear", causal=True),
                                  attnx.linear_attention(q, q, q, causal=True))
    with pytest.raises(TypeError, match="missing required keyword argument 'scale'"):
        _C.delta_rule(q, q, q, np.ones((2, 3)), recurrent=True, chunk=1)
    with pytest.raises(TypeError, match="missing required keyword argument 'chunk'"):
        _C.lsh_attention(q, q, np.ones((1, 4, 1)))
    with pytest.raises(TypeError):  # options are keyword-only
        _C.softmax_backward(q, q, q, q, q, np.zeros((2, 3)), None)
