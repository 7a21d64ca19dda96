"""Plots of attention: weight matrices, masks and kernel regression.

Needs matplotlib (``pip install matplotlib``; from a checkout
``pip install -e ".[plot]"``), imported on first use, and
works headless (the Agg backend). Every function draws into an existing
Axes when given ``ax=`` (or makes a new figure) and returns the matplotlib
object it drew on, whose image or line data are the numbers computed, so a
plot can be checked as well as looked at:

* ``weights(q, k, variant="softmax", **options)``: a heatmap of
  ``attnx.attention_weights(q, k, variant, **options)``; the cells the mask
  options (causal, window, mask, key_mask) leave invisible are masked and
  drawn in grey, apart from visible cells whose weight is merely 0.
* ``compare(q, k, variants=[...], **options)``: the same queries under
  several variants, side by side on one colour scale.
* ``mask(n, m, causal=, window=, layout=, block_size=)``: the visibility
  pattern itself, block-sparse layouts included.
* ``kernel_regression(x, y, x_query, sigma=)``: the Nadaraya-Watson fit of
  1-d data, computed by ``attnx.gaussian_attention``, and optionally the
  weights of one query.
* ``visibility(n, m, causal=, window=, layout=, block_size=)``: the boolean
  pattern ``mask`` draws, as an array.
"""
import math
import numbers
import operator

import numpy as np

from . import _C
from ._inspect import _VARIANTS, attention_weights

# the colour of cells no query may see: outside viridis (and most sequential
# maps), so that a visible weight of 0 (dark) never looks like a masked cell
INVISIBLE_COLOUR = "#d0d0d0"
VISIBLE_COLOUR = "#2b6ca3"


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError('attnx.plot needs matplotlib: pip install matplotlib (from an '
                          'attnx checkout: pip install -e ".[plot]"; once attnx is released: '
                          'pip install "attnx[plot]")') from error
    return plt


def _new_axes(ax):
    if ax is not None:
        return ax
    _, ax = _pyplot().subplots()
    return ax


def _colormap(cmap):
    import matplotlib

    base = matplotlib.colormaps[cmap] if isinstance(cmap, str) else cmap
    return base.with_extremes(bad=INVISIBLE_COLOUR)


# ------------------------------------------------------------ visibility

def _count(value, name):
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if count < 0:
        raise ValueError(f"{name} must be >= 0, got {count}")
    return count


def _causal_mode(causal):
    if causal is False or causal is None:
        return None
    if causal is True or causal == "lower_right":
        return "lower_right"
    if causal == "upper_left":
        return "upper_left"
    raise ValueError(f"causal must be a bool, 'lower_right' or 'upper_left', got {causal!r}")


def _window_sides(window):
    """(left, right), None for an open side, from window=w or (left, right)."""
    if window is None:
        return None, None
    if isinstance(window, (tuple, list)):
        if len(window) != 2:
            raise ValueError(f"window must be an int or a (left, right) pair, got {window!r}")
        return tuple(None if side is None else _count(side, "window") for side in window)
    side = _count(window, "window")
    return side, side


def _block_mask(n, m, layout, block_size):
    """kron(layout, ones(bs, bs))[:n, :m], the mask a block layout stands for."""
    if layout is None:
        if block_size is not None:
            raise ValueError("block_size is given without a layout")
        return None
    if block_size is None:
        raise ValueError("layout needs block_size= (the side of a block, in tokens)")
    block_size = _count(block_size, "block_size")
    if block_size == 0:
        raise ValueError("block_size must be >= 1, got 0")
    layout = np.asarray(layout)
    if layout.dtype != np.bool_:
        raise TypeError(f"layout must be a boolean array (True = the block is computed), "
                        f"got dtype {layout.dtype}")
    blocks = (-(-n // block_size), -(-m // block_size))
    if layout.ndim > 2:
        raise ValueError(f"layout must be one 2-d block layout {blocks} for a plot, "
                         f"got shape {layout.shape}")
    try:
        layout = np.broadcast_to(layout, blocks)
    except ValueError:
        raise ValueError(f"layout of shape {layout.shape} does not broadcast to the "
                         f"{blocks} blocks of size {block_size} covering ({n}, {m})") from None
    return np.kron(layout, np.ones((block_size, block_size), bool)).astype(bool)[:n, :m]


def visibility(n, m, causal=False, window=None, layout=None, block_size=None):
    """The boolean pattern of the keys each query may see, as an array.

    Parameters
    ----------
    n, m : int
        Queries and keys.
    causal : bool or {"lower_right", "upper_left"}, default False
        As in `attnx.softmax_attention`.
    window : int or (int or None, int or None), optional
        As in `attnx.softmax_attention`.
    layout : array_like of bool, optional
        A block layout (`attnx.layouts`), with ``block_size``.
    block_size : int, optional
        The block of the layout.

    Returns
    -------
    ndarray of bool, shape (n, m)
        True where query i may see key j.

    Raises
    ------
    ValueError
        Negative sizes, an unknown causal mode, a bad window, a layout
        without a block size or too small for n and m.
    TypeError
        Sizes that are not integers.

    See Also
    --------
    mask : Draws this pattern.

    Notes
    -----
    With ``i' = i + (m - n)``: causal (lower right) ``j <= i'``, upper left
    ``j <= i``, window ``i' - left <= j <= i' + right``, layout
    ``kron(layout, ones((bs, bs)))[:n, :m]``, all combined.

    Examples
    --------
    >>> import attnx.plot
    >>> print(attnx.plot.visibility(3, 5, causal=True).astype(int))
    [[1 1 1 0 0]
     [1 1 1 1 0]
     [1 1 1 1 1]]
    """
    n, m = _count(n, "n"), _count(m, "m")
    mode = _causal_mode(causal)
    left, right = _window_sides(window)
    blocks = _block_mask(n, m, layout, block_size)
    i = np.arange(n)[:, None]
    j = np.arange(m)[None, :]
    aligned = i + (m - n)
    visible = np.ones((n, m), bool)
    if mode == "lower_right":
        visible &= j <= aligned
    elif mode == "upper_left":
        visible &= j <= i
    if left is not None:
        visible &= j >= aligned - left
    if right is not None:
        visible &= j <= aligned + right
    if blocks is not None:
        visible &= blocks
    return visible


def _options_visibility(n, m, options):
    """What the mask options of an attention call leave visible, (n, m)."""
    visible = visibility(n, m, options.get("causal", False), options.get("window"))
    mask = options.get("mask")
    if mask is not None:
        visible &= np.broadcast_to(np.asarray(mask, bool), (n, m))
    key_mask = options.get("key_mask")
    if key_mask is not None:
        visible &= np.broadcast_to(np.asarray(key_mask, bool), (m,))[None, :]
    return visible


# ------------------------------------------------------------ weights

def _head_weights(q, k, variant, options):
    """(weights (n, m), visible (n, m)) for one head, arguments checked."""
    if not isinstance(variant, str) or variant not in _VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of "
                         f"{', '.join(map(repr, _VARIANTS))}")
    if np.ndim(q) != 2 or np.ndim(k) != 2:
        raise ValueError(f"a weights plot shows one head: q must be (n, d) and k (m, d), got "
                         f"shapes {np.shape(q)} and {np.shape(k)} (select a head, e.g. q[0, 0])")
    weights = attention_weights(q, k, variant, **options)   # checks the options
    if weights.ndim != 2:
        raise ValueError(f"a weights plot shows one head, but the options give weights of shape "
                         f"{weights.shape}; give masks of shape (n, m), (1, m) or (m,) only")
    visible = _options_visibility(*weights.shape, options)
    return weights, visible


def _label_grid(ax):
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")


def _draw_weights(ax, weights, visible, cmap, vmax, title):
    image = ax.imshow(np.ma.masked_array(weights, mask=~visible), cmap=_colormap(cmap),
                      vmin=0.0, vmax=vmax, interpolation="nearest", aspect="equal")
    _label_grid(ax)
    if title:
        ax.set_title(title)
    return image


def _weights_vmax(weights):
    top = float(np.max(weights, initial=0.0))
    return top if top > 0 else 1.0


def weights(q, k, variant="softmax", ax=None, *, cmap="viridis", colorbar=True, title=None,
            **options):
    """Draw a heatmap of the attention weights of one head.

    Parameters
    ----------
    q : array_like, shape (n, d)
        Queries.
    k : array_like, shape (m, d)
        Keys.
    variant : str, default "softmax"
        As in `attnx.attention_weights`.
    ax : matplotlib.axes.Axes, optional
        Where to draw; default a new figure's.
    cmap : str, default "viridis"
        A matplotlib colormap.
    colorbar : bool, default True
        Draw a colorbar.
    title : str, optional
        Default the variant's name.
    **options
        The options of the variant's front end (causal=, window=, mask=,
        key_mask=, scale=, sigma=, feature_map=...).

    Returns
    -------
    matplotlib.axes.Axes
        The Axes drawn on; ``ax.images[0].get_array()`` is a masked array
        holding the weights, masked where the options hide a cell.

    Raises
    ------
    ValueError
        q or k not two-dimensional, and the errors of
        `attnx.attention_weights`.
    ImportError
        When matplotlib is not installed.

    See Also
    --------
    compare : Several variants side by side.
    attnx.attention_weights : The numbers drawn.

    Notes
    -----
    Queries run down, keys across, on a colour scale from 0 to the largest
    weight; cells the mask options leave invisible are grey (apart from
    visible cells whose weight is merely 0).

    Examples
    --------
    >>> import numpy as np, attnx, attnx.plot
    >>> q = np.random.default_rng(0).standard_normal((6, 4))
    >>> ax = attnx.plot.weights(q, q, causal=True)
    >>> image = ax.images[0].get_array()
    >>> image.shape, int(image.mask.sum())        # 15 cells above the diagonal hidden
    ((6, 6), 15)
    >>> np.allclose(image.filled(0), attnx.attention_weights(q, q, causal=True))
    True
    """
    w, visible = _head_weights(q, k, variant, options)
    ax = _new_axes(ax)
    image = _draw_weights(ax, w, visible, cmap, _weights_vmax(w),
                          variant if title is None else title)
    if colorbar:
        ax.figure.colorbar(image, ax=ax, label="weight")
    return ax


def _short(value):
    """An option's value for a panel title (arrays by their shape)."""
    if isinstance(value, np.ndarray):
        return f"<array {value.shape}>"
    return repr(value)


def _variant_and_options(entry):
    if isinstance(entry, str):
        return entry, {}, entry
    if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], dict):
        name, own = entry
        detail = ", ".join(f"{key}={_short(value)}" for key, value in own.items())
        return name, own, f"{name} ({detail})" if detail else name
    raise TypeError(f"variants must hold names or (name, {{options}}) pairs, got {entry!r}")


def compare(q, k, variants=("softmax", "linear", "taylor", "cosformer"), *, cmap="viridis",
            shared_scale=True, panel_size=3.2, **options):
    """Draw the weights of the same queries and keys under several variants.

    Parameters
    ----------
    q : array_like, shape (n, d)
        Queries.
    k : array_like, shape (m, d)
        Keys.
    variants : sequence, default ("softmax", "linear", "taylor", "cosformer")
        Names ("softmax", "gaussian", "linear", "cosformer", "focused",
        "taylor", "performer", "efficient") or ``(name, {options})`` pairs
        for options of one variant only, such as ``("linear",
        {"feature_map": "relu"})``.
    cmap : str, default "viridis"
        A matplotlib colormap.
    shared_scale : bool, default True
        One colour scale (0 to the largest weight of any panel) and one
        colorbar, so that panels compare; otherwise one each.
    panel_size : float, default 3.2
        The width of a panel in inches.
    **options
        Options given to every variant (causal=, window=, ...).

    Returns
    -------
    matplotlib.figure.Figure
        A new Figure; its Axes, in order, are ``fig.axes[:len(variants)]``.

    Raises
    ------
    TypeError
        ``variants`` given as one string.
    ValueError
        An unknown variant, and the errors of `weights`.

    See Also
    --------
    weights : One panel.

    Notes
    -----
    One `weights` panel per variant, in a row.

    Examples
    --------
    >>> import numpy as np, attnx.plot
    >>> q = np.random.default_rng(0).standard_normal((6, 4))
    >>> fig = attnx.plot.compare(q, q, ["softmax", ("linear", {"feature_map": "relu"})])
    >>> [ax.get_title() for ax in fig.axes[:2]]
    ['softmax', "linear (feature_map='relu')"]
    """
    if isinstance(variants, str):
        raise TypeError("variants must be a list of variant names, not one string")
    entries = [_variant_and_options(entry) for entry in variants]
    if not entries:
        raise ValueError("variants is empty; give at least one variant")
    panels = []
    for name, own, label in entries:
        clash = own.keys() & options.keys()
        if clash:
            raise TypeError(f"option {sorted(clash)[0]!r} given for variant {name!r} and for all")
        try:
            panels.append(_head_weights(q, k, name, {**options, **own}) + (label,))
        except (TypeError, ValueError) as error:
            raise type(error)(f"variant {label!r}: {error}") from error
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(panel_size * len(panels) + 1.0, panel_size),
                             squeeze=False, layout="constrained")
    axes = list(axes[0])
    top = max(_weights_vmax(w) for w, _, _ in panels)
    for ax, (w, visible, label) in zip(axes, panels):
        image = _draw_weights(ax, w, visible, cmap, top if shared_scale else _weights_vmax(w), label)
        if not shared_scale:
            fig.colorbar(image, ax=ax, shrink=0.8)
        if ax is not axes[0]:
            ax.set_ylabel("")
    if shared_scale:
        fig.colorbar(axes[0].images[0], ax=axes, shrink=0.8, label="weight")
    return fig


# ------------------------------------------------------------ masks

def mask(n, m, causal=False, window=None, layout=None, block_size=None, ax=None):
    """Draw the visibility pattern of n queries over m keys.

    Parameters
    ----------
    n, m : int
        Queries and keys.
    causal, window, layout, block_size
        As in `visibility`.
    ax : matplotlib.axes.Axes, optional
        Where to draw; default a new figure's.

    Returns
    -------
    matplotlib.axes.Axes
        The Axes drawn on; ``ax.images[0].get_array()`` is the boolean
        (n, m) pattern.

    Raises
    ------
    ValueError
        As in `visibility`.
    ImportError
        When matplotlib is not installed.

    See Also
    --------
    visibility : The pattern as an array.

    Notes
    -----
    The cells a query may see are blue, the others grey; a block of
    ``block_size`` x ``block_size`` tokens is visible where the layout is
    True: ``kron(layout, ones((bs, bs)))[:n, :m]``, the mask block-sparse
    attention computes under, combined with the causal mode and window.

    Examples
    --------
    >>> import numpy as np, attnx.plot
    >>> ax = attnx.plot.mask(8, 8, causal=True, layout=np.eye(2, dtype=bool), block_size=4)
    >>> int(ax.images[0].get_array().sum())        # two causal 4 x 4 blocks
    20
    """
    visible = visibility(n, m, causal, window, layout, block_size)
    ax = _new_axes(ax)  # first: without matplotlib, the ImportError saying how to install it
    from matplotlib.colors import ListedColormap

    ax.imshow(visible, cmap=ListedColormap([INVISIBLE_COLOUR, VISIBLE_COLOUR]), vmin=0, vmax=1,
              interpolation="nearest", aspect="equal")
    if layout is not None:
        for edge in range(block_size, n, block_size):
            ax.axhline(edge - 0.5, color="white", linewidth=0.8)
        for edge in range(block_size, m, block_size):
            ax.axvline(edge - 0.5, color="white", linewidth=0.8)
    _label_grid(ax)
    parts = [f"causal={causal!r}" if causal else "", f"window={window!r}" if window is not None else "",
             f"blocks of {block_size}" if layout is not None else ""]
    ax.set_title(", ".join(part for part in parts if part) or "all visible")
    return ax


# ------------------------------------------------------------ kernel regression

def _points(values, name):
    array = np.asarray(values)
    if array.dtype.kind not in "fiub":
        raise TypeError(f"{name} must hold real numbers, got dtype {array.dtype}")
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-d (one number per point), got shape {array.shape}")
    array = array.astype(np.float64)
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{name} must be finite")
    return array


def kernel_regression(x, y, x_query, sigma=1.0, ax=None, *, weights_at=None):
    """Draw the Nadaraya-Watson estimate of y at x_query from points (x, y).

    Parameters
    ----------
    x, y : array_like, shape (n,)
        The data points.
    x_query : array_like, shape (q,)
        Where the estimate is drawn.
    sigma : float, default 1.0
        The kernel's width.
    ax : matplotlib.axes.Axes, optional
        Where to draw; default a new figure's.
    weights_at : float, optional
        A position t whose weights over the data points are drawn too, as
        stems on a second y axis (``ax.weights_axes``, its
        ``collections[0]`` segments ``(x_i, 0)-(x_i, w_i)``).

    Returns
    -------
    matplotlib.axes.Axes
        The Axes: the data points are ``ax.collections[0]``, the fit
        ``ax.lines[0]`` (its x data sorted).

    Raises
    ------
    ValueError
        Points of different lengths or not one-dimensional, a bad sigma or
        weights_at.
    ImportError
        When matplotlib is not installed.

    See Also
    --------
    attnx.gaussian_attention : Computes the fit.

    Notes
    -----
    ``f(t) = sum_i K(t - x_i) y_i / sum_i K(t - x_i)`` with the Gaussian
    kernel ``K(u) = exp(-u^2 / (2 sigma^2))``: Gaussian attention with the
    queries x_query, the keys x and the values y (each as (n, 1)), in
    float64.

    Examples
    --------
    >>> import numpy as np, attnx.plot
    >>> x = np.linspace(0, 6, 30)
    >>> ax = attnx.plot.kernel_regression(x, np.sin(x), np.linspace(0, 6, 50), sigma=0.3)
    >>> fit = ax.lines[0].get_ydata()
    >>> fit.shape, bool(np.abs(fit - np.sin(np.linspace(0, 6, 50))).max() < 0.2)
    ((50,), True)
    """
    x, y, x_query = _points(x, "x"), _points(y, "y"), _points(x_query, "x_query")
    if weights_at is not None:
        if isinstance(weights_at, (bool, np.bool_)) or not isinstance(weights_at, numbers.Real) \
                or not math.isfinite(weights_at):
            raise ValueError(f"weights_at must be a finite number (a query position), got {weights_at!r}")
    if x.shape != y.shape:
        raise ValueError(f"x and y must have the same length, got {x.size} and {y.size}")
    if x.size == 0:
        raise ValueError("x and y hold no points; the fit needs at least one")
    if isinstance(sigma, (bool, np.bool_)) or not isinstance(sigma, numbers.Real):
        raise TypeError(f"sigma must be a positive finite number, got {type(sigma).__name__}")
    if not math.isfinite(sigma) or sigma <= 0:
        raise ValueError(f"sigma must be a positive finite number, got {sigma!r}")
    order = np.argsort(x_query, kind="stable")
    t = x_query[order]
    fit = _C.gaussian_attention(t[:, None], x[:, None], y[:, None], sigma=float(sigma))[:, 0]
    ax = _new_axes(ax)
    ax.plot(t, fit, color="C3", linewidth=2, label=f"Nadaraya-Watson fit, sigma = {sigma:g}")
    ax.scatter(x, y, s=14, color="C0", alpha=0.7, label="data", zorder=3)
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    handles, labels = ax.get_legend_handles_labels()
    if weights_at is not None:
        w = attention_weights(np.array([[float(weights_at)]]), x[:, None], "gaussian",
                              sigma=float(sigma))[0]
        ax.axvline(weights_at, color="C2", linestyle=":", linewidth=1)
        twin = ax.twinx()
        stems = twin.vlines(x, 0.0, w, color="C2", linewidth=2, alpha=0.8,
                            label=f"weights of the query at x = {weights_at:g}")
        twin.set_ylim(0.0, 3.0 * max(float(w.max()), np.finfo(float).tiny))  # stems in the lower third
        twin.set_ylabel("weight")
        ax.weights_axes = twin
        handles, labels = handles + [stems], labels + [stems.get_label()]
    ax.legend(handles, labels, loc="best", fontsize="small")
    return ax
