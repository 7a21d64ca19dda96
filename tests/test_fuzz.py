"""Random, mostly wrong calls of every public function (tests/fuzz_calls.py)
in child processes: forwards, backwards, state.step, and (seed 3) the
operators of attnx.torch with autograd's backward. Each must return or
raise ValueError, TypeError or MemoryError (or the exception a callable
feature map raised; RuntimeError from torch), never crash, hang or raise
anything else. ATTNX_FUZZ_CALLS sets the calls per seed
(default 500); a failure names the seed and the call."""
import os
import subprocess
import sys

import numpy as np
import pytest

import attnx

CALLS = int(os.environ.get("ATTNX_FUZZ_CALLS", 500))
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_calls.py")


@pytest.mark.parametrize("seed", range(4))
def test_random_calls_never_crash(seed):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(attnx.__file__)))
    try:
        run = subprocess.run([sys.executable, SCRIPT, str(seed), str(CALLS)], env=env,
                             capture_output=True, text=True, timeout=60 + CALLS)
    except subprocess.TimeoutExpired as hang:
        lines = (hang.stdout or b"").decode(errors="replace").splitlines()
        pytest.fail(f"seed {seed} hung; last call: {lines[-1] if lines else '?'}")
    lines = run.stdout.splitlines()
    unexpected = [f"{lines[i - 1]}\n  -> {line}" for i, line in enumerate(lines)
                  if line.startswith("UNEXPECTED")]
    assert run.returncode == 0 and lines and lines[-1] == "done", (
        f"seed {seed}: exit status {run.returncode}; last call: "
        f"{lines[-1] if lines else '?'}\n{run.stderr[-2000:]}")
    assert not unexpected, "\n".join(unexpected)


# Crashes of the Python front ends the extended fuzz run found (each an
# exception other than the documented ones), kept as regression tests.

def test_backward_refuses_a_pair_as_initial_state():
    q = np.ones((3, 4))
    with pytest.raises(TypeError, match="initial_state must be the LinearAttentionState"):
        attnx.linear_attention_backward(q, q, q, q, causal=True,
                                        initial_state=(np.ones((4, 4)), np.ones(4)))


@pytest.mark.parametrize("k", [[1.0, 2.0], 3.0])
def test_backward_names_a_key_of_too_few_axes(k):
    q = np.ones((3, 4))
    for backward in (attnx.linear_attention_backward, attnx.cosformer_attention_backward,
                     attnx.efficient_attention_backward):
        with pytest.raises(ValueError, match=r"k has shape .*expected \(\.\.\., m, d\)"):
            backward(q, q, k, q)


def test_torch_performer_checks_q_before_reading_its_width():
    torch = pytest.importorskip("torch")
    import attnx.torch as attnx_torch
    x = torch.ones(3, 4)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        attnx_torch.performer_attention("q", x, x, seed=0)
