"""Bad input to the kernelised family: clear exceptions naming the argument.

The variants under test, their references and the stated tolerances are
in tests/linear_variants.py.
"""
import numpy as np
import pytest

import attnx

import attnx.reference as ref
from helpers import assert_close, make, qkv, run_isolated, vscale  # noqa: E402
from linear_variants import VARIANTS, WVARIANT, call, prep  # noqa: E402


# --------------------------------------------------------------------------
# bad input: clear exceptions naming the argument
# --------------------------------------------------------------------------

def _base(rng=None):
    rng = rng or np.random.default_rng(54)
    return qkv(rng, (2,), 4, 5, 3, 2)


def test_error_unknown_feature_map_and_method():
    q, k, v = _base()
    for bad in ["gelu", "ELU", "", "favor+"]:
        with pytest.raises(ValueError, match="feature_map"):
            attnx.linear_attention(q, k, v, feature_map=bad)
        with pytest.raises(ValueError, match="feature_map"):
            attnx.attention_weights(q, k, "linear", feature_map=bad)
    for bad in [3, None, 1.5]:
        with pytest.raises((TypeError, ValueError), match="feature_map"):
            attnx.linear_attention(q, k, v, feature_map=bad)
    for bad in ["parallel", "Chunk", "", "scan"]:
        with pytest.raises(ValueError, match="method"):
            attnx.linear_attention(q, k, v, method=bad, causal=True)
    with pytest.raises((TypeError, ValueError), match="method"):
        attnx.linear_attention(q, k, v, method=1, causal=True)
    for bad in ["upper-left", "lower", "", 2]:
        with pytest.raises((TypeError, ValueError), match="causal"):
            attnx.linear_attention(q, k, v, causal=bad)


def test_error_bad_eps():
    q, k, v = _base()
    for bad in [-1e-6, -1.0, float("nan"), float("inf")]:
        with pytest.raises(ValueError, match="eps"):
            attnx.linear_attention(q, k, v, eps=bad)
        with pytest.raises(ValueError, match="eps"):
            attnx.cosformer_attention(q, k, v, eps=bad)
    for bad in ["1e-6", None, [1e-6]]:
        with pytest.raises((TypeError, ValueError), match="eps"):
            attnx.linear_attention(q, k, v, eps=bad)


def test_error_chunk_size():
    q, k, v = _base()
    for bad in [0, -1, -64]:
        with pytest.raises(ValueError, match="chunk_size"):
            attnx.linear_attention(q, k, v, causal=True, chunk_size=bad)
    for bad in [1.5, "8", True]:
        with pytest.raises((TypeError, ValueError), match="chunk_size"):
            attnx.linear_attention(q, k, v, causal=True, chunk_size=bad)
    # numpy integers are fine, huge sizes act like n
    got = attnx.linear_attention(q, k, v, causal=True, chunk_size=np.int64(2))
    assert_close(got, ref.linear_attention(q, k, v, causal=True), np.float64,
                 vscale(v))
    got = attnx.linear_attention(q, k, v, causal=True, chunk_size=2 ** 62)
    assert_close(got, ref.linear_attention(q, k, v, causal=True), np.float64,
                 vscale(v))


def test_error_favor_projection():
    q, k, v = _base()
    with pytest.raises(ValueError, match="projection"):
        attnx.linear_attention(q, k, v, feature_map="favor")
    for bad in [np.ones((5, 2)), np.ones((5, 4)), np.ones(3), np.ones((2, 5, 3))]:
        with pytest.raises(ValueError, match="projection"):
            attnx.linear_attention(q, k, v, feature_map="favor", projection=bad)
        with pytest.raises(ValueError, match="projection"):
            attnx.performer_attention(q, k, v, projection=bad)
    with pytest.raises((TypeError, ValueError), match="projection"):
        attnx.linear_attention(q, k, v, feature_map="favor",
                               projection=np.ones((5, 3), np.complex128))


def test_error_key_mask():
    q, k, v = _base()
    for name in VARIANTS:
        qq, kk = prep(name, q, k)
        for dt in [np.float64, np.int64, np.uint8]:
            with pytest.raises(TypeError, match="key_mask"):
                call(name, qq, kk, v, key_mask=np.ones(5, dtype=dt))
        for shape in [(4,), (6,), (3, 5), (2, 4, 5), (5, 1)]:
            with pytest.raises(ValueError, match="key_mask"):
                call(name, qq, kk, v, key_mask=np.ones(shape, bool))


def test_error_state_from_another_call():
    rng = np.random.default_rng(55)
    q, k, v = qkv(rng, (2,), 6, 6, 3, 2)
    _, state = attnx.linear_attention(q, k, v, causal=True, return_state=True)
    # another dtype
    with pytest.raises((TypeError, ValueError), match="initial_state|state"):
        attnx.linear_attention(q.astype(np.float32), k.astype(np.float32),
                               v.astype(np.float32), causal=True,
                               initial_state=state)
    # another e, another d (r), another feature size
    with pytest.raises(ValueError, match="initial_state|state"):
        attnx.linear_attention(q, k, make(rng, (2, 6, 3)), causal=True,
                               initial_state=state)
    with pytest.raises(ValueError, match="initial_state|state"):
        attnx.linear_attention(make(rng, (2, 6, 4)), make(rng, (2, 6, 4)), v,
                               causal=True, initial_state=state)
    with pytest.raises(ValueError, match="initial_state|state"):
        attnx.linear_attention(q, k, v, causal=True, initial_state=state,
                               feature_map="taylor")
    # another batch shape (not broadcastable)
    with pytest.raises(ValueError, match="initial_state|state|broadcast"):
        attnx.linear_attention(make(rng, (3, 6, 3)), make(rng, (3, 6, 3)),
                               make(rng, (3, 6, 2)), causal=True,
                               initial_state=state)
    # not a state
    with pytest.raises((TypeError, ValueError), match="initial_state"):
        attnx.linear_attention(q, k, v, causal=True, initial_state=(1, 2, 3))
    with pytest.raises((TypeError, ValueError), match="initial_state"):
        attnx.linear_attention(q, k, v, causal=True, initial_state=state.S)


def test_error_callable_features():
    q, k, v = _base()
    with pytest.raises(ValueError, match="negative"):
        attnx.linear_attention(q, k, v, feature_map=lambda x: x)
    with pytest.raises(ValueError, match="shape|features"):
        attnx.linear_attention(q, k, v, feature_map=lambda x: np.abs(x)[..., 0])
    with pytest.raises(ValueError, match="shape|features"):
        attnx.linear_attention(q, k, v, feature_map=lambda x: np.abs(x)[:1])
    with pytest.raises(ValueError, match="shape|features"):
        attnx.linear_attention(q, k, v, feature_map=lambda x: np.abs(x).T)
    calls = []

    def varying(x):  # q and k get different feature sizes
        calls.append(1)
        return np.abs(x)[..., :len(calls) + 1]
    with pytest.raises(ValueError, match="features|r\\b|agree"):
        attnx.linear_attention(q, k, v, feature_map=varying)
    with pytest.raises(TypeError):
        attnx.linear_attention(q, k, v,
                               feature_map=lambda x: np.abs(x).astype(complex))
    with pytest.raises(ValueError, match="negative"):
        attnx.linear_attention(q, k, v, feature_map=lambda x: x * 0 - 1)
    # an exception inside the callable propagates unchanged
    def boom(x):
        raise KeyError("boom")
    with pytest.raises(KeyError, match="boom"):
        attnx.linear_attention(q, k, v, feature_map=boom)


def test_error_identity_negative():
    q, k, v = _base()
    qa, ka = np.abs(q), np.abs(k)
    with pytest.raises(ValueError, match="negative|identity"):
        attnx.linear_attention(q, ka, v, feature_map="identity")
    with pytest.raises(ValueError, match="negative|identity"):
        attnx.linear_attention(qa, k, v, feature_map="identity")
    qa[0, 0, 0] = -1e-300
    with pytest.raises(ValueError, match="negative|identity"):
        attnx.linear_attention(qa, ka, v, feature_map="identity", causal=True)


def test_error_focused_p():
    q, k, v = _base()
    for bad in [0, -1, float("nan"), float("inf")]:
        with pytest.raises(ValueError, match=r"\bp\b"):
            attnx.focused_linear_attention(q, k, v, p=bad)
        with pytest.raises(ValueError, match=r"\bp\b"):
            attnx.linear_attention(q, k, v, feature_map="focused", p=bad)


def test_error_shapes():
    q, k, v = _base()
    for name in VARIANTS:
        qq, kk = prep(name, q, k)
        with pytest.raises(ValueError, match=r"\bq\b|\bk\b"):
            call(name, qq, kk[..., :2], v)
        with pytest.raises(ValueError, match=r"\bk\b|\bv\b"):
            call(name, qq, kk, v[:, :4])
        with pytest.raises(ValueError, match=r"\bq\b"):
            call(name, qq[0, 0], kk, v)
        with pytest.raises(ValueError, match=r"\bq\b|\bk\b|\bv\b|broadcast"):
            call(name, np.stack([qq] * 3), np.stack([kk] * 2), v)


def test_error_unknown_keyword():
    q, k, v = _base()
    for name in VARIANTS:
        qq, kk = prep(name, q, k)
        with pytest.raises(TypeError, match="is_causal"):
            call(name, qq, kk, v, is_causal=True)
        with pytest.raises(TypeError):
            attnx.attention_weights(qq, kk, WVARIANT[name], nonsense=1)
    with pytest.raises(TypeError):
        attnx.efficient_attention(q, k, v, mask=np.ones((4, 5), bool))
    with pytest.raises(ValueError, match="variant|bogus"):
        attnx.attention_weights(q, k, variant="bogus")
    with pytest.raises(ValueError, match="projection"):
        attnx.linear_attention(q, k, v, feature_map="elu",
                               projection=np.ones((4, 3)))


def test_error_streaming_with_mask_or_window():
    """A state keeps no key positions: mask=/window= with streaming is a
    clear ValueError (the quadratic form has no carried state)."""
    q, k, v = _base()
    with pytest.raises(ValueError, match="mask|window|state"):
        attnx.linear_attention(q, k, v, causal=True, return_state=True,
                               mask=np.ones((4, 5), bool))
    with pytest.raises(ValueError, match="mask|window|state"):
        attnx.linear_attention(q, k, v, causal=True, return_state=True,
                               window=2)


def test_cumsum_refuses_large_sizes():
    """method='cumsum' materialises (m + 1) prefix states: it refuses sizes
    whose prefix tensor would not fit, with a message giving the size. A
    modest input (m = 300, d = e = 1024: 2.5 GB of prefix states) ..."""
    rng = np.random.default_rng(56)
    q, k, v = qkv(rng, (), 300, 300, 1024, 1024, np.float64)
    with pytest.raises(ValueError, match="cumsum") as ei:
        attnx.linear_attention(q, k, v, causal=True, method="cumsum")
    assert "301" in str(ei.value) or "300" in str(ei.value), str(ei.value)
    # smaller sizes run
    o = attnx.linear_attention(q[:40, :64], k[:40, :64], v[:40, :64],
                               causal=True, method="cumsum")
    assert o.shape == (40, 64)


def test_cumsum_refuses_huge_broadcast_n_without_allocating():
    """... and a huge n built with np.broadcast_to from a tiny array (2**28
    rows of d = 4: 8 GiB if copied, 43 GB of prefix states): a ValueError
    naming the size, with nothing big allocated. Run in a subprocess under
    a 3 GiB address-space limit so that a copy fails there, not here."""
    out = run_isolated("""
        import os, resource
        # AddressSanitizer reserves terabytes of shadow address space, so
        # the limit is left off in the sanitizer run (tests/run_sanitizers.sh)
        if "libasan" not in os.environ.get("LD_PRELOAD", ""):
            resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        n = 2 ** 28
        x = np.broadcast_to(np.arange(4.0), (n, 4))
        try:
            attnx.linear_attention(x, x, x, causal=True, method="cumsum")
        except ValueError as exc:
            print("ValueError:", exc)
        except MemoryError as exc:
            print("MemoryError:", exc)
    """)
    assert out.startswith("ValueError:"), out
    assert "cumsum" in out and ("268435456" in out or "268435457" in out
                                or "GiB" in out or "GB" in out), out


def test_efficient_options_not_available():
    q, k, v = _base()
    for kw in (dict(initial_state=None, return_state=True),
               dict(method="chunk"), dict(window=2)):
        with pytest.raises((TypeError, ValueError)):
            attnx.efficient_attention(q, k, v, **kw)
