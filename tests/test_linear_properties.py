"""Hypothesis property tests of the kernelised family (the properties of docs/testing.md).

The variants under test, their references and the stated tolerances are
in tests/linear_variants.py.
"""
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import attnx.reference as ref
from helpers import CAUSAL_MODES, assert_close, make, qkv, tol, vscale  # noqa: E402
from linear_variants import (HYP, METHODS, STATEFUL, VARIANTS, assert_close_cond, call,  # noqa: E402
                             check_state, prep, ref_out, ref_similarity, row_condition,
                             similarity, weights)


# --------------------------------------------------------------------------
# hypothesis: the properties of docs/testing.md
# --------------------------------------------------------------------------

LEADS = [(), (1,), (3,), (2, 3), (2, 1)]
SMALL = st.integers(1, 20)
BIG = st.one_of(st.integers(1, 20), st.sampled_from([31, 64, 65, 97, 130]))


@st.composite
def problems(draw, variants=VARIANTS, causal_ok=True, causal_only=False,
             key_mask_ok=True, general_ok=False, big=True,
             dtypes=(np.float32, np.float64)):
    name = draw(st.sampled_from(variants))
    dtype = draw(st.sampled_from(dtypes))
    lead = draw(st.sampled_from(LEADS))
    size = BIG if big else SMALL
    n = draw(size)
    if name == "efficient" or not causal_ok:
        causal = False
    elif causal_only:
        causal = draw(st.sampled_from([True, "lower_right", "upper_left"]))
    else:
        causal = draw(st.sampled_from(CAUSAL_MODES))
    m = n if (name == "cosformer" and causal) else draw(size)
    # taylor at d = 1: 1 + cos is exactly 0 for keys of the opposite sign,
    # the eps clamp then turns any rounding of s into an O(1) weight; that
    # corner has its own test (test_taylor_d1_opposite_signs_exact_zero)
    d = draw(st.integers(2 if name in ("taylor", "taylor_front") else 1, 9))
    e = draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    q, k, v = qkv(rng, lead, n, m, d, e, dtype)
    q, k = prep(name, q, k)
    kw = dict(causal=causal)
    if key_mask_ok and draw(st.booleans()):
        km_lead = draw(st.sampled_from([(), lead, (1,) * len(lead)]))
        kw["key_mask"] = rng.random(km_lead + (m,)) < draw(st.floats(0.1, 1.0))
    if general_ok and name != "efficient":
        kind = draw(st.sampled_from([None, "mask", "window", "both"]))
        if kind in ("mask", "both"):
            kw["mask"] = rng.random(draw(st.sampled_from(
                [(n, m), lead + (n, m), (1, m), (n, 1)]))) < 0.6
        if kind in ("window", "both"):
            kw["window"] = draw(st.one_of(st.integers(0, 10), st.tuples(
                st.one_of(st.none(), st.integers(0, 10)),
                st.one_of(st.none(), st.integers(0, 10)))))
    if name != "efficient" and draw(st.booleans()):
        kw["eps"] = draw(st.sampled_from([0.0, 1e-6, 1e-3, 0.5]))
    if name == "cosformer" and draw(st.booleans()):
        kw["M"] = max(n, m) + draw(st.integers(0, 50))
    return dict(name=name, dtype=dtype, q=q, k=k, v=v, kw=kw, lead=lead, n=n,
                m=m)


def _call(P, q=None, k=None, v=None, **over):
    kw = dict(P["kw"], **over)
    return call(P["name"], P["q"] if q is None else q, P["k"] if k is None else k,
                P["v"] if v is None else v, **kw)


def _vis(P):
    kw = P["kw"]
    km = kw.get("key_mask")
    mask = kw.get("mask")
    if km is not None:
        kmm = km[..., None, :]
        mask = kmm if mask is None else (mask & kmm)
    return ref.visibility(P["n"], P["m"], kw["causal"], mask, kw.get("window"))


@HYP
@given(problems(general_ok=True))
def test_prop_matches_reference(P):
    """Property 7: float32 and float64 agree with the float64 reference."""
    got = _call(P)
    assert got.dtype == P["dtype"]
    want = ref_out(P["name"], P["q"], P["k"], P["v"], **P["kw"])
    assert_close_cond(got, want, P["dtype"], vscale(P["v"]),
                      row_condition(P["name"], P["q"], P["k"], **P["kw"]))
    assert not np.any(np.isnan(got))


@HYP
@given(problems(general_ok=True))
def test_prop_weights_similarity(P):
    """Properties 1, 2 and 4: similarities >= 0 (0 off the visible set),
    weights >= 0 with rows summing to 1 where the mass reaches eps (else
    mass / eps; 0 for rows that see nothing), output == weights @ v."""
    name, dtype, kw = P["name"], P["dtype"], dict(P["kw"])
    w = weights(name, P["q"], P["k"], **kw)
    s = similarity(name, P["q"], P["k"], **kw)
    shape = np.broadcast_shapes(P["q"].shape[:-2], P["k"].shape[:-2]) + \
        (P["n"], P["m"])
    vis = np.broadcast_to(_vis(P), w.shape)
    assert w.shape == s.shape
    assert w.shape[-2:] == shape[-2:]
    assert w.dtype == dtype and s.dtype == dtype
    assert np.all(w >= 0) and np.all(s >= 0)
    assert np.all(w[~vis] == 0) and np.all(s[~vis] == 0)
    assert_close(s, ref_similarity(name, P["q"], P["k"],
                                   **{a: b for a, b in kw.items() if a != "eps"}),
                 dtype, err_msg="similarity")
    w64 = w.astype(np.float64)
    sums = w64.sum(-1)
    mass = s.astype(np.float64).sum(-1)
    eps = 0.0 if name == "efficient" else kw.get("eps", 1e-6)
    kappa = np.broadcast_to(row_condition(name, P["q"], P["k"], **kw)[..., 0],
                            sums.shape)
    rt = (1e-12 if dtype == np.float64 else 2e-6 * max(1, P["m"]) ** 0.5) * kappa
    full = (mass > eps * (1 + 1e-3)) & (mass > 0)
    assert np.all(np.abs(sums[full] - 1) <= rt[full]), sums[full]
    assert np.all(sums[mass == 0] == 0)
    assert np.all(sums <= 1 + rt)
    o = _call(P)
    assert_close_cond(o, np.matmul(w64, P["v"].astype(np.float64)), dtype,
                      vscale(P["v"]), kappa[..., None])


@HYP
@given(problems(variants=STATEFUL, causal_only=True,
                dtypes=(np.float64,)), st.data())
def test_prop_methods_agree(P, data):
    """Property 3: cumsum == recurrent == chunk (every chunk size) ==
    quadratic == default in float64."""
    base = _call(P, method="cumsum")
    for method in (None, "chunk", "recurrent", "quadratic"):
        c = data.draw(st.sampled_from([None, 1, 2, 3, 7, 64, P["n"] + 3,
                                       max(1, P["n"] // 2)]))
        got = _call(P, method=method, chunk_size=c)
        assert_close(got, base, np.float64, vscale(P["v"]),
                     err_msg="%s %s" % (method, c))


@HYP
@given(problems(variants=STATEFUL, causal_only=True), st.data())
def test_prop_streaming_pieces(P, data):
    """Property 3: streaming in random pieces (one token at a time
    included) equals one call; the final state is sum psi(k) v^T."""
    name, n = P["name"], P["n"]
    if P["m"] != n:   # self-attention pieces
        P = dict(P, k=P["k"][..., :min(n, P["m"]), :],
                 v=P["v"][..., :min(n, P["m"]), :],
                 q=P["q"][..., :min(n, P["m"]), :])
        n = min(n, P["m"])
        if "key_mask" in P["kw"]:
            P["kw"] = dict(P["kw"], key_mask=P["kw"]["key_mask"][..., :n])
    M = P["kw"].get("M", n + data.draw(st.integers(0, 9))) \
        if name == "cosformer" else None
    if M is not None:
        M = max(M, n)
    km = P["kw"].get("key_mask")
    eps = P["kw"].get("eps", 1e-6)
    extra = {} if M is None else dict(M=M)
    full = call(name, P["q"], P["k"], P["v"], causal=True, key_mask=km,
                eps=eps, **extra)
    one_by_one = data.draw(st.booleans())
    if one_by_one:
        bounds = list(range(n + 1))
    else:
        cuts = data.draw(st.lists(st.integers(0, n), max_size=6))
        bounds = sorted(set([0, n] + cuts))
    methods = tuple(data.draw(st.lists(st.sampled_from([None] + METHODS),
                                       min_size=1, max_size=3)))
    sizes = tuple(data.draw(st.lists(st.sampled_from([None, 1, 2, 5, 64]),
                                     min_size=1, max_size=3)))
    state, outs = None, []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        o, state = call(name, P["q"][..., a:b, :], P["k"][..., a:b, :],
                        P["v"][..., a:b, :], causal=True,
                        key_mask=None if km is None else km[..., a:b],
                        eps=eps, initial_state=state, return_state=True,
                        method=methods[i % len(methods)],
                        chunk_size=sizes[i % len(sizes)], **extra)
        assert state.offset == b
        outs.append(o)
    got = np.concatenate(outs, axis=-2)
    # the pieces and the one call round their sums apart: taylor's rows
    # where 1 + cos cancels get their condition number's share (row_condition)
    assert_close_cond(got, full, P["dtype"], vscale(P["v"]),
                      row_condition(name, P["q"], P["k"], eps=eps, causal=True, key_mask=km))
    km_full = None if km is None else np.broadcast_to(
        km, np.broadcast_shapes(km.shape, P["k"].shape[:-1]))
    check_state(name, state, P["k"], P["v"], km_full, M, P["dtype"])


@HYP
@given(problems(causal_only=True, variants=STATEFUL, general_ok=True), st.data())
def test_prop_causality(P, data):
    """Property 5: changing keys/values a row cannot see leaves it unchanged."""
    vis = _vis(P)
    vis = vis.reshape((-1,) + vis.shape[-2:]).any(0)   # seen by any head
    o = _call(P)
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    j = data.draw(st.integers(0, P["m"] - 1))
    k2, v2 = P["k"].copy(), P["v"].copy()
    k2[..., j:, :] = make(rng, k2[..., j:, :].shape, P["dtype"], 3.0)
    v2[..., j:, :] = make(rng, v2[..., j:, :].shape, P["dtype"], 3.0)
    k2, _ = prep(P["name"], k2, k2)
    o2 = _call(P, k=k2, v=v2)
    rows = ~vis[:, j:].any(-1)
    t = tol(P["dtype"], vscale(P["v"]))
    np.testing.assert_allclose(o2[..., rows, :], o[..., rows, :],
                               rtol=t["rtol"] / 10, atol=t["atol"] / 10)


@HYP
@given(problems(general_ok=True), st.data())
def test_prop_masked_keys_have_no_effect(P, data):
    """Property 5: keys removed by key_mask can have any keys and values
    (for efficient attention too: they leave the key softmax)."""
    lead, m = P["lead"], P["m"]
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    km = rng.random(lead + (m,)) < 0.6
    base = P["kw"].get("key_mask")
    km = km if base is None else (km & base)
    o = _call(P, key_mask=km)
    hidden = ~km[..., :, None]
    k2 = np.where(hidden, make(rng, P["k"].shape, P["dtype"], 5.0), P["k"])
    v2 = np.where(hidden, make(rng, P["v"].shape, P["dtype"], 5.0), P["v"])
    k2, _ = prep(P["name"], k2, k2)
    o2 = _call(P, k=k2.astype(P["dtype"]), v=v2.astype(P["dtype"]), key_mask=km)
    t = tol(P["dtype"], vscale(P["v"]))
    np.testing.assert_allclose(o2, o, rtol=t["rtol"] / 10, atol=t["atol"] / 10)


@HYP
@given(problems(variants=[v for v in VARIANTS if v != "cosformer"],
                causal_ok=False), st.data())
def test_prop_permutation(P, data):
    """Property 6 (non-causal): equivariant to permuting queries, invariant
    to permuting key/value pairs (with the key mask). cosFormer is left out:
    its similarity depends on the positions by design."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    n, m = P["n"], P["m"]
    pq, pk = rng.permutation(n), rng.permutation(m)
    km = P["kw"].get("key_mask")
    o = _call(P)
    o2 = _call(P, q=P["q"][..., pq, :], k=P["k"][..., pk, :],
               v=P["v"][..., pk, :],
               key_mask=None if km is None else km[..., pk])
    assert_close(o2, o[..., pq, :].astype(np.float64), P["dtype"],
                 vscale(P["v"]))


@HYP
@given(problems(big=False, general_ok=True), st.data())
def test_prop_broadcast_equals_loop(P, data):
    """Property 8: a broadcast / strided call equals the loop over slices."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1)))
    name, dtype, n, m = P["name"], P["dtype"], P["n"], P["m"]
    d, e = P["q"].shape[-1], P["v"].shape[-1]
    A, Bh = 2, 3
    q = make(rng, (A, n, 1, d), dtype).transpose(0, 2, 1, 3)       # (A,1,n,d)
    k = np.broadcast_to(make(rng, (Bh, m, d), dtype), (1, Bh, m, d))
    v = make(rng, (A, Bh, m, 2 * e), dtype)[..., ::2]
    q, k = prep(name, q, k)
    kw = dict(P["kw"])
    kw["key_mask"] = None if "key_mask" not in kw else \
        (rng.random((Bh, m)) < 0.7)
    if "mask" in kw:
        kw["mask"] = rng.random((A, 1, n, m)) < 0.7
    got = call(name, q, k, v, **kw)
    assert got.shape == (A, Bh, n, e)
    for a in range(A):
        for b in range(Bh):
            kw1 = dict(kw)
            if kw1.get("key_mask") is not None:
                kw1["key_mask"] = kw["key_mask"][b]
            if kw1.get("mask") is not None:
                kw1["mask"] = kw["mask"][a, 0]
            one = call(name, np.ascontiguousarray(q[a, 0]),
                       np.ascontiguousarray(k[0, b]),
                       np.ascontiguousarray(v[a, b]), **kw1)
            t = tol(dtype, vscale(v))
            np.testing.assert_allclose(got[a, b], one, rtol=t["rtol"] / 10,
                                       atol=t["atol"] / 10)


@HYP
@given(problems(dtypes=(np.float32,), general_ok=True))
def test_prop_float32_vs_float64(P):
    """Property 7: float32 agrees with the float64 call on the same
    (float32-representable) inputs within the float32 tolerance."""
    o32 = _call(P)
    o64 = _call(P, q=P["q"].astype(np.float64), k=P["k"].astype(np.float64),
                v=P["v"].astype(np.float64))
    assert o32.dtype == np.float32 and o64.dtype == np.float64
    assert_close_cond(o32, o64, np.float32, vscale(P["v"]),
                      row_condition(P["name"], P["q"], P["k"], **P["kw"]))
