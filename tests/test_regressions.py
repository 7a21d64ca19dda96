"""Calls that once crashed the interpreter or ran away, each kept as a
regression test. Crashes run in a child process (tests/helpers.py's
run_isolated), so a regression fails this test, not the session."""
import time

import numpy as np
import pytest

import attnx
from helpers import run_isolated

METHODS = ["cumsum", "chunk", "recurrent", "quadratic"]


def test_zero_features_cumsum_does_not_crash():
    """0 features (d = 0 with elu, or a callable map returning none) made the
    cumsum plan divide by the size of an empty prefix tensor: SIGFPE."""
    out = run_isolated("""
        q = np.ones((2, 4, 0)); v = np.arange(24.0).reshape(2, 4, 3)
        print(attnx.linear_attention(q, q, v, causal=True, method="cumsum").tolist())
        x = np.ones((2, 4, 5))
        o = attnx.linear_attention(x, x, v, causal=True, method="cumsum",
                                   feature_map=lambda t: t[..., :0])
        print(o.tolist())
    """, timeout=60)
    zeros = np.zeros((2, 4, 3)).tolist()
    assert out.splitlines() == [str(zeros), str(zeros)], out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("method", METHODS)
def test_zero_features_give_zeros_in_every_method(dtype, causal, method):
    """With no features every row's mass phi(q_i) . z is 0: zeros, by every
    method, with and without a carried state."""
    q = np.ones((3, 6, 0), dtype)
    v = np.random.default_rng(0).standard_normal((3, 6, 4)).astype(dtype)
    out, state = attnx.linear_attention(q, q, v, causal=causal, method=method,
                                        return_state=True)
    assert out.dtype == dtype and out.shape == (3, 6, 4)
    np.testing.assert_array_equal(out, 0)
    assert state.S.shape == (3, 0, 4) and state.z.shape == (3, 0)
    if causal:
        again = attnx.linear_attention(q, q, v, causal=True, method=method,
                                       initial_state=state)
        np.testing.assert_array_equal(again, 0)


def test_random_features_refuses_huge_sizes_before_work():
    """random_features(2**40, 8) ran QR factorisations for 2**37 blocks
    before running out of memory; it now refuses at once, naming r and d."""
    start = time.monotonic()
    with pytest.raises(MemoryError, match=r"r=1099511627776, d=8"):
        attnx.random_features(2**40, 8)
    with pytest.raises(ValueError, match=r"r=4611686018427387904, d=8"):
        attnx.random_features(2**62, 8)
    with pytest.raises(MemoryError, match=r"r=1099511627776"):
        attnx.performer_attention(np.ones((2, 8)), np.ones((2, 8)), np.ones((2, 8)),
                                  num_features=2**40, seed=0)
    assert time.monotonic() - start < 1.0  # refused, not attempted


@pytest.mark.parametrize("q", [3.0, None, "q", np.ones(4)])
def test_performer_without_projection_names_q(q):
    """performer_attention drew its projection from q's last axis before the
    kernel checked q: a q of fewer than 2 dimensions raised IndexError."""
    k = v = np.ones((3, 4))
    with pytest.raises(ValueError, match="q must have at least 2 dimensions"):
        attnx.performer_attention(q, k, v, seed=0)
    with pytest.raises(ValueError, match="q must have at least 2 dimensions"):
        attnx.attention_weights(q, k, variant="performer", seed=0)
