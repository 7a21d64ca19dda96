"""Block-sparse, Linformer, pooled and multi-head attention against plain
numpy float64 references (and torch.nn.MultiheadAttention)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnx
from attnx import _systems

import attnx.reference as ref
from helpers import assert_close, hypothesis_settings, vscale  # noqa: E402
from attnx.reference import reduce_to

HYP = hypothesis_settings(60)


def expanded_mask(layout, block_size, n, m):
    """kron(layout, ones(bs, bs))[..., :n, :m], built by a loop over tokens."""
    layout = np.asarray(layout)
    out = np.zeros(layout.shape[:-2] + (n, m), dtype=bool)
    for i in range(n):
        for j in range(m):
            out[..., i, j] = layout[..., i // block_size, j // block_size]
    return out


def lse_close(got, want, dtype):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    assert_close(got[finite], want[finite], dtype, scale=vscale(want))


# --------------------------------------------------------------------------
# block-sparse attention
# --------------------------------------------------------------------------

@HYP
@given(n=st.integers(1, 40), m=st.integers(1, 40), block_size=st.integers(1, 9),
       d=st.integers(1, 6), e=st.integers(1, 5), density=st.floats(0, 1),
       causal=st.sampled_from([False, True, "upper_left"]),
       window=st.sampled_from([None, 3, (0, 2), (None, 1), (5, None)]),
       with_mask=st.booleans(), with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_block_sparse_equals_softmax_under_the_expanded_mask(n, m, block_size, d, e, density, causal,
                                                             window, with_mask, with_bias, seed):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((2, n, d)), rng.standard_normal((2, m, d)), rng.standard_normal((2, m, e))
    layout = rng.random((-(-n // block_size), -(-m // block_size))) < density
    mask = rng.random((2, n, m)) < 0.8 if with_mask else None
    bias = rng.standard_normal((1, n, m)) if with_bias else None
    options = dict(causal=causal, window=window, bias=bias)
    got, lse = attnx.block_sparse_attention(q, k, v, layout, block_size, mask=mask, return_lse=True, **options)
    full = expanded_mask(layout, block_size, n, m)
    want, want_lse = ref.softmax_attention(q, k, v, mask=full if mask is None else full & mask,
                                           return_lse=True, **options)
    assert_close(got, want, np.float64, scale=vscale(v))
    lse_close(lse, want_lse, np.float64)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_block_sparse_per_head_layouts_and_grouped_heads(dtype):
    # a layout per query head (B, Hkv, g, nb, nb) with keys shared by each group
    rng = np.random.default_rng(1)
    B, Hkv, g, n, d, bs = 2, 2, 3, 37, 8, 5
    q = rng.standard_normal((B, Hkv, g, n, d)).astype(dtype)
    k, v = (rng.standard_normal((B, Hkv, 1, n, d)).astype(dtype) for _ in range(2))
    layout = rng.random((1, Hkv, g, 8, 8)) < 0.3
    got = attnx.block_sparse_attention(q, k, v, layout, bs, causal=True)
    assert got.dtype == dtype and got.shape == (B, Hkv, g, n, d)
    want = ref.softmax_attention(q, k, v, mask=expanded_mask(layout, bs, n, n), causal=True)
    assert_close(got, want, dtype, scale=vscale(v))


def test_block_sparse_layout_with_more_leading_axes_than_the_inputs():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((12, 4)) for _ in range(3))
    layout = np.stack([attnx.layouts.local(3, 0), attnx.layouts.local(3, 1)])[:, None]  # (2, 1, 3, 3)
    got = attnx.block_sparse_attention(q, k, v, layout, 4)
    assert got.shape == (2, 1, 12, 4)
    want = ref.softmax_attention(q, k, v, mask=expanded_mask(layout, 4, 12, 12))
    assert_close(got, want, np.float64)


@pytest.mark.parametrize("make_layout", [
    lambda nb: attnx.layouts.local(nb, 1),
    lambda nb: attnx.layouts.strided(nb, 3),
    lambda nb: attnx.layouts.fixed(nb, 4, 1),
    lambda nb: attnx.layouts.longformer(nb, 1, 2),
    lambda nb: attnx.layouts.bigbird(nb, 1, 1, 2, seed=3),
])
def test_block_sparse_with_each_layout_builder(make_layout):
    rng = np.random.default_rng(3)
    n, bs = 70, 8
    q, k, v = (rng.standard_normal((2, n, 16)) for _ in range(3))
    layout = make_layout(-(-n // bs))
    for causal in (False, True):
        got = attnx.block_sparse_attention(q, k, v, layout, bs, causal=causal)
        want = ref.softmax_attention(q, k, v, mask=expanded_mask(layout, bs, n, n), causal=causal)
        assert_close(got, want, np.float64)


def test_block_sparse_computes_only_the_named_blocks(monkeypatch):
    # count the query-key pairs handed to the softmax kernel: calls take
    # queries (R, r, d) against keys (R, K, d), R query blocks at a time
    pairs = []
    real = _systems._C.softmax_attention

    class Counting:
        def softmax_attention(self, q, k, v, **options):
            assert q.ndim == 3 and k.ndim == 3
            pairs.append(q.shape[0] * q.shape[1] * k.shape[1])
            return real(q, k, v, **options)

    monkeypatch.setattr(_systems, "_C", Counting())
    rng = np.random.default_rng(4)
    n, bs = 256, 16
    q, k, v = (rng.standard_normal((n, 8)) for _ in range(3))
    layout = attnx.layouts.bigbird(n // bs, 1, 1, 2, seed=0)
    attnx.block_sparse_attention(q, k, v, layout, bs)
    assert sum(pairs) == layout.sum() * bs * bs
    # one call per count of key blocks per query block (global row, edges, the rest)
    assert len(pairs) == len(np.unique(layout.sum(axis=1)))
    pairs.clear()
    # causal: blocks above the diagonal are skipped as well
    attnx.block_sparse_attention(q, k, v, layout, bs, causal=True)
    assert sum(pairs) == np.tril(layout).sum() * bs * bs
    pairs.clear()
    # a window of 20 tokens reaches at most 3 key blocks of a query block of 16 rows
    attnx.block_sparse_attention(q, k, v, np.ones((16, 16), bool), bs, window=(20, 0))
    assert sum(pairs) == (3 * 16 - 2 - 1) * bs * bs


def test_block_sparse_rows_without_blocks_are_zero():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((10, 4)) for _ in range(3))
    layout = np.array([[True, False], [False, False]])
    out, lse = attnx.block_sparse_attention(q, k, v, layout, 5, return_lse=True)
    np.testing.assert_array_equal(out[5:], 0)
    assert np.all(np.isneginf(lse[5:])) and np.all(np.isfinite(lse[:5]))


def test_block_sparse_out_inputs_unchanged_and_views():
    rng = np.random.default_rng(6)
    base = rng.standard_normal((3, 40, 2, 8))
    q = k = v = base.transpose(0, 2, 1, 3)  # strided (3, 2, 40, 8)
    kept = base.copy()
    layout = attnx.layouts.strided(5, 2)
    out_base = np.zeros((3, 40, 2, 8))
    out = out_base.transpose(0, 2, 1, 3)
    result = attnx.block_sparse_attention(q, k, v, layout, 8, out=out)
    assert result is out
    np.testing.assert_array_equal(base, kept)
    want = ref.softmax_attention(q, k, v, mask=expanded_mask(layout, 8, 40, 40))
    assert_close(out, want, np.float64)


def test_block_sparse_empty_sizes():
    q, k, v = np.zeros((2, 0, 4)), np.zeros((2, 5, 4)), np.zeros((2, 5, 3))
    assert attnx.block_sparse_attention(q, k, v, np.ones((0, 2), bool), 4).shape == (2, 0, 3)
    q = np.ones((2, 5, 4))
    out = attnx.block_sparse_attention(q, k[:, :0], v[:, :0], np.ones((2, 0), bool), 4)
    np.testing.assert_array_equal(out, np.zeros((2, 5, 3)))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(layout=np.ones((3, 3))), TypeError, "layout must be a boolean array"),
    (dict(layout=np.ones((2, 3), bool)), ValueError, r"must broadcast to \(\.\.\., 3, 3\)"),
    (dict(layout=np.ones(3, bool)), ValueError, "layout must have at least 2 dimensions"),
    (dict(block_size=0), ValueError, "block_size must be at least 1"),
    (dict(block_size=2.0), TypeError, "block_size must be an integer"),
    (dict(causal="sideways"), ValueError, "causal must be"),
    (dict(window=-1), ValueError, "window must be at least 0"),
    (dict(mask=np.ones((10, 10))), TypeError, "mask must be a boolean array"),
    (dict(mask=np.ones((4, 10), bool)), ValueError, "mask of shape"),
    (dict(layout=np.ones((5, 3, 3), bool)), ValueError, "leading axes"),
    (dict(out=np.zeros((2, 10, 4), np.float32)), ValueError, "out must be an array of shape"),
    (dict(k=np.zeros((2, 10, 3))), ValueError, "k's last axis"),
])
def test_block_sparse_bad_arguments(kwargs, error, match):
    rng = np.random.default_rng(7)
    arguments = dict(q=rng.standard_normal((2, 10, 4)), k=rng.standard_normal((2, 10, 4)),
                     v=rng.standard_normal((2, 10, 4)), layout=np.ones((3, 3), bool), block_size=4)
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        attnx.block_sparse_attention(**arguments)


def test_block_sparse_complex_input_raises():
    with pytest.raises(TypeError, match="real numbers"):
        attnx.block_sparse_attention(np.ones((4, 2), complex), np.ones((4, 2)), np.ones((4, 2)),
                                     np.ones((1, 1), bool), 4)


# --------------------------------------------------------------------------
# gradients: a dense float64 reference from the formulas
# --------------------------------------------------------------------------

def reference_gradients(dout, q, k, v, scale=None, visible=None, bias=None):
    """Gradients of sum(dout * softmax attention) with P = softmax(scale q k^T + b)
    over the visible keys: dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)),
    dQ = scale dS K, dK = scale dS^T Q, dbias = dS; each summed to its input's shape."""
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    scores = scale * q @ np.swapaxes(k, -1, -2) + (0 if bias is None else bias)
    if visible is not None:
        scores = np.where(visible, scores, -np.inf)
    row_max = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(row_max), row_max, 0))
    total = weights.sum(axis=-1, keepdims=True)
    P = np.where(total > 0, weights / np.where(total > 0, total, 1), 0)
    out = P @ v
    dV = np.swapaxes(P, -1, -2) @ dout
    dP = dout @ np.swapaxes(v, -1, -2)
    dS = P * (dP - np.sum(dout * out, axis=-1, keepdims=True))
    dQ = scale * dS @ k
    dK = scale * np.swapaxes(dS, -1, -2) @ q
    grads = [reduce_to(dQ, q.shape), reduce_to(dK, k.shape), reduce_to(dV, v.shape)]
    grads.append(None if bias is None else reduce_to(dS, np.shape(bias)))
    return out, grads


def test_reference_gradients_match_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(20)
    q, k, v = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((1, 3, 6, 4)), rng.standard_normal((1, 3, 6, 2))
    bias, dout = rng.standard_normal((5, 6)), rng.standard_normal((2, 3, 5, 2))
    tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v, bias)]
    out = torch.nn.functional.scaled_dot_product_attention(*tensors[:3], attn_mask=tensors[3])
    out.backward(torch.from_numpy(dout))
    _, grads = reference_gradients(dout, q, k, v, bias=bias)
    for got, tensor in zip(grads, tensors):
        np.testing.assert_allclose(got, tensor.grad.numpy(), rtol=1e-12, atol=1e-12)


@HYP
@given(n=st.integers(1, 30), m=st.integers(1, 30), block_size=st.integers(1, 8), density=st.floats(0, 1),
       causal=st.sampled_from([False, True, "upper_left"]), window=st.sampled_from([None, 2, (None, 0)]),
       with_mask=st.booleans(), with_bias=st.booleans(), seed=st.integers(0, 2**16))
def test_block_sparse_backward_matches_the_dense_reference(n, m, block_size, density, causal, window,
                                                           with_mask, with_bias, seed):
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((2, 2, n, 3)), rng.standard_normal((1, 2, m, 3)), rng.standard_normal((2, 1, m, 4))
    layout = rng.random((2, 1, -(-n // block_size), -(-m // block_size))) < density
    mask = rng.random((n, m)) < 0.8 if with_mask else None
    bias = rng.standard_normal((2, 1, n, m)) if with_bias else None
    dout = rng.standard_normal((2, 2, n, 4))
    options = dict(causal=causal, window=window, mask=mask, bias=bias, scale=0.7)
    out, pullback = attnx.vjp(attnx.block_sparse_attention, q, k, v, layout, block_size, **options)
    g = pullback(dout)
    visible = ref.visibility(n, m, causal, expanded_mask(layout, block_size, n, m) & (True if mask is None else mask),
                             window)
    want_out, want = reference_gradients(dout, q, k, v, 0.7, visible, bias)
    assert_close(out, want_out, np.float64)
    for got, expected, x in zip((g.q, g.k, g.v, g.bias), want, (q, k, v, bias)):
        if x is None:
            assert got is None
            continue
        assert got.shape == x.shape and got.dtype == np.float64
        assert_close(got, expected, np.float64, scale=vscale(expected))


def test_block_sparse_backward_float32_and_preallocated():
    rng = np.random.default_rng(21)
    n, bs = 64, 8
    q, k, v, dout = (rng.standard_normal((2, n, 16)).astype(np.float32) for _ in range(4))
    layout = attnx.layouts.bigbird(n // bs, 1, 1, 2, seed=1)
    out, lse = attnx.block_sparse_attention(q, k, v, layout, bs, causal=True, return_lse=True)
    dq, dk, dv = (np.empty_like(x) for x in (q, k, v))
    g = attnx.block_sparse_attention_backward(dout, q, k, v, out, lse, layout, bs, causal=True, dq=dq, dk=dk, dv=dv)
    assert g.q is dq and g.k is dk and g.v is dv and dq.dtype == np.float32
    _, want = reference_gradients(dout, q, k, v, visible=ref.visibility(n, n, True, expanded_mask(layout, bs, n, n)))
    for got, expected in zip((dq, dk, dv), want):
        assert_close(got, expected, np.float32, scale=vscale(expected))


def test_block_sparse_backward_checks_the_forward_results():
    q = np.ones((8, 2))
    with pytest.raises(ValueError, match="lse must have the shape"):
        attnx.block_sparse_attention_backward(q, q, q, q, q, np.zeros(7), np.ones((2, 2), bool), 4)


def test_block_sparse_split_into_calls_under_the_gather_budget(monkeypatch):
    # one query block per call when the budget is tiny: same results
    rng = np.random.default_rng(22)
    n, bs = 45, 4
    q, k, v, dout = (rng.standard_normal((2, n, 3)) for _ in range(4))
    layout = rng.random((12, 12)) < 0.4
    whole, pullback = attnx.vjp(attnx.block_sparse_attention, q, k, v, layout, bs, causal=True)
    g = pullback(dout)
    monkeypatch.setattr(_systems._BlockPlan, "GATHER_BYTES", 1)
    split, pullback = attnx.vjp(attnx.block_sparse_attention, q, k, v, layout, bs, causal=True)
    np.testing.assert_allclose(split, whole, rtol=1e-14, atol=1e-15)
    for a, b in zip(pullback(dout)[:3], g[:3]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    want = ref.softmax_attention(q, k, v, mask=expanded_mask(layout, bs, n, n), causal=True)
    assert_close(split, want, np.float64)


# --------------------------------------------------------------------------
# pooled attention
# --------------------------------------------------------------------------

def loop_pool(x, stride, mode):
    """Window by window, the last one over what remains."""
    x = np.asarray(x, dtype=np.float64)
    m = x.shape[-2]
    windows = [x[..., start:start + stride, :] for start in range(0, m, stride)]
    reduce = np.mean if mode == "mean" else np.max
    return np.stack([reduce(w, axis=-2) for w in windows], axis=-2)


def loop_unpool(grad, x, stride, mode):
    x = np.asarray(x, dtype=np.float64)
    out = np.zeros(x.shape)
    for w, start in enumerate(range(0, x.shape[-2], stride)):
        size = min(stride, x.shape[-2] - start)
        for index in np.ndindex(*x.shape[:-2]):
            for c in range(x.shape[-1]):
                if mode == "mean":
                    out[index + (slice(start, start + size), c)] = grad[index + (w, c)] / size
                else:
                    window = x[index + (slice(start, start + size), c)]
                    first = next(j for j in range(size) if window[j] == window.max())
                    out[index + (start + first, c)] = grad[index + (w, c)]
    return out


@pytest.mark.parametrize("mode", ["mean", "max"])
@pytest.mark.parametrize("m, stride", [(12, 3), (13, 4), (5, 1), (5, 7), (1, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_pooled_attention_and_backward_match_the_loops(mode, m, stride, causal):
    rng = np.random.default_rng(30)
    n = 6
    q, k, v = rng.standard_normal((2, 1, n, 4)), rng.standard_normal((2, 3, m, 4)), rng.standard_normal((1, 3, m, 5))
    dout = rng.standard_normal((2, 3, n, 5))
    pk, pv = loop_pool(k, stride, mode), loop_pool(v, stride, mode)
    m_pooled = pk.shape[-2]
    out, pullback = attnx.vjp(attnx.pooled_attention, q, k, v, stride, mode=mode, causal=causal)
    want = ref.softmax_attention(q, pk, pv, causal=causal)
    assert out.shape == want.shape
    assert_close(out, want, np.float64)
    g = pullback(dout)
    _, (dq, dpk, dpv, _) = reference_gradients(dout, q, pk, pv, visible=ref.visibility(n, m_pooled, causal))
    assert_close(g.q, dq, np.float64, scale=vscale(dq))
    assert_close(g.k, loop_unpool(dpk, k, stride, mode), np.float64, scale=vscale(dpk))
    assert_close(g.v, loop_unpool(dpv, v, stride, mode), np.float64, scale=vscale(dpv))


def test_pooled_max_ties_route_to_the_first():
    q = np.ones((1, 2))
    k = np.array([[1.0, 2.0], [1.0, 2.0], [0.0, 2.0], [3.0, 3.0], [3.0, -1.0]])
    v = k.copy()
    out, lse = attnx.pooled_attention(q, k, v, 3, mode="max", return_lse=True)
    g = attnx.pooled_attention_backward(np.ones((1, 2)), q, k, v, out, lse, 3, mode="max")
    # window 0 holds rows 0-2: feature 0 ties rows 0 and 1, feature 1 ties all three
    assert np.all(g.k[1:3] == 0) and np.all(g.v[1:3] == 0)
    assert np.all(g.k[0] != 0) and np.all(g.v[0] != 0)
    # window 1 (rows 3-4): feature 0 ties, feature 1 is row 3's
    assert np.all(g.k[4] == 0) and np.all(g.v[4] == 0)
    assert np.all(g.k[3] != 0) and np.all(g.v[3] != 0)


def test_pooled_mean_matches_torch_avg_pool_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(31)
    q, k, v, dout = (rng.standard_normal((2, 12, 4)) for _ in range(4))
    tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    pooled = [torch.nn.functional.avg_pool1d(t.transpose(1, 2), 3).transpose(1, 2) for t in tensors[1:]]
    out = torch.nn.functional.scaled_dot_product_attention(tensors[0], *pooled)
    out.backward(torch.from_numpy(dout))
    got, pullback = attnx.vjp(attnx.pooled_attention, q, k, v, 3)
    np.testing.assert_allclose(got, out.detach().numpy(), rtol=1e-12, atol=1e-12)
    for a, t in zip(pullback(dout)[:3], tensors):
        np.testing.assert_allclose(a, t.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_pooled_dtypes(dtype):
    rng = np.random.default_rng(32)
    q, k, v = (rng.standard_normal((3, 10, 4)).astype(dtype) for _ in range(3))
    got = attnx.pooled_attention(q, k, v, 4)
    assert got.dtype == dtype
    want = ref.softmax_attention(q, loop_pool(k, 4, "mean"), loop_pool(v, 4, "mean"))
    assert_close(got, want, dtype)


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((0,), {}, ValueError, "stride must be at least 1"),
    ((2.0,), {}, TypeError, "stride must be an integer"),
    ((2,), dict(mode="median"), ValueError, "mode must be 'mean' or 'max'"),
])
def test_pooled_bad_arguments(args, kwargs, error, match):
    x = np.ones((4, 2))
    with pytest.raises(error, match=match):
        attnx.pooled_attention(x, x, x, *args, **kwargs)


# --------------------------------------------------------------------------
# Linformer
# --------------------------------------------------------------------------

@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("E_shape", [(3, 10), (1, 4, 3, 10)])
def test_linformer_matches_torch_autograd(shared, E_shape):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(33)
    q, k, v = rng.standard_normal((2, 4, 7, 5)), rng.standard_normal((2, 4, 10, 5)), rng.standard_normal((2, 4, 10, 6))
    E, F = rng.standard_normal(E_shape) * 0.3, rng.standard_normal((3, 10)) * 0.3
    dout = rng.standard_normal((2, 4, 7, 6))
    bias = rng.standard_normal((7, 3))
    tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v, E, F, bias)]
    tq, tk, tv, tE, tF, tb = tensors
    out = torch.nn.functional.scaled_dot_product_attention(tq, tE @ tk, (tE if shared else tF) @ tv, attn_mask=tb)
    out.backward(torch.from_numpy(dout))
    got, pullback = attnx.vjp(attnx.linformer_attention, q, k, v, E, None if shared else F, bias=bias)
    np.testing.assert_allclose(got, out.detach().numpy(), rtol=1e-12, atol=1e-12)
    g = pullback(dout)
    for a, t in zip((g.q, g.k, g.v, g.bias), (tq, tk, tv, tb)):
        np.testing.assert_allclose(a, t.grad.numpy(), rtol=1e-10, atol=1e-12)
    dE, dF = g.projection
    assert dE.shape == E.shape
    np.testing.assert_allclose(dE, tE.grad.numpy(), rtol=1e-10, atol=1e-12)
    if shared:
        assert dF is None
    else:
        np.testing.assert_allclose(dF, tF.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_linformer_equals_softmax_over_projected_keys_float32():
    rng = np.random.default_rng(34)
    q, k, v = (rng.standard_normal((2, 16, 8)).astype(np.float32) for _ in range(3))
    E = (rng.standard_normal((4, 16)) / 4).astype(np.float32)
    got = attnx.linformer_attention(q, k, v, E)
    assert got.dtype == np.float32
    E64 = E.astype(np.float64)
    assert_close(got, ref.softmax_attention(q, E64 @ k.astype(np.float64), E64 @ v.astype(np.float64)), np.float32)


def test_linformer_bad_projection():
    x = np.ones((5, 2))
    with pytest.raises(ValueError, match="E must have shape"):
        attnx.linformer_attention(x, x, x, np.ones((3, 4)))
    with pytest.raises(ValueError, match="F must have shape"):
        attnx.linformer_attention(x, x, x, np.ones((3, 5)), np.ones((3, 4)))
    with pytest.raises(TypeError, match="E must hold real numbers"):
        attnx.linformer_attention(x, x, x, np.ones((3, 5), complex))


# --------------------------------------------------------------------------
# multi-head attention
# --------------------------------------------------------------------------

def literal_rotary(x):
    """Rotate-half RoPE at positions 0..L-1 along -2, by complex numbers."""
    half = x.shape[-1] // 2
    theta = np.arange(x.shape[-2])[:, None] * 10000.0 ** (-2.0 * np.arange(half) / x.shape[-1])
    z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * theta)
    return np.concatenate([z.real, z.imag], axis=-1)


def literal_mha(x_q, x_kv, w, b, heads, kv_heads, causal=False, mask=None, positions=None):
    """Head by head in float64, with plain loops and slices."""
    x_q, x_kv = np.asarray(x_q, np.float64), np.asarray(x_kv, np.float64)
    if positions == "sinusoidal":
        table = lambda L, c: np.array([[np.sin(p / 10000 ** (2 * (i // 2) / c)) if i % 2 == 0
                                        else np.cos(p / 10000 ** (2 * (i // 2) / c)) for i in range(c)]
                                       for p in range(L)])
        x_q, x_kv = x_q + table(*x_q.shape[-2:]), x_kv + table(*x_kv.shape[-2:])
    q, k, v = x_q @ w["q"] + b["q"], x_kv @ w["k"] + b["k"], x_kv @ w["v"] + b["v"]
    d, e = q.shape[-1] // heads, v.shape[-1] // kv_heads
    n, m = q.shape[-2], k.shape[-2]
    outputs = []
    for h in range(heads):
        kv = h // (heads // kv_heads)
        qh, kh, vh = q[..., h * d:(h + 1) * d], k[..., kv * d:(kv + 1) * d], v[..., kv * e:(kv + 1) * e]
        if positions == "rotary":
            qh, kh = literal_rotary(qh), literal_rotary(kh)
        visible = np.ones((n, m), bool) if not causal else np.tril(np.ones((n, m), bool), m - n)
        if mask is not None:
            visible = visible & mask[..., min(h, mask.shape[-3] - 1), :, :]
        outputs.append(ref.softmax_attention(qh, kh, vh, mask=visible))
    return np.concatenate(outputs, axis=-1) @ w["o"] + b["o"]


def mha_parameters(rng, in_q, in_kv, heads, kv_heads, d, e, out, dtype=np.float64):
    w = dict(q=rng.standard_normal((in_q, heads * d)), k=rng.standard_normal((in_kv, kv_heads * d)),
             v=rng.standard_normal((in_kv, kv_heads * e)), o=rng.standard_normal((heads * e, out)))
    b = dict(q=rng.standard_normal(heads * d), k=rng.standard_normal(kv_heads * d),
             v=rng.standard_normal(kv_heads * e), o=rng.standard_normal(out))
    w = {key: (x / np.sqrt(x.shape[0])).astype(dtype) for key, x in w.items()}
    return w, {key: x.astype(dtype) for key, x in b.items()}


def call_mha(x_q, x_kv, w, b, heads, **kwargs):
    return attnx.multi_head_attention(x_q, x_kv, w["q"], w["k"], w["v"], w["o"], heads, b_q=b["q"],
                                      b_k=b["k"], b_v=b["v"], b_o=b["o"], **kwargs)


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("positions", [None, "rotary", "sinusoidal"])
@pytest.mark.parametrize("causal", [False, True])
def test_multi_head_matches_the_literal_layer(heads, kv_heads, positions, causal):
    rng = np.random.default_rng(40)
    x_q, x_kv = rng.standard_normal((2, 7, 12)), rng.standard_normal((2, 9, 10))
    w, b = mha_parameters(rng, 12, 10, heads, kv_heads, d=4, e=3, out=5)
    pad = np.ones((2, 1, 1, 9), bool)
    pad[0, ..., 7:] = False
    got = call_mha(x_q, x_kv, w, b, heads, num_kv_heads=kv_heads, causal=causal, mask=pad, positions=positions)
    want = literal_mha(x_q, x_kv, w, b, heads, kv_heads, causal=causal, mask=pad, positions=positions)
    assert got.shape == (2, 7, 5)
    assert_close(got, want, np.float64, scale=vscale(want))


def test_multi_head_per_head_mask_and_self_attention():
    rng = np.random.default_rng(41)
    x = rng.standard_normal((3, 8, 6))
    w, b = mha_parameters(rng, 6, 6, 4, 2, d=3, e=2, out=6)
    mask = rng.random((3, 4, 8, 8)) < 0.7
    mask[..., 0] = True
    got = call_mha(x, None, w, b, 4, num_kv_heads=2, mask=mask)
    assert_close(got, literal_mha(x, x, w, b, 4, 2, mask=mask), np.float64)


@pytest.mark.parametrize("variant, options", [
    ("linear", dict(causal=True)),
    ("cosformer", {}),
    ("block_sparse", dict(layout=np.tril(np.ones((3, 3), bool)), block_size=4)),
    ("pooled", dict(stride=3)),
])
def test_multi_head_variants_equal_the_front_end_per_head(variant, options):
    rng = np.random.default_rng(42)
    x = rng.standard_normal((2, 10, 8))
    w, b = mha_parameters(rng, 8, 8, 4, 4, d=2, e=2, out=8)
    got = call_mha(x, x, w, b, 4, variant=variant, **options)
    front = {"linear": attnx.linear_attention, "cosformer": attnx.cosformer_attention,
             "block_sparse": attnx.block_sparse_attention, "pooled": attnx.pooled_attention}[variant]
    q, k, v = x @ w["q"] + b["q"], x @ w["k"] + b["k"], x @ w["v"] + b["v"]
    heads = [front(q[..., 2 * h:2 * h + 2], k[..., 2 * h:2 * h + 2], v[..., 2 * h:2 * h + 2], **options)
             for h in range(4)]
    want = np.concatenate(heads, axis=-1) @ w["o"] + b["o"]
    assert_close(got, want, np.float64)


@pytest.mark.parametrize("causal", [False, True])
def test_multi_head_matches_torch_multihead_attention(causal):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(43)
    E, H, n = 16, 4, 11
    layer = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=torch.float64)
    x = rng.standard_normal((2, n, E))
    pad = np.zeros((2, n), bool)
    pad[1, 8:] = True  # torch: True = padding
    causal_mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1) if causal else None
    tx = torch.from_numpy(x)
    want, _ = layer(tx, tx, tx, key_padding_mask=torch.from_numpy(pad), attn_mask=causal_mask, need_weights=False)
    W, B = layer.in_proj_weight.detach().numpy(), layer.in_proj_bias.detach().numpy()
    got = attnx.multi_head_attention(
        x, x, W[:E].T, W[E:2 * E].T, W[2 * E:].T, layer.out_proj.weight.detach().numpy().T, H,
        b_q=B[:E], b_k=B[E:2 * E], b_v=B[2 * E:], b_o=layer.out_proj.bias.detach().numpy(),
        causal=causal, mask=~pad[:, None, None, :])
    np.testing.assert_allclose(got, want.detach().numpy(), rtol=1e-11, atol=1e-11)


def test_multi_head_float32():
    rng = np.random.default_rng(44)
    x = rng.standard_normal((2, 9, 8)).astype(np.float32)
    w, b = mha_parameters(rng, 8, 8, 2, 2, d=4, e=4, out=8, dtype=np.float32)
    got = call_mha(x, x, w, b, 2, positions="rotary")
    assert got.dtype == np.float32
    want = literal_mha(x, x, w, b, 2, 2, positions="rotary")
    assert_close(got, want, np.float32, scale=vscale(want))


@pytest.mark.parametrize("change, error, match", [
    (dict(num_heads=3), ValueError, r"w_q must have shape \(8, 3 \* d\)"),
    (dict(num_kv_heads=3), ValueError, r"num_kv_heads \(3\) must divide num_heads \(4\)"),
    (dict(variant="nope"), ValueError, "unknown variant"),
    (dict(positions="learned"), ValueError, "positions must be"),
    (dict(w_k=np.ones((8, 6))), ValueError, "w_k must have shape"),
    (dict(w_o=np.ones((7, 8))), ValueError, "w_o must have shape"),
    (dict(b_q=np.ones(5)), ValueError, r"b_q must have shape \(8,\)"),
    (dict(mask=np.ones((2, 3, 5, 5), bool)), ValueError, "head axis"),
    (dict(return_lse=True), TypeError, "takes no return_lse"),
])
def test_multi_head_bad_arguments(change, error, match):
    rng = np.random.default_rng(45)
    arguments = dict(x_q=rng.standard_normal((2, 5, 8)), x_kv=None, w_q=np.ones((8, 8)), w_k=np.ones((8, 8)),
                     w_v=np.ones((8, 8)), w_o=np.ones((8, 8)), num_heads=4)
    arguments.update(change)
    with pytest.raises(error, match=match):
        attnx.multi_head_attention(**arguments)


# --------------------------------------------------------------------------
# FLatten's depthwise convolution term (attnx/_dwc.py)
# --------------------------------------------------------------------------

from attnx import _dwc  # noqa: E402


def loop_dwc(v, weight, grid):
    """Token by token, channel by channel, offsets by offsets, zero outside."""
    v = np.asarray(v, np.float64)
    out = np.zeros(v.shape)
    kernel = weight.shape[1:]
    for lead in np.ndindex(*v.shape[:-2]):
        for t in range(v.shape[-2]):
            position = np.unravel_index(t, grid)
            for c in range(v.shape[-1]):
                total = 0.0
                for offset in np.ndindex(*kernel):
                    source = [p + o - (k - 1) // 2 for p, o, k in zip(position, offset, kernel)]
                    if all(0 <= s < g for s, g in zip(source, grid)):
                        total += weight[(c,) + offset] * v[lead + (np.ravel_multi_index(source, grid), c)]
                out[lead + (t, c)] = total
    return out


@pytest.mark.parametrize("spatial, kernel, n", [(None, (3,), 9), (None, (5,), 4), (None, (1,), 3),
                                                ((3, 4), (3, 3), 12), ((2, 5), (3, 5), 10)])
def test_depthwise_convolution_matches_the_loop_and_torch(spatial, kernel, n):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(50)
    v, dout = rng.standard_normal((2, 3, n, 4)), rng.standard_normal((2, 3, n, 4))
    weight = rng.standard_normal((4,) + kernel)
    got = _dwc.depthwise_convolution(v, weight, spatial)
    np.testing.assert_allclose(got, loop_dwc(v, weight, spatial or (n,)), rtol=1e-12, atol=1e-12)
    # torch: (N, C, L) or (N, C, H, W) with groups = channels, padding (k - 1) / 2
    tv, tw = torch.tensor(v, requires_grad=True), torch.tensor(weight, requires_grad=True)
    x = tv.reshape(6, *(spatial or (n,)), 4).movedim(-1, 1)
    conv = torch.nn.functional.conv1d if spatial is None else torch.nn.functional.conv2d
    y = conv(x, tw.unsqueeze(1), padding=tuple(k // 2 for k in kernel), groups=4)
    y = y.movedim(1, -1).reshape(2, 3, n, 4)
    np.testing.assert_allclose(got, y.detach().numpy(), rtol=1e-12, atol=1e-12)
    y.backward(torch.from_numpy(dout))
    dv, dweight = _dwc.depthwise_convolution_backward(dout, v, weight, spatial)
    np.testing.assert_allclose(dv, tv.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dweight, tw.grad.numpy(), rtol=1e-11, atol=1e-11)


def test_add_depthwise_convolution_to_focused_attention():
    rng = np.random.default_rng(51)
    q, k, v = (rng.standard_normal((2, 12, 4)) for _ in range(3))
    weight = rng.standard_normal((4, 3, 3))
    base = attnx.focused_linear_attention(q, k, v)
    got = _dwc.add_depthwise_convolution(base, v, weight, spatial=(3, 4))
    np.testing.assert_allclose(got, base + loop_dwc(v, weight, (3, 4)), rtol=1e-12, atol=1e-12)
    assert _dwc.add_depthwise_convolution(base, v, None) is base


@pytest.mark.parametrize("args, error, match", [
    ((np.ones((5, 4)), np.ones((4, 2))), ValueError, "odd"),
    ((np.ones((5, 4)), np.ones((3, 3))), ValueError, r"shape \(e, ks\) = \(4, ks\)"),
    ((np.ones((6, 4)), np.ones((4, 3, 3)), (2, 2)), ValueError, "holds 4 tokens but v has n = 6"),
    ((np.ones((6, 4)), np.ones((4, 3)), (2, 3)), ValueError, r"shape \(e, kh, kw\)"),
    ((np.ones((6, 4)), np.ones((4, 3, 3)), (2, -3)), ValueError, "spatial must be"),
    ((np.ones((6, 4)), np.ones((4, 3), complex)), TypeError, "real numbers"),
])
def test_depthwise_convolution_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        _dwc.depthwise_convolution(*args)


def test_add_depthwise_convolution_needs_n_equal_m():
    with pytest.raises(ValueError, match="n must equal m"):
        _dwc.add_depthwise_convolution(np.zeros((3, 4)), np.ones((5, 4)), np.ones((4, 3)))


def test_block_sparse_never_reads_blocks_the_layout_leaves_out():
    # NaN keys and values in blocks no query block names cannot reach the output
    rng = np.random.default_rng(61)
    n, bs = 48, 8
    q, k, v = (rng.standard_normal((2, n, 4)) for _ in range(3))
    layout = attnx.layouts.local(6, 1)
    layout[:, 3] = False
    k[:, 24:32], v[:, 24:32] = np.nan, np.nan
    out = attnx.block_sparse_attention(q, k, v, layout, bs)
    assert np.all(np.isfinite(out))
    want = ref.softmax_attention(q, np.nan_to_num(k), np.nan_to_num(v), mask=expanded_mask(layout, bs, n, n))
    assert_close(out, want, np.float64)


@pytest.mark.parametrize("dtype", [np.float16, np.int64, np.bool_])
def test_block_sparse_dtypes_follow_softmax(dtype):
    rng = np.random.default_rng(62)
    q, k, v = ((rng.standard_normal((2, 20, 4)) * 2).astype(dtype) for _ in range(3))
    layout = rng.random((3, 3)) < 0.6
    got = attnx.block_sparse_attention(q, k, v, layout, 7)
    want = attnx.softmax_attention(q, k, v, mask=expanded_mask(layout, 7, 20, 20))
    assert got.dtype == want.dtype
    assert_close(got, want.astype(np.float64), np.float16 if dtype == np.float16 else np.float64)


def test_block_taker_reads_bands_in_place_and_copies_the_rest():
    x = np.arange(2 * 6 * 4 * 3, dtype=np.float64).reshape(2, 6, 4, 3)  # (..., nb, bs, c)
    take = _systems._BlockTaker()
    band = np.array([[0, 1, 2], [1, 2, 3], [2, 3, 4]])
    scattered = np.array([[0, 2, 5], [1, 3, 4]])
    for columns in (band, scattered):
        got = take("k", x, columns)
        want = np.concatenate([np.concatenate([x[:, j] for j in row], axis=-2)[:, None] for row in columns], axis=1)
        np.testing.assert_array_equal(got, want)
        assert np.shares_memory(got, x) == (columns is band)
    rows = np.array([1, 2, 3])
    assert np.shares_memory(take("q", x, rows), x)
    np.testing.assert_array_equal(take("q", x, np.array([0, 4])), x[:, [0, 4]])


def test_pooled_and_linformer_pass_dropout_to_softmax_and_its_backward():
    rng = np.random.default_rng(60)
    q, k, v, dout = (rng.standard_normal((2, 12, 4)) for _ in range(4))
    E = rng.standard_normal((5, 12)) / 4
    for front, pooled_k, pooled_v, args in (
            (attnx.pooled_attention, loop_pool(k, 3, "mean"), loop_pool(v, 3, "mean"), (3,)),
            (attnx.linformer_attention, E @ k, E @ v, (E,))):
        out, pullback = attnx.vjp(front, q, k, v, *args, dropout_p=0.4, seed=7)
        want, lse = attnx.softmax_attention(q, pooled_k, pooled_v, dropout_p=0.4, seed=7, return_lse=True)
        np.testing.assert_allclose(out, want, rtol=1e-13, atol=1e-13)
        assert not np.allclose(want, attnx.softmax_attention(q, pooled_k, pooled_v))  # something was dropped
        inner = attnx.softmax_attention_backward(dout, q, pooled_k, pooled_v, want, lse, dropout_p=0.4, seed=7)
        np.testing.assert_allclose(pullback(dout).q, inner.q, rtol=1e-12, atol=1e-13)


def test_multi_head_grouped_query_matches_torch_sdpa_enable_gqa():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(46)
    x = rng.standard_normal((2, 10, 12))
    w, b = mha_parameters(rng, 12, 12, 6, 2, d=4, e=5, out=7)
    got = call_mha(x, x, w, b, 6, num_kv_heads=2, causal=True)
    project = lambda key, heads, size: torch.from_numpy(x @ w[key] + b[key]).reshape(2, 10, heads, size).transpose(1, 2)
    heads = torch.nn.functional.scaled_dot_product_attention(
        project("q", 6, 4), project("k", 2, 4), project("v", 2, 5), is_causal=True, enable_gqa=True)
    want = heads.transpose(1, 2).reshape(2, 10, 30).numpy() @ w["o"] + b["o"]
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-11)


# --------------------------------------------------------------------------
# the multi-head layer's backward, against torch autograd of a torch layer
# written head by head from the formulas
# --------------------------------------------------------------------------

def torch_layer(torch, x_q, x_kv, w, b, heads, kv_heads, variant, positions, options):
    """The multi-head layer in torch operations, one head at a time."""
    if positions == "sinusoidal":
        def table(length, c):
            p = torch.arange(length, dtype=torch.float64)[:, None]
            i = torch.arange(c, dtype=torch.float64)
            angle = p / 10000.0 ** (2 * torch.div(i, 2, rounding_mode="floor") / c)
            return torch.where(i % 2 == 0, torch.sin(angle), torch.cos(angle))
        x_q, x_kv = x_q + table(*x_q.shape[-2:]), x_kv + table(*x_kv.shape[-2:])
    q, k, v = x_q @ w["q"] + b["q"], x_kv @ w["k"] + b["k"], x_kv @ w["v"] + b["v"]
    d, e = q.shape[-1] // heads, v.shape[-1] // kv_heads
    n, m = q.shape[-2], k.shape[-2]

    def rotate(x):
        half, length = x.shape[-1] // 2, x.shape[-2]
        angle = torch.arange(length, dtype=torch.float64)[:, None] * 10000.0 ** (-2.0 * torch.arange(half, dtype=torch.float64) / x.shape[-1])
        a, c = x[..., :half], x[..., half:]
        return torch.cat([a * angle.cos() - c * angle.sin(), c * angle.cos() + a * angle.sin()], -1)

    outputs = []
    for h in range(heads):
        kv = h // (heads // kv_heads)
        qh, kh, vh = q[..., h * d:(h + 1) * d], k[..., kv * d:(kv + 1) * d], v[..., kv * e:(kv + 1) * e]
        if positions == "rotary":
            qh, kh = rotate(qh), rotate(kh)
        if variant == "pooled":
            s = options["stride"]
            kh = torch.stack([kh[..., i:i + s, :].mean(-2) for i in range(0, m, s)], -2)
            vh = torch.stack([vh[..., i:i + s, :].mean(-2) for i in range(0, m, s)], -2)
        if variant == "linformer":
            kh, vh = options["E"] @ kh, options["E"] @ vh
        keys = kh.shape[-2]
        visible = torch.ones(n, keys, dtype=torch.bool)
        if options.get("causal"):
            visible = visible.tril(keys - n)
        if options.get("mask") is not None:
            visible = visible & torch.as_tensor(options["mask"])[..., 0, :, :]
        if variant == "block_sparse":
            bs = options["block_size"]
            visible = visible & torch.as_tensor(options["layout"]).repeat_interleave(bs, 0).repeat_interleave(bs, 1)[:n, :keys]
        if variant == "linear":
            features = lambda x: torch.nn.functional.elu(x) + 1
            s = (features(qh) @ features(kh).transpose(-1, -2)) * visible
            weights = s / s.sum(-1, keepdim=True).clamp_min(1e-6)
        else:
            if variant == "gaussian":
                sigma = options["sigma"]
                scores = -((qh[..., :, None, :] - kh[..., None, :, :]) ** 2).sum(-1) / (2 * sigma ** 2)
            else:
                scores = qh @ kh.transpose(-1, -2) * options.get("scale", d ** -0.5)
            if options.get("bias") is not None:
                scores = scores + options["bias"][..., h, :, :]
            weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
        outputs.append(weights @ vh)
    return torch.cat(outputs, -1) @ w["o"] + b["o"]


MHA_BACKWARD_CASES = [
    ("softmax", dict(causal=True, scale=0.4), None, True),
    ("softmax", dict(bias="per head"), "rotary", False),
    ("softmax", dict(mask="padding"), "sinusoidal", True),
    ("gaussian", dict(sigma=1.3, causal=True), None, False),
    ("linear", dict(causal=True), "rotary", True),
    ("block_sparse", dict(layout=np.tril(np.ones((3, 3), bool)), block_size=4), None, True),
    ("pooled", dict(stride=3), "sinusoidal", False),
    ("linformer", dict(E="learned"), None, True),
]


@pytest.mark.parametrize("variant, options, positions, self_attention", MHA_BACKWARD_CASES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (4, 2)])
def test_multi_head_backward_matches_torch_autograd(variant, options, positions, self_attention, heads, kv_heads):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(70)
    n, m = (12, 12) if self_attention or variant == "linear" else (10, 12)
    x_q = rng.standard_normal((2, n, 8))
    x_kv = x_q if self_attention else rng.standard_normal((2, m, 6))
    w, b = mha_parameters(rng, 8, x_kv.shape[-1], heads, kv_heads, d=4, e=3, out=5)
    options = dict(options)
    if options.get("bias") == "per head":
        options["bias"] = rng.standard_normal((heads, n, m))
    if options.get("mask") == "padding":
        options["mask"] = np.ones((2, 1, 1, m), bool)
        options["mask"][1, ..., 8:] = False
    if options.get("E") == "learned":
        options["E"] = rng.standard_normal((5, m)) / 3
    dout = rng.standard_normal((2, n, 5))
    names = ("x_q", "x_kv", "w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")
    arrays = [x_q, x_kv, w["q"], w["k"], w["v"], w["o"], b["q"], b["k"], b["v"], b["o"]]
    tensors = {name: torch.tensor(a, requires_grad=True) for name, a in zip(names, arrays)}
    t_options = {key: torch.tensor(value, requires_grad=key in ("bias", "E")) if isinstance(value, np.ndarray)
                 and value.dtype != bool else value for key, value in options.items()}
    want = torch_layer(torch, tensors["x_q"], tensors["x_q"] if self_attention else tensors["x_kv"],
                       {p: tensors[f"w_{p}"] for p in "qkvo"}, {p: tensors[f"b_{p}"] for p in "qkvo"},
                       heads, kv_heads, variant, positions, t_options)
    want.backward(torch.from_numpy(dout))
    call = (x_q, None if self_attention else x_kv, w["q"], w["k"], w["v"], w["o"], heads)
    kwargs = dict(b_q=b["q"], b_k=b["k"], b_v=b["v"], b_o=b["o"], num_kv_heads=kv_heads, variant=variant,
                  positions=positions, **options)
    g = attnx.multi_head_attention_backward(dout, *call, **kwargs)
    out, pullback = attnx.vjp(attnx.multi_head_attention, *call, **kwargs)
    np.testing.assert_allclose(out, want.detach().numpy(), rtol=1e-11, atol=1e-11)
    assert isinstance(g, attnx.MultiHeadGradients)
    for got in (g, pullback(dout)):
        for name in names:
            reference = tensors[name].grad
            if self_attention and name == "x_kv":
                assert got.x_kv is None
                continue
            assert getattr(got, name).shape == reference.shape
            np.testing.assert_allclose(getattr(got, name), reference.numpy(), rtol=1e-10, atol=1e-11, err_msg=name)
        if "bias" in t_options:
            np.testing.assert_allclose(got.bias, t_options["bias"].grad.numpy(), rtol=1e-10, atol=1e-11)
        if variant == "linformer":
            assert got.projection[1] is None
            np.testing.assert_allclose(got.projection[0], t_options["E"].grad.numpy(), rtol=1e-10, atol=1e-11)


def test_multi_head_backward_float32_without_biases_and_errors():
    rng = np.random.default_rng(71)
    x = rng.standard_normal((3, 7, 8)).astype(np.float32)
    w, _ = mha_parameters(rng, 8, 8, 2, 2, d=4, e=4, out=6, dtype=np.float32)
    dout = rng.standard_normal((3, 7, 6)).astype(np.float32)
    g = attnx.multi_head_attention_backward(dout, x, None, w["q"], w["k"], w["v"], w["o"], 2, causal=True)
    assert g.b_q is None and g.b_o is None and g.x_kv is None
    assert all(getattr(g, name).dtype == np.float32 for name in ("x_q", "w_q", "w_k", "w_v", "w_o"))
    g64 = attnx.multi_head_attention_backward(dout.astype(np.float64), x.astype(np.float64), None,
                                              *(w[p].astype(np.float64) for p in "qkvo"), 2, causal=True)
    for name in ("x_q", "w_q", "w_k", "w_v", "w_o"):
        assert_close(getattr(g, name), getattr(g64, name), np.float32, scale=vscale(getattr(g64, name)))
    with pytest.raises(ValueError, match=r"dout must have the layer output's shape \(3, 7, 6\)"):
        attnx.multi_head_attention_backward(dout[:, :5], x, None, w["q"], w["k"], w["v"], w["o"], 2)


# --------------------------------------------------------------------------
# attention_weights and similarity of the systems over fewer keys
# --------------------------------------------------------------------------

def assert_rows_sum_to_one(weights, visible_rows):
    sums = weights.sum(axis=-1)
    np.testing.assert_allclose(sums[visible_rows], 1.0, rtol=1e-12)
    np.testing.assert_array_equal(sums[~visible_rows], 0.0)
    assert np.all(weights >= 0)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_weights_block_sparse(causal):
    rng = np.random.default_rng(80)
    q, k, v = rng.standard_normal((2, 11, 4)), rng.standard_normal((2, 11, 4)), rng.standard_normal((2, 11, 3))
    layout = rng.random((3, 3)) < 0.5
    layout[0, 0] = False
    w = attnx.attention_weights(q, k, "block_sparse", layout=layout, block_size=4, causal=causal)
    assert w.shape == (2, 11, 11)
    visible = expanded_mask(layout, 4, 11, 11)
    if causal:
        visible &= np.tril(np.ones((11, 11), bool))
    assert np.all(w[:, ~visible] == 0)
    assert_rows_sum_to_one(w, np.broadcast_to(visible.any(axis=-1), (2, 11)))
    np.testing.assert_allclose(w @ v, attnx.block_sparse_attention(q, k, v, layout, 4, causal=causal),
                               rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(w, ref.softmax_weights(q, k, mask=visible), rtol=1e-12, atol=1e-13)
    s = attnx.similarity(q, k, "block_sparse", layout=layout, block_size=4, causal=causal)
    np.testing.assert_allclose(s, np.where(visible, np.exp(q @ np.swapaxes(k, -1, -2) / 2), 0), rtol=1e-12)


@pytest.mark.parametrize("mode", ["mean", "max"])
def test_attention_weights_pooled(mode):
    rng = np.random.default_rng(81)
    q, k, v = rng.standard_normal((2, 6, 4)), rng.standard_normal((2, 10, 4)), rng.standard_normal((2, 10, 3))
    w = attnx.attention_weights(q, k, "pooled", stride=4, mode=mode, causal=True)
    assert w.shape == (2, 6, 3)  # ceil(10 / 4) pooled keys
    # lower-right causal over 3 pooled keys: query i sees j <= i - 3
    assert_rows_sum_to_one(w, np.broadcast_to(np.arange(6) >= 3, (2, 6)))
    np.testing.assert_allclose(w @ loop_pool(v, 4, mode), attnx.pooled_attention(q, k, v, 4, mode, causal=True),
                               rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(w, ref.softmax_weights(q, loop_pool(k, 4, mode), causal=True), rtol=1e-12, atol=1e-13)


def test_attention_weights_linformer():
    rng = np.random.default_rng(82)
    q, k, v = rng.standard_normal((2, 6, 4)), rng.standard_normal((2, 10, 4)), rng.standard_normal((2, 10, 3))
    E, F = rng.standard_normal((5, 10)) / 3, rng.standard_normal((5, 10)) / 3
    bias = rng.standard_normal((6, 5))
    w = attnx.attention_weights(q, k, "linformer", E=E, F=F, bias=bias)
    assert w.shape == (2, 6, 5)
    assert_rows_sum_to_one(w, np.ones((2, 6), bool))
    np.testing.assert_allclose(w @ (F @ v), attnx.linformer_attention(q, k, v, E, F, bias=bias), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(w, ref.softmax_weights(q, E @ k, bias=bias), rtol=1e-12, atol=1e-13)
    s = attnx.similarity(q, k, "linformer", E=E)
    np.testing.assert_allclose(s, np.exp(q @ np.swapaxes(E @ k, -1, -2) / 2), rtol=1e-12)


@pytest.mark.parametrize("variant, options, match", [
    ("block_sparse", dict(block_size=4), "needs layout="),
    ("pooled", {}, "needs stride="),
    ("linformer", {}, "needs E="),
    ("linformer", dict(E=np.ones((3, 10)), out=np.ones(1)), "take no out="),
])
def test_attention_weights_systems_need_their_options(variant, options, match):
    x = np.ones((10, 4))
    with pytest.raises(TypeError, match=match):
        attnx.attention_weights(x, x, variant, **options)
