"""What attnx does to run on every machine: the OpenBLAS core it steers
clear of (attnx/__init__.py, _openblas_core) and the one it reports."""

import io
import platform
from contextlib import redirect_stdout

import numpy as np
import pytest

import attnx

try:
    from numpy._core import _multiarray_umath as numpy_core
except ImportError:  # numpy 1.x
    from numpy.core import _multiarray_umath as numpy_core


def test_blas_core_is_reported():
    """build_info and show_config name the kernels OpenBLAS chose."""
    core = attnx._C.build_info()["blas_core"]
    assert isinstance(core, str) and core
    out = io.StringIO()
    with redirect_stdout(out):
        attnx.show_config()
    assert f"{core} kernels" in out.getvalue()


@pytest.mark.parametrize("machine,features,hwcap2,want", [
    # x86-64 without SSSE3: OpenBLAS would take its Nehalem kernels (SIGILL)
    ("x86_64", {"SSSE3": False}, 0, "Prescott"),
    ("x86_64", {"SSSE3": True}, 0, None),
    # aarch64 advertising SME (HWCAP2 bit 23): OpenBLAS's SME core computed
    # NaN and wrong products under an emulated one (docs/building.md)
    ("aarch64", {"SVE": True}, 1 << 23, "ARMV8SVE"),
    ("aarch64", {"SVE": False}, 1 << 23, "ARMV8"),
    ("aarch64", {"SVE": True}, 1 << 22, None),
    ("aarch64", {"SVE": False}, 0, None),
])
def test_openblas_core_kept_off_known_bad_ones(monkeypatch, machine, features, hwcap2, want):
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(attnx, "_hwcap2", lambda: hwcap2)
    for name, value in features.items():
        monkeypatch.setitem(numpy_core.__cpu_features__, name, value)
    assert attnx._openblas_core() == want


def test_hwcap2_reads_this_process():
    """An int on any machine: the auxiliary vector's AT_HWCAP2 on Linux, 0
    where it cannot be read."""
    value = attnx._hwcap2()
    assert isinstance(value, int) and value >= 0


def test_the_loader_restores_the_environment(monkeypatch):
    """The variables set for OpenBLAS's load are put back as they were."""
    import os

    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.setattr(attnx, "_openblas_core", lambda: "Prescott")
    assert attnx._load_extension() is attnx._C
    assert os.environ["OPENBLAS_NUM_THREADS"] == "3"
    assert "OPENBLAS_CORETYPE" not in os.environ
    assert np.isfinite(attnx.softmax_attention(*[np.ones((4, 8), np.float32)] * 3)).all()
