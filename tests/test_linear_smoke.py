"""Quick checks of the kernelised (linear) family against plain numpy float64
formulas written here: every method, feature map, mask mode and streaming.
The full suite is tests/test_linear*.py; this file is a fast smoke run (and
the one run under the sanitizers)."""
import numpy as np
import pytest

import attnx

METHODS = [None, "chunk", "recurrent", "cumsum", "quadratic"]


def elu1(x):
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def unit(x):
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.where(norm > 0, x / np.where(norm > 0, norm, 1), 0)


def focused(x, p=3):
    y = np.maximum(x, 0)
    return np.linalg.norm(y, axis=-1, keepdims=True) * unit(y ** p)


def favor(x, W):
    xt = x * x.shape[-1] ** -0.25
    return np.exp(xt @ W.T - (xt * xt).sum(-1, keepdims=True) / 2) / np.sqrt(len(W))


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


FEATURES = {
    "elu": elu1,
    "relu": lambda x: np.maximum(x, 0),
    "softmax": softmax,
    "taylor": lambda x: np.concatenate([np.ones(x.shape[:-1] + (1,)), unit(x)], -1),
    "focused": focused,
}


def visible(n, m, causal, key_mask=None):
    vis = np.ones((n, m), bool)
    if causal:
        shift = 0 if causal == "upper_left" else m - n
        vis = np.arange(m)[None, :] <= np.arange(n)[:, None] + shift
    return vis if key_mask is None else vis & key_mask[..., None, :]


def attend(s, vis, v, eps=1e-6):
    s = np.where(vis, s, 0)
    return s / np.maximum(s.sum(-1, keepdims=True), eps) @ v


def data(rng, lead, n, m, d=6, e=4):
    return (rng.standard_normal(lead + (n, d)), rng.standard_normal(lead + (m, d)),
            rng.standard_normal(lead + (m, e)))


def close(got, want, tol=1e-11):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1, np.abs(want).max(initial=0)))


@pytest.mark.parametrize("name", sorted(FEATURES))
@pytest.mark.parametrize("causal", [False, True, "upper_left"])
@pytest.mark.parametrize("n,m", [(1, 1), (9, 9), (5, 13), (13, 5), (70, 70)])
def test_feature_maps_and_methods(name, causal, n, m):
    rng = np.random.default_rng(n * 100 + m)
    q, k, v = data(rng, (2,), n, m)
    key_mask = rng.random((2, m)) < 0.7
    phi = FEATURES[name]
    want = attend(phi(q) @ np.swapaxes(phi(k), -1, -2), visible(n, m, causal, key_mask), v)
    for method in METHODS:
        for chunk_size in ([None, 1, 7, 1000] if method in (None, "chunk") else [None]):
            got = attnx.linear_attention(q, k, v, feature_map=name, causal=causal,
                                         key_mask=key_mask, method=method, chunk_size=chunk_size)
            close(got, want)


@pytest.mark.parametrize("heads,n", [(1, 1500), (3, 1500), (1, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_segments_and_threads(heads, n, causal):
    """Few heads, long sequences: the chunk method cuts heads into segments."""
    rng = np.random.default_rng(1)
    q, k, v = data(rng, (heads,), n, n, 16, 16)
    want = attend(elu1(q) @ np.swapaxes(elu1(k), -1, -2), visible(n, n, causal), v)
    for threads in (1, 2, 3):
        attnx.set_num_threads(threads)
        try:
            close(attnx.linear_attention(q, k, v, causal=causal, chunk_size=16), want)
        finally:
            attnx.set_num_threads(2)


def test_favor_and_performer():
    rng = np.random.default_rng(2)
    q, k, v = data(rng, (2,), 17, 17)
    W = attnx.random_features(20, 6, seed=0)
    want = attend(favor(q, W) @ np.swapaxes(favor(k, W), -1, -2), visible(17, 17, True), v)
    for method in METHODS:
        close(attnx.linear_attention(q, k, v, feature_map="favor", projection=W, causal=True,
                                     method=method), want)
        close(attnx.performer_attention(q, k, v, projection=W, causal=True, method=method), want)
    # many features: an estimate of softmax attention
    big = attnx.performer_attention(q * 0.5, k * 0.5, v, num_features=20000, seed=1)
    exact = attnx.softmax_attention(q * 0.5, k * 0.5, v)
    assert np.abs(big - exact).max() < 0.05
    # never inf or NaN, however large the inputs
    for dtype in (np.float32, np.float64):
        out = attnx.performer_attention((q * 1e4).astype(dtype), (k * 1e4).astype(dtype),
                                        v.astype(dtype), projection=W, causal=True)
        assert np.isfinite(out).all()


def test_random_features_are_orthogonal_blocks():
    W = attnx.random_features(10, 4, seed=3)
    assert W.shape == (10, 4)
    for block in (W[:4], W[4:8]):
        u = block / np.linalg.norm(block, axis=1, keepdims=True)
        close(u @ u.T, np.eye(4))


def test_cosformer_efficient_identity_callable():
    rng = np.random.default_rng(4)
    q, k, v = data(rng, (2,), 11, 11)
    pos = np.arange(1, 12)
    cos = np.cos(np.pi / 2 * (pos[:, None] - pos[None, :]) / 20)
    s = np.maximum(q, 0) @ np.swapaxes(np.maximum(k, 0), -1, -2) * cos
    for method in METHODS:
        close(attnx.cosformer_attention(q, k, v, causal=True, M=20, method=method),
              attend(s, visible(11, 11, True), v))
    eff = softmax(q) @ (np.swapaxes(softmax(k, axis=-2), -1, -2) @ v)
    close(attnx.efficient_attention(q, k, v), eff)
    close(attnx.attention_weights(q, k, "efficient").sum(-1), np.ones((2, 11)))
    feats = np.abs(q), np.abs(k)
    want = attend(feats[0] @ np.swapaxes(feats[1], -1, -2), visible(11, 11, True), v)
    close(attnx.linear_attention(*feats, v, feature_map="identity", causal=True), want)
    close(attnx.linear_attention(q, k, v, feature_map=np.abs, causal=True), want)


@pytest.mark.parametrize("name", ["elu", "taylor", "favor", "cosformer"])
@pytest.mark.parametrize("method", ["chunk", "recurrent", "cumsum"])
def test_streaming_equals_one_call(name, method):
    rng = np.random.default_rng(5)
    q, k, v = data(rng, (2, 3), 40, 40)
    W = attnx.random_features(9, 6, seed=0)

    def call(a, b, state, **kw):
        args = (q[..., a:b, :], k[..., a:b, :], v[..., a:b, :])
        if name == "cosformer":
            return attnx.cosformer_attention(*args, M=40, causal=True, method=method,
                                             initial_state=state, return_state=True, **kw)
        return attnx.linear_attention(*args, feature_map=name, causal=True, method=method,
                                      projection=W if name == "favor" else None,
                                      initial_state=state, return_state=True, **kw)

    whole, final = call(0, 40, None)
    for cuts in ([0, 1, 2, 17, 40], list(range(41))):
        state, pieces = None, []
        for a, b in zip(cuts[:-1], cuts[1:]):
            out, state = call(a, b, state)
            pieces.append(out)
        close(np.concatenate(pieces, axis=-2), whole)
        close(state.S, final.S)
        close(state.z, final.z)
        assert state.offset == 40


def test_masks_windows_and_inspection():
    rng = np.random.default_rng(6)
    q, k, v = data(rng, (2,), 12, 15)
    mask = rng.random((2, 12, 15)) < 0.6
    window = (3, 1)
    i, j = np.arange(12)[:, None] + 3, np.arange(15)[None, :]
    vis = mask & (i - 3 <= j) & (j <= i + 1)
    s = elu1(q) @ np.swapaxes(elu1(k), -1, -2)
    close(attnx.linear_attention(q, k, v, mask=mask, window=window), attend(s, vis, v))
    w = attnx.attention_weights(q, k, "linear", mask=mask, window=window)
    close(w @ v, attend(s, vis, v))
    close(attnx.similarity(q, k, "linear", mask=mask, window=window), np.where(vis, s, 0))
    t = attnx.similarity(q, -q, "taylor")
    assert (t >= 0).all()


def test_nan_stays_in_its_rows():
    rng = np.random.default_rng(7)
    q, k, v = data(rng, (), 30, 30)
    v_nan, k_nan = v.copy(), k.copy()
    v_nan[20] = np.nan
    k_nan[5] = np.inf
    key_mask = np.ones(30, bool)
    key_mask[5] = False
    for method in METHODS:
        out = attnx.linear_attention(q, k, v_nan, causal=True, method=method, chunk_size=64)
        assert np.isfinite(out[:20]).all() and np.isnan(out[20:]).all()
        out = attnx.linear_attention(q, k_nan, v, causal=True, key_mask=key_mask, method=method)
        assert np.isfinite(out).all()


def test_empty_and_dtypes():
    rng = np.random.default_rng(8)
    assert attnx.linear_attention(*data(rng, (2,), 0, 5)).shape == (2, 0, 4)
    close(attnx.linear_attention(*data(rng, (2,), 3, 0), causal=True), np.zeros((2, 3, 4)))
    q, k, v = data(rng, (2,), 9, 9)
    want = attnx.linear_attention(q, k, v, causal=True)
    for dtype, tol in ((np.float32, 1e-5), (np.float16, 3e-3)):
        got = attnx.linear_attention(q.astype(dtype), k.astype(dtype), v.astype(dtype), causal=True)
        assert got.dtype == dtype
        close(got.astype(np.float64), want, tol)


@pytest.mark.parametrize("call,error", [
    (lambda q, k, v: attnx.linear_attention(q, k, v, feature_map="nope"), ValueError),
    (lambda q, k, v: attnx.linear_attention(q, k, v, method="nope"), ValueError),
    (lambda q, k, v: attnx.linear_attention(q, k, v, eps=-1), ValueError),
    (lambda q, k, v: attnx.linear_attention(q, k, v, chunk_size=0), ValueError),
    (lambda q, k, v: attnx.efficient_attention(q, k, v, causal=True), ValueError),
    (lambda q, k, v: attnx.cosformer_attention(q, k, v, M=2), ValueError),
    (lambda q, k, v: attnx.cosformer_attention(q[:, :2], k, v, causal=True), ValueError),
    (lambda q, k, v: attnx.linear_attention(q, k, v, feature_map="favor",
                                            projection=np.ones((3, 5))), ValueError),
    (lambda q, k, v: attnx.linear_attention(q, k, v, key_mask=np.ones((2, 4), bool)), ValueError),
    (lambda q, k, v: attnx.linear_attention(q, k, v, key_mask=np.ones((2, 5))), TypeError),
    (lambda q, k, v: attnx.linear_attention(q, k, v, feature_map=lambda x: x - 10), ValueError),
    (lambda q, k, v: attnx.linear_attention(q, k, v, feature_map="identity"), ValueError),
])
def test_bad_input(call, error):
    q, k, v = data(np.random.default_rng(9), (2,), 5, 5)
    with pytest.raises(error):
        call(q, k, v)


def test_state_from_another_shape_or_dtype():
    q, k, v = data(np.random.default_rng(10), (2,), 5, 5)
    _, state = attnx.linear_attention(q, k, v, causal=True, return_state=True)
    with pytest.raises(ValueError, match="initial_state"):
        attnx.linear_attention(q, k, v[..., :3], causal=True, initial_state=state)
    with pytest.raises(TypeError, match="initial_state"):
        attnx.linear_attention(*(x.astype(np.float32) for x in (q, k, v)), initial_state=state)
