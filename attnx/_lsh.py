"""Reformer's LSH attention with shared query-keys (the kernel is in C:
csrc/lsh.c): the public functions, the rotations drawn from the seed, and
the ``vjp`` rule.

The hashing is reproducible outside attnx: round r's rotation is
``attnx.lsh_rotations(d, n_buckets, n_hashes, seed)[r]``, a (d, n_buckets / 2)
matrix of standard normal numbers from ``numpy.random.default_rng(seed)``,
and a token's bucket is ``argmax(concatenate([x @ R, -(x @ R)]))`` (the
first maximum) computed in the compute dtype.
"""
import numpy as np

from . import _C
from ._checks import count
from ._grad import Gradients, deliver, register_vjp


def lsh_rotations(d, n_buckets, n_hashes=1, seed=0):
    """The random rotations of `lsh_attention`'s hashing.

    Parameters
    ----------
    d : int
        The feature size of q.
    n_buckets : int
        Buckets per round, even and at least 2.
    n_hashes : int, default 1
        Hashing rounds.
    seed : int, default 0
        The seed of ``numpy.random.default_rng``.

    Returns
    -------
    ndarray, shape (n_hashes, d, n_buckets // 2), float64
        Standard normal numbers, the same for every head.

    Raises
    ------
    ValueError
        An odd or too small n_buckets, n_hashes below 1, a negative seed.
    TypeError
        Arguments that are not integers.

    See Also
    --------
    lsh_buckets : The buckets these rotations give.

    Notes
    -----
    Round r's bucket of a token x is ``argmax([x R_r, -x R_r])`` (angular
    LSH, Andoni et al. 2015), so similar directions share a bucket.

    Examples
    --------
    >>> import attnx
    >>> attnx.lsh_rotations(8, n_buckets=4, n_hashes=2, seed=0).shape
    (2, 8, 2)
    """
    d = count(d, "d")
    n_buckets, n_hashes, seed = _hash_options(n_buckets, n_hashes, seed)
    return np.random.default_rng(seed).standard_normal((n_hashes, d, n_buckets // 2))


def _hash_options(n_buckets, n_hashes, seed):
    n_buckets = count(n_buckets, "n_buckets", 2)
    if n_buckets % 2:
        raise ValueError(f"n_buckets must be even (a token's bucket is the argmax over "
                         f"[x R, -x R] with R of n_buckets / 2 columns), got {n_buckets}")
    if n_buckets >= 2**31:
        raise ValueError(f"n_buckets must be below 2**31, got {n_buckets}")
    n_hashes = count(n_hashes, "n_hashes", 1)
    seed = count(seed, "seed", 0)
    return n_buckets, n_hashes, seed


def _rotations_for(q, n_buckets, n_hashes, seed):
    """The rotations for q's feature size (q's shape is checked by the kernel;
    a q without axes gets d = 0 here and the kernel's message)."""
    shape = np.shape(q)
    return lsh_rotations(shape[-1] if shape else 0, n_buckets, n_hashes, seed)


def lsh_buckets(q, n_buckets, n_hashes=1, seed=0):
    """The buckets `lsh_attention` puts the tokens of q in.

    Parameters
    ----------
    q : array_like, shape (..., n, d)
        The shared queries and keys.
    n_buckets, n_hashes, seed
        As in `lsh_attention`.

    Returns
    -------
    ndarray, shape (..., n_hashes, n), int32
        Each round's bucket of each token.

    Raises
    ------
    ValueError
        As in `lsh_rotations`, or a q with fewer than 2 dimensions.
    TypeError
        Complex, object or string inputs.

    See Also
    --------
    lsh_rotations : The rotations.
    lsh_attention : The attention over these buckets.

    Notes
    -----
    Round r's bucket of token j is ``argmax([q_j @ R_r, -(q_j @ R_r)])``
    with ``R_r = attnx.lsh_rotations(d, n_buckets, n_hashes, seed)[r]``,
    computed in q's compute dtype (float32 for float32 and float16, else
    float64).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> q = np.random.default_rng(0).standard_normal((6, 4))
    >>> b = attnx.lsh_buckets(q, n_buckets=4, n_hashes=2)
    >>> b.shape, b.dtype
    ((2, 6), dtype('int32'))
    >>> R = attnx.lsh_rotations(4, 4, 2)
    >>> xr = q @ R[0]
    >>> np.array_equal(b[0], np.argmax(np.concatenate([xr, -xr], axis=1), axis=1))
    True
    """
    n_buckets, n_hashes, seed = _hash_options(n_buckets, n_hashes, seed)
    return _C.lsh_buckets(q, _rotations_for(q, n_buckets, n_hashes, seed))


def lsh_attention(q, v, n_buckets, n_hashes=1, chunk=64, causal=False, seed=0, *, out=None,
                  return_lse=False):
    """Reformer's LSH attention with shared query-keys (Kitaev et al. 2020).

    Parameters
    ----------
    q : array_like, shape (..., n, d)
        The queries and, normalised, the keys.
    v : array_like, shape (..., n, e)
        The values; the leading axes of q and v broadcast.
    n_buckets : int
        Buckets per round, even.
    n_hashes : int, default 1
        Hashing rounds.
    chunk : int, default 64
        The length of the chunks the sorted order is cut into.
    causal : bool or str, default False
        Attend to earlier positions only.
    seed : int, default 0
        The seed of the rotations (`lsh_rotations`).
    out : ndarray, optional
        Receives the result.
    return_lse : bool, default False
        Also return the log of each row's softmax denominator.

    Returns
    -------
    out : ndarray, shape (..., n, e)
        The output.
    lse : ndarray, shape (..., n)
        Only with ``return_lse=True``.

    Raises
    ------
    ValueError
        An odd n_buckets, a chunk below 1, mismatched shapes.
    TypeError
        Complex, object or string inputs.

    See Also
    --------
    lsh_buckets : The buckets, for inspection.
    lsh_attention_backward : The gradients.
    softmax_attention : Full attention.

    Notes
    -----
    The logits are ``q_i . q_j / |q_j| / sqrt(d)`` (a zero q_j gives the
    zero key). Each round hashes the tokens into buckets by a random
    rotation, sorts them by (bucket, position) and cuts the sorted order
    into chunks; a token attends to the tokens of its own chunk and of the
    chunk before that are in its bucket, other than itself (with
    ``causal``, earlier ones only). The rounds are merged by log-sum-exp
    with every key counted once, so the result is exact softmax attention
    over the union of the keys the rounds show. A token that sees no other
    key attends to itself. Cost O(n_hashes n (chunk + n_buckets / 2) d)
    per head plus the sort (docs/lsh.md).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, v = rng.standard_normal((8, 4)), rng.standard_normal((8, 3))
    >>> attnx.lsh_attention(q, v, n_buckets=2, n_hashes=2, chunk=4).shape
    (8, 3)

    With one bucket pair and one chunk covering the sequence, it is full
    attention over the other tokens:

    >>> o = attnx.lsh_attention(q, v, n_buckets=2, chunk=8)
    >>> keys = q / np.linalg.norm(q, axis=1, keepdims=True)
    >>> s = q @ keys.T / 2
    >>> b = attnx.lsh_buckets(q, 2)[0]
    >>> visible = (b[:, None] == b[None, :]) & ~np.eye(8, dtype=bool)
    >>> w = np.where(visible, np.exp(s), 0)
    >>> np.allclose(o[visible.any(1)], (w / w.sum(1, keepdims=True) @ v)[visible.any(1)])
    True
    """
    n_buckets, n_hashes, seed = _hash_options(n_buckets, n_hashes, seed)
    result, lse = _C.lsh_attention(q, v, _rotations_for(q, n_buckets, n_hashes, seed),
                                   chunk=chunk, causal=causal, out=out)
    return (result, lse) if return_lse else result


def lsh_attention_backward(dout, q, v, out, lse, n_buckets, n_hashes=1, chunk=64, causal=False,
                           seed=0, *, dq=None, dv=None):
    """Gradients of ``sum(dout * lsh_attention(q, v, n_buckets, ...))``.

    Parameters
    ----------
    dout : array_like, shape (..., n, e)
        The gradient arriving at the forward's output.
    q, v : array_like
        The forward's inputs.
    out, lse : array_like
        The forward's results (``lsh_attention(..., return_lse=True)``).
    n_buckets, n_hashes, chunk, causal, seed
        The forward's options (the hashing is redone from the same seed).
    dq, dv : ndarray, optional
        Arrays to receive the gradients.

    Returns
    -------
    Gradients
        ``q`` (through both its query and its normalised-key role) and
        ``v``, each of its input's shape and dtype.

    Raises
    ------
    ValueError
        Shapes that do not match the forward's, or its options' errors.
    TypeError
        Inputs of an unsupported dtype.

    See Also
    --------
    lsh_attention : The forward.
    vjp : The forward and this backward in one call.

    Notes
    -----
    The buckets are constants: the gradient is that of softmax attention
    under the visibility they give.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, v = rng.standard_normal((8, 4)), rng.standard_normal((8, 3))
    >>> out, lse = attnx.lsh_attention(q, v, 4, chunk=4, return_lse=True)
    >>> g = attnx.lsh_attention_backward(np.ones_like(out), q, v, out, lse, 4, chunk=4)
    >>> g.q.shape, g.v.shape, g.k is None
    ((8, 4), (8, 3), True)
    """
    n_buckets, n_hashes, seed = _hash_options(n_buckets, n_hashes, seed)
    grad_q, grad_v = _C.lsh_backward(dout, q, v, out, lse,
                                     _rotations_for(q, n_buckets, n_hashes, seed), chunk=chunk,
                                     causal=causal)
    return Gradients(q=deliver(grad_q, q, dq, "dq"), v=deliver(grad_v, v, dv, "dv"))


def _lsh_vjp_rule(q, v, *args, **options):
    if options.get("return_lse"):
        raise TypeError("vjp: return_lse is not an option of the differentiated function")
    out, lse = lsh_attention(q, v, *args, return_lse=True, **options)
    options.pop("out", None)

    def pullback(dout):
        return lsh_attention_backward(dout, q, v, out, lse, *args, **options)

    return out, pullback


register_vjp(lsh_attention, _lsh_vjp_rule)
