"""attnx.layouts: each builder against a literal loop over its rule."""
import numpy as np
import pytest

from attnx import layouts


def loop_layout(nb, rule):
    out = np.zeros((nb, nb), dtype=bool)
    for i in range(nb):
        for j in range(nb):
            out[i, j] = rule(i, j)
    return out


def check(got, want):
    assert got.dtype == np.bool_ and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("nb", [0, 1, 5, 13])
@pytest.mark.parametrize("window", [0, 1, 3, 20, (2, 0), (0, 1), (None, 0), (1, None), (None, None)])
def test_local(nb, window):
    left, right = window if isinstance(window, tuple) else (window, window)

    def rule(i, j):
        return (left is None or i - left <= j) and (right is None or j <= i + right)

    check(layouts.local(nb, window), loop_layout(nb, rule))


@pytest.mark.parametrize("nb", [1, 7, 16])
@pytest.mark.parametrize("stride", [1, 2, 3, 5])
def test_strided(nb, stride):
    check(layouts.strided(nb, stride),
          loop_layout(nb, lambda i, j: abs(i - j) < stride or (i - j) % stride == 0))


def test_strided_causal_rows_are_the_sparse_transformer_heads():
    # row i of the lower triangle: the previous `stride` blocks and every stride-th before them
    layout = np.tril(layouts.strided(12, 4))
    np.testing.assert_array_equal(np.flatnonzero(layout[10]), [2, 6, 7, 8, 9, 10])


@pytest.mark.parametrize("nb", [1, 8, 11])
@pytest.mark.parametrize("stride, summary", [(1, 1), (3, 1), (4, 2), (4, 4)])
def test_fixed(nb, stride, summary):
    check(layouts.fixed(nb, stride, summary),
          loop_layout(nb, lambda i, j: i // stride == j // stride or j % stride >= stride - summary))


@pytest.mark.parametrize("nb", [1, 6, 10])
@pytest.mark.parametrize("window", [0, 1, (2, 0)])
@pytest.mark.parametrize("global_blocks", [0, 1, 2, [3], [0, 5], []])
def test_longformer(nb, window, global_blocks):
    left, right = window if isinstance(window, tuple) else (window, window)
    indices = list(range(global_blocks)) if isinstance(global_blocks, int) else global_blocks
    if any(g >= nb for g in indices) or (isinstance(global_blocks, int) and global_blocks > nb):
        with pytest.raises(ValueError, match="global_blocks"):
            layouts.longformer(nb, window, global_blocks)
        return

    def rule(i, j):
        return i - left <= j <= i + right or i in indices or j in indices

    check(layouts.longformer(nb, window, global_blocks), loop_layout(nb, rule))


@pytest.mark.parametrize("nb, window, num_global, num_random", [
    (16, 1, 2, 3), (9, 0, 0, 2), (6, 1, 1, 10), (12, 2, 3, 0), (1, 0, 0, 1)])
def test_bigbird(nb, window, num_global, num_random):
    layout = layouts.bigbird(nb, window, num_global, num_random, seed=7)
    base = loop_layout(nb, lambda i, j: abs(i - j) <= window or i < num_global or j < num_global)
    assert layout.dtype == np.bool_ and layout.shape == (nb, nb)
    # everything of the window and the global blocks, plus exactly num_random
    # other blocks per non-global row (all that remain when fewer do)
    assert np.all(layout[base])
    for row in range(nb):
        extra = int(np.sum(layout[row] & ~base[row]))
        if row < num_global:
            assert extra == 0
        else:
            assert extra == min(num_random, int(np.sum(~base[row])))
    np.testing.assert_array_equal(layout, layouts.bigbird(nb, window, num_global, num_random, seed=7))


def test_bigbird_random_blocks_follow_the_seed():
    a = layouts.bigbird(64, 1, 1, 3, seed=0)
    b = layouts.bigbird(64, 1, 1, 3, seed=1)
    assert not np.array_equal(a, b)
    # the draw is from numpy's default_rng(seed), row by row over the free blocks
    rng = np.random.default_rng(0)
    base = layouts.longformer(64, 1, 1)
    for row in range(1, 64):
        free = np.flatnonzero(~base[row])
        chosen = rng.choice(free, size=3, replace=False)
        np.testing.assert_array_equal(np.flatnonzero(a[row] & ~base[row]), np.sort(chosen))


@pytest.mark.parametrize("call, error, match", [
    (lambda: layouts.local(-1, 1), ValueError, "nb must be at least 0"),
    (lambda: layouts.local(4, 1.5), TypeError, "window's left side must be an integer"),
    (lambda: layouts.local(4, (1, 2, 3)), ValueError, "window must be w or"),
    (lambda: layouts.strided(4, 0), ValueError, "stride must be at least 1"),
    (lambda: layouts.fixed(4, 2, 3), ValueError, r"summary \(3\) cannot exceed stride \(2\)"),
    (lambda: layouts.fixed(4, 2, 0), ValueError, "summary must be at least 1"),
    (lambda: layouts.longformer(4, 1, 5), ValueError, "global_blocks"),
    (lambda: layouts.longformer(4, 1, [1.5]), TypeError, "global_blocks"),
    (lambda: layouts.bigbird(4, 1, 1, -1, 0), ValueError, "num_random must be at least 0"),
])
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()
