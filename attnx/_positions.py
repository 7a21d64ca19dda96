"""Position encodings: the Transformer's sinusoidal table and rotary
position embeddings (RoPE), with the rotation's backward.

Rotary embeddings (Su et al., RoFormer) rotate pairs of features of each
query and key vector by an angle proportional to the token's position, so
that ``rotary(q)_i . rotary(k)_j`` depends on the positions only through
``i - j``. Two pairings are in use:

* rotate-half (GPT-NeoX, Llama; the default): pair ``(x[i], x[i + d/2])``;
* interleaved (RoFormer): pair ``(x[2i], x[2i + 1])``;

pair ``i`` (of ``d/2``) turns by ``position * base**(-2i/d)``.
"""
import numpy as np

from ._checks import count
from ._grad import Gradients, register_vjp


def _float_input(x, name):
    """x as an array in the dtype it is computed in, and the result dtype:
    float32/float64 stay, float16 computes in float32 and returns float16,
    integers and bool compute in float64."""
    x = np.asarray(x)
    if x.dtype.kind == "f":
        if x.dtype == np.float16:
            return x.astype(np.float32), x.dtype
        return x, x.dtype
    if x.dtype.kind in "iub":
        return x.astype(np.float64), np.dtype(np.float64)
    raise TypeError(f"{name} must hold real numbers (float, int or bool), got dtype {x.dtype}")


def _check_base(base):
    try:
        base = float(base)
    except (TypeError, ValueError):
        raise TypeError(f"base must be a real number, got {base!r}") from None
    if not np.isfinite(base) or base <= 0:
        raise ValueError(f"base must be finite and positive, got {base}")
    return base


def sinusoidal_positions(n, d, base=10000):
    """The Transformer's sinusoidal position table.

    Parameters
    ----------
    n : int
        Positions (rows), at least 0.
    d : int
        Features (columns), at least 0.
    base : float, default 10000
        The base of the wavelengths, positive and finite.

    Returns
    -------
    ndarray, shape (n, d), float64
        The table, added to the inputs of a model.

    Raises
    ------
    ValueError
        A negative n or d, or a base that is not positive and finite.
    TypeError
        An n or d that is not an integer.

    See Also
    --------
    rotary : Rotary position embeddings.

    Notes
    -----
    ``PE[p, 2i] = sin(p / base**(2i/d))``, ``PE[p, 2i+1] = cos(p /
    base**(2i/d))``; an odd d ends with a sine column (Vaswani et al.
    2017).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> P = attnx.sinusoidal_positions(3, 4)
    >>> print(np.round(P, 3))
    [[ 0.     1.     0.     1.   ]
     [ 0.841  0.54   0.01   1.   ]
     [ 0.909 -0.416  0.02   1.   ]]
    """
    n = count(n, "n")
    d = count(d, "d")
    base = _check_base(base)
    pair = np.arange(d) // 2
    angles = np.arange(n, dtype=np.float64)[:, None] / base ** (2.0 * pair / d)
    return np.where(np.arange(d) % 2 == 0, np.sin(angles), np.cos(angles))


def _angles(shape, positions, base):
    """cos and sin of the rotation angles, each of shape
    ``positions' shape + (d/2,)``, broadcastable against x's pairs.
    ``shape`` is x's shape (..., n, d)."""
    if len(shape) < 2:
        raise ValueError(f"x must have at least 2 dimensions (..., n, d), got shape {shape}")
    d = shape[-1]
    if d % 2:
        raise ValueError(f"x's last axis must have an even size to form rotation pairs, got d = {d}")
    if positions is None:
        positions = np.arange(shape[-2], dtype=np.float64)
    else:
        positions = np.asarray(positions)
        if positions.dtype.kind not in "iuf":
            raise TypeError(f"positions must hold integers or floats, got dtype {positions.dtype}")
        positions = positions.astype(np.float64)
        if not np.all(np.isfinite(positions)):
            raise ValueError("positions must be finite")
        try:
            broadcast = np.broadcast_shapes(positions.shape, shape[:-1])
        except ValueError:
            broadcast = None
        if broadcast != tuple(shape[:-1]):
            raise ValueError(f"positions of shape {positions.shape} must broadcast to x's "
                             f"positions {tuple(shape[:-1])} (x of shape {tuple(shape)})")
    frequencies = base ** (-2.0 * np.arange(d // 2) / d)
    angles = positions[..., None] * frequencies
    return np.cos(angles), np.sin(angles)


def _rotate(x, cos, sin, interleaved, out_dtype):
    """Each pair (a, b) -> (a cos - b sin, b cos + a sin)."""
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    out = np.empty(x.shape, dtype=x.dtype)
    half = x.shape[-1] // 2
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        out_a, out_b = out[..., 0::2], out[..., 1::2]
    else:
        a, b = x[..., :half], x[..., half:]
        out_a, out_b = out[..., :half], out[..., half:]
    out_a[...] = a * cos - b * sin
    out_b[...] = b * cos + a * sin
    return out.astype(out_dtype, copy=False)


def rotary(x, positions=None, base=10000, interleaved=False):
    """Rotary position embedding (RoPE) of x over its last axis.

    Parameters
    ----------
    x : array_like, shape (..., n, d)
        Queries or keys; d even.
    positions : array_like, optional
        Default 0..n-1 along the second-to-last axis; otherwise integers or
        floats broadcastable to ``x.shape[:-1]`` (``[t]`` when decoding the
        token at position t, or (batch, n) offsets per sequence).
    base : float, default 10000
        The base of the rotation frequencies, positive and finite.
    interleaved : bool, default False
        Rotate the pairs ``(x[2i], x[2i + 1])`` (RoFormer) instead of
        ``(x[i], x[i + d/2])`` (rotate-half: GPT-NeoX, Llama).

    Returns
    -------
    ndarray
        A new array of x's shape and float dtype.

    Raises
    ------
    ValueError
        An odd d, positions that do not broadcast, a bad base.
    TypeError
        Complex, object or string inputs.

    See Also
    --------
    rotary_backward : The gradient.
    sinusoidal_positions : The additive table.
    multi_head_attention : Takes ``positions="rotary"``.

    Notes
    -----
    Pair i (of d/2) of the vector at position p turns by the angle
    ``p * base**(-2i/d)``: ``(a, b) -> (a cos - b sin, b cos + a sin)``, so
    the score of a rotated query and key depends on their positions only
    through ``p_q - p_k`` (Su et al. 2021). ``attnx.vjp(attnx.rotary, x,
    ...)`` gives a pullback whose `Gradients` hold x's gradient in the
    first field (``g.q``).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> x = np.ones((3, 2))                        # one pair, positions 0, 1, 2
    >>> print(np.round(attnx.rotary(x), 3))
    [[ 1.     1.   ]
     [-0.301  1.382]
     [-1.325  0.493]]
    >>> q, k = np.random.default_rng(0).standard_normal((2, 1, 4))
    >>> s1 = attnx.rotary(q, positions=[5]) @ attnx.rotary(k, positions=[2]).T
    >>> s2 = attnx.rotary(q, positions=[13]) @ attnx.rotary(k, positions=[10]).T
    >>> np.allclose(s1, s2)                        # only p_q - p_k matters
    True
    """
    x, out_dtype = _float_input(x, "x")
    cos, sin = _angles(x.shape, positions, _check_base(base))
    return _rotate(x, cos, sin, bool(interleaved), out_dtype)


def rotary_backward(dout, positions=None, base=10000, interleaved=False):
    """The gradient of ``sum(dout * rotary(x, ...))`` with respect to x.

    Parameters
    ----------
    dout : array_like, shape (..., n, d)
        The gradient arriving at the rotated array.
    positions, base, interleaved
        The forward's options.

    Returns
    -------
    ndarray
        The gradient of x, dout's shape.

    Raises
    ------
    ValueError
        As in `rotary`.
    TypeError
        As in `rotary`.

    See Also
    --------
    rotary : The forward.

    Notes
    -----
    The rotation is orthogonal, so its transpose turns each pair back by
    the same angle: ``rotary_backward(dout) == rotary(dout)`` with the
    angles negated.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> x = np.random.default_rng(0).standard_normal((4, 6))
    >>> np.allclose(attnx.rotary_backward(attnx.rotary(x)), x)
    True
    """
    dout, out_dtype = _float_input(dout, "dout")
    cos, sin = _angles(dout.shape, positions, _check_base(base))
    return _rotate(dout, cos, -sin, bool(interleaved), out_dtype)


def _rotary_vjp(x, positions=None, base=10000, interleaved=False):
    out = rotary(x, positions, base, interleaved)

    def pullback(dout):
        dout = np.asarray(dout)
        if dout.shape != out.shape:
            raise ValueError(f"dout must have the output's shape {out.shape}, got {dout.shape}")
        return Gradients(q=rotary_backward(dout, positions, base, interleaved))

    return out, pullback


register_vjp(rotary, _rotary_vjp)
