"""The kernelised family against an independent torch formulation, and under threads (attnx's team and concurrent Python threads).

The variants under test, their references and the stated tolerances are
in tests/linear_variants.py.
"""
import concurrent.futures

import numpy as np
import pytest

import attnx

from helpers import assert_close, make, qkv, vscale  # noqa: E402
from linear_variants import STATEFUL, call, prep, ref_out  # noqa: E402


# --------------------------------------------------------------------------
# torch and threads
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vs_torch_cumsum_formulation(dtype):
    """Causal elu linear attention against an independent pure-torch
    cumsum formulation (float64), on torch tensors passed through numpy."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(57)
    B, H, n, d, e = 2, 3, 70, 16, 8
    x = torch.from_numpy(make(rng, (B, n, 3 * H * d), dtype))
    qt, kt, vt = x.view(B, n, 3, H, d).permute(2, 0, 3, 1, 4)
    vt = vt[..., :e]
    fq = torch.nn.functional.elu(qt.double()) + 1
    fk = torch.nn.functional.elu(kt.double()) + 1
    S = torch.cumsum(fk[..., :, :, None] * vt.double()[..., :, None, :], dim=-3)
    z = torch.cumsum(fk, dim=-2)
    num = torch.einsum("bhnr,bhnre->bhne", fq, S)
    den = torch.einsum("bhnr,bhnr->bhn", fq, z).clamp_min(1e-6)
    want = (num / den[..., None]).numpy()
    got = attnx.linear_attention(qt.numpy(), kt.numpy(), vt.numpy(), causal=True)
    assert_close(got, want, dtype, vscale(vt.numpy()))


@pytest.mark.parametrize("name", ["elu", "favor", "cosformer", "taylor"])
def test_threads_and_segments_agree(name):
    """One head, long sequence: the chunk method may cut the head into
    segments across threads; 1 thread and 2 threads give the same numbers
    as the reference (float64), for several chunk sizes."""
    rng = np.random.default_rng(58)
    n = 1100
    q, k, v = qkv(rng, (), n, n, 8, 4)
    orig = attnx.get_num_threads()
    try:
        res = {}
        for threads in (1, 2):
            attnx.set_num_threads(threads)
            for c in (None, 3, 16, 64):
                res[threads, c] = call(name, q, k, v, causal=True,
                                       method="chunk", chunk_size=c)
    finally:
        attnx.set_num_threads(orig)
    want = ref_out(name, q, k, v, causal=True)
    for key, got in res.items():
        assert_close(got, want, np.float64, vscale(v), err_msg=str(key))


def test_python_threads_concurrent():
    rng = np.random.default_rng(59)
    jobs = []
    for i in range(12):
        name = STATEFUL[i % len(STATEFUL)]
        dtype = np.float32 if i % 2 else np.float64
        q, k, v = qkv(rng, (2, 2), 60 + 13 * i, 60 + 13 * i, 8, 4, dtype)
        q, k = prep(name, q, k)
        jobs.append((name, q, k, v, dict(causal=bool(i % 3))))

    def run(job):
        name, q, k, v, kw = job
        return call(name, q, k, v, **kw)

    sequential = [run(j) for j in jobs]
    with concurrent.futures.ThreadPoolExecutor(max_workers=6) as ex:
        for _ in range(2):
            for i, got in enumerate(ex.map(run, jobs * 2)):
                want = sequential[i % len(jobs)]
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for (name, q, k, v, kw), got in zip(jobs, sequential):
        assert_close(got, ref_out(name, q, k, v, **kw), got.dtype, vscale(v))
