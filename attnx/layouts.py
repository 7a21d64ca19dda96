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
    """Blocks j with ``i - left <= j <= i + right``; ``window`` is w or
    ``(left, right)`` (None for an open side)."""
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
    """Blocks j with ``|i - j| < stride`` or ``(i - j) % stride == 0``."""
    nb = _count(nb, "nb")
    stride = _count(stride, "stride", 1)
    offset = _offsets(nb)
    return (np.abs(offset) < stride) | (offset % stride == 0)


def fixed(nb, stride, summary):
    """Blocks j with ``i // stride == j // stride`` or
    ``j % stride >= stride - summary`` (1 <= summary <= stride)."""
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
    """``local(nb, window)`` plus whole rows and columns for the global
    blocks (a count g: the first g blocks; or a sequence of indices)."""
    layout = local(nb, window)
    indices = _global_indices(layout.shape[0], global_blocks)
    layout[indices, :] = True
    layout[:, indices] = True
    return layout


def bigbird(nb, window, num_global, num_random, seed):
    """``longformer(nb, window, num_global)`` plus ``num_random`` random key
    blocks in each row that is not global, drawn without replacement from
    the blocks the row does not have yet, by ``default_rng(seed)``."""
    num_random = _count(num_random, "num_random")
    layout = longformer(nb, window, _count(num_global, "num_global"))
    rng = np.random.default_rng(seed)
    for row in range(int(num_global), layout.shape[0]):
        free = np.flatnonzero(~layout[row])
        chosen = rng.choice(free, size=min(num_random, free.size), replace=False)
        layout[row, chosen] = True
    return layout
