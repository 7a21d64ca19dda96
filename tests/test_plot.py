"""attnx.plot: the drawn arrays are the computed numbers.

The heatmaps hold attention_weights exactly, with exactly the cells the
visibility rules hide masked (rules written here again as plain loops);
the regression curve is a numpy float64 Nadaraya-Watson estimate."""
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

matplotlib = pytest.importorskip("matplotlib", reason="attnx.plot needs matplotlib (the plot extra)")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import attnx  # noqa: E402
import attnx.plot  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def visible_by_rule(n, m, causal=False, window=None, layout=None, block_size=None):
    """The visibility rules, one (i, j) at a time."""
    left, right = (window, window) if not isinstance(window, tuple) else window
    visible = np.zeros((n, m), bool)
    for i in range(n):
        aligned = i + m - n
        for j in range(m):
            ok = True
            if causal in (True, "lower_right"):
                ok = ok and j <= aligned
            if causal == "upper_left":
                ok = ok and j <= i
            if left is not None:
                ok = ok and aligned - left <= j
            if right is not None:
                ok = ok and j <= aligned + right
            if layout is not None:
                row = layout[i // block_size] if layout.shape[0] > 1 else layout[0]
                ok = ok and bool(row[j // block_size] if row.shape[0] > 1 else row[0])
            visible[i, j] = ok
    return visible


def image_array(ax):
    assert len(ax.images) == 1
    return ax.images[0].get_array()


def data(n=9, m=11, d=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d)), rng.standard_normal((m, d))


# ------------------------------------------------------------ weights

MASK_MODES = [
    {},
    {"causal": True},
    {"causal": "lower_right"},
    {"causal": "upper_left"},
    {"window": 2},
    {"window": (3, 0)},
    {"window": (None, 1)},
    {"causal": True, "window": (4, None)},
]


@pytest.mark.parametrize("n, m", [(9, 11), (11, 9), (7, 7)])
@pytest.mark.parametrize("options", MASK_MODES)
@pytest.mark.parametrize("variant", ["softmax", "gaussian", "linear", "taylor", "focused"])
def test_weights_heatmap_is_attention_weights_with_invisible_cells_masked(variant, options, n, m):
    q, k = data(n, m)
    ax = attnx.plot.weights(q, k, variant, **options)
    shown = image_array(ax)
    expected = attnx.attention_weights(q, k, variant, **options)
    np.testing.assert_array_equal(shown.data, expected)
    rule = visible_by_rule(n, m, options.get("causal", False), options.get("window"))
    np.testing.assert_array_equal(np.ma.getmaskarray(shown), ~rule)
    assert np.all(expected[~rule] == 0)
    assert ax.get_title() == variant


@pytest.mark.parametrize("variant", ["cosformer", "efficient", "performer"])
def test_weights_of_the_other_variants(variant):
    q, k = data(8, 8)
    options = {"seed": 3} if variant == "performer" else {}
    shown = image_array(attnx.plot.weights(q, k, variant, **options))
    np.testing.assert_array_equal(shown.data, attnx.attention_weights(q, k, variant, **options))
    assert not np.ma.getmaskarray(shown).any()


def test_boolean_mask_and_key_mask_are_masked_exactly():
    q, k = data(6, 10)
    rng = np.random.default_rng(1)
    mask = rng.random((6, 10)) < 0.6
    shown = image_array(attnx.plot.weights(q, k, mask=mask, causal=True))
    np.testing.assert_array_equal(np.ma.getmaskarray(shown), ~(mask & visible_by_rule(6, 10, True)))
    np.testing.assert_array_equal(shown.data, attnx.attention_weights(q, k, mask=mask, causal=True))

    padding = np.ones((1, 10), bool)
    padding[:, 7:] = False
    shown = image_array(attnx.plot.weights(q, k, mask=padding))
    expected_mask = np.zeros((6, 10), bool)
    expected_mask[:, 7:] = True
    np.testing.assert_array_equal(np.ma.getmaskarray(shown), expected_mask)

    key_mask = np.array([True, False] * 5)
    shown = image_array(attnx.plot.weights(q, k, "linear", key_mask=key_mask))
    np.testing.assert_array_equal(np.ma.getmaskarray(shown), np.broadcast_to(~key_mask, (6, 10)))
    np.testing.assert_array_equal(shown.data, attnx.attention_weights(q, k, "linear", key_mask=key_mask))


def test_visible_cells_of_weight_zero_are_not_masked():
    # relu features: a query with no positive entry has zero similarity to
    # every key; its row is visible, weight 0, and must not look masked
    q, k = data(5, 6)
    q[2] = -np.abs(q[2])
    shown = image_array(attnx.plot.weights(q, k, "linear", feature_map="relu"))
    assert np.all(shown.data[2] == 0)
    assert not np.ma.getmaskarray(shown).any()


def test_a_row_that_sees_nothing_is_all_masked():
    q, k = data(6, 3)     # n > m, lower right: the first 3 queries see no key
    shown = image_array(attnx.plot.weights(q, k, causal=True))
    assert np.ma.getmaskarray(shown)[:3].all()
    assert np.all(shown.data[:3] == 0)


def test_weights_draws_into_a_given_axes_with_a_grey_invisible_colour():
    q, k = data()
    fig, (left, right) = plt.subplots(1, 2)
    returned = attnx.plot.weights(q, k, ax=right, causal=True, colorbar=False, title="mine")
    assert returned is right
    assert not left.images and right.get_title() == "mine"
    image = right.images[0]
    assert image.get_clim() == (0.0, float(attnx.attention_weights(q, k, causal=True).max()))
    assert matplotlib.colors.to_hex(image.cmap.get_bad()) == attnx.plot.INVISIBLE_COLOUR
    # the grey is none of the map's own colours
    assert attnx.plot.INVISIBLE_COLOUR not in {matplotlib.colors.to_hex(c) for c in image.cmap(np.linspace(0, 1, 256))}


def test_inputs_are_not_modified():
    q, k = data()
    mask = np.tril(np.ones((9, 11), bool))
    copies = q.copy(), k.copy(), mask.copy()
    attnx.plot.weights(q, k, mask=mask)
    attnx.plot.compare(q, k, mask=mask)
    for before, after in zip(copies, (q, k, mask)):
        np.testing.assert_array_equal(before, after)


# ------------------------------------------------------------ compare

def test_compare_panels_are_each_variants_weights_on_one_scale():
    q, k = data(8, 8)
    variants = ["softmax", ("linear", {"feature_map": "relu"}), "cosformer", ("gaussian", {"sigma": 2.0})]
    fig = attnx.plot.compare(q, k, variants, causal=True)
    assert isinstance(fig, matplotlib.figure.Figure)
    panels = fig.axes[:4]
    expected = [attnx.attention_weights(q, k, "softmax", causal=True),
                attnx.attention_weights(q, k, "linear", feature_map="relu", causal=True),
                attnx.attention_weights(q, k, "cosformer", causal=True),
                attnx.attention_weights(q, k, "gaussian", sigma=2.0, causal=True)]
    top = max(float(w.max()) for w in expected)
    for ax, w in zip(panels, expected):
        shown = image_array(ax)
        np.testing.assert_array_equal(shown.data, w)
        np.testing.assert_array_equal(np.ma.getmaskarray(shown), ~visible_by_rule(8, 8, True))
        assert ax.images[0].get_clim() == (0.0, top)
    assert [ax.get_title() for ax in panels] == [
        "softmax", "linear (feature_map='relu')", "cosformer", "gaussian (sigma=2.0)"]
    assert len(fig.axes) == 5   # one shared colorbar


def test_compare_titles_show_arrays_by_shape():
    q, k = data(8, 8)
    W = attnx.random_features(16, 5, seed=0)
    fig = attnx.plot.compare(q, k, [("performer", {"projection": W})])
    assert fig.axes[0].get_title() == "performer (projection=<array (16, 5)>)"
    np.testing.assert_array_equal(image_array(fig.axes[0]).data,
                                  attnx.attention_weights(q, k, "performer", projection=W))


def test_compare_with_own_scales():
    q, k = data(8, 8)
    fig = attnx.plot.compare(q, k, ["softmax", "taylor"], shared_scale=False)
    for ax, name in zip(fig.axes[:2], ["softmax", "taylor"]):
        assert ax.images[0].get_clim() == (0.0, float(attnx.attention_weights(q, k, name).max()))


def test_compare_errors_name_the_variant():
    q, k = data(8, 8)
    with pytest.raises(ValueError, match="'efficient'.*causal"):
        attnx.plot.compare(q, k, ["softmax", "efficient"], causal=True)
    with pytest.raises(TypeError, match="'softmax'.*feature_map"):
        attnx.plot.compare(q, k, ["softmax"], feature_map="relu")
    with pytest.raises(TypeError, match="not one string"):
        attnx.plot.compare(q, k, "softmax")
    with pytest.raises(ValueError, match="empty"):
        attnx.plot.compare(q, k, [])
    with pytest.raises(TypeError, match="names or"):
        attnx.plot.compare(q, k, [("linear", "relu")])
    with pytest.raises(TypeError, match="'causal' given for variant 'softmax' and for all"):
        attnx.plot.compare(q, k, [("softmax", {"causal": True})], causal=False)


# ------------------------------------------------------------ mask

@pytest.mark.filterwarnings("ignore:Attempting to set identical:UserWarning")  # n or m == 0
@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 13), m=st.integers(0, 13),
       causal=st.sampled_from([False, True, "lower_right", "upper_left"]),
       window=st.one_of(st.none(), st.integers(0, 5),
                        st.tuples(st.one_of(st.none(), st.integers(0, 5)),
                                  st.one_of(st.none(), st.integers(0, 5)))),
       block_size=st.one_of(st.none(), st.integers(1, 5)), data=st.data())
def test_mask_plot_is_the_visibility_rule(n, m, causal, window, block_size, data):
    layout = None
    if block_size is not None:
        rows, cols = -(-n // block_size), -(-m // block_size)
        shape = data.draw(st.sampled_from([(rows, cols), (1, cols), (rows, 1)]))
        layout = np.array(data.draw(st.lists(st.booleans(), min_size=shape[0] * shape[1],
                                             max_size=shape[0] * shape[1])), bool).reshape(shape)
    ax = attnx.plot.mask(n, m, causal=causal, window=window, layout=layout, block_size=block_size)
    shown = np.asarray(image_array(ax))
    assert shown.dtype == bool and shown.shape == (n, m)
    np.testing.assert_array_equal(shown, visible_by_rule(n, m, causal, window, layout, block_size))
    plt.close("all")


def test_mask_matches_what_softmax_attention_sees():
    # the block layout as a boolean mask: exactly the cells with nonzero weight
    q, k = data(10, 10)
    layout = np.array([[1, 0, 0], [1, 1, 0], [0, 1, 1]], bool)
    shown = np.asarray(image_array(attnx.plot.mask(10, 10, causal=True, layout=layout, block_size=4)))
    w = attnx.attention_weights(q, k, causal=True, mask=shown)
    np.testing.assert_array_equal(w > 0, shown)


def test_mask_draws_block_edges_and_into_a_given_axes():
    fig, ax = plt.subplots()
    returned = attnx.plot.mask(10, 7, layout=np.ones((4, 3), bool), block_size=3, ax=ax)
    assert returned is ax
    edges = sorted(line.get_ydata()[0] for line in ax.lines if line.get_ydata()[0] == line.get_ydata()[1])
    assert edges == [2.5, 5.5, 8.5]


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(n=-1, m=3), ValueError, "n must be >= 0"),
    (dict(n=3.0, m=3), TypeError, "n must be an int"),
    (dict(n=3, m=True), TypeError, "m must be an int, got bool"),
    (dict(n=3, m=3, causal="upper"), ValueError, "causal must be"),
    (dict(n=3, m=3, window=-1), ValueError, "window must be >= 0"),
    (dict(n=3, m=3, window=(1, 2, 3)), ValueError, "window must be an int or a"),
    (dict(n=3, m=3, window=1.5), TypeError, "window must be an int"),
    (dict(n=4, m=4, layout=np.ones((2, 2), bool)), ValueError, "needs block_size"),
    (dict(n=4, m=4, block_size=2), ValueError, "without a layout"),
    (dict(n=4, m=4, layout=np.ones((2, 2), int), block_size=2), TypeError, "layout must be a boolean"),
    (dict(n=4, m=4, layout=np.ones((3, 2), bool), block_size=2), ValueError, r"does not broadcast to the \(2, 2\)"),
    (dict(n=4, m=4, layout=np.ones((1, 2, 2), bool), block_size=2), ValueError, "2-d block layout"),
    (dict(n=4, m=4, layout=np.ones((2, 2), bool), block_size=0), ValueError, "block_size must be >= 1"),
])
def test_mask_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        attnx.plot.mask(**kwargs)


# ------------------------------------------------------------ kernel regression

def nadaraya_watson(x, y, t, sigma):
    kernel = np.exp(-(t[:, None] - x[None, :]) ** 2 / (2 * sigma**2))
    return kernel @ y / kernel.sum(axis=1)


@pytest.mark.parametrize("sigma", [0.1, 0.5, 2.0])
def test_kernel_regression_curve_is_nadaraya_watson(sigma):
    rng = np.random.default_rng(5)
    x = rng.uniform(0, 5, 40)
    y = np.sin(2 * x) + 0.3 * rng.standard_normal(40)
    x_query = rng.uniform(0, 5, 150)      # unsorted: the curve is drawn sorted
    ax = attnx.plot.kernel_regression(x, y, x_query, sigma=sigma)
    curve = ax.lines[0]
    t = np.asarray(curve.get_xdata())
    np.testing.assert_array_equal(t, np.sort(x_query))
    np.testing.assert_allclose(curve.get_ydata(), nadaraya_watson(x, y, t, sigma), rtol=1e-12, atol=1e-13)
    np.testing.assert_array_equal(ax.collections[0].get_offsets(), np.column_stack([x, y]))


def test_kernel_regression_draws_the_weights_of_one_query():
    rng = np.random.default_rng(6)
    x = rng.uniform(0, 5, 30)
    y = np.cos(x)
    ax = attnx.plot.kernel_regression(x, y, np.linspace(0, 5, 50), sigma=0.4, weights_at=2.5)
    segments = ax.weights_axes.collections[0].get_segments()
    kernel = np.exp(-(2.5 - x) ** 2 / (2 * 0.4**2))
    np.testing.assert_array_equal([s[0] for s in segments], np.column_stack([x, np.zeros(30)]))
    np.testing.assert_array_equal([s[1][0] for s in segments], x)
    np.testing.assert_allclose([s[1][1] for s in segments], kernel / kernel.sum(), rtol=1e-12, atol=1e-15)
    assert ax.lines[1].get_xdata()[0] == 2.5       # the query's position, marked
    with pytest.raises(ValueError, match="weights_at must be a finite number"):
        attnx.plot.kernel_regression(x, y, [1.0], weights_at=np.nan)
    with pytest.raises(ValueError, match="weights_at must be a finite number"):
        attnx.plot.kernel_regression(x, y, [1.0], weights_at="2")


def test_kernel_regression_takes_integers_and_a_given_axes():
    fig, ax = plt.subplots()
    returned = attnx.plot.kernel_regression([0, 1, 2, 3], [1, 3, 2, 5], [0, 1.5, 3], sigma=1, ax=ax)
    assert returned is ax
    np.testing.assert_allclose(ax.lines[0].get_ydata(),
                               nadaraya_watson(np.arange(4.0), np.array([1.0, 3, 2, 5]),
                                               np.array([0, 1.5, 3]), 1.0), rtol=1e-12)


@pytest.mark.parametrize("args, kwargs, error, message", [
    (([0, 1], [1, 2, 3], [0.5]), {}, ValueError, "same length"),
    (([[0, 1]], [[1, 2]], [0.5]), {}, ValueError, "x must be 1-d"),
    (([0, 1], [1, 2], [[0.5]]), {}, ValueError, "x_query must be 1-d"),
    (([0, 1j], [1, 2], [0.5]), {}, TypeError, "x must hold real numbers"),
    (([0, np.nan], [1, 2], [0.5]), {}, ValueError, "x must be finite"),
    (([], [], [0.5]), {}, ValueError, "no points"),
    (([0, 1], [1, 2], [0.5]), {"sigma": 0.0}, ValueError, "sigma must be a positive"),
    (([0, 1], [1, 2], [0.5]), {"sigma": np.inf}, ValueError, "sigma must be a positive"),
    (([0, 1], [1, 2], [0.5]), {"sigma": "1"}, TypeError, "sigma must be a positive"),
])
def test_kernel_regression_errors(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        attnx.plot.kernel_regression(*args, **kwargs)


# ------------------------------------------------------------ errors, headless

def test_weights_errors():
    q, k = data()
    with pytest.raises(ValueError, match="unknown variant 'soft'"):
        attnx.plot.weights(q, k, "soft")
    with pytest.raises(ValueError, match="one head"):
        attnx.plot.weights(q[None], k[None])
    with pytest.raises(ValueError, match="one head"):
        attnx.plot.weights(q, k, mask=np.ones((2, 9, 11), bool))
    with pytest.raises(TypeError, match="window"):
        attnx.plot.weights(q, k, window=1.5)
    with pytest.raises(TypeError):
        attnx.plot.weights(q, k, mask=np.ones((9, 11)))     # float mask: the kernel's error


def test_headless_in_a_fresh_interpreter():
    code = ("import numpy as np, attnx.plot, matplotlib, io\n"
            "ax = attnx.plot.weights(np.eye(4), np.eye(4), causal=True)\n"
            "ax.figure.savefig(io.BytesIO(), format='png')\n"
            "print(matplotlib.get_backend().lower())\n")
    env = {key: value for key, value in os.environ.items() if key not in ("DISPLAY", "MPLBACKEND")}
    root = os.path.dirname(os.path.dirname(os.path.abspath(attnx.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "agg"


def test_importing_attnx_does_not_import_matplotlib():
    code = "import sys, attnx, attnx.plot; print('matplotlib' in sys.modules)"
    root = os.path.dirname(os.path.dirname(os.path.abspath(attnx.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# ------------------------------------------------------------ the README figure

def test_readme_figure_script(tmp_path):
    """examples/make_figures.py regenerates docs/images/weights.png: a PNG
    whose panels are the variants' weights under window=4."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(attnx.__file__)))
    # examples/ beside tests/ (the checkout's, or a copy run against an installed attnx)
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "examples", "make_figures.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    result = subprocess.run([sys.executable, script, "--out", str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "weights.png", "rb") as png:
        assert png.read(8) == b"\x89PNG\r\n\x1a\n"

    sys.path.insert(0, os.path.dirname(script))
    try:
        import make_figures
    finally:
        sys.path.pop(0)
    fig = make_figures.weights_figure()
    rng = np.random.default_rng(7)
    q, k = rng.standard_normal((16, 16)), rng.standard_normal((16, 16))
    expected = [attnx.attention_weights(q, k, "softmax", window=4),
                attnx.attention_weights(q, k, "gaussian", sigma=3.0, window=4),
                attnx.attention_weights(q, k, "linear", window=4),
                attnx.attention_weights(q, k, "taylor", window=4),
                attnx.attention_weights(q, k, "cosformer", window=4)]
    for ax, w in zip(fig.axes[:5], expected):
        shown = image_array(ax)
        np.testing.assert_array_equal(shown.data, w)
        np.testing.assert_array_equal(np.ma.getmaskarray(shown), ~visible_by_rule(16, 16, window=4))
