"""Every notebook in examples/ runs from top to bottom without an error
(their cells assert attnx's results against numpy formulas), and is kept
in git without outputs.

The kernel is this interpreter (sys.executable) through ipykernel, from a
kernel spec written for the test, so that the notebooks run in the
environment the tests run in, whatever kernels are installed elsewhere;
it imports the same attnx as the tests."""
import glob
import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs the test extra (nbformat)")
nbclient = pytest.importorskip("nbclient", reason="needs the test extra (nbclient)")
pytest.importorskip("ipykernel", reason="needs the test extra (ipykernel)")
pytest.importorskip("matplotlib", reason="needs the test extra (matplotlib)")

import attnx  # noqa: E402

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
NOTEBOOKS = sorted(glob.glob(os.path.join(EXAMPLES, "*.ipynb")))
CELL_TIMEOUT_S = 300


def test_there_are_notebooks():
    names = {os.path.basename(path) for path in NOTEBOOKS}
    assert {"tour.ipynb", "kernel_regression.ipynb", "long_sequences.ipynb",
            "training.ipynb"} <= names


@pytest.fixture(scope="module")
def kernel_spec_dir(tmp_path_factory):
    """A kernel spec that starts ipykernel on this interpreter."""
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("jupyter")
    install(kernel_name="attnx-tests", prefix=str(prefix))
    return os.path.join(str(prefix), "share", "jupyter", "kernels")


def kernel_environment():
    """This environment, with attnx's own directory first on the path."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(attnx.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("DISPLAY", None)              # headless, as on a test machine
    env.pop("MPLBACKEND", None)           # the kernel's inline backend
    return env


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, kernel_spec_dir):
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    notebook = nbformat.read(path, as_version=4)
    manager = KernelManager(kernel_name="attnx-tests",
                            kernel_spec_manager=KernelSpecManager(kernel_dirs=[kernel_spec_dir]))
    assert manager.kernel_spec.argv[0] == sys.executable
    client = nbclient.NotebookClient(notebook, km=manager, timeout=CELL_TIMEOUT_S,
                                     resources={"metadata": {"path": EXAMPLES}})
    client.execute(env=kernel_environment())      # raises CellExecutionError on any error
    ran = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert ran and all(cell.execution_count is not None for cell in ran)
    errors = [output for cell in ran for output in cell.outputs if output.output_type == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, \
                f"{os.path.basename(path)}: strip the outputs before committing"


def test_jupyter_execute_of_the_test_extra_runs_a_notebook(tmp_path):
    """The README's command for running a notebook from the command line
    (`jupyter execute`, nbclient's) is installed by the test extra and runs
    a notebook on this environment's kernel, failing on a cell error."""
    import subprocess

    jupyter = os.path.join(os.path.dirname(sys.executable), "jupyter")
    cells = ["import numpy as np, attnx",
             "q = np.eye(3); print(attnx.softmax_attention(q, q, q).shape)"]
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                       "language": "python"}
    good = tmp_path / "good.ipynb"
    nbformat.write(notebook, str(good))
    result = subprocess.run([jupyter, "execute", "--inplace", str(good)], capture_output=True,
                            text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    outputs = nbformat.read(str(good), as_version=4).cells[1].outputs
    assert outputs[0]["text"] == "(3, 3)\n"

    notebook.cells.append(nbformat.v4.new_code_cell("assert False, 'a failing cell'"))
    bad = tmp_path / "bad.ipynb"
    nbformat.write(notebook, str(bad))
    result = subprocess.run([jupyter, "execute", str(bad)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode != 0 and "a failing cell" in result.stderr
