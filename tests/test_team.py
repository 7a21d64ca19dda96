"""Decoding steps on attnx's helper threads (csrc/team.c) when a helper is
late: after a pause the helpers sleep, and the caller, having done its own
range of heads, takes the ranges no helper has started. Whoever runs a
range, the step is the same arithmetic: results equal the one-thread
steps bit for bit, for the linear family's state and the delta rule's."""
import time

import numpy as np
import pytest

import attnx

STEPS = 40  # the helpers take steps from the 17th of a run on


def _linear_steps(threads, pause):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 32, 1, 64)).astype(np.float32) for _ in range(3))
    empty = q[..., :0, :]
    attnx.set_num_threads(threads)
    state = attnx.linear_attention(empty, empty, empty, causal=True, return_state=True)[1]
    outs = []
    for t in range(STEPS):
        outs.append(state.step(q * (t + 1) / STEPS, k, v).copy())
        time.sleep(pause)
    return np.stack(outs), state.S.copy()


def _delta_steps(threads, pause):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 16, 1, 64)).astype(np.float32) for _ in range(3))
    beta = rng.random((1, 16, 1)).astype(np.float32)
    g = -rng.random((1, 16, 1)).astype(np.float32) * 0.1
    attnx.set_num_threads(threads)
    _, state = attnx.delta_rule_attention(q, k, v, beta, g, qk_l2norm=True, return_state=True)
    outs = []
    for t in range(STEPS):
        outs.append(state.step(q * (t + 1) / STEPS, k, v, beta, g).copy())
        time.sleep(pause)
    return np.stack(outs), state.S.copy()


@pytest.mark.parametrize("steps", [_linear_steps, _delta_steps])
@pytest.mark.parametrize("pause", [0.0, 0.002])
def test_steps_on_two_threads_equal_one_thread(steps, pause):
    threads = attnx.get_num_threads()
    try:
        want_out, want_state = steps(1, 0.0)
        got_out, got_state = steps(2, pause)
    finally:
        attnx.set_num_threads(threads)
    np.testing.assert_array_equal(got_out, want_out)
    np.testing.assert_array_equal(got_state, want_state)
