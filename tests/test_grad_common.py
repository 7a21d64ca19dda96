"""The pieces every gradient shares (attnx/_grad.py)."""
import numpy as np
import pytest

import attnx
from attnx._grad import sum_to_shape


def test_gradients_fields_default_to_none():
    g = attnx.Gradients(q=1, k=2, v=3)
    assert g._fields == ("q", "k", "v", "bias", "projection", "state")
    assert (g.q, g.k, g.v, g.bias, g.projection, g.state) == (1, 2, 3, None, None, None)


@pytest.mark.parametrize("full, shape", [
    ((2, 3, 4, 5), (2, 3, 4, 5)),
    ((2, 3, 4, 5), (3, 4, 5)),
    ((2, 3, 4, 5), (2, 1, 4, 5)),
    ((2, 3, 4, 5), (1, 1, 4, 5)),
    ((2, 3, 4, 5), (4, 5)),
    ((2, 3, 4, 5), (1, 5)),
    ((2, 3, 4, 5), (5,)),
])
def test_sum_to_shape_is_the_adjoint_of_broadcasting(full, shape):
    # <grad, broadcast(x)> == <sum_to_shape(grad), x> for every x: the
    # defining property of the gradient of a broadcast
    rng = np.random.default_rng(0)
    grad, x = rng.standard_normal(full), rng.standard_normal(shape)
    reduced = sum_to_shape(grad, shape)
    assert reduced.shape == shape
    np.testing.assert_allclose(np.sum(grad * np.broadcast_to(x, full)), np.sum(reduced * x),
                               rtol=1e-12)


def test_sum_to_shape_refuses_a_larger_shape():
    with pytest.raises(ValueError, match="cannot reduce"):
        sum_to_shape(np.zeros((3, 4)), (2, 3, 4))


def test_vjp_of_a_function_without_backward_names_it():
    with pytest.raises(TypeError, match="random_features has no backward"):
        attnx.vjp(attnx.random_features, 4, 4)
