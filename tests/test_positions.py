"""Position encodings: attnx.sinusoidal_positions, attnx.rotary and its
backward, against literal float64 references (loops, complex numbers)."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnx

from helpers import assert_close, hypothesis_settings  # noqa: E402

HYP = hypothesis_settings(40)


# --------------------------------------------------------------------------
# references, straight from the formulas
# --------------------------------------------------------------------------

def loop_sinusoidal(n, d, base=10000.0):
    table = np.zeros((n, d))
    for p in range(n):
        for c in range(d):
            angle = p / base ** (2 * (c // 2) / d)
            table[p, c] = np.sin(angle) if c % 2 == 0 else np.cos(angle)
    return table


def complex_rotary(x, positions, base=10000.0, interleaved=False):
    """Each pair as the complex number a + ib, multiplied by exp(i theta)."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : d // 2], x[..., d // 2:]
    theta = np.asarray(positions, dtype=np.float64)[..., None] * base ** (-2.0 * np.arange(d // 2) / d)
    z = (a + 1j * b) * np.exp(1j * theta)
    out = np.empty_like(x)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
    else:
        out[..., : d // 2], out[..., d // 2:] = z.real, z.imag
    return out


def loop_rotary(x, positions, base=10000.0, interleaved=False):
    """2x2 rotation matrices applied pair by pair, one vector at a time."""
    x = np.asarray(x, dtype=np.float64)
    d = x.shape[-1]
    positions = np.broadcast_to(np.asarray(positions, dtype=np.float64), x.shape[:-1])
    out = np.zeros_like(x)
    for index in np.ndindex(*x.shape[:-1]):
        for i in range(d // 2):
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + d // 2)
            t = positions[index] * base ** (-2.0 * i / d)
            rotation = np.array([[np.cos(t), -np.sin(t)], [np.sin(t), np.cos(t)]])
            out[index + (a,)], out[index + (b,)] = rotation @ np.array([x[index + (a,)], x[index + (b,)]])
    return out


# --------------------------------------------------------------------------
# sinusoidal
# --------------------------------------------------------------------------

@pytest.mark.parametrize("n, d, base", [(7, 8, 10000), (16, 6, 100.0), (5, 7, 10000), (1, 2, 3), (0, 4, 10)])
def test_sinusoidal_positions_match_the_loop(n, d, base):
    table = attnx.sinusoidal_positions(n, d, base=base)
    assert table.shape == (n, d) and table.dtype == np.float64
    np.testing.assert_allclose(table, loop_sinusoidal(n, d, base), rtol=1e-13, atol=1e-13)


def test_sinusoidal_positions_first_row_and_columns():
    table = attnx.sinusoidal_positions(50, 16)
    np.testing.assert_array_equal(table[0, 0::2], 0)
    np.testing.assert_array_equal(table[0, 1::2], 1)
    np.testing.assert_allclose(table[:, 0], np.sin(np.arange(50)), rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("args, error, match", [
    ((-1, 4), ValueError, "n must be at least 0"),
    ((4, 2.5), TypeError, "d must be an integer"),
    ((4, 4, 0), ValueError, "base must be finite and positive"),
    ((4, 4, "x"), TypeError, "base must be a real number"),
])
def test_sinusoidal_positions_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        attnx.sinusoidal_positions(*args)


# --------------------------------------------------------------------------
# rotary
# --------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("base", [10000, 500.0])
def test_rotary_matches_complex_and_rotation_references(interleaved, base):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 9, 8))
    got = attnx.rotary(x, base=base, interleaved=interleaved)
    positions = np.arange(9)
    np.testing.assert_allclose(got, complex_rotary(x, positions, base, interleaved), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(got, loop_rotary(x, positions, base, interleaved), rtol=1e-13, atol=1e-13)


def test_rotary_rotate_half_is_llama_layout():
    # Llama's formula: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1],
    # with the angle table repeated over both halves
    rng = np.random.default_rng(1)
    n, d = 6, 10
    x = rng.standard_normal((n, d))
    theta = np.arange(n)[:, None] * 10000.0 ** (-np.arange(0, d, 2) / d)
    cos, sin = np.cos(np.concatenate([theta, theta], -1)), np.sin(np.concatenate([theta, theta], -1))
    rotate_half = np.concatenate([-x[:, d // 2:], x[:, : d // 2]], -1)
    np.testing.assert_allclose(attnx.rotary(x), x * cos + rotate_half * sin, rtol=1e-13, atol=1e-13)


def test_rotary_matches_transformers_llama_when_installed():
    transformers_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    import torch
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((2, 1, 4, 7, 16)), rng.standard_normal((2, 1, 4, 7, 16))
    theta = np.arange(7)[:, None] * 10000.0 ** (-np.arange(0, 16, 2) / 16)
    emb = np.concatenate([theta, theta], -1)
    rq, rk = transformers_llama.apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k),
                                                      torch.from_numpy(np.cos(emb)), torch.from_numpy(np.sin(emb)),
                                                      unsqueeze_dim=0)
    np.testing.assert_allclose(attnx.rotary(q), rq.numpy(), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(attnx.rotary(k), rk.numpy(), rtol=1e-13, atol=1e-13)


@HYP
@given(n=st.integers(1, 12), half=st.integers(1, 8), shift=st.integers(-50, 50),
       interleaved=st.booleans(), base=st.sampled_from([10.0, 10000.0]), seed=st.integers(0, 2**16))
def test_rotary_dot_products_depend_only_on_the_offset(n, half, shift, interleaved, base, seed):
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal((n, 2 * half)), rng.standard_normal((n, 2 * half))
    positions = np.arange(n)
    scores = attnx.rotary(q, positions, base, interleaved) @ attnx.rotary(k, positions, base, interleaved).T
    shifted = (attnx.rotary(q, positions + shift, base, interleaved)
               @ attnx.rotary(k, positions + shift, base, interleaved).T)
    np.testing.assert_allclose(shifted, scores, rtol=1e-10, atol=1e-10)
    # and the score of (i, j) is the score of the same two vectors at (i - j, 0)
    i, j = n - 1, 0
    alone = (attnx.rotary(q[i:i + 1], [i - j], base, interleaved)
             @ attnx.rotary(k[j:j + 1], [0], base, interleaved).T)
    np.testing.assert_allclose(alone[0, 0], scores[i, j], rtol=1e-10, atol=1e-10)


def test_rotary_preserves_norms():
    x = np.random.default_rng(3).standard_normal((4, 5, 12))
    np.testing.assert_allclose(np.linalg.norm(attnx.rotary(x), axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-13)


def test_rotary_explicit_positions_decode_one_token_at_a_time():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 10, 8))
    whole = attnx.rotary(x)
    for t in range(10):
        np.testing.assert_allclose(attnx.rotary(x[..., t:t + 1, :], positions=[t]), whole[..., t:t + 1, :],
                                   rtol=1e-14, atol=1e-14)
        np.testing.assert_allclose(attnx.rotary(x[..., t:t + 1, :], positions=t), whole[..., t:t + 1, :],
                                   rtol=1e-14, atol=1e-14)


def test_rotary_positions_per_sequence_broadcast():
    # (batch, n) positions against x (batch, heads, n, d): a different offset per sequence
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 1, 5, 6))
    positions = np.array([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])[:, None, :]
    got = attnx.rotary(x, positions)
    np.testing.assert_allclose(got, loop_rotary(x, positions), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(got[1], attnx.rotary(x[1], np.arange(7, 12)), rtol=1e-14)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_rotary_dtypes(dtype):
    x = np.random.default_rng(6).standard_normal((3, 7, 8))
    got = attnx.rotary(x.astype(dtype))
    assert got.dtype == dtype
    want = complex_rotary(x.astype(dtype).astype(np.float64), np.arange(7))
    assert_close(got, want, dtype, scale=np.abs(want).max())


def test_rotary_integer_input_computes_in_float64():
    x = np.arange(24).reshape(3, 8)
    got = attnx.rotary(x)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, complex_rotary(x, np.arange(3)), rtol=1e-13, atol=1e-12)


def test_rotary_leaves_input_unchanged_and_reads_views():
    rng = np.random.default_rng(7)
    base = rng.standard_normal((2, 6, 3, 8))
    view = base.transpose(0, 2, 1, 3)  # (2, 3, 6, 8) strided
    kept = base.copy()
    got = attnx.rotary(view)
    np.testing.assert_array_equal(base, kept)
    np.testing.assert_allclose(got, attnx.rotary(np.ascontiguousarray(view)), rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(x=np.zeros((4, 7))), ValueError, "even"),
    (dict(x=np.zeros(8)), ValueError, "at least 2 dimensions"),
    (dict(x=np.zeros((4, 8)), positions=np.arange(5)), ValueError, "positions of shape"),
    (dict(x=np.zeros((4, 8)), positions=np.zeros((2, 4))), ValueError, "positions of shape"),
    (dict(x=np.zeros((4, 8)), positions=np.array([0, 1, np.nan, 3])), ValueError, "finite"),
    (dict(x=np.zeros((4, 8)), positions=np.array(["a"] * 4)), TypeError, "positions"),
    (dict(x=np.zeros((4, 8), complex)), TypeError, "x must hold real numbers"),
    (dict(x=np.zeros((4, 8)), base=-1), ValueError, "base"),
])
def test_rotary_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        attnx.rotary(**kwargs)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_backward_is_the_transpose(interleaved):
    # <dout, R x> == <R^T dout, x>, and R^T undoes R
    rng = np.random.default_rng(8)
    x, dout = rng.standard_normal((2, 5, 8)), rng.standard_normal((2, 5, 8))
    positions = np.array([3, 1, 4, 1, 5])
    lhs = np.sum(dout * attnx.rotary(x, positions, interleaved=interleaved))
    dx = attnx.rotary_backward(dout, positions, interleaved=interleaved)
    np.testing.assert_allclose(lhs, np.sum(dx * x), rtol=1e-13)
    back = attnx.rotary_backward(attnx.rotary(x, positions, interleaved=interleaved), positions,
                                 interleaved=interleaved)
    np.testing.assert_allclose(back, x, rtol=1e-13, atol=1e-13)


def test_rotary_vjp_matches_finite_differences():
    rng = np.random.default_rng(9)
    x, dout = rng.standard_normal((3, 6)), rng.standard_normal((3, 6))
    out, pullback = attnx.vjp(attnx.rotary, x, base=100.0, interleaved=True)
    np.testing.assert_array_equal(out, attnx.rotary(x, base=100.0, interleaved=True))
    g = pullback(dout)
    assert isinstance(g, attnx.Gradients) and g.q.shape == x.shape
    numeric = np.zeros_like(x)
    h = 1e-6
    for index in np.ndindex(*x.shape):
        step = np.zeros_like(x)
        step[index] = h
        numeric[index] = (np.sum(dout * attnx.rotary(x + step, base=100.0, interleaved=True))
                          - np.sum(dout * attnx.rotary(x - step, base=100.0, interleaved=True))) / (2 * h)
    np.testing.assert_allclose(g.q, numeric, rtol=1e-8, atol=1e-8)


def test_rotary_backward_matches_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(10)
    x, dout = rng.standard_normal((2, 7, 8)), rng.standard_normal((2, 7, 8))
    theta = np.arange(7)[:, None] * 10000.0 ** (-np.arange(0, 8, 2) / 8)
    cos, sin = torch.from_numpy(np.cos(theta)), torch.from_numpy(np.sin(theta))
    tx = torch.from_numpy(x).requires_grad_()
    a, b = tx[..., :4], tx[..., 4:]
    out = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
    out.backward(torch.from_numpy(dout))
    np.testing.assert_allclose(attnx.rotary_backward(dout), tx.grad.numpy(), rtol=1e-13, atol=1e-13)
