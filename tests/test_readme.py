"""The Python code of the README and of docs/ is run, so what they show stays
true, the way a reader would run it: each ```python block on its own,
saved as a script (nothing prepended, no earlier block's names) and run by
a fresh interpreter in an empty folder (a block may start processes, as the
dask example's local cluster does, or change process-wide settings such as
the thread count). Blocks of parts not built yet are written as ```text
and not run."""
import ast
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
    if name.endswith(".md"))
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def _blocks():
    """(page, line, code) of every python block, the line being where its
    code starts in the page."""
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start(1)) + 1
            yield pytest.param(page, line, match.group(1), id=f"{page}:{line}")


BLOCKS = list(_blocks())


def test_the_readme_and_docs_have_python_blocks():
    pages = {param.values[0] for param in BLOCKS}
    assert {"README.md", os.path.join("docs", "dask.md")} <= pages


# the optional packages a block may use; the test extra installs them all
# (.ci/run), the wheel tests of cibuildwheel only some (pyproject.toml)
OPTIONAL = {"torch", "transformers", "dask", "matplotlib"}


def _missing_packages(code):
    imported = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    for module, package in [("attnx.plot", "matplotlib"), ("attnx.torch", "torch"),
                            ("attnx.dask", "dask")]:
        if module in code:
            imported.add(package)
    return sorted(name for name in imported & OPTIONAL if importlib.util.find_spec(name) is None)


@pytest.mark.parametrize("page, line, code", BLOCKS)
def test_python_block_runs_alone_as_a_script(page, line, code, tmp_path):
    missing = _missing_packages(code)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}, which the test extra installs")
    script = tmp_path / f"{os.path.basename(page)[:-3]}_line{line}.py"
    script.write_text(code, encoding="utf-8")
    # PYTHONPATH and the like from the test run would let a block lean on
    # something a reader does not have; the block gets the interpreter alone
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(("PYTHON", "PYTEST"))}
    env["MPLBACKEND"] = "Agg"
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (
        f"{page}, the block at line {line}, saved as {script.name} and run alone, "
        f"exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}")


def test_no_file_cites_documents_users_do_not_have():
    """Users have this repository, not the project's internal notes: the
    code and docs point at docs/ instead."""
    citing = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [s for s in subfolders if not s.startswith(".") and s not in ("build", "_build")]
        for name in files:
            if not name.endswith((".py", ".pyi", ".md", ".c", ".h", ".toml", ".sh", ".yml")):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8", errors="replace") as f:
                for number, line in enumerate(f, 1):
                    if "design" + ".md" in line or "shared" + " folder" in line:
                        citing.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not citing, "\n".join(citing)
