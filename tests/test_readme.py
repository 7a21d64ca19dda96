"""The Python code of the README and of docs/ is run, so what they show stays
true: each page's ```python blocks in order, as one script (a later block
may use an earlier block's names), in a fresh interpreter (a block may
change process-wide settings such as the thread count). Blocks of parts not
built yet are written as ```text and not run."""
import os
import re

import pytest

from helpers import run_isolated

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
    if name.endswith(".md"))
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def _pages():
    """(page, script of its python blocks), for each page that has some;
    each block starts with a comment naming its line in the page."""
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
        blocks = [f"# {page}, line {text.count(chr(10), 0, match.start()) + 1}\n{match.group(1)}"
                  for match in BLOCK.finditer(text)]
        if blocks:
            yield pytest.param("\n".join(blocks), id=page)


def test_the_readme_has_python_blocks():
    assert "README.md" in [param.id for param in _pages()]


@pytest.mark.parametrize("script", list(_pages()))
def test_python_blocks_run(script):
    run_isolated(script, timeout=300)


def test_no_file_cites_documents_users_do_not_have():
    """Users have this repository, not the project's internal notes: the
    code and docs point at docs/ instead."""
    citing = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [s for s in subfolders if not s.startswith(".") and s != "build"]
        for name in files:
            if not name.endswith((".py", ".pyi", ".md", ".c", ".h", ".toml", ".sh", ".yml")):
                continue
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8", errors="replace") as f:
                for number, line in enumerate(f, 1):
                    if "design" + ".md" in line or "shared" + " folder" in line:
                        citing.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    assert not citing, "\n".join(citing)
