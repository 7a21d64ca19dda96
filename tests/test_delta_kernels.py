"""The delta rule's kernel sets (the delta_rule family, csrc/dispatch.c):
the chunks' products on the register-blocked kernels and the triangular
solve by blocks on them (csrc/delta.c's product and unit_lower_solve),
against plain C + BLAS and the numpy reference. Needs neither torch nor
transformers, so the emulated aarch64 run checks the NEON set with it."""
import numpy as np
import pytest

import attnx
from attnx.reference import delta_rule as reference
from helpers import dispatched


def make(rng, H, n, dk, dv, gate):
    q, k = rng.standard_normal((H, n, dk)), rng.standard_normal((H, n, dk))
    v = rng.standard_normal((H, n, dv))
    beta = rng.uniform(0, 1, (H, n))
    g = {None: None, "scalar": -rng.uniform(0, 0.5, (H, n)),
         "channel": -rng.uniform(0, 0.5, (H, n, dk))}[gate]
    return q, k, v, beta, g


def run(kernels, inputs, S0, dout, dS, chunk):
    """out, the final state and the gradients on one kernel set"""
    with dispatched(delta_rule=kernels) as chosen:
        assert chosen["delta_rule"] == kernels
        out, state = attnx.delta_rule_attention(*inputs, qk_l2norm=True, chunk=chunk,
                                                initial_state=S0, return_state=True)
        grads = attnx.delta_rule_attention_backward(dout, *inputs, qk_l2norm=True, chunk=chunk,
                                                    initial_state=S0, grad_state=dS)
    return [out, state.S] + [x for x in grads if x is not None]


def close(a, b, tol):
    scale = max(np.abs(b).max(), 1e-300)
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * scale)


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 2e-5)])
@pytest.mark.parametrize("dk,dv", [(32, 32), (16, 24)])
@pytest.mark.parametrize("chunk", [16, 32, 64])
@pytest.mark.parametrize("gate", [None, "scalar", "channel"])
def test_kernel_sets_equal_the_plain_path(delta_rule_kernels, dtype, tol, dk, dv, chunk, gate):
    # states of whole vectors of every width (32 x 32) take the kernels'
    # products and blocked solve; d_v = 24 is whole vectors of float64 on
    # AVX-512 and AVX2 but not of float32 there (BLAS then); chunks of whole
    # vectors (16, 32) take Kn^T's products for M and P, and the last chunk
    # of 45 tokens (13 rows) or a single chunk of 45 does not. Forward and
    # every gradient equal plain C + BLAS to rounding, the forward the
    # float64 reference too.
    rng = np.random.default_rng(dk + dv + chunk)
    n = 45
    q, k, v, beta, g = make(rng, 2, n, dk, dv, gate)
    S0 = rng.standard_normal((2, dk, dv)) * 0.1
    dout, dS = rng.standard_normal((2, n, dv)), rng.standard_normal((2, dk, dv))
    cast = (lambda x: None if x is None else x.astype(dtype))
    inputs = [cast(x) for x in (q, k, v, beta, g)]
    got = run(delta_rule_kernels, inputs, cast(S0), cast(dout), cast(dS), chunk)
    plain = run("plain", inputs, cast(S0), cast(dout), cast(dS), chunk)
    assert len(got) == len(plain) == (8 if gate else 7)
    for ours, theirs in zip(got, plain):
        assert ours.dtype == dtype
        close(ours, theirs, tol)
    ref_out, ref_S = reference(q, k, v, beta, g, qk_l2norm=True, initial_state=S0)
    close(got[0], ref_out, tol)
    close(got[1], ref_S, tol)
