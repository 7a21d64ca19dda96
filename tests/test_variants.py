"""The kernelised family's variant table (csrc/py_linear.c, attnx/_variants.py):
every front end is a row, the row's rule r(d) is what the kernel returns,
and the forward, the backward and attnx.dask's checks say the same."""
import numpy as np
import pytest

import attnx
from attnx._variants import VARIANTS, resolve


def test_every_row_names_its_front_ends():
    assert set(VARIANTS) == {"linear", "cosformer", "focused", "taylor", "performer", "efficient"}
    for front, variant in VARIANTS.items():
        assert callable(getattr(attnx, variant.function)), front
        assert callable(getattr(attnx, variant.backward)), front


@pytest.mark.parametrize("front", sorted(VARIANTS))
def test_feature_count_is_the_state_the_kernel_returns(front):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((5, 3)) for _ in range(3))
    options = {"projection": attnx.random_features(7, 3, seed=0)} if front == "performer" else {}
    if front == "efficient":  # no state: its r is its feature count, d
        assert resolve(front, d=3)["features"] == 3
        return
    extra = {"M": 9} if front == "cosformer" else {}
    _, state = getattr(attnx, VARIANTS[front].function)(q, k, v, causal=True, return_state=True,
                                                         **options, **extra)
    assert resolve(front, feature_map="elu", d=3, **options)["features"] == state.S.shape[-2]


def test_cosformer_checks_are_the_kernels():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((4, 3)) for _ in range(3))
    for call in (lambda: attnx.cosformer_attention(q, k, v, M=2),
                 lambda: attnx.cosformer_attention_backward(q, q, k, v, M=2),
                 lambda: resolve("cosformer", M=2, n=4, m=4)):
        with pytest.raises(ValueError, match=r"^M=2 is smaller than the largest position 4 "):
            call()
    for call in (lambda: attnx.cosformer_attention(q, k[:3], v[:3], causal=True),
                 lambda: attnx.cosformer_attention_backward(q, q, k[:3], v[:3], causal=True),
                 lambda: resolve("cosformer", causal=True, n=4, m=3)):
        with pytest.raises(ValueError, match="causal cosformer_attention needs as many queries"):
            call()
    with pytest.raises(ValueError, match=r"fixed M= when streaming \(initial_state= or grad_state="):
        attnx.cosformer_attention_backward(q, q, k, v, grad_state=(np.zeros((6, 3)), np.zeros(6)))


def test_unknown_names():
    with pytest.raises(ValueError, match="unknown linear-family variant 'nope'"):
        resolve("nope")
    with pytest.raises(ValueError, match="unknown feature_map 'nope'"):
        resolve("linear", feature_map="nope")
    # a variant that fixes its feature map ignores feature_map=
    assert resolve("taylor", feature_map="nope", d=2)["features"] == 3
