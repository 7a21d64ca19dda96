"""The peers attnx is measured against: plain numpy and pure PyTorch.

Each is what a careful user would write: batched (..., n, d) arrays, no
Python loop over heads, in-place operations where numpy allows them, and
torch under no-grad. torch is imported lazily so that numpy-only callers
(the memory probe) do not pay for it. All linear attention peers use the
Linear Transformer feature map phi(x) = elu(x) + 1 on queries and keys and
clamp the denominator at eps, as attnx does.
"""
import math

import numpy as np

EPS = 1e-6
CHUNK = 64          # chunk length of the chunked peers (the usual choice)


def visibility(n, m, causal=False, window=None, key_valid=None):
    """Boolean (n, m) (or broadcastable) mask, True = query i sees key j, with
    attnx's lower-right alignment; None when every key is visible."""
    visible = None
    if causal or window is not None:
        rows = np.arange(n)[:, None] + (m - n)
        cols = np.arange(m)[None, :]
        left, right = window if window is not None else (None, None)
        if causal:
            right = 0 if right is None else min(right, 0)
        visible = np.ones((n, m), dtype=bool)
        if left is not None:
            visible &= cols >= rows - left
        if right is not None:
            visible &= cols <= rows + right
    if key_valid is not None:
        visible = key_valid[None, :] if visible is None else visible & key_valid[None, :]
    return visible


# ---------------------------------------------------------------- numpy

def numpy_softmax_attention(q, k, v, visible=None):
    """softmax(q k^T / sqrt(d), masked) v, one (..., n, m) score array."""
    scores = q @ np.swapaxes(k, -1, -2)
    scores *= 1.0 / math.sqrt(q.shape[-1])
    if visible is not None:
        np.copyto(scores, -np.inf, where=~visible)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores @ v


def numpy_elu1(x):
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def numpy_linear_causal_chunked(q, k, v, chunk=CHUNK):
    """Causal linear attention, chunk by chunk with a carried state (S, z)."""
    phi_q, phi_k = numpy_elu1(q), numpy_elu1(k)
    n, r, e = q.shape[-2], phi_q.shape[-1], v.shape[-1]
    lead = q.shape[:-2]
    state = np.zeros(lead + (r, e), q.dtype)         # S = sum psi(k_j) v_j^T
    key_sum = np.zeros(lead + (1, r), q.dtype)       # z = sum psi(k_j)
    out = np.empty(lead + (n, e), q.dtype)
    lower = np.tril(np.ones((chunk, chunk), q.dtype))
    for start in range(0, n, chunk):
        rows = slice(start, min(start + chunk, n))
        size = rows.stop - rows.start
        q_c, k_c, v_c = phi_q[..., rows, :], phi_k[..., rows, :], v[..., rows, :]
        weights = q_c @ np.swapaxes(k_c, -1, -2)
        weights *= lower[:size, :size]
        numer = weights @ v_c + q_c @ state
        denom = weights.sum(axis=-1, keepdims=True) + (q_c * key_sum).sum(axis=-1, keepdims=True)
        out[..., rows, :] = numer / np.maximum(denom, EPS)
        state += np.swapaxes(k_c, -1, -2) @ v_c
        key_sum += k_c.sum(axis=-2, keepdims=True)
    return out


def numpy_linear_step(q, k, v, state):
    """One decoding step: q, k, v (..., 1, d); state = (S, z), updated in place."""
    s, z = state
    phi_q, phi_k = numpy_elu1(q), numpy_elu1(k)
    s += np.swapaxes(phi_k, -1, -2) @ v
    z += phi_k
    denom = (phi_q * z).sum(axis=-1, keepdims=True)
    return (phi_q @ s) / np.maximum(denom, EPS)


def numpy_sgemm(a, b):
    return a @ b


# ---------------------------------------------------------------- torch

def torch_module():
    import torch
    torch.set_grad_enabled(False)
    return torch


def torch_sdpa(q, k, v, causal=False, mask=None):
    """torch.nn.functional.scaled_dot_product_attention on zero-copy views.
    `mask` (numpy bool, True = attend) is converted to a tensor once by the
    caller through torch_tensor."""
    torch = torch_module()
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def torch_tensor(array):
    return None if array is None else torch_module().from_numpy(np.ascontiguousarray(array))


def torch_elu1(x):
    return torch_module().nn.functional.elu(x) + 1


def torch_linear_recurrent(q, k, v):
    """RNN form: one token at a time, S_t = S_{t-1} + psi(k_t) v_t^T."""
    torch = torch_module()
    phi_q, phi_k = torch_elu1(q), torch_elu1(k)
    *lead, n, r = phi_q.shape
    state = q.new_zeros(*lead, r, v.shape[-1])
    key_sum = q.new_zeros(*lead, r)
    rows = []
    for q_t, k_t, v_t in zip(phi_q.unbind(-2), phi_k.unbind(-2), v.unbind(-2)):
        state += k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
        key_sum += k_t
        numer = torch.matmul(q_t.unsqueeze(-2), state).squeeze(-2)
        denom = (q_t * key_sum).sum(-1, keepdim=True)
        rows.append(numer / denom.clamp_min(EPS))
    return torch.stack(rows, -2)


def torch_linear_cumsum(q, k, v):
    """Materialise every prefix state (n x r x e per head) with cumsum."""
    torch = torch_module()
    phi_q, phi_k = torch_elu1(q), torch_elu1(k)
    prefix_states = torch.einsum("...nr,...ne->...nre", phi_k, v).cumsum(-3)
    prefix_key_sums = phi_k.cumsum(-2)
    numer = torch.einsum("...nr,...nre->...ne", phi_q, prefix_states)
    denom = (phi_q * prefix_key_sums).sum(-1, keepdim=True)
    return numer / denom.clamp_min(EPS)


def torch_linear_chunked(q, k, v, chunk=CHUNK):
    """Loop over chunks: masked intra-chunk product plus a carried state."""
    torch = torch_module()
    phi_q, phi_k = torch_elu1(q), torch_elu1(k)
    *lead, n, r = phi_q.shape
    state = q.new_zeros(*lead, r, v.shape[-1])
    key_sum = q.new_zeros(*lead, 1, r)
    out = q.new_empty(*lead, n, v.shape[-1])
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        q_c, k_c, v_c = phi_q[..., start:stop, :], phi_k[..., start:stop, :], v[..., start:stop, :]
        size = stop - start
        weights = (q_c @ k_c.transpose(-1, -2)).masked_fill_(~lower[:size, :size], 0)
        numer = weights @ v_c + q_c @ state
        denom = weights.sum(-1, keepdim=True) + (q_c * key_sum).sum(-1, keepdim=True)
        out[..., start:stop, :] = numer / denom.clamp_min(EPS)
        state += k_c.transpose(-1, -2) @ v_c
        key_sum += k_c.sum(-2, keepdim=True)
    return out


def torch_linear_chunked_parallel(q, k, v, chunk=CHUNK):
    """All chunks at once: each chunk's incoming state is an exclusive cumsum
    of the per-chunk sums psi(K_c)^T V_c. Needs n divisible by chunk."""
    torch = torch_module()
    phi_q, phi_k = torch_elu1(q), torch_elu1(k)
    *lead, n, r = phi_q.shape
    e = v.shape[-1]
    q_c = phi_q.reshape(*lead, n // chunk, chunk, r)
    k_c = phi_k.reshape(*lead, n // chunk, chunk, r)
    v_c = v.reshape(*lead, n // chunk, chunk, e)
    chunk_states = k_c.transpose(-1, -2) @ v_c                  # (..., N, r, e)
    chunk_key_sums = k_c.sum(-2, keepdim=True)                  # (..., N, 1, r)
    incoming_states = exclusive_cumsum(chunk_states, dim=-3)
    incoming_key_sums = exclusive_cumsum(chunk_key_sums, dim=-3)
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    weights = (q_c @ k_c.transpose(-1, -2)).masked_fill_(~lower, 0)
    numer = weights @ v_c + q_c @ incoming_states
    denom = weights.sum(-1, keepdim=True) + (q_c * incoming_key_sums).sum(-1, keepdim=True)
    return (numer / denom.clamp_min(EPS)).reshape(*lead, n, e)


def exclusive_cumsum(x, dim):
    torch = torch_module()
    shifted = torch.cat([torch.zeros_like(x.narrow(dim, 0, 1)), x.narrow(dim, 0, x.shape[dim] - 1)], dim)
    return shifted.cumsum(dim)


def torch_linear_step(q, k, v, state):
    """One decoding step on tensors; state = (S, z) updated in place."""
    s, z = state
    phi_q, phi_k = torch_elu1(q), torch_elu1(k)
    s += phi_k.transpose(-1, -2) @ v
    z += phi_k
    denom = (phi_q * z).sum(-1, keepdim=True)
    return (phi_q @ s) / denom.clamp_min(EPS)
