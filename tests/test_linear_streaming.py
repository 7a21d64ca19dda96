"""Streaming the kernelised variants in pieces with a carried state (initial_state= / return_state=), and decoding.

The variants under test, their references and the stated tolerances are
in tests/linear_variants.py.
"""
import numpy as np
import pytest

import attnx

import attnx.reference as ref
from helpers import assert_close, make, qkv, tol, vscale  # noqa: E402
from linear_variants import (METHODS, STATEFUL, call, check_state, prep, ref_out,  # noqa: E402
                             stream_in_pieces)


# --------------------------------------------------------------------------
# streaming (property 3) and decoding
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", STATEFUL)
@pytest.mark.parametrize("pieces", ["one", "tokens", "halves", "random",
                                    "mixed_methods"])
def test_streaming_equals_one_call(dtype, name, pieces):
    rng = np.random.default_rng(25)
    n = 97
    q, k, v = qkv(rng, (2, 2), n, n, 6, 4, dtype)
    q, k = prep(name, q, k)
    km = rng.random((2, 1, n)) < 0.85
    M = n + 13 if name == "cosformer" else None
    extra = {} if M is None else dict(M=M)
    full = call(name, q, k, v, causal=True, key_mask=km, **extra)
    assert_close(full, ref_out(name, q, k, v, causal=True, key_mask=km,
                               **extra), dtype, vscale(v))
    if pieces == "one":
        bounds = [0, n]
    elif pieces == "tokens":
        bounds = list(range(n + 1))
    elif pieces == "halves":
        bounds = [0, 48, n]
    else:
        cuts = sorted(rng.choice(np.arange(1, n), 9, replace=False))
        bounds = [0] + list(cuts) + [n]
    methods = METHODS + [None] if pieces == "mixed_methods" else (None,)
    sizes = (None, 1, 3, 64) if pieces == "mixed_methods" else (None,)
    got, state = stream_in_pieces(name, q, k, v, bounds, M, km, methods, sizes)
    assert got.dtype == dtype
    t = tol(dtype, vscale(v))
    np.testing.assert_allclose(got, full, rtol=t["rtol"], atol=t["atol"])
    check_state(name, state, k, v, km, M, dtype)


@pytest.mark.parametrize("name", STATEFUL)
def test_state_can_be_reused(name):
    """A state is not consumed or modified by the call that continues it:
    two continuations from one state are identical (a fork), and the state's
    arrays are unchanged."""
    rng = np.random.default_rng(26)
    q, k, v = qkv(rng, (2,), 40, 40, 5, 3)
    q, k = prep(name, q, k)
    extra = dict(M=40) if name == "cosformer" else {}
    _, st0 = call(name, q[:, :20], k[:, :20], v[:, :20], causal=True,
                  return_state=True, **extra)
    S0, z0, off0 = st0.S.copy(), st0.z.copy(), st0.offset
    a, st_a = call(name, q[:, 20:], k[:, 20:], v[:, 20:], causal=True,
                   initial_state=st0, return_state=True, **extra)
    b = call(name, q[:, 20:], k[:, 20:], v[:, 20:], causal=True,
             initial_state=st0, **extra)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(st0.S, S0)
    np.testing.assert_array_equal(st0.z, z0)
    assert st0.offset == off0 == 20 and st_a.offset == 40
    full = call(name, q, k, v, causal=True, **extra)
    assert_close(a, full[:, 20:], np.float64, vscale(v))


@pytest.mark.parametrize("name", STATEFUL)
def test_decoding_one_token_at_a_time(name):
    """Decoding: (1, 32, 1, 64) per step, carrying the state, equals the
    full causal call (float32 and float64)."""
    H, d, n = 32, 64, 24
    for dtype in (np.float32, np.float64):
        rng = np.random.default_rng(27)
        q, k, v = qkv(rng, (1, H), n, n, d, d, dtype)
        q, k = prep(name, q, k)
        extra = dict(M=n) if name == "cosformer" else {}
        full = call(name, q, k, v, causal=True, **extra)
        # a prompt of 5 tokens, then one token per call
        o, state = call(name, q[..., :5, :], k[..., :5, :], v[..., :5, :],
                        causal=True, return_state=True, **extra)
        outs = [o]
        for t in range(5, n):
            o, state = call(name, q[..., t:t + 1, :], k[..., t:t + 1, :],
                            v[..., t:t + 1, :], causal=True,
                            initial_state=state, return_state=True, **extra)
            assert o.shape == (1, H, 1, d) and o.dtype == dtype
            outs.append(o)
        assert state.offset == n
        got = np.concatenate(outs, axis=-2)
        t_ = tol(dtype, vscale(v))
        np.testing.assert_allclose(got, full, rtol=t_["rtol"], atol=t_["atol"])
        assert_close(got, ref_out(name, q, k, v, causal=True, **extra), dtype,
                     vscale(v))


def test_state_shape_and_dtype_rules():
    rng = np.random.default_rng(28)
    q = make(rng, (2, 1, 7, 4))
    k = make(rng, (1, 3, 7, 4))
    v = make(rng, (1, 3, 7, 6))
    o, st_ = attnx.linear_attention(q, k, v, causal=True, return_state=True)
    assert o.shape == (2, 3, 7, 6)
    assert st_.S.shape == (2, 3, 4, 6) and st_.z.shape == (2, 3, 4)
    assert isinstance(st_.offset, int) and st_.offset == 7
    # float16 computes in float32: its state is float32
    o, st_ = attnx.linear_attention(q.astype(np.float16), k.astype(np.float16),
                                    v.astype(np.float16), causal=True,
                                    return_state=True)
    assert o.dtype == np.float16 and st_.S.dtype == np.float32
    o2, _ = attnx.linear_attention(q.astype(np.float16), k.astype(np.float16),
                                   v.astype(np.float16), causal=True,
                                   initial_state=st_, return_state=True)
    assert o2.dtype == np.float16
    # a state and out= together
    out = np.full((2, 3, 7, 6), np.nan)
    res = attnx.linear_attention(q, k, v, causal=True, return_state=True,
                                 out=out)
    assert isinstance(res, tuple) and res[0] is out
    assert_close(out, ref.linear_attention(q, k, v, causal=True), np.float64,
                 vscale(v))
