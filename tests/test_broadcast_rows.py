"""Keys and values broadcast from one row (np.broadcast_to, a row stride of
0) are read in place, never materialised: results equal those of the
materialised arrays, and a call over 2**20 such keys allocates nothing of
their size (numpy's and attnx's allocations are traced by tracemalloc)."""
import numpy as np
import pytest

import attnx
from helpers import assert_close, make, traced_peak

D, E = 16, 8
PROJECTION = attnx.random_features(24, D, seed=1)


def broadcast_rows(rng, lead, m, width, dtype):
    """(lead..., m, width) whose m rows are one row: stride 0 on that axis"""
    row = make(rng, lead + (1, width), dtype)
    return np.broadcast_to(row, lead + (m, width))


def inputs(which, dtype, lead=(2, 3), n=7, m=41, seed=0):
    """q, k, v with k and / or v (`which`) broadcast from one row per head"""
    rng = np.random.default_rng(seed)
    q = make(rng, lead + (n, D), dtype)
    k = broadcast_rows(rng, lead, m, D, dtype) if "k" in which else make(rng, lead + (m, D), dtype)
    v = broadcast_rows(rng, lead, m, E, dtype) if "v" in which else make(rng, lead + (m, E), dtype)
    return q, k, v


def check_against_materialised(call, q, k, v, dtype):
    assert 0 in k.strides[-2:] or 0 in v.strides[-2:]
    got = call(q, k, v)
    want = call(q, np.ascontiguousarray(k), np.ascontiguousarray(v))
    assert_close(got, want, dtype, scale=np.abs(want).max())


SOFTMAX_CALLS = {
    "softmax": lambda q, k, v: attnx.softmax_attention(q, k, v),
    "softmax causal": lambda q, k, v: attnx.softmax_attention(q, k, v, causal=True),
    "softmax window": lambda q, k, v: attnx.softmax_attention(q, k, v, window=(5, 2)),
    "softmax mask": lambda q, k, v: attnx.softmax_attention(
        q, k, v, mask=np.arange(k.shape[-2]) % 3 != 1),
    "softmax bias": lambda q, k, v: attnx.softmax_attention(
        q, k, v, bias=np.linspace(-1, 1, k.shape[-2])),
    "gaussian": lambda q, k, v: attnx.gaussian_attention(q, k, v, sigma=2.0),
}

LINEAR_CALLS = {
    "linear": lambda q, k, v: attnx.linear_attention(q, k, v),
    "chunk": lambda q, k, v: attnx.linear_attention(q, k, v, causal=True, chunk_size=8),
    "chunk 16": lambda q, k, v: attnx.linear_attention(q, k, v, causal=True, chunk_size=16),
    "recurrent": lambda q, k, v: attnx.linear_attention(q, k, v, causal=True, method="recurrent"),
    "cumsum": lambda q, k, v: attnx.linear_attention(q, k, v, causal=True, method="cumsum"),
    "quadratic": lambda q, k, v: attnx.linear_attention(q, k, v, method="quadratic",
                                                        window=(6, 0)),
    "key_mask": lambda q, k, v: attnx.linear_attention(
        q, k, v, causal=True, key_mask=np.arange(k.shape[-2]) % 4 != 0),
    "favor": lambda q, k, v: attnx.linear_attention(q, k, v, feature_map="favor",
                                                    projection=PROJECTION, causal=True),
    "softmax features": lambda q, k, v: attnx.linear_attention(q, k, v, feature_map="softmax"),
    "taylor": lambda q, k, v: attnx.taylor_attention(q, k, v, causal=True),
    "cosformer": lambda q, k, v: attnx.cosformer_attention(q, k[..., :7, :], v[..., :7, :],
                                                           causal=True),
    "efficient": lambda q, k, v: attnx.efficient_attention(q, k, v),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("which", ["k", "v", "kv"])
@pytest.mark.parametrize("name", sorted(SOFTMAX_CALLS) + sorted(LINEAR_CALLS))
def test_broadcast_rows_equal_materialised(name, which, dtype):
    call = {**SOFTMAX_CALLS, **LINEAR_CALLS}[name]
    if name == "cosformer":  # causal cosFormer needs n == m
        q, k, v = inputs(which, dtype, m=7)
    else:
        q, k, v = inputs(which, dtype)
    check_against_materialised(call, q, k, v, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 64])
def test_softmax_tiles_of_broadcast_rows(n, dtype):
    """Enough keys and queries for the tiled kernels (d = 64), one query
    for the decoding path."""
    rng = np.random.default_rng(n)
    q = make(rng, (2, n, 64), dtype)
    k = broadcast_rows(rng, (2,), 700, 64, dtype)
    v = broadcast_rows(rng, (2,), 700, 64, dtype)
    for causal in (False, True):
        check_against_materialised(
            lambda q, k, v: attnx.softmax_attention(q, k, v, causal=causal), q, k, v, dtype)


def test_streaming_and_step_with_broadcast_rows():
    q, k, v = inputs("kv", np.float64, n=6, m=6)
    _, state = attnx.linear_attention(q[..., :3, :], k[..., :3, :], v[..., :3, :], causal=True,
                                      return_state=True)
    got = state.step(q[..., 3:, :], k[..., 3:, :], v[..., 3:, :])
    want = attnx.linear_attention(q, np.ascontiguousarray(k), np.ascontiguousarray(v),
                                  causal=True)[..., 3:, :]
    assert_close(got, want, np.float64)


def test_inputs_not_written():
    q, k, v = inputs("kv", np.float32)
    base_k, base_v = k.base.copy(), v.base.copy()
    attnx.softmax_attention(q, k, v)
    attnx.linear_attention(q, k, v, causal=True)
    np.testing.assert_array_equal(k.base, base_k)
    np.testing.assert_array_equal(v.base, base_v)


MANY = 2 ** 20  # keys: 512 MiB each for k and v at d = e = 64 (float64) if materialised


@pytest.mark.parametrize("call", [
    lambda q, k, v: attnx.softmax_attention(q, k, v),
    lambda q, k, v: attnx.softmax_attention(q, k, v, causal=True),
    lambda q, k, v: attnx.linear_attention(q, k, v),
    lambda q, k, v: attnx.linear_attention(q, k, v, causal=True),
], ids=["softmax", "softmax causal", "linear", "linear causal"])
def test_many_broadcast_keys_allocate_nothing_of_their_size(call):
    rng = np.random.default_rng(2)
    # float64: the sums over 2**20 keys stay exact to ~1e-10
    q = make(rng, (4, 64))
    k = np.broadcast_to(make(rng, (64,)), (MANY, 64))
    v = np.broadcast_to(make(rng, (64,)), (MANY, 64))
    out, peak = traced_peak(lambda: call(q, k, v))
    assert peak < 4 * 2 ** 20, f"peak {peak / 2**20:.1f} MiB: the broadcast rows were copied"
    # every key is the same row: attention returns that value row
    np.testing.assert_allclose(out, np.broadcast_to(v[0], out.shape), rtol=1e-8)


@pytest.mark.parametrize("dtype", [np.float16, np.int32])
@pytest.mark.parametrize("name", ["softmax", "softmax causal", "linear", "chunk", "recurrent"])
def test_broadcast_rows_of_a_converted_dtype(name, dtype):
    """float16 and integer inputs are converted to the computing dtype: the
    one row is converted, the broadcast kept"""
    call = {**SOFTMAX_CALLS, **LINEAR_CALLS}[name]
    rng = np.random.default_rng(3)
    q = make(rng, (2, 5, D), np.float32).astype(dtype)
    k = np.broadcast_to(make(rng, (2, 1, D), np.float32, scale=3).astype(dtype), (2, 30, D))
    v = np.broadcast_to(make(rng, (2, 1, E), np.float32, scale=3).astype(dtype), (2, 30, E))
    got = call(q, k, v)
    want = call(q, np.ascontiguousarray(k), np.ascontiguousarray(v))
    assert got.dtype == want.dtype
    # float16 results are rounded to float16; integers compute in float64
    compute = np.float64 if dtype == np.int32 else np.float16
    assert_close(got, want, compute, scale=np.abs(want.astype(np.float64)).max())


@pytest.mark.parametrize("call", [attnx.softmax_attention, attnx.linear_attention])
def test_converted_broadcast_rows_and_heads_allocate_nothing_of_their_size(call):
    """float16 keys and values broadcast over 2**20 rows and 8 heads: the
    conversion to float32 takes the one row, not 2**23 of them"""
    rng = np.random.default_rng(4)
    q = make(rng, (8, 4, 64), np.float16)
    k = np.broadcast_to(make(rng, (64,), np.float16), (8, MANY, 64))
    v = np.broadcast_to(make(rng, (64,), np.float16), (8, MANY, 64))
    out, peak = traced_peak(lambda: call(q, k, v))
    assert peak < 4 * 2 ** 20, f"peak {peak / 2**20:.1f} MiB: the broadcast rows were copied"
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float32), np.broadcast_to(v[0, 0], out.shape),
                               rtol=2e-3, atol=2e-3)


# the backward functions read broadcast key / value rows in place too
BACKWARD_CALLS = {
    "softmax": (attnx.softmax_attention, {}),
    "softmax causal window": (attnx.softmax_attention, dict(causal=True, window=(5, 2))),
    "softmax bias": (attnx.softmax_attention, dict(bias=np.linspace(-1, 1, 41))),
    "gaussian": (attnx.gaussian_attention, dict(sigma=2.0)),
    "linear": (attnx.linear_attention, {}),
    "chunk": (attnx.linear_attention, dict(causal=True, chunk_size=8)),
    "chunk 16": (attnx.linear_attention, dict(causal=True, chunk_size=16)),
    "recurrent": (attnx.linear_attention, dict(causal=True, method="recurrent")),
    "cumsum": (attnx.linear_attention, dict(causal=True, method="cumsum")),
    "quadratic": (attnx.linear_attention, dict(method="quadratic", window=(6, 0))),
    "key_mask": (attnx.linear_attention, dict(causal=True, key_mask=np.arange(41) % 4 != 0)),
    "favor": (attnx.performer_attention, dict(projection=PROJECTION, causal=True)),
    "taylor": (attnx.taylor_attention, dict(causal=True)),
    "efficient": (attnx.efficient_attention, {}),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("which", ["k", "v", "kv"])
@pytest.mark.parametrize("name", sorted(BACKWARD_CALLS))
def test_backward_of_broadcast_rows_equals_materialised(name, which, dtype):
    fn, options = BACKWARD_CALLS[name]
    q, k, v = inputs(which, dtype)
    dout = make(np.random.default_rng(5), q.shape[:-1] + (E,), dtype)
    out, pullback = attnx.vjp(fn, q, k, v, **options)
    got = pullback(dout)
    want_out, want_pullback = attnx.vjp(fn, q, np.ascontiguousarray(k), np.ascontiguousarray(v),
                                        **options)
    want = want_pullback(dout)
    assert_close(out, want_out, dtype, scale=np.abs(want_out).max())
    for field in ("q", "k", "v"):
        got_grad, want_grad = getattr(got, field), getattr(want, field)
        assert got_grad.shape == want_grad.shape
        assert_close(got_grad, want_grad, dtype, scale=np.abs(want_grad).max())


@pytest.mark.parametrize("backward", ["softmax", "linear", "linear causal"])
def test_backward_of_many_broadcast_keys_copies_nothing(backward):
    """The gradients dk, dv have the broadcast shape (2**18 rows each); the
    keys and values themselves are not copied beside them."""
    rng = np.random.default_rng(6)
    m = 2 ** 18
    q = make(rng, (4, 64))
    k = np.broadcast_to(make(rng, (64,)), (m, 64))
    v = np.broadcast_to(make(rng, (64,)), (m, 64))
    causal = backward == "linear causal"
    fn = attnx.softmax_attention if backward == "softmax" else attnx.linear_attention
    out, pullback = attnx.vjp(fn, q, k, v, **({"causal": True} if causal else {}))
    gradients_bytes = 2 * m * 64 * 8
    g, peak = traced_peak(lambda: pullback(np.ones_like(out)))
    assert peak < gradients_bytes + 4 * 2 ** 20, (
        f"peak {peak / 2**20:.1f} MiB beside {gradients_bytes / 2**20:.0f} MiB of gradients: "
        "the broadcast rows were copied")
    assert g.k.shape == k.shape and g.v.shape == v.shape
    # every key is the same row, so a query weighs the keys it sees equally:
    # dv_j = sum over the queries i that see key j of 1 / (keys i sees);
    # causal (lower right) query i sees m - 3 + i keys
    seen = [m - 3 + i for i in range(4)] if causal else [m] * 4
    np.testing.assert_allclose(g.v[:m - 3], sum(1 / s for s in seen), rtol=1e-9)
