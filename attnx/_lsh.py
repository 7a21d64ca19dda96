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
    """The random rotations of :func:`lsh_attention`'s hashing: a float64
    array (n_hashes, d, n_buckets // 2) of standard normal numbers drawn by
    ``numpy.random.default_rng(seed)``, the same for every head."""
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
    """The buckets :func:`lsh_attention` puts the tokens of ``q`` (..., n, d)
    in: an int32 array (..., n_hashes, n). Round r's bucket of token j is
    ``argmax([q_j @ R_r, -(q_j @ R_r)])`` with ``R_r`` =
    ``attnx.lsh_rotations(d, n_buckets, n_hashes, seed)[r]``, computed in
    q's compute dtype (float32 for float32 and float16, else float64)."""
    n_buckets, n_hashes, seed = _hash_options(n_buckets, n_hashes, seed)
    return _C.lsh_buckets(q, _rotations_for(q, n_buckets, n_hashes, seed))


def lsh_attention(q, v, n_buckets, n_hashes=1, chunk=64, causal=False, seed=0, *, out=None,
                  return_lse=False):
    """Reformer's LSH attention with shared query-keys (Kitaev et al., 2020).

    ``q`` (..., n, d) are the queries and, normalised, the keys; ``v``
    (..., n, e) the values; the leading axes broadcast. The logits are
    ``q_i . q_j / |q_j| / sqrt(d)`` (a zero ``q_j`` gives the zero key).
    Each of ``n_hashes`` rounds hashes the tokens into ``n_buckets`` (even)
    buckets by a random rotation drawn from ``seed`` (see
    :func:`lsh_buckets`), sorts them by (bucket, position) and cuts the
    sorted order into chunks of ``chunk``; a token attends to the tokens of
    its own chunk and of the chunk before (none before the first) that are
    in its bucket, other than itself, and with ``causal`` only to earlier
    positions. The rounds are merged by log-sum-exp with every key counted
    once, so the result is exact softmax attention over the union of the
    keys the rounds show. A token that sees no other key attends to itself
    (its output is its own value). With one bucket and one chunk covering
    the sequence this is full attention over the other tokens.

    Returns ``out`` (..., n, e) (and ``lse`` (..., n), the log of the
    softmax denominator, with ``return_lse=True``). ``out=``: an array to
    receive the result. Cost O(n_hashes n (chunk + n_buckets / 2) d) per
    head plus the sort, O(n_hashes n) memory besides the output."""
    n_buckets, n_hashes, seed = _hash_options(n_buckets, n_hashes, seed)
    result, lse = _C.lsh_attention(q, v, _rotations_for(q, n_buckets, n_hashes, seed), chunk,
                                   causal, out)
    return (result, lse) if return_lse else result


def lsh_attention_backward(dout, q, v, out, lse, n_buckets, n_hashes=1, chunk=64, causal=False,
                           seed=0, *, dq=None, dv=None):
    """Gradients of ``sum(dout * lsh_attention(q, v, n_buckets, ...))``.

    ``out`` and ``lse`` are the forward's results
    (``lsh_attention(..., return_lse=True)``) and the options must be the
    forward's (the hashing is redone from the same seed). Returns
    :class:`attnx.Gradients` with ``q`` (through both its query and its
    normalised-key role) and ``v``, each of its input's shape and dtype;
    ``dq``, ``dv``: arrays to receive them. The buckets are constants: the
    gradient is that of softmax attention under the visibility they give."""
    n_buckets, n_hashes, seed = _hash_options(n_buckets, n_hashes, seed)
    grad_q, grad_v = _C.lsh_backward(dout, q, v, out, lse,
                                     _rotations_for(q, n_buckets, n_hashes, seed), chunk, causal)
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
