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


def _backward(dout, q, k, v, out, lse, scale, sigma, causal, mask, bias, window, dropout_p, seed,
              bias_grad, dq, dk, dv):
    inputs = (dout, q, k, v, out)
    shapes = [np.shape(x)[:-2] for x in (dout, q, k, v, out, mask, bias) if x is not None]
    shapes.append(np.shape(lse)[:-1])
    direct = [direct_output(g, x, inputs, shapes) for g, x in ((dq, q), (dk, k), (dv, v))]
    grad_q, grad_k, grad_v, grad_bias = _C.softmax_backward(
        dout, q, k, v, out, lse, scale, sigma, causal, mask, bias, window, dropout_p, seed,
        bool(bias_grad), *direct)
    return Gradients(q=deliver(grad_q, q, dq, "dq"), k=deliver(grad_k, k, dk, "dk"),
                     v=deliver(grad_v, v, dv, "dv"),
                     bias=None if grad_bias is None else deliver(grad_bias, bias, None, "dbias"))


def softmax_attention_backward(dout, q, k, v, out, lse, *, scale=None, causal=False, mask=None,
                               bias=None, window=None, dropout_p=0.0, seed=None, bias_grad=False,
                               dq=None, dk=None, dv=None):
    """Gradients of ``sum(dout * softmax_attention(q, k, v, ...))``.

    ``out`` and ``lse`` are the forward's results
    (``softmax_attention(..., return_lse=True)``), and the options must be
    the forward's. Returns :class:`attnx.Gradients` with ``q``, ``k``,
    ``v`` (and ``bias`` when ``bias_grad=True``), each of its input's shape
    (summed over the axes the input was broadcast along) and dtype.
    ``dq``, ``dk``, ``dv``: arrays of those shapes and dtypes to receive the
    gradients. Computed FlashAttention-2 style: the probabilities are
    recomputed tile by tile from ``lse``; no n x m matrix is held (except
    the gradient of a bias when asked for, which has the bias's size).
    Rows that see no key get zero gradients. ``dropout_p``, ``seed``: the
    forward's dropout, whose mask is regenerated from the seed."""
    return _backward(dout, q, k, v, out, lse, scale, None, causal, mask, bias, window, dropout_p,
                     seed, bias_grad, dq, dk, dv)


def gaussian_attention_backward(dout, q, k, v, out, lse, sigma=1.0, *, causal=False, mask=None,
                                bias=None, window=None, dropout_p=0.0, seed=None,
                                bias_grad=False, dq=None, dk=None, dv=None):
    """Gradients of ``sum(dout * gaussian_attention(q, k, v, sigma, ...))``;
    as :func:`softmax_attention_backward`, with the forward's ``out`` and
    ``lse`` (the lse of the scores ``-|q_i - k_j|^2 / (2 sigma^2) + bias``)."""
    return _backward(dout, q, k, v, out, lse, None, sigma, causal, mask, bias, window, dropout_p,
                     seed, bias_grad, dq, dk, dv)


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
