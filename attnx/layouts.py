"""Block layouts for :func:`attnx.block_sparse_attention`.

Each builder returns a boolean array of shape (nb, nb): entry (i, j) is True
when query block i may attend to key block j. The patterns are
two-directional; for autoregressive models pass ``causal=True`` to the
attention call (or take ``np.tril`` of the layout), which intersects each
pattern with the causal rule as the papers do. Layouts combine with ``|``
and ``&`` like any boolean arrays, and may differ per head by stacking them
to shape (..., nb, nb).

The rules, for query block i and key block j:

* ``local(nb, window)``: ``i - left <= j <= i + right``, where ``window`` is
  w (meaning ``left = right = w``) or ``(left, right)``, None for an open
  side. The block form of the sliding window.
* ``strided(nb, stride)``: ``|i - j| < stride`` or ``(i - j) % stride == 0``;
  the union of the two heads of the Sparse Transformer's strided pattern
  (Child et al. 2019): the previous ``stride`` blocks and every
  ``stride``-th block before them.
* ``fixed(nb, stride, summary)``: ``i // stride == j // stride`` or
  ``j % stride >= stride - summary``; the Sparse Transformer's fixed
  pattern: blocks attend within their own group of ``stride`` blocks, and
  every block attends to the last ``summary`` blocks of each group.
* ``longformer(nb, window, global_blocks)``: ``local(nb, window)``, and a
  global block attends to every block and is attended to by every block
  (Beltagy et al. 2020). ``global_blocks`` is a count g (the first g blocks)
  or a sequence of block indices.
* ``bigbird(nb, window, num_global, num_random, seed)``: ``longformer(nb,
  window, num_global)`` plus, in each row that is not global, ``num_random``
  further key blocks drawn uniformly without replacement from those the row
  does not already have (all of them if fewer remain), by
  ``numpy.random.default_rng(seed)`` (Zaheer et al. 2020).
"""
import numpy as np

from ._checks import count as _count

__all__ = ["local", "strided", "fixed", "longformer", "bigbird"]


def _offsets(nb):
    """(i - j) for every query block i (rows) and key block j (columns)."""
    blocks = np.arange(nb)
    return blocks[:, None] - blocks[None, :]


def local(nb, window):
    """The block form of a sliding window.

    Parameters
    ----------
    nb : int
        Blocks along the query and the key axis (ceil(n / block_size)).
    window : int or (int or None, int or None)
        w (``left = right = w``) or ``(left, right)``, None for an open
        side.

    Returns
    -------
    ndarray of bool, shape (nb, nb)
        Entry (i, j) is True when query block i may attend to key block j.

    Raises
    ------
    ValueError
        A negative nb or side, a window tuple not of two entries.
    TypeError
        Sizes that are not integers.

    See Also
    --------
    attnx.block_sparse_attention : Takes the layout.
    attnx.plot.mask : Draws it.

    Notes
    -----
    Query block i sees key blocks ``i - left <= j <= i + right``.

    Examples
    --------
    >>> import attnx
    >>> print(attnx.layouts.local(4, (1, 0)).astype(int))
    [[1 0 0 0]
     [1 1 0 0]
     [0 1 1 0]
     [0 0 1 1]]
    """
    nb = _count(nb, "nb")
    if isinstance(window, tuple):
        if len(window) != 2:
            raise ValueError(f"window must be w or (left, right), got {window!r}")
        left, right = window
    else:
        left = right = window
    left = nb if left is None else _count(left, "window's left side")
    right = nb if right is None else _count(right, "window's right side")
    offset = _offsets(nb)
    return (offset <= left) & (-offset <= right)


def strided(nb, stride):
    """The Sparse Transformer's strided pattern (Child et al. 2019).

    Parameters
    ----------
    nb : int
        Blocks along the query and the key axis (ceil(n / block_size)).
    stride : int
        At least 1.

    Returns
    -------
    ndarray of bool, shape (nb, nb)
        Entry (i, j) is True when query block i may attend to key block j.

    Raises
    ------
    ValueError
        A negative nb, a stride below 1.
    TypeError
        Sizes that are not integers.

    See Also
    --------
    attnx.block_sparse_attention : Takes the layout.
    attnx.plot.mask : Draws it.

    Notes
    -----
    ``|i - j| < stride`` or ``(i - j) % stride == 0``: the union of the
    pattern's two heads, the previous ``stride`` blocks and every
    ``stride``-th block before them (both directions; ``causal=True`` in
    the attention call keeps the earlier ones).

    Examples
    --------
    >>> import attnx
    >>> print(attnx.layouts.strided(5, 2).astype(int))
    [[1 1 1 0 1]
     [1 1 1 1 0]
     [1 1 1 1 1]
     [0 1 1 1 1]
     [1 0 1 1 1]]
    """
    nb = _count(nb, "nb")
    stride = _count(stride, "stride", 1)
    offset = _offsets(nb)
    return (np.abs(offset) < stride) | (offset % stride == 0)


def fixed(nb, stride, summary):
    """The Sparse Transformer's fixed pattern (Child et al. 2019).

    Parameters
    ----------
    nb : int
        Blocks along the query and the key axis (ceil(n / block_size)).
    stride : int
        The blocks of a group, at least 1.
    summary : int
        The last blocks of each group every block attends to,
        ``1 <= summary <= stride``.

    Returns
    -------
    ndarray of bool, shape (nb, nb)
        Entry (i, j) is True when query block i may attend to key block j.

    Raises
    ------
    ValueError
        A negative nb, a stride or summary below 1, a summary above stride.
    TypeError
        Sizes that are not integers.

    See Also
    --------
    attnx.block_sparse_attention : Takes the layout.
    attnx.plot.mask : Draws it.

    Notes
    -----
    ``i // stride == j // stride`` or ``j % stride >= stride - summary``:
    blocks attend within their own group, and to the summary blocks of
    every group.

    Examples
    --------
    >>> import attnx
    >>> print(attnx.layouts.fixed(4, 2, 1).astype(int))
    [[1 1 0 1]
     [1 1 0 1]
     [0 1 1 1]
     [0 1 1 1]]
    """
    nb = _count(nb, "nb")
    stride = _count(stride, "stride", 1)
    summary = _count(summary, "summary", 1)
    if summary > stride:
        raise ValueError(f"summary ({summary}) cannot exceed stride ({stride})")
    blocks = np.arange(nb)
    same_group = blocks[:, None] // stride == blocks[None, :] // stride
    summary_column = blocks % stride >= stride - summary
    return same_group | summary_column[None, :]


def _global_indices(nb, global_blocks):
    if isinstance(global_blocks, (int, np.integer)) and not isinstance(global_blocks, (bool, np.bool_)):
        count = _count(global_blocks, "global_blocks")
        if count > nb:
            raise ValueError(f"global_blocks ({count}) cannot exceed nb ({nb})")
        return np.arange(count)
    indices = np.asarray(global_blocks)
    if indices.ndim != 1 or (indices.size and indices.dtype.kind not in "iu"):
        raise TypeError("global_blocks must be a count or a sequence of block indices")
    indices = indices.astype(np.intp)
    if indices.size and (indices.min() < 0 or indices.max() >= nb):
        raise ValueError(f"global_blocks must lie in [0, {nb}), got {global_blocks!r}")
    return indices


def longformer(nb, window, global_blocks):
    """Longformer's pattern: a sliding window and global blocks (Beltagy et al. 2020).

    Parameters
    ----------
    nb : int
        Blocks along the query and the key axis (ceil(n / block_size)).
    window : int or (int or None, int or None)
        As in `local`.
    global_blocks : int or sequence of int
        A count g (the first g blocks) or the indices of the global blocks.

    Returns
    -------
    ndarray of bool, shape (nb, nb)
        Entry (i, j) is True when query block i may attend to key block j.

    Raises
    ------
    ValueError
        As in `local`, or global blocks outside [0, nb).
    TypeError
        global_blocks neither a count nor a sequence of indices.

    See Also
    --------
    attnx.block_sparse_attention : Takes the layout.
    attnx.plot.mask : Draws it.

    Notes
    -----
    ``local(nb, window)``, and a global block attends to every block and is
    attended to by every block.

    Examples
    --------
    >>> import attnx
    >>> print(attnx.layouts.longformer(4, 0, 1).astype(int))
    [[1 1 1 1]
     [1 1 0 0]
     [1 0 1 0]
     [1 0 0 1]]
    """
    layout = local(nb, window)
    indices = _global_indices(layout.shape[0], global_blocks)
    layout[indices, :] = True
    layout[:, indices] = True
    return layout


def bigbird(nb, window, num_global, num_random, seed):
    """BigBird's pattern: window, global and random blocks (Zaheer et al. 2020).

    Parameters
    ----------
    nb : int
        Blocks along the query and the key axis (ceil(n / block_size)).
    window : int or (int or None, int or None)
        As in `local`.
    num_global : int
        The first num_global blocks are global.
    num_random : int
        Random key blocks added to each row that is not global.
    seed : int or None
        Anything ``numpy.random.default_rng`` takes.

    Returns
    -------
    ndarray of bool, shape (nb, nb)
        Entry (i, j) is True when query block i may attend to key block j.

    Raises
    ------
    ValueError
        As in `longformer`, or a negative num_random.
    TypeError
        Sizes that are not integers.

    See Also
    --------
    attnx.block_sparse_attention : Takes the layout.
    attnx.plot.mask : Draws it.

    Notes
    -----
    ``longformer(nb, window, num_global)`` plus, in each row that is not
    global, ``num_random`` further key blocks drawn uniformly without
    replacement from those the row does not have yet (all of them if fewer
    remain), by ``numpy.random.default_rng(seed)``.

    Examples
    --------
    >>> import attnx
    >>> layout = attnx.layouts.bigbird(6, 1, 1, 1, seed=0)
    >>> layout.shape, layout.sum(1).tolist()
    ((6, 6), [6, 4, 5, 5, 5, 4])
    """
    num_random = _count(num_random, "num_random")
    layout = longformer(nb, window, _count(num_global, "num_global"))
    rng = np.random.default_rng(seed)
    for row in range(int(num_global), layout.shape[0]):
        free = np.flatnonzero(~layout[row])
        chosen = rng.choice(free, size=min(num_random, free.size), replace=False)
        layout[row, chosen] = True
    return layout
