"""Gradients of the kernelised family (linear_attention_backward and the
named front ends' backwards, vjp).

References, independent of the C code:
* a float64 numpy implementation of the gradients written from the
  formulas (the chain rule through o = phi S / max(phi z, eps) and each
  feature map's derivative by hand);
* torch float64 autograd of the quadratic formulas (explicit weights);
* central finite differences of the forward on tiny cases.
"""
import math
import zlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import attnx
from attnx._linear import LinearAttentionState
from helpers import traced_peak

torch = pytest.importorskip("torch")

F64_TOL = 1e-9
F32_TOL = 2e-4
MAPS = ["elu", "relu", "softmax", "taylor", "focused", "favor", "identity"]


# ---------------------------------------------------------------- references

def visibility(n, m, causal=False, key_mask=None, mask=None, window=None):
    """bool (..., n, m): which keys each query sees"""
    i = np.arange(n)[:, None]
    j = np.arange(m)[None, :]
    vis = np.ones((n, m), bool)
    if causal in (True, "lower_right"):
        vis &= j <= i + (m - n)
    elif causal == "upper_left":
        vis &= j <= i
    if window is not None:
        left, right = (window, window) if np.isscalar(window) else window
        shifted = i + (m - n)
        if left is not None:
            vis &= j >= shifted - left
        if right is not None:
            vis &= j <= shifted + right
    if mask is not None:
        vis = vis & mask
    if key_mask is not None:
        vis = vis & key_mask[..., None, :]
    return vis


def torch_features(x, kind, W=None, positions=None, M=None, p=3, is_key=False, key_vis=None):
    if kind == "elu":
        return torch.nn.functional.elu(x) + 1
    if kind == "relu":
        return torch.relu(x)
    if kind == "identity":
        return x
    if kind == "softmax":
        return torch.softmax(x, -1)
    if kind == "taylor":
        return torch.cat([torch.ones_like(x[..., :1]), x / x.norm(dim=-1, keepdim=True)], -1)
    if kind == "focused":
        y = torch.relu(x)
        # a zero vector gives 0 (its norms would give NaN gradients)
        zero = (y == 0).all(-1, keepdim=True)
        y_safe = torch.where(zero, torch.ones_like(y), y)
        w = y_safe ** p
        f = y_safe.norm(dim=-1, keepdim=True) * w / w.norm(dim=-1, keepdim=True)
        return torch.where(zero, torch.zeros_like(f), f)
    if kind == "favor":
        d = x.shape[-1]
        xt = x * d ** -0.25
        u = xt @ W.T - (xt * xt).sum(-1, keepdim=True) / 2
        return W.shape[0] ** -0.5 * torch.exp(u)
    if kind == "cosformer":
        theta = math.pi / 2 * torch.as_tensor(positions, dtype=x.dtype) / M
        y = torch.relu(x)
        return torch.cat([y * torch.sin(theta)[:, None], y * torch.cos(theta)[:, None]], -1)
    if kind == "efficient":
        if not is_key:
            return torch.softmax(x, -1)
        # softmax of each column over the visible keys
        logits = torch.where(torch.as_tensor(key_vis)[..., None], x, torch.tensor(-math.inf))
        out = torch.softmax(logits, -2)
        return torch.nan_to_num(out, nan=0.0)
    raise ValueError(kind)


def torch_grads(dout, q, k, v, kind="elu", causal=False, key_mask=None, mask=None, window=None,
                eps=1e-6, W=None, p=3, S0=None, z0=None, dS=None, dz=None, M=None, offset=0):
    """(out, dq, dk, dv, dW, dS0, dz0) by torch autograd of the explicit
    quadratic formula, float64"""
    t = lambda x: torch.tensor(np.asarray(x, np.float64), requires_grad=True)
    qt, kt, vt = t(q), t(k), t(v)
    Wt = t(W) if W is not None else None
    n, m = q.shape[-2], k.shape[-2]
    vis = visibility(n, m, causal, key_mask, mask, window)
    key_vis = np.ones(k.shape[:-1], bool) if key_mask is None else key_mask
    if kind == "cosformer":
        M = M or max(n, m) + offset
        phi = torch_features(qt, kind, positions=np.arange(n) + 1 + offset, M=M)
        psi = torch_features(kt, kind, positions=np.arange(m) + 1 + offset, M=M)
    else:
        phi = torch_features(qt, kind, Wt, p=p)
        psi = torch_features(kt, kind, Wt, p=p, is_key=True, key_vis=key_vis)
    scores = (phi @ psi.transpose(-1, -2)) * torch.as_tensor(vis, dtype=torch.float64)
    num = scores @ vt
    den = scores.sum(-1)
    leaves = [qt, kt, vt]
    if S0 is not None:
        S0t, z0t = t(S0), t(z0)
        num = num + phi @ S0t
        den = den + (phi * z0t[..., None, :]).sum(-1)
    out = torch.where(den[..., None] == 0, torch.zeros_like(num),
                      num / torch.clamp(den, min=eps)[..., None])
    loss = (out * torch.as_tensor(dout)).sum()
    if dS is not None:
        # the returned state holds every key (masked keys excluded)
        kept = torch.as_tensor(key_vis, dtype=torch.float64)[..., None]
        S_end = (psi * kept).transpose(-1, -2) @ vt
        z_end = (psi * kept).sum(-2)
        if S0 is not None:
            S_end, z_end = S_end + S0t, z_end + z0t
        loss = loss + (S_end * torch.as_tensor(dS)).sum() + (z_end * torch.as_tensor(dz)).sum()
    loss.backward()
    grad = lambda x: None if x is None or x.grad is None else x.grad.numpy()
    return (out.detach().numpy(), grad(qt), grad(kt), grad(vt), grad(Wt),
            grad(S0t) if S0 is not None else None, grad(z0t) if S0 is not None else None)


# numpy: each map's features and their vector-Jacobian product, by hand
def np_features(x, kind):
    if kind == "elu":
        return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))
    if kind == "relu":
        return np.maximum(x, 0)
    if kind == "identity":
        return x
    if kind == "softmax":
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    if kind == "taylor":
        return np.concatenate([np.ones(x.shape[:-1] + (1,)), x / np.linalg.norm(x, axis=-1, keepdims=True)], -1)
    raise ValueError(kind)


def np_features_vjp(x, kind, g):
    if kind == "elu":
        return g * np.where(x > 0, 1.0, np.exp(np.minimum(x, 0)))
    if kind == "relu":
        return g * (x > 0)
    if kind == "identity":
        return g
    if kind == "softmax":
        f = np_features(x, kind)
        return f * (g - (f * g).sum(-1, keepdims=True))
    if kind == "taylor":
        norm = np.linalg.norm(x, axis=-1, keepdims=True)
        u, gu = x / norm, g[..., 1:]
        return (gu - (u * gu).sum(-1, keepdims=True) * u) / norm
    raise ValueError(kind)


def numpy_grads(dout, q, k, v, kind="elu", causal=False, key_mask=None, eps=1e-6):
    """the chain rule written out, float64"""
    phi, psi = np_features(q, kind), np_features(k, kind)
    vis = visibility(q.shape[-2], k.shape[-2], causal, key_mask).astype(float)
    scores = phi @ np.swapaxes(psi, -1, -2) * vis
    num, den = scores @ v, scores.sum(-1)
    D = np.maximum(den, eps)
    out = np.where(den[..., None] == 0, 0, num / D[..., None])
    a = np.where(den[..., None] == 0, 0, dout / D[..., None])
    b = np.where(den >= eps, -(dout * out).sum(-1) / np.where(den == 0, 1, den), 0)
    dscores = (a @ np.swapaxes(v, -1, -2) + b[..., None]) * vis
    dphi = dscores @ psi
    dpsi = np.swapaxes(dscores, -1, -2) @ phi
    dv = np.swapaxes(scores, -1, -2) @ a
    return np_features_vjp(q, kind, dphi), np_features_vjp(k, kind, dpsi), dv


def assert_close(got, want, tol, what=""):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    # a floor on the scale: a gradient that cancels to 0 (n = 1: dq, dk) is
    # compared to 1e-3 times the tolerance, not to its own rounding noise
    scale = max(np.abs(want).max(), 1e-3) if want.size else 1
    err = np.abs(got - want).max() / scale if want.size else 0
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def inputs(rng, batch, n, m, d, e, kind="elu"):
    q = rng.standard_normal(batch + (n, d))
    k = rng.standard_normal(batch + (m, d))
    v = rng.standard_normal(batch + (m, e))
    dout = rng.standard_normal(batch + (n, e))
    if kind == "identity":
        q, k = np.abs(q), np.abs(k)
    if kind == "favor":
        q, k = q * 0.5, k * 0.5
    return dout, q, k, v


def options_for(kind, d, rng):
    if kind == "favor":
        return {"feature_map": kind, "projection": attnx.random_features(12, d, seed=1)}
    return {"feature_map": kind}


# ---------------------------------------------------------------- against references

@pytest.mark.parametrize("kind", ["elu", "relu", "softmax", "taylor", "identity"])
@pytest.mark.parametrize("causal", [False, True])
def test_numpy_reference(kind, causal):
    rng = np.random.default_rng(3)
    dout, q, k, v = inputs(rng, (2,), 19, 19 if causal else 23, 6, 5, kind)
    key_mask = rng.random((2, k.shape[-2])) > 0.3
    g = attnx.linear_attention_backward(dout, q, k, v, feature_map=kind, causal=causal,
                                        key_mask=key_mask, chunk_size=4)
    want = numpy_grads(dout, q, k, v, kind, causal, key_mask)
    for got, ref, name in zip(g[:3], want, "qkv"):
        assert_close(got, ref, F64_TOL, f"d{name}")


@pytest.mark.parametrize("kind", MAPS)
@pytest.mark.parametrize("causal", [False, True, "upper_left"])
@pytest.mark.parametrize("method", [None, "recurrent", "cumsum", "quadratic"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_against_torch(kind, causal, method, dtype):
    if not causal and method == "recurrent":
        method = None
    # a seed of the case itself (hash() of strings changes from run to run)
    rng = np.random.default_rng(zlib.crc32(repr((kind, causal, method)).encode()))
    n, m = (13, 17) if causal != "upper_left" else (17, 13)
    dout, q, k, v = inputs(rng, (2, 1), n, m, 5, 4, kind)
    # the reference sees the inputs as the kernel does (rounded to dtype), so
    # that the comparison measures the kernel's arithmetic alone
    dout, q, k, v = (x.astype(dtype).astype(np.float64) for x in (dout, q, k, v))
    key_mask = rng.random((2, 3, m)) > 0.25  # widens the batch to (2, 3): dq, dk, dv summed
    opts = options_for(kind, 5, rng)
    cast = lambda x: x.astype(dtype)
    g = attnx.linear_attention_backward(cast(dout), cast(q), cast(k), cast(v), causal=causal,
                                        key_mask=key_mask, method=method, chunk_size=4, **opts)
    W = opts.get("projection")
    want = torch_grads(dout, q, k, v, kind, causal, key_mask=key_mask, W=W)
    tol = F64_TOL if dtype == np.float64 else F32_TOL
    for got, ref, name in zip(g[:3], want[1:4], "qkv"):
        assert got.dtype == dtype
        assert_close(got, ref, tol, f"d{name}")


# The causal chunk backward runs whole chunks of 16 through fused kernels
# of the linear_backward family's set (AVX-512, AVX2 or NEON; float32,
# features in blocks of 8, values in blocks of 16, no mask): the tests
# below run on every set the family can run here, so these cases take each
# set's kernels, with partial last chunks, offsets, masked keys and states
# around them, and plain C's general path.
@pytest.mark.parametrize("kind, d, r", [("elu", 64, 64), ("elu", 16, 16), ("relu", 32, 32),
                                        ("softmax", 24, 24), ("focused", 16, 16),
                                        ("taylor", 15, 16), ("identity", 8, 8), ("favor", 16, 24)])
@pytest.mark.parametrize("n, m", [(64, 64), (53, 53), (40, 75)])
def test_whole_chunks_float32(kind, d, r, n, m, linear_backward_kernels):
    rng = np.random.default_rng(zlib.crc32(repr((kind, d, n, m)).encode()))
    e = 32 if d != 64 else 64
    dout, q, k, v = inputs(rng, (2,), n, m, d, e, kind)
    dout, q, k, v = (x.astype(np.float32).astype(np.float64) for x in (dout, q, k, v))
    key_mask = rng.random((2, m)) > 0.2
    W = attnx.random_features(r, d, seed=2) if kind == "favor" else None
    opts = {"feature_map": kind, "projection": W} if W is not None else {"feature_map": kind}
    f32 = lambda x: x.astype(np.float32)
    g = attnx.linear_attention_backward(f32(dout), f32(q), f32(k), f32(v), causal=True,
                                        key_mask=key_mask, **opts)
    want = torch_grads(dout, q, k, v, kind, True, key_mask=key_mask, W=W)
    for got, ref, name in zip(g[:3], want[1:4], "qkv"):
        assert got.dtype == np.float32
        assert_close(got, ref, F32_TOL, f"d{name}")


def test_whole_chunks_float32_states_and_clamp(linear_backward_kernels):
    """initial_state, grad_state, rows whose denominator is 0 and rows where
    the clamp binds, through the fused chunks"""
    rng = np.random.default_rng(31)
    n, d, e = 48, 16, 16
    dout, q, k, v = inputs(rng, (1,), n, n, d, e, "identity")
    q[0, 20] = 0.0                    # row 20: zero features, den = 0
    q[0, 35] *= 1e-6                  # row 35: den under eps
    dout, q, k, v = (x.astype(np.float32).astype(np.float64) for x in (dout, q, k, v))
    S0 = np.abs(rng.standard_normal((1, d, e))).astype(np.float32).astype(np.float64)
    z0 = np.abs(rng.standard_normal((1, d))).astype(np.float32).astype(np.float64)
    dS, dz = rng.standard_normal((1, d, e)), rng.standard_normal((1, d))
    f32 = lambda x: x.astype(np.float32)
    state = LinearAttentionState(f32(S0), f32(z0), 0)
    for eps, S_init in [(1e-6, None), (1e-3, state)]:
        g = attnx.linear_attention_backward(f32(dout), f32(q), f32(k), f32(v), causal=True,
                                            feature_map="identity", eps=eps, initial_state=S_init,
                                            grad_state=(f32(dS), f32(dz)))
        want = torch_grads(dout, q, k, v, "identity", True, eps=eps,
                           S0=S0 if S_init is not None else None,
                           z0=z0 if S_init is not None else None, dS=dS, dz=dz)
        if S_init is None:
            assert (g.q[0, 20] == 0).all()
        for got, ref, name in zip(g[:3], want[1:4], "qkv"):
            assert_close(got, ref, F32_TOL, f"d{name} eps={eps}")
        if S_init is not None:
            assert_close(g.state[0], want[5], F32_TOL, "dS0")
            assert_close(g.state[1], want[6], F32_TOL, "dz0")


@pytest.mark.parametrize("where", ["v", "dout", "q", "k"])
def test_whole_chunks_nonfinite_stays_in_place(where, linear_backward_kernels):
    """a NaN in one chunk reaches exactly the gradients that float64 (the
    general path) says it reaches, and the finite ones agree"""
    rng = np.random.default_rng(32)
    dout, q, k, v = inputs(rng, (1,), 64, 64, 16, 16)
    {"v": v, "dout": dout, "q": q, "k": k}[where][0, 21, 3] = np.nan
    g64 = attnx.linear_attention_backward(dout, q, k, v, causal=True, chunk_size=16)
    g32 = attnx.linear_attention_backward(*(x.astype(np.float32) for x in (dout, q, k, v)),
                                          causal=True)
    for got, ref, name in zip(g32[:3], g64[:3], "qkv"):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=f"d{name}")
        finite = ~np.isnan(ref)
        assert_close(got[finite], ref[finite], F32_TOL, f"d{name}")


def test_whole_chunks_nonfinite_per_head_one_thread(linear_backward_kernels):
    """the keys pass takes each chunk's path from the rows pass of the same
    head: heads that run one after another on one thread, each with its NaN
    in another chunk (or none), keep their NaNs where float64 puts them"""
    rng = np.random.default_rng(33)
    dout, q, k, v = inputs(rng, (4,), 80, 80, 16, 16)
    v[0, 21, 3] = np.nan
    dout[1, 40, 0] = np.nan
    k[2, 79, 5] = np.nan
    previous = attnx.get_num_threads()
    attnx.set_num_threads(1)
    try:
        g32 = attnx.linear_attention_backward(*(x.astype(np.float32) for x in (dout, q, k, v)),
                                              causal=True)
    finally:
        attnx.set_num_threads(previous)
    g64 = attnx.linear_attention_backward(dout, q, k, v, causal=True, chunk_size=16)
    for got, ref, name in zip(g32[:3], g64[:3], "qkv"):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=f"d{name}")
        assert np.isnan(ref[:3]).any() and not np.isnan(ref[3]).any()
        finite = ~np.isnan(ref)
        assert_close(got[finite], ref[finite], F32_TOL, f"d{name}")


@pytest.mark.parametrize("e, values", [(64, "contiguous"), (64, "strided"), (80, "contiguous")])
def test_whole_chunks_float32_64_features(e, values, linear_backward_kernels):
    """64 features and 64 values rows 64 apart take the fused kernels'
    variant with constant sizes; values rows 128 apart, or 80 values, the
    general one: each against torch float64 with states, a row whose
    denominator is 0, rows where the clamp binds, masked keys and a partial
    last chunk, and against the steps the fused kernels replace (chunks of
    32); a NaN value stays where float64 puts it"""
    rng = np.random.default_rng(34)
    n, d = 77, 64
    dout, q, k, v = inputs(rng, (2,), n, n, d, e, "identity")
    q[0, 20] = 0.0                    # den = 0 without an initial state
    q[1, 35] *= 1e-7                  # den under eps
    dout, q, k, v = (x.astype(np.float32).astype(np.float64) for x in (dout, q, k, v))
    key_mask = rng.random((2, n)) > 0.2
    S0 = np.abs(rng.standard_normal((2, d, e))).astype(np.float32).astype(np.float64)
    z0 = np.abs(rng.standard_normal((2, d))).astype(np.float32).astype(np.float64)
    dS, dz = rng.standard_normal((2, d, e)), rng.standard_normal((2, d))
    f32 = lambda x: x.astype(np.float32)

    def values_of(x):
        if values == "contiguous":
            return f32(x)
        wide = np.zeros(x.shape[:-1] + (2 * x.shape[-1],), np.float32)
        wide[..., : x.shape[-1]] = x
        return wide[..., : x.shape[-1]]

    for eps, state in [(1e-6, None), (1e-3, LinearAttentionState(f32(S0), f32(z0), 0))]:
        opts = dict(causal=True, feature_map="identity", eps=eps, key_mask=key_mask,
                    initial_state=state, grad_state=(f32(dS), f32(dz)))
        g = attnx.linear_attention_backward(f32(dout), f32(q), f32(k), values_of(v), **opts)
        steps = attnx.linear_attention_backward(f32(dout), f32(q), f32(k), values_of(v),
                                                chunk_size=32, **opts)
        want = torch_grads(dout, q, k, v, "identity", True, eps=eps, key_mask=key_mask,
                           S0=S0 if state is not None else None,
                           z0=z0 if state is not None else None, dS=dS, dz=dz)
        if state is None:
            assert (g.q[0, 20] == 0).all()
        for got, other, ref, name in zip(g[:3], steps[:3], want[1:4], "qkv"):
            assert_close(got, ref, F32_TOL, f"d{name} eps={eps}")
            assert_close(got, other, F32_TOL, f"d{name} eps={eps} against chunks of 32")
        if state is not None:
            assert_close(g.state[0], want[5], F32_TOL, "dS0")
            assert_close(g.state[1], want[6], F32_TOL, "dz0")

    v_nan = v.copy()
    v_nan[1, 40, 7] = np.nan
    g64 = attnx.linear_attention_backward(dout, q, k, v_nan, causal=True, chunk_size=16,
                                          feature_map="identity")
    g32 = attnx.linear_attention_backward(f32(dout), f32(q), f32(k), values_of(v_nan),
                                          causal=True, feature_map="identity")
    for got, ref, name in zip(g32[:3], g64[:3], "qkv"):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref), err_msg=f"d{name}")
        assert np.isnan(ref[1]).any() == (name != "v") and not np.isnan(ref[0]).any()
        finite = ~np.isnan(ref)
        assert_close(got[finite], ref[finite], F32_TOL, f"d{name}")


@pytest.mark.parametrize("d", [32, 64])
@pytest.mark.parametrize("n, m, causal", [(80, 80, True), (48, 83, True), (83, 75, True),
                                          (83, 48, "upper_left"), (48, 83, "upper_left")])
def test_whole_chunks_keep_block_in_dk_rows(d, n, m, causal, linear_backward_kernels):
    """with d >= 32 the rows pass keeps each fused block's products in the
    chunk's dk rows for the keys pass: a preallocated dk full of NaN, rows
    wider than d, gets exactly the gradients torch float64 gives, nothing
    outside its d columns is written, and the alignments of queries and keys
    where those rows would be overwritten first (m < n lower right) or lie
    past m are handled"""
    rng = np.random.default_rng(zlib.crc32(repr((d, n, m, causal)).encode()))
    dout, q, k, v = inputs(rng, (2,), n, m, d, 64, "elu")
    dout, q, k, v = (x.astype(np.float32).astype(np.float64) for x in (dout, q, k, v))
    f32 = lambda x: x.astype(np.float32)
    wide = np.full((2, m, d + 24), np.nan, np.float32)
    dk = wide[..., 8:8 + d]
    g = attnx.linear_attention_backward(f32(dout), f32(q), f32(k), f32(v), causal=causal, dk=dk)
    assert g.k is dk
    want = torch_grads(dout, q, k, v, "elu", causal)
    for got, ref, name in zip(g[:3], want[1:4], "qkv"):
        assert_close(got, ref, F32_TOL, f"d{name}")
    assert np.isnan(wide[..., :8]).all() and np.isnan(wide[..., 8 + d:]).all()


def test_float32_against_float64_reference_long_causal():
    """chunks of the default length, several of them, float32"""
    rng = np.random.default_rng(5)
    dout, q, k, v = inputs(rng, (2,), 300, 300, 16, 8)
    g = attnx.linear_attention_backward(*(x.astype(np.float32) for x in (dout, q, k, v)),
                                        causal=True)
    want = numpy_grads(dout, q, k, v, "elu", True)
    for got, ref, name in zip(g[:3], want, "qkv"):
        assert_close(got, ref, F32_TOL, f"d{name}")


@pytest.mark.parametrize("causal", [False, True])
def test_favor_projection_grad(causal):
    rng = np.random.default_rng(7)
    dout, q, k, v = inputs(rng, (2,), 11, 11, 4, 3, "favor")
    W = attnx.random_features(9, 4, seed=2)
    g = attnx.performer_attention_backward(dout, q, k, v, projection=W, causal=causal,
                                           projection_grad=True)
    want = torch_grads(dout, q, k, v, "favor", causal, W=W)
    assert g.projection.shape == W.shape
    assert_close(g.projection, want[4], F64_TOL, "dW")
    assert_close(g.q, want[1], F64_TOL, "dq")
    assert_close(g.k, want[2], F64_TOL, "dk")


def test_favor_large_inputs_stabilised():
    """exponents far past exp's range: the stabilisers cancel, the
    gradients stay finite and equal the reference's on rescaled features"""
    rng = np.random.default_rng(8)
    dout, q, k, v = inputs(rng, (1,), 9, 9, 4, 3)
    q = q * 30
    W = attnx.random_features(6, 4, seed=3)
    g = attnx.performer_attention_backward(dout, q, k, v, projection=W, causal=True)
    assert all(np.isfinite(x).all() for x in g[:3])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("offset", [0, 5])
def test_cosformer(causal, offset):
    rng = np.random.default_rng(9)
    dout, q, k, v = inputs(rng, (2,), 10, 10, 4, 3)
    M = 40
    kw = {}
    S0 = z0 = None
    if offset:
        # a state that has consumed `offset` positions
        prefix_k = rng.standard_normal((2, offset, 4))
        prefix_v = rng.standard_normal((2, offset, 3))
        _, state = attnx.cosformer_attention(prefix_k, prefix_k, prefix_v, causal=True, M=M,
                                             return_state=True)
        kw["initial_state"] = state
        S0, z0 = state.S, state.z
    g = attnx.cosformer_attention_backward(dout, q, k, v, causal=causal, M=M, **kw)
    want = torch_grads(dout, q, k, v, "cosformer", causal, M=M, offset=offset, S0=S0, z0=z0)
    for got, ref, name in zip(g[:3], want[1:4], "qkv"):
        assert_close(got, ref, F64_TOL, f"d{name}")
    if offset:
        assert_close(g.state[0], want[5], F64_TOL, "dS0")
        assert_close(g.state[1], want[6], F64_TOL, "dz0")


@pytest.mark.parametrize("masked", [False, True])
def test_efficient(masked):
    rng = np.random.default_rng(10)
    dout, q, k, v = inputs(rng, (2,), 7, 12, 5, 3)
    key_mask = rng.random((2, 12)) > 0.3 if masked else None
    g = attnx.efficient_attention_backward(dout, q, k, v, key_mask=key_mask)
    want = torch_grads(dout, q, k, v, "efficient", key_mask=key_mask, eps=0)
    for got, ref, name in zip(g[:3], want[1:4], "qkv"):
        assert_close(got, ref, F64_TOL, f"d{name}")


@pytest.mark.parametrize("p", [3, 1.5, 0.5])
def test_focused_powers(p):
    rng = np.random.default_rng(11)
    dout, q, k, v = inputs(rng, (2,), 9, 9, 5, 3)
    g = attnx.focused_linear_attention_backward(dout, q, k, v, p=p, causal=True)
    want = torch_grads(dout, q, k, v, "focused", True, p=p)
    for got, ref, name in zip(g[:3], want[1:4], "qkv"):
        assert_close(got, ref, F64_TOL, f"d{name}")


@pytest.mark.parametrize("window", [None, 2, (3, 0), (None, 1)])
@pytest.mark.parametrize("with_mask", [False, True])
def test_quadratic_mask_window(window, with_mask):
    rng = np.random.default_rng(12)
    dout, q, k, v = inputs(rng, (2,), 11, 14, 4, 3)
    mask = rng.random((2, 11, 14)) > 0.3 if with_mask else None
    if mask is None and window is None:
        window = 1
    g = attnx.linear_attention_backward(dout, q, k, v, mask=mask, window=window, chunk_size=4)
    want = torch_grads(dout, q, k, v, "elu", mask=mask, window=window)
    for got, ref, name in zip(g[:3], want[1:4], "qkv"):
        assert_close(got, ref, F64_TOL, f"d{name}")


@pytest.mark.parametrize("method", ["chunk", "recurrent", "cumsum", "quadratic"])
@pytest.mark.parametrize("causal", [False, True])
def test_state_gradients(method, causal):
    """initial_state gives g.state; grad_state feeds the returned state"""
    rng = np.random.default_rng(13)
    dout, q, k, v = inputs(rng, (2,), 9, 9, 4, 3)
    if method == "recurrent" and not causal:
        return
    _, state = attnx.linear_attention(rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 4)),
                                      rng.standard_normal((2, 5, 3)), causal=True, return_state=True)
    dS, dz = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 4))
    key_mask = np.array([[1, 1, 0, 1, 1, 1, 0, 1, 1]] * 2, bool)
    g = attnx.linear_attention_backward(dout, q, k, v, causal=causal, method=method, chunk_size=4,
                                        initial_state=state, grad_state=(dS, dz), key_mask=key_mask)
    want = torch_grads(dout, q, k, v, causal=causal, S0=state.S, z0=state.z, dS=dS, dz=dz,
                       key_mask=key_mask)
    for got, ref, name in zip(list(g[:3]) + list(g.state), list(want[1:4]) + list(want[5:7]),
                              ["dq", "dk", "dv", "dS0", "dz0"]):
        assert_close(got, ref, F64_TOL, name)


# ---------------------------------------------------------------- finite differences

@pytest.mark.parametrize("kind", MAPS + ["cosformer", "efficient"])
def test_finite_differences(kind):
    rng = np.random.default_rng(14)
    causal = kind != "efficient"
    dout, q, k, v = inputs(rng, (), 4, 4, 3, 2, kind)
    if kind == "cosformer":
        fwd = lambda q, k, v: attnx.cosformer_attention(q, k, v, causal=causal)
        bwd = lambda: attnx.cosformer_attention_backward(dout, q, k, v, causal=causal)
    elif kind == "efficient":
        fwd = lambda q, k, v: attnx.efficient_attention(q, k, v)
        bwd = lambda: attnx.efficient_attention_backward(dout, q, k, v)
    else:
        opts = options_for(kind, 3, rng)
        fwd = lambda q, k, v: attnx.linear_attention(q, k, v, causal=causal, **opts)
        bwd = lambda: attnx.linear_attention_backward(dout, q, k, v, causal=causal, **opts)
    g = bwd()
    h = 1e-6
    for index, x in enumerate((q, k, v)):
        numeric = np.zeros_like(x)
        for pos in np.ndindex(x.shape):
            args = [q.copy(), k.copy(), v.copy()]
            args[index][pos] += h
            up = (fwd(*args) * dout).sum()
            args[index][pos] -= 2 * h
            down = (fwd(*args) * dout).sum()
            numeric[pos] = (up - down) / (2 * h)
        assert_close(g[index], numeric, 1e-6, f"d{'qkv'[index]} ({kind})")


# ---------------------------------------------------------------- properties

@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 23), extra=st.integers(0, 5), chunk=st.integers(1, 9),
       kind=st.sampled_from(["elu", "relu", "taylor", "softmax"]), seed=st.integers(0, 2**31))
def test_causal_forms_equal(n, extra, chunk, kind, seed):
    rng = np.random.default_rng(seed)
    dout, q, k, v = inputs(rng, (2,), n, n + extra, 3, 2, kind)
    grads = [attnx.linear_attention_backward(dout, q, k, v, feature_map=kind, causal=True,
                                             method=method, chunk_size=chunk)
             for method in ("chunk", "recurrent", "cumsum", "quadratic")]
    for other in grads[1:]:
        for got, ref in zip(other[:3], grads[0][:3]):
            assert_close(got, ref, F64_TOL)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 30), cuts=st.lists(st.integers(1, 29), max_size=3),
       chunk=st.integers(1, 8), kind=st.sampled_from(["elu", "favor", "cosformer"]),
       seed=st.integers(0, 2**31))
def test_streamed_gradients_equal_one_call(n, cuts, chunk, kind, seed):
    """truncated backprop: the pieces' backwards in reverse, each passing
    g.state to the previous piece as grad_state, equal one call"""
    rng = np.random.default_rng(seed)
    dout, q, k, v = inputs(rng, (2,), n, n, 3, 2, "favor" if kind == "favor" else "elu")
    if kind == "cosformer":
        fwd, bwd, opts = attnx.cosformer_attention, attnx.cosformer_attention_backward, {"M": 64}
    else:
        fwd, bwd = attnx.linear_attention, attnx.linear_attention_backward
        opts = options_for(kind, 3, rng)
    bounds = sorted({0, n, *[c for c in cuts if c < n]})
    states = [None]
    for a, b in zip(bounds[:-1], bounds[1:]):
        _, state = fwd(q[:, a:b], k[:, a:b], v[:, a:b], causal=True, return_state=True,
                       initial_state=states[-1], **opts)
        states.append(state)
    whole = bwd(dout, q, k, v, causal=True, chunk_size=chunk, **opts)
    pieces, grad_state = [], None
    for index in range(len(bounds) - 2, -1, -1):
        a, b = bounds[index], bounds[index + 1]
        g = bwd(dout[:, a:b], q[:, a:b], k[:, a:b], v[:, a:b], causal=True, chunk_size=chunk,
                initial_state=states[index], grad_state=grad_state, **opts)
        pieces.insert(0, g)
        grad_state = g.state
    for field in range(3):
        got = np.concatenate([g[field] for g in pieces], axis=1)
        assert_close(got, whole[field], F64_TOL, "dqkv"[field])


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 15), causal=st.booleans(), chunk=st.integers(1, 6),
       method=st.sampled_from([None, "cumsum", "quadratic"]), seed=st.integers(0, 2**31))
def test_masked_key_gets_zero_gradient(n, causal, chunk, method, seed):
    rng = np.random.default_rng(seed)
    dout, q, k, v = inputs(rng, (2,), n, n, 3, 2)
    key_mask = rng.random((2, n)) > 0.4
    v = v.copy()
    v[~key_mask] = np.nan  # nothing of a removed key may reach a gradient
    g = attnx.linear_attention_backward(dout, q, k, v, causal=causal, key_mask=key_mask,
                                        method=method, chunk_size=chunk)
    assert (g.k[~key_mask] == 0).all() and (g.v[~key_mask] == 0).all()
    assert np.isfinite(g.q).all() and np.isfinite(g.k).all() and np.isfinite(g.v).all()


@settings(max_examples=20, deadline=None)
@given(groups=st.integers(1, 3), heads=st.integers(1, 3), n=st.integers(1, 12),
       causal=st.booleans(), seed=st.integers(0, 2**31))
def test_broadcast_gradients_equal_summed_slices(groups, heads, n, causal, seed):
    """keys/values shared by a group of query heads: their gradients are
    the sums over the group of the per-slice gradients"""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((heads, groups, n, 3))
    k = rng.standard_normal((heads, 1, n, 3))
    v = rng.standard_normal((heads, 1, n, 2))
    dout = rng.standard_normal((heads, groups, n, 2))
    g = attnx.linear_attention_backward(dout, q, k, v, causal=causal)
    assert g.k.shape == k.shape and g.v.shape == v.shape
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for h in range(heads):
        for s in range(groups):
            one = attnx.linear_attention_backward(dout[h, s], q[h, s], k[h, 0], v[h, 0], causal=causal)
            assert_close(g.q[h, s], one.q, F64_TOL)
            dk[h, 0] += one.k
            dv[h, 0] += one.v
    assert_close(g.k, dk, F64_TOL)
    assert_close(g.v, dv, F64_TOL)


def test_strided_inputs_and_float16():
    rng = np.random.default_rng(15)
    x = rng.standard_normal((2, 16, 3, 4))  # (B, n, H, d) read as (B, H, n, d)
    q = k = x.transpose(0, 2, 1, 3)
    v = rng.standard_normal((2, 3, 16, 4))
    dout = rng.standard_normal((2, 3, 16, 4))
    g = attnx.linear_attention_backward(dout, q, k, v, causal=True)
    want = numpy_grads(dout, q, k, v, "elu", True)
    assert_close(g.q, want[0], F64_TOL)
    g16 = attnx.linear_attention_backward(*(a.astype(np.float16) for a in (dout, q, k, v)),
                                          causal=True)
    assert g16.q.dtype == np.float16
    assert_close(g16.v, want[2], 2e-3)


def test_zero_denominator_rows_have_zero_gradient():
    rng = np.random.default_rng(16)
    dout, q, k, v = inputs(rng, (1,), 6, 6, 3, 2)
    q[0, 2] = -5.0  # relu features of row 2 are all zero: its denominator is 0
    g = attnx.linear_attention_backward(dout, q, k, v, feature_map="relu", causal=True)
    assert (g.q[0, 2] == 0).all()
    want = numpy_grads(dout, q, k, v, "relu", True)
    for got, ref in zip(g[:3], want):
        assert_close(got, ref, F64_TOL)


def test_clamp_binds():
    """tiny features: every denominator under eps, so out = num / eps and b = 0"""
    rng = np.random.default_rng(17)
    dout, q, k, v = inputs(rng, (1,), 5, 5, 3, 2, "identity")
    q, k = q * 1e-4, k * 1e-4
    g = attnx.linear_attention_backward(dout, q, k, v, feature_map="identity", causal=True, eps=1e-3)
    want = torch_grads(dout, q, k, v, "identity", True, eps=1e-3)
    for got, ref in zip(g[:3], want[1:4]):
        assert_close(got, ref, F64_TOL)


# ---------------------------------------------------------------- vjp and API

@pytest.mark.parametrize("front", ["linear", "cosformer", "focused", "taylor", "performer",
                                   "efficient"])
def test_vjp_every_front_end(front):
    rng = np.random.default_rng(18)
    dout, q, k, v = inputs(rng, (2,), 8, 8, 4, 3, "favor")
    fn = getattr(attnx, {"linear": "linear_attention", "focused": "focused_linear_attention"}.get(
        front, f"{front}_attention"))
    opts = {} if front == "efficient" else {"causal": True}
    if front == "performer":
        opts["seed"] = 4
    out, pullback = attnx.vjp(fn, q, k, v, **opts)
    assert_close(out, fn(q, k, v, **opts), 0)
    g = pullback(dout)
    backward = getattr(attnx, fn.__name__ + "_backward")
    direct = backward(dout, q, k, v, **opts)
    for got, ref in zip(g[:3], direct[:3]):
        assert_close(got, ref, 0)


def test_vjp_performer_draws_one_projection():
    rng = np.random.default_rng(19)
    dout, q, k, v = inputs(rng, (1,), 6, 6, 4, 3, "favor")
    out, pullback = attnx.vjp(attnx.performer_attention, q, k, v)
    g = pullback(dout)
    assert all(np.isfinite(x).all() for x in g[:3])


def test_callable_feature_map_names_torch_front_end():
    rng = np.random.default_rng(20)
    dout, q, k, v = inputs(rng, (1,), 4, 4, 3, 2)
    with pytest.raises(TypeError, match="attnx.torch"):
        attnx.linear_attention_backward(dout, q, k, v, feature_map=lambda x: np.exp(x))
    out, pullback = attnx.vjp(attnx.linear_attention, q, k, v, feature_map=lambda x: np.exp(x))
    with pytest.raises(TypeError, match="attnx.torch"):
        pullback(dout)


def test_preallocated_gradients_and_inputs_unchanged():
    rng = np.random.default_rng(21)
    dout, q, k, v = inputs(rng, (2,), 7, 7, 3, 2)
    copies = [x.copy() for x in (dout, q, k, v)]
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    g = attnx.linear_attention_backward(dout, q, k, v, causal=True, dq=dq, dk=dk, dv=dv)
    assert g.q is dq and g.k is dk and g.v is dv
    want = numpy_grads(dout, q, k, v, "elu", True)
    assert_close(dq, want[0], F64_TOL)
    for x, y in zip(copies, (dout, q, k, v)):
        assert (x == y).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_preallocated_gradients_written_in_place(dtype):
    """dq, dk, dv of the call's whole batch are written by the kernel itself:
    strided rows are honoured, and no gradient-sized temporary is made"""
    rng = np.random.default_rng(23)
    dout, q, k, v = (x.astype(dtype) for x in inputs(rng, (2, 3), 200, 200, 16, 16))
    want = attnx.linear_attention_backward(dout, q, k, v, causal=True)
    wide = np.full(q.shape[:-1] + (40,), np.nan, dtype)
    dq = wide[..., 5:21]                        # rows 40 apart
    dk, dv = np.empty_like(k), np.empty_like(v)
    g, peak = traced_peak(lambda: attnx.linear_attention_backward(
        dout, q, k, v, causal=True, dq=dq, dk=dk, dv=dv))
    assert g.q is dq and g.k is dk and g.v is dv
    assert peak < q.nbytes / 4, peak
    for got, ref in zip(g[:3], want[:3]):
        np.testing.assert_array_equal(got, ref)
    assert np.isnan(wide[..., :5]).all() and np.isnan(wide[..., 21:]).all()
    # broadcast keys: dk is a sum over the query heads, computed then reduced
    k1, v1 = k[:, :1], v[:, :1]
    dk1 = np.empty_like(k1)
    g = attnx.linear_attention_backward(dout, q, k1, v1, causal=True, dk=dk1)
    assert g.k is dk1
    np.testing.assert_allclose(dk1, attnx.linear_attention_backward(dout, q, k1, v1, causal=True).k)
    with pytest.raises(ValueError, match="overlap"):
        attnx.linear_attention_backward(dout, q, k, v, causal=True, dq=q)


def test_bad_arguments():
    rng = np.random.default_rng(22)
    dout, q, k, v = inputs(rng, (1,), 4, 4, 3, 2)
    with pytest.raises(ValueError, match="dout"):
        attnx.linear_attention_backward(dout[..., :1], q, k, v)
    with pytest.raises(ValueError, match="feature_map"):
        attnx.linear_attention_backward(dout, q, k, v, feature_map="nope")
    with pytest.raises(ValueError, match="method"):
        attnx.linear_attention_backward(dout, q, k, v, method="nope")
    with pytest.raises(ValueError, match="projection_grad"):
        attnx.linear_attention_backward(dout, q, k, v, projection_grad=True)
    with pytest.raises(ValueError, match="quadratic"):
        attnx.linear_attention_backward(dout, q, k, v, window=1, method="chunk")
    with pytest.raises(ValueError, match="causal"):
        attnx.efficient_attention_backward(dout, q, k, v, causal=True)
    with pytest.raises(ValueError, match="projection"):
        attnx.performer_attention_backward(dout, q, k, v)
    with pytest.raises(ValueError, match="eps"):
        attnx.linear_attention_backward(dout, q, k, v, eps=-1)
    with pytest.raises(ValueError, match="grad_state"):
        attnx.linear_attention_backward(dout, q, k, v, grad_state=(np.zeros((1, 3, 5)), np.zeros((1, 3))))


def test_empty_shapes():
    rng = np.random.default_rng(23)
    dout, q, k, v = inputs(rng, (2,), 0, 5, 3, 2)
    g = attnx.linear_attention_backward(dout, q, k, v, causal=True)
    assert g.q.shape == q.shape and (g.k == 0).all() and (g.v == 0).all()
    dout, q, k, v = inputs(rng, (2,), 4, 0, 3, 2)
    g = attnx.linear_attention_backward(dout, q, k, v)
    assert (g.q == 0).all() and g.k.shape == k.shape


def test_threads_give_identical_gradients():
    """each head runs on one thread and the projection's gradient is summed
    in a fixed order: results do not depend on the thread count"""
    rng = np.random.default_rng(24)
    dout, q, k, v = inputs(rng, (6,), 70, 70, 8, 4, "favor")
    W = attnx.random_features(10, 8, seed=5)
    saved = attnx.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            attnx.set_num_threads(threads)
            results.append(attnx.performer_attention_backward(dout, q, k, v, projection=W,
                                                              causal=True, projection_grad=True))
    finally:
        attnx.set_num_threads(saved)
    for other in results[1:]:
        for got, ref in zip(other[:5], results[0][:5]):
            assert np.array_equal(got, ref)


def test_vjp_with_returned_state():
    rng = np.random.default_rng(25)
    dout, q, k, v = inputs(rng, (2,), 6, 6, 3, 2)
    dS, dz = rng.standard_normal((2, 3, 2)), rng.standard_normal((2, 3))
    (out, state), pullback = attnx.vjp(attnx.linear_attention, q, k, v, causal=True,
                                       return_state=True)
    g = pullback(dout, grad_state=(dS, dz))
    want = torch_grads(dout, q, k, v, causal=True, dS=dS, dz=dz)
    for got, ref in zip(g[:3], want[1:4]):
        assert_close(got, ref, F64_TOL)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("method", ["chunk", "quadratic"])
def test_nan_reaches_only_what_it_affects(which, method):
    """a NaN at position j of q, k or v (causal): the query rows before j
    (k, v) or the keys after j (q) depend on nothing it touches, and keep
    the gradients of the same call with that entry finite"""
    rng = np.random.default_rng(26)
    dout, q, k, v = inputs(rng, (1,), 12, 12, 3, 2)
    j = 5
    clean = attnx.linear_attention_backward(dout, q, k, v, causal=True, method=method, chunk_size=8)
    arrays = {"q": q.copy(), "k": k.copy(), "v": v.copy()}
    arrays[which][0, j, 0] = np.nan
    g = attnx.linear_attention_backward(dout, arrays["q"], arrays["k"], arrays["v"], causal=True,
                                        method=method, chunk_size=8)
    if which == "q":
        for field in (1, 2):
            assert_close(g[field][0, j + 1:], clean[field][0, j + 1:], F64_TOL)
    else:
        assert_close(g.q[0, :j], clean.q[0, :j], F64_TOL)
