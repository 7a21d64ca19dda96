"""What a user is told when an install does not fit: the unbuilt attnx/
folder of a checkout imported ahead of an installed copy (docs/install.md,
"Editable or not"), and an optional module whose package is missing. Each
case runs in a fresh interpreter."""
import os
import shutil
import subprocess
import sys

import pytest

import attnx

PACKAGE = os.path.dirname(os.path.abspath(attnx.__file__))


def _python(code, cwd, extra_path=None):
    env = {name: value for name, value in os.environ.items() if not name.startswith("PYTHON")}
    if extra_path:
        env["PYTHONPATH"] = extra_path
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def _unbuilt_checkout(folder):
    """A checkout as `pip install .` leaves it: attnx/ with its Python
    files and no built extension."""
    os.makedirs(folder / "attnx")
    for name in os.listdir(PACKAGE):
        if name.endswith((".py", ".pyi")):
            shutil.copy(os.path.join(PACKAGE, name), folder / "attnx" / name)
    return folder


def test_an_unbuilt_checkout_shadowing_an_install_is_explained(tmp_path):
    checkout = _unbuilt_checkout(tmp_path / "checkout")
    # the installed copy elsewhere on the path (found, never imported)
    installed = tmp_path / "site"
    os.makedirs(installed / "attnx")
    (installed / "attnx" / "__init__.py").write_text("")
    # an editable install's import hook would find attnx._C in its own
    # checkout for the fake one: removed, as a `pip install .` has none
    result = _python("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' "
                     "not in getattr(f, '__name__', type(f).__name__).lower()]; import attnx",
                     cwd=checkout, extra_path=str(installed))
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: attnx's C extension is not built in "), result.stderr
    assert str(checkout / "attnx") in last
    assert f"hides the installed attnx at {installed / 'attnx'}" in last
    assert "run Python from outside the checkout" in last
    assert "partially initialized" not in last


def test_the_checkout_itself_imports():
    """The detection never fires for a built package."""
    result = _python("import attnx; print(attnx.__file__)", cwd=os.path.dirname(PACKAGE))
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("module, package, extra, code", [
    ("attnx.dask", "dask", "dask", "import attnx.dask"),
    ("attnx.plot", "matplotlib", "plot",
     "import numpy as np, attnx.plot; attnx.plot.weights(np.eye(2), np.eye(2))"),
    ("attnx.plot", "matplotlib", "plot", "import attnx.plot; attnx.plot.mask(4, 4, causal=True)"),
])
def test_a_missing_optional_package_is_named_with_the_ways_to_install_it(
        module, package, extra, code, tmp_path):
    # None in sys.modules makes `import package` fail as if it were absent
    result = _python(f"import sys; sys.modules[{package!r}] = None; {code}", cwd=tmp_path)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: {module} needs {package}: pip install "), result.stderr
    assert f'pip install -e ".[{extra}]"' in last
    assert f'once attnx is released: pip install "attnx[{extra}]"' in last
