"""The type stubs (attnx/__init__.pyi, attnx/_C.pyi) and py.typed: they ship
with the package, agree with the module (mypy.stubtest), and give a type
checker the right result types. Run against whichever attnx this process
imports (the checkout or an installed wheel)."""
import os
import re
import subprocess
import sys
import sysconfig
import textwrap

import pytest

import attnx

pytest.importorskip("mypy", reason="mypy is not installed (pip install 'attnx[test]')")

TESTS = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(os.path.abspath(attnx.__file__))
CONFIG = os.path.join(TESTS, "stubtest_mypy.ini")


def _installed():
    """True when the imported attnx is an installed copy (in site-packages)."""
    root = os.path.realpath(os.path.dirname(PACKAGE))
    paths = sysconfig.get_paths()
    return root in {os.path.realpath(paths["purelib"]), os.path.realpath(paths["platlib"])}


def _run(args, tmp_path):
    """Run a mypy tool in tmp_path (also its cache) on the attnx this process
    imports: an installed copy is found as any installed package; a checkout
    through PYTHONPATH (the runtime import) and MYPYPATH (the stubs). Never
    from site-packages itself, whose modules would shadow the libraries."""
    env = dict(os.environ, MYPY_CACHE_DIR=str(tmp_path / "mypy_cache"))
    if not _installed():
        root = os.path.dirname(PACKAGE)
        env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
        env["MYPYPATH"] = root
    return subprocess.run([sys.executable, "-m"] + args, capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=600)


def test_stubs_and_marker_ship_with_the_package():
    for name in ("py.typed", "__init__.pyi", "_C.pyi"):
        assert os.path.isfile(os.path.join(PACKAGE, name)), name


def test_stubtest(tmp_path):
    """Every public name is in the stubs with the runtime's signature."""
    result = _run(["mypy.stubtest", "attnx", "--concise", "--mypy-config-file", CONFIG,
                   "--allowlist", os.path.join(TESTS, "stubtest_allowlist.txt"),
                   "--ignore-unused-allowlist"], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_stub_types_seen_by_mypy(tmp_path):
    """The overloads give a checker the result types of each option, and
    wrong option values are type errors (the lines marked 'error')."""
    snippet = tmp_path / "use_attnx.py"
    snippet.write_text(textwrap.dedent("""\
        import numpy as np
        from numpy.typing import NDArray
        import attnx

        q = np.zeros((2, 4, 8), np.float32)
        out: NDArray[np.float32] = attnx.softmax_attention(q, q, q, causal=True)
        o, lse = attnx.softmax_attention(q, q, q, return_lse=True)
        o2, state = attnx.linear_attention(q, q, q, causal=True, return_state=True)
        step_out: np.ndarray = state.step(q[:, -1:], q[:, -1:], q[:, -1:])
        offset: int = state.offset
        o3, state = attnx.performer_attention(q, q, q, num_features=16, seed=0, causal=True,
                                              return_state=True)
        weights = attnx.attention_weights(q, q, variant="cosformer", causal=True)
        threads: int = attnx.get_num_threads()
        g = attnx.Gradients(q=q)
        g = attnx.softmax_attention_backward(q, q, q, q, o, lse, causal=True, dropout_p=0.1,
                                             seed=3)
        grad_q: np.ndarray | None = g.q
        attnx.softmax_attention(q, q, q, causal="sideways")  # error
        attnx.linear_attention(q, q, q, method="fast")  # error
        bad: int = attnx.softmax_attention(q, q, q)  # error
        attnx.random_features(16, 8, seed=0).sum()
    """))
    result = _run(["mypy", "--config-file", CONFIG, "--no-error-summary", str(snippet)], tmp_path)
    lines = snippet.read_text().splitlines()
    expected = {i + 1 for i, line in enumerate(lines) if line.endswith("# error")}
    reported, elsewhere = set(), []
    for line in result.stdout.splitlines():
        if ": error:" in line:
            match = re.match(r"use_attnx\.py:(\d+): error:", line)
            if match:
                reported.add(int(match.group(1)))
            else:
                elsewhere.append(line)
    assert reported == expected and not elsewhere, result.stdout + result.stderr
