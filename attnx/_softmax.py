"""Gradients of softmax and gaussian attention (the kernels are in C:
csrc/softmax_backward.c), and their ``vjp`` rules.

The C entry returns one gradient per head of the broadcast batch; here
each is reduced to its input's own shape (summed over the axes the input
was broadcast along, e.g. key/value heads shared by a group of query
heads) and dtype.
"""
import numpy as np

from . import _C
from ._grad import Gradients, deliver, direct_output, register_vjp


def _backward(dout, q, k, v, out, lse, *, mask, bias, bias_grad, dq, dk, dv, **options):
    """The kernel's gradients delivered to the inputs; `options`: the
    kernel's scale or sigma, causal, window, dropout_p, seed, and
    attnx.torch's private _bf16_products and _half_kv (k and v in half
    precision, as the C entry reads them; their gradients float32)."""
    kv = (k, v)
    if options.get("_half_kv"):
        kv = tuple(np.broadcast_to(np.float32(0), np.shape(x)) for x in kv)
    inputs = (dout, q) + kv + (out,)
    shapes = [np.shape(x)[:-2] for x in (dout, q, k, v, out, mask, bias) if x is not None]
    shapes.append(np.shape(lse)[:-1])
    direct = [direct_output(g, x, inputs, shapes) for g, x in ((dq, q), (dk, kv[0]), (dv, kv[1]))]
    grad_q, grad_k, grad_v, grad_bias = _C.softmax_backward(
        dout, q, k, v, out, lse, mask=mask, bias=bias, bias_grad=bool(bias_grad), dq=direct[0],
        dk=direct[1], dv=direct[2], **options)
    return Gradients(q=deliver(grad_q, q, dq, "dq"), k=deliver(grad_k, kv[0], dk, "dk"),
                     v=deliver(grad_v, kv[1], dv, "dv"),
                     bias=None if grad_bias is None else deliver(grad_bias, bias, None, "dbias"))


def softmax_attention_backward(dout, q, k, v, out, lse, *, scale=None, causal=False, mask=None,
                               bias=None, window=None, dropout_p=0.0, seed=None, bias_grad=False,
                               dq=None, dk=None, dv=None):
    """Gradients of ``sum(dout * softmax_attention(q, k, v, ...))``.

    Computed FlashAttention-2 style: the probabilities are recomputed tile
    by tile from the forward's ``lse``, so no n x m matrix is held (except
    the gradient of a bias when asked for, which has the bias's size).

    Parameters
    ----------
    dout : array_like, shape (..., n, e)
        The gradient arriving at the forward's output.
    q, k, v : array_like
        The forward's inputs, (..., n, d), (..., m, d), (..., m, e).
    out : array_like, shape (..., n, e)
        The forward's output.
    lse : array_like, shape (..., n)
        The forward's log-sum-exp (``softmax_attention(...,
        return_lse=True)``).
    scale, causal, mask, bias, window, dropout_p, seed
        The forward's options, which must be the ones it ran with (the
        dropout mask is regenerated from ``seed``).
    bias_grad : bool, default False
        Also return the gradient of ``bias``.
    dq, dk, dv : ndarray, optional
        Arrays of the shapes and dtypes of q, k, v to receive the
        gradients.

    Returns
    -------
    Gradients
        ``q``, ``k``, ``v`` (and ``bias`` with ``bias_grad=True``), each of
        its input's shape (summed over the axes the input was broadcast
        along, such as key/value heads shared by a group of query heads)
        and dtype.

    Raises
    ------
    ValueError
        Shapes that do not match the forward's, or the errors of
        `softmax_attention` for its options.
    TypeError
        Inputs of an unsupported dtype.

    See Also
    --------
    softmax_attention : The forward.
    vjp : The forward and this backward in one call.
    attnx.torch.softmax_attention : The same gradients through autograd.

    Notes
    -----
    With ``P`` the attention weights and ``D_i = dout_i . out_i``:
    ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - D)``,
    ``dQ = scale dS K``, ``dK = scale dS^T Q``, ``dbias = dS``. Rows that
    see no key get zero gradients (docs/gradients.md).

    Examples
    --------
    >>> import numpy as np, attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((3, 2)) for _ in range(3))
    >>> out, lse = attnx.softmax_attention(q, k, v, causal=True, return_lse=True)
    >>> g = attnx.softmax_attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True)
    >>> g.q.shape, g.k.shape, g.v.shape
    ((3, 2), (3, 2), (3, 2))

    The gradient of ``sum(out)`` against v is each key's total weight:

    >>> w = attnx.attention_weights(q, k, causal=True)
    >>> np.allclose(g.v, w.sum(0)[:, None] * np.ones((3, 2)))
    True
    """
    return _backward(dout, q, k, v, out, lse, scale=scale, causal=causal, mask=mask, bias=bias,
                     window=window, dropout_p=dropout_p, seed=seed, bias_grad=bias_grad, dq=dq,
                     dk=dk, dv=dv)


def gaussian_attention_backward(dout, q, k, v, out, lse, sigma=1.0, *, causal=False, mask=None,
                                bias=None, window=None, dropout_p=0.0, seed=None,
                                bias_grad=False, dq=None, dk=None, dv=None):
    """Gradients of ``sum(dout * gaussian_attention(q, k, v, sigma, ...))``.

    Parameters
    ----------
    dout : array_like, shape (..., n, e)
        The gradient arriving at the forward's output.
    q, k, v : array_like
        The forward's inputs, (..., n, d), (..., m, d), (..., m, e).
    out : array_like, shape (..., n, e)
        The forward's output.
    lse : array_like, shape (..., n)
        The forward's log-sum-exp, that of the scores
        ``-|q_i - k_j|^2 / (2 sigma^2) + bias_ij`` up to the query's own
        term (``gaussian_attention(..., return_lse=True)``).
    sigma : float, default 1.0
        The forward's kernel width.
    causal, mask, bias, window, dropout_p, seed
        The forward's options.
    bias_grad : bool, default False
        Also return the gradient of ``bias``.
    dq, dk, dv : ndarray, optional
        Arrays of the shapes and dtypes of q, k, v to receive the
        gradients.

    Returns
    -------
    Gradients
        ``q``, ``k``, ``v`` (and ``bias``), each in its input's shape and
        dtype.

    Raises
    ------
    ValueError
        Shapes that do not match the forward's, a bad sigma, or the errors
        of `gaussian_attention` for its options.
    TypeError
        Inputs of an unsupported dtype.

    See Also
    --------
    gaussian_attention : The forward.
    softmax_attention_backward : The backward this one runs.

    Notes
    -----
    Gaussian attention is softmax attention with ``scale = 1 / sigma^2``
    and the per-key bias ``-|k_j|^2 / (2 sigma^2)``; the gradient of that
    bias adds ``-k_j / sigma^2`` times the column sums of ``dS`` to ``dK``.

    Examples
    --------
    >>> import numpy as np, attnx
    >>> x = np.linspace(0, 1, 4)[:, None]
    >>> y = x ** 2
    >>> out, lse = attnx.gaussian_attention(x, x, y, sigma=0.5, return_lse=True)
    >>> g = attnx.gaussian_attention_backward(np.ones_like(out), x, x, y, out, lse, sigma=0.5)
    >>> g.v.shape
    (4, 1)
    >>> round(float(g.v.sum()), 6)                 # each output's weights sum to 1
    4.0
    """
    return _backward(dout, q, k, v, out, lse, sigma=sigma, causal=causal, mask=mask, bias=bias,
                     window=window, dropout_p=dropout_p, seed=seed, bias_grad=bias_grad, dq=dq,
                     dk=dk, dv=dv)


def lse_vjp_rule(forward, backward):
    """The vjp rule of softmax attention or of a front end over it
    (attnx/_systems.py): the forward with its lse, then the backward with
    the bias gradient when a bias was given."""
    def rule(q, k, v, *args, **options):
        if options.get("return_lse"):
            raise TypeError("vjp: return_lse is not an option of the differentiated function")
        out, lse = forward(q, k, v, *args, return_lse=True, **options)
        options.pop("out", None)

        def pullback(dout):
            return backward(dout, q, k, v, out, lse, *args,
                            bias_grad=options.get("bias") is not None, **options)

        return out, pullback

    return rule


register_vjp(_C.softmax_attention, lse_vjp_rule(_C.softmax_attention, softmax_attention_backward))
register_vjp(_C.gaussian_attention, lse_vjp_rule(_C.gaussian_attention, gaussian_attention_backward))
