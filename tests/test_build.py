"""What the built extension carries: no run path of the machine that built
it (only the package's own folder, where the bundled libraries are), and
the BLAS licence beside a bundled BLAS."""
import os
import shutil
import subprocess
import sys

import pytest

import attnx

MODULE = attnx._C.__file__
PACKAGE = os.path.dirname(MODULE)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF run paths are Linux's")
@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) is not installed")
def test_run_paths_are_relative_to_the_package():
    dynamic = subprocess.run(["readelf", "-d", MODULE], capture_output=True, text=True,
                             check=True).stdout
    paths = []
    for line in dynamic.splitlines():
        if "(RPATH)" in line or "(RUNPATH)" in line:
            paths += line.split("[", 1)[1].rstrip("]").split(":")
    assert paths, dynamic  # the bundled OpenBLAS is found through one
    # $ORIGIN itself, or a folder beside it (a repaired wheel's attnx.libs)
    assert all(p == "$ORIGIN" or p.startswith("$ORIGIN/") for p in paths), paths


def test_bundled_blas_ships_its_licence():
    bundled = [f for f in os.listdir(PACKAGE) if f.startswith("libscipy_openblas")]
    if not bundled:  # ATTNX_BLAS=system: nothing bundled, nothing to license
        assert "system" in attnx._C.build_info()["blas"]
        return
    licences = os.listdir(os.path.join(PACKAGE, "licenses"))
    assert any(name.startswith("OpenBLAS") for name in licences), licences
