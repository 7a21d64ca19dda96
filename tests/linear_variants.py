"""The kernelised ("linear") family under test (docs/linear.md and
docs/inspecting.md), shared by tests/test_linear*.py: the variants
(linear_attention with every feature map: "elu", "relu", "softmax",
"taylor", "focused", "favor", "identity", a Python callable; the front ends
cosformer_attention, focused_linear_attention, taylor_attention,
performer_attention, efficient_attention), how each is called, its plain
numpy float64 reference (attnx/reference.py, itself tested in
tests/test_reference.py), a log-space FAVOR+ reference for inputs whose
literal features overflow, and the streaming state's check.

Stated tolerances (see `tol`), the same as the softmax suite:
  float64 vs the float64 reference: rtol 1e-10, atol 1e-10 * value scale;
  float32 vs the float64 reference (on the same float32 inputs):
      rtol 2e-5, atol 2e-5 * value scale (value scale = max |v|, >= 1);
  float16 (computed in float32, rounded to float16): 2e-3 relative.
Methods (chunk / recurrent / cumsum / quadratic, every chunk size) and
streaming pieces are compared with the same bounds; they compute the same
sums in different orders, so float64 agrees to ~1e-14 for a correct kernel.
Inputs are ~N(0, 1) (|x| for "identity"); the FAVOR projections used for
the exact comparisons are N(0, 1) matrices of r = 2d + 3 rows, so every
exponent stays below ~40 and the float32 features keep ~1e-6 relative
accuracy, well inside 2e-5.
"""
import math

import numpy as np

import attnx

import attnx.reference as ref
from helpers import f64, hypothesis_settings, tol  # noqa: E402

HYP = hypothesis_settings(40)

METHODS = ["chunk", "recurrent", "cumsum", "quadratic"]


# --------------------------------------------------------------------------
# the variants under test and their references
# --------------------------------------------------------------------------

# linear_attention(feature_map=...) for each named map and a callable, then
# the named front ends ("focused_front": focused_linear_attention with p=2,
# "taylor_front": taylor_attention, "performer": performer_attention with a
# fixed projection)
FEATURE_MAPS = ["elu", "relu", "softmax", "taylor", "focused", "favor",
                "identity", "callable"]
FRONT_ENDS = ["cosformer", "focused_front", "taylor_front", "performer",
              "efficient"]
VARIANTS = FEATURE_MAPS + FRONT_ENDS
STATEFUL = [v for v in VARIANTS if v != "efficient"]   # causal, streaming
FAVOR_LIKE = ("favor", "performer")


def fm_callable(x):
    """A learned-map stand-in: numpy in, non-negative numpy out, r = 2d."""
    x = np.asarray(x)
    return np.concatenate([np.maximum(x, 0), np.exp(np.minimum(x, 0))], axis=-1)


_PROJ = {}


def projection(d):
    """A fixed N(0, 1) FAVOR projection of r = 2d + 3 rows (any W is valid)."""
    if d not in _PROJ:
        _PROJ[d] = np.random.default_rng(777 + d).standard_normal((2 * d + 3, d))
    return _PROJ[d]


def feature_size(name, d):
    if name in ("taylor", "taylor_front"):
        return d + 1
    if name in FAVOR_LIKE:
        return 2 * d + 3
    if name in ("callable", "cosformer"):
        return 2 * d
    return d


def fixed_options(name, d):
    """The options that select the variant (besides causal, key_mask...)."""
    if name == "favor":
        return dict(feature_map="favor", projection=projection(d))
    if name == "callable":
        return dict(feature_map=fm_callable)
    if name in FEATURE_MAPS:
        return dict(feature_map=name)
    if name == "focused_front":
        return dict(p=2)
    if name == "performer":
        return dict(projection=projection(d))
    return {}


def front(name):
    return {"cosformer": attnx.cosformer_attention,
            "focused_front": attnx.focused_linear_attention,
            "taylor_front": attnx.taylor_attention,
            "performer": attnx.performer_attention,
            "efficient": attnx.efficient_attention}.get(name,
                                                        attnx.linear_attention)


WVARIANT = dict({fm: "linear" for fm in FEATURE_MAPS}, cosformer="cosformer",
                focused_front="focused", taylor_front="taylor",
                performer="performer", efficient="efficient")


def prep(name, q, k):
    """Inputs valid for the variant: identity features must be >= 0."""
    if name == "identity":
        return np.abs(q), np.abs(k)
    return q, k


def _drop_defaults(name, kw):
    """efficient_attention has only key_mask= (and causal=False, out=)."""
    kw = dict(kw)
    if name == "efficient":
        if kw.get("causal", 0) is False:
            del kw["causal"]
        for opt in ("method", "chunk_size"):
            if opt in kw and kw[opt] is None:
                del kw[opt]
    return kw


def call(name, q, k, v, **kw):
    return front(name)(q, k, v, **fixed_options(name, np.shape(q)[-1]),
                       **_drop_defaults(name, kw))


def weights(name, q, k, **kw):
    return attnx.attention_weights(q, k, variant=WVARIANT[name],
                                   **fixed_options(name, np.shape(q)[-1]),
                                   **_drop_defaults(name, kw))


def similarity(name, q, k, **kw):
    return attnx.similarity(q, k, variant=WVARIANT[name],
                            **fixed_options(name, np.shape(q)[-1]),
                            **_drop_defaults(name, kw))


def _ref_fm(name, d):
    """(feature map, p, projection) of the reference for a variant."""
    if name in FAVOR_LIKE:
        return "favor", 3, projection(d)
    if name == "callable":
        return fm_callable, 3, None
    if name == "focused_front":
        return "focused", 2, None
    if name == "taylor_front":
        return "taylor", 3, None
    return name, 3, None


def ref_similarity(name, q, k, causal=False, key_mask=None, mask=None,
                   window=None, M=None, offset=0):
    q, k = f64(q), f64(k)
    if name == "efficient":
        assert not causal and mask is None and window is None
        return ref.efficient_weights(q, k, key_mask)
    if name == "cosformer":
        return ref.cosformer_similarity(q, k, causal, key_mask, M, offset, mask,
                                        window)
    fm, p, W = _ref_fm(name, q.shape[-1])
    return ref.linear_similarity(q, k, fm, causal, key_mask, mask, window,
                                 projection=W, p=p)


def ref_weights(name, q, k, eps=1e-6, **kw):
    s = ref_similarity(name, q, k, **kw)
    if name == "efficient":
        return s
    return ref._clamped_weights(s, eps)


def ref_out(name, q, k, v, eps=1e-6, **kw):
    return ref._weighted_sum(ref_weights(name, q, k, eps=eps, **kw), v)


def row_condition(name, q, k, eps=1e-6, causal=False, key_mask=None, mask=None,
                  window=None, **_):
    """kappa_i = sum_j |phi(q_i)|.|psi(k_j)| / max(sum_j s_ij, eps) over the
    visible keys, the condition number of row i's linear-form sums (o_i is
    computed as phi(q_i) S / phi(q_i) z, not from s_ij): 1 for non-negative
    features, large for taylor where 1 + cos(q, k) cancels towards 0. The
    float32/float64 tolerances of the linear forms scale with it (rounding
    of phi.S and phi.z is ~u * sum |terms|, relative ~u * kappa); shape
    (..., n, 1)."""
    if name not in ("taylor", "taylor_front"):
        return np.ones((1, 1))
    fq = np.abs(ref.apply_feature_map(f64(q), "taylor"))
    fk = np.abs(ref.apply_feature_map(f64(k), "taylor"))
    a = np.matmul(fq, np.swapaxes(fk, -1, -2))
    vis = ref.visibility(a.shape[-2], a.shape[-1], causal,
                         ref._key_mask_to_mask(key_mask, mask), window)
    a, vis = np.broadcast_arrays(a, vis)
    abs_mass = np.where(vis, a, 0.0).sum(-1)
    mass = ref_similarity(name, q, k, causal, key_mask, mask, window).sum(-1)
    kappa = abs_mass / np.maximum(mass, max(eps, 1e-300))
    return np.maximum(kappa, 1.0)[..., None]


def assert_close_cond(got, want, dtype, scale, kappa, err_msg=""):
    """assert_close with the tolerance of row i multiplied by kappa_i."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    t = tol(dtype, scale)
    bound = (t["atol"] + t["rtol"] * np.abs(want)) * kappa
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    bad = ~same & ~(np.abs(got - want) <= bound)
    assert not np.any(bad), "%s\n%d mismatches; got %s want %s (kappa %s)" % (
        err_msg, bad.sum(), got[bad][:5], want[bad][:5],
        np.broadcast_to(kappa, bad.shape)[bad][:5])


def ref_key_features(name, k, offset=0, M=None):
    """psi(k) (..., m, r) as the state accumulates it (cosFormer: the
    [relu sin, relu cos] features at 1-based positions offset + 1...)."""
    k = f64(k)
    if name == "cosformer":
        m = k.shape[-2]
        theta = np.pi / 2 * (offset + np.arange(1, m + 1)) / M
        rk = np.maximum(k, 0.0)
        return np.concatenate([rk * np.sin(theta)[:, None],
                               rk * np.cos(theta)[:, None]], axis=-1)
    fm, p, W = _ref_fm(name, k.shape[-1])
    return ref.apply_feature_map(k, fm, W, p)


def favor_weights_logspace(q, k, W, causal=False, key_mask=None, eps=1e-6):
    """FAVOR+ weights s_ij / max(sum_j s_ij, eps) with the literal
    (unstabilised) features, evaluated in log space so that nothing
    overflows or underflows: log s_ij = logsumexp_f(a_if + b_jf) with
    a = log phi(q), b = log psi(k). Plain numpy from the formula."""
    q, k, W = f64(q), f64(k), f64(W)
    r, d = W.shape
    qt, kt = q * d ** -0.25, k * d ** -0.25
    a = qt @ W.T - 0.5 * np.sum(qt * qt, -1, keepdims=True) - 0.5 * math.log(r)
    b = kt @ W.T - 0.5 * np.sum(kt * kt, -1, keepdims=True) - 0.5 * math.log(r)
    L = a[..., :, None, :] + b[..., None, :, :]          # (..., n, m, r)
    mx = L.max(-1)
    logs = mx + np.log(np.exp(L - mx[..., None]).sum(-1))
    n, m = logs.shape[-2:]
    vis = ref.visibility(n, m, causal,
                         None if key_mask is None else key_mask[..., None, :])
    logs = np.where(vis, logs, -np.inf)
    rmx = logs.max(-1, keepdims=True)
    rmx_f = np.where(np.isfinite(rmx), rmx, 0.0)
    with np.errstate(divide="ignore"):
        logtot = rmx_f + np.log(np.exp(logs - rmx_f).sum(-1, keepdims=True))
    return np.exp(logs - np.maximum(logtot, math.log(eps)))


def stream_in_pieces(name, q, k, v, bounds, M=None, key_mask=None, methods=(None,),
            chunk_sizes=(None,), causal=True):
    """Run the sequence in pieces [bounds[i], bounds[i+1]) carrying the state."""
    extra = {} if M is None else dict(M=M)
    state, outs = None, []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        km = None if key_mask is None else key_mask[..., a:b]
        o, state = call(name, q[..., a:b, :], k[..., a:b, :], v[..., a:b, :],
                        causal=causal, key_mask=km, initial_state=state,
                        return_state=True, method=methods[i % len(methods)],
                        chunk_size=chunk_sizes[i % len(chunk_sizes)], **extra)
        assert state.offset == b
        outs.append(o)
    return np.concatenate(outs, axis=-2), state


def check_state(name, state, k, v, key_mask=None, M=None, dtype=np.float64):
    """S = sum_j psi(k_j) v_j^T, z = sum_j psi(k_j) over the unmasked keys
    (favor: the same up to one constant positive factor, the stabiliser)."""
    psi = ref_key_features(name, k, 0, M)
    if key_mask is not None:
        psi = psi * np.asarray(key_mask)[..., None]
    S = np.matmul(np.swapaxes(psi, -1, -2), f64(v))
    z = psi.sum(-2)
    lead = np.broadcast_shapes(S.shape[:-2], state.S.shape[:-2])
    S = np.broadcast_to(S, lead + S.shape[-2:])
    z = np.broadcast_to(z, lead + z.shape[-1:])
    assert state.S.shape == S.shape and state.z.shape == z.shape
    assert state.S.shape[-2] == feature_size(name, np.shape(k)[-1])
    assert state.S.dtype == dtype and state.z.dtype == dtype
    gS, gz = np.asarray(state.S, np.float64), np.asarray(state.z, np.float64)
    if name in FAVOR_LIKE:
        zs = z.sum(-1, keepdims=True)
        alpha = np.where(zs > 0, gz.sum(-1, keepdims=True) / np.where(
            zs > 0, zs, 1.0), 1.0)
        assert np.all(alpha > 0)
        gS, gz = gS / alpha[..., None], gz / alpha
    t = tol(dtype)
    np.testing.assert_allclose(gz, z, rtol=t["rtol"] * 10,
                               atol=t["rtol"] * 10 * np.abs(z).max())
    np.testing.assert_allclose(gS, S, rtol=t["rtol"] * 10,
                               atol=t["rtol"] * 10 * np.abs(S).max())
