"""Every public function and class of attnx, attnx.torch, attnx.dask,
attnx.plot and attnx.layouts has a complete docstring in the numpy
convention (the sections of SECTIONS; attnx.reference's functions those of
REFERENCE_SECTIONS: each states its formula in its summary, so it needs no
Notes, and most check no argument, so they need no Raises), and the code of its Examples section runs as a doctest: each docstring's examples in a fresh namespace,
so they import what they use, as a reader pasting them would. The API
reference of the documentation site (docs/api/) lists every public name.
"""
import doctest
import importlib
import importlib.util
import os
import re

import numpy as np
import pytest

import attnx
import attnx.layouts
import attnx.plot
import attnx.reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLOT_NAMES = ["weights", "compare", "mask", "kernel_regression", "visibility"]


# the optional modules and the package each needs: the test extra installs
# them all (.ci/run); the wheel tests of cibuildwheel have neither torch nor
# dask (pyproject.toml), and their names are skipped there
OPTIONAL = {"attnx.torch": "torch", "attnx.dask": "dask"}


def _public():
    """(qualified name, object or the missing package's name) of every
    public function and class."""
    modules = [(attnx, attnx.__all__), (attnx.plot, PLOT_NAMES),
               (attnx.layouts, attnx.layouts.__all__),
               (attnx.reference, attnx.reference.__all__)]
    for name, package in OPTIONAL.items():
        if importlib.util.find_spec(package) is None:
            yield name + ".*", package
        else:
            module = importlib.import_module(name)
            modules.append((module, module.__all__))
    for module, names in modules:
        for name in names:
            value = getattr(module, name)
            if not isinstance(value, type(attnx)):  # not a submodule
                yield f"{module.__name__}.{name}", value
    yield "attnx.LinearAttentionState.step", attnx.LinearAttentionState.step
    yield "attnx.DeltaRuleState.step", attnx.DeltaRuleState.step


def _skip_if_missing(obj):
    if isinstance(obj, str):
        pytest.skip(f"needs {obj}, which the test extra installs")


PUBLIC = list(_public())
SECTIONS = ["Parameters", "Returns", "Raises", "See Also", "Notes", "Examples"]
REFERENCE_SECTIONS = ["Parameters", "Returns", "See Also", "Examples"]
# what has no parameters
NO_PARAMETERS = {"attnx.get_num_threads", "attnx.show_config", "attnx.cpu_dispatch",
                 "attnx.torch.register_delta_rule", "attnx.torch.unregister_delta_rule"}


def _sections(doc):
    return re.findall(r"^ *([A-Z][A-Za-z ]+)\n *-{3,}$", doc, re.M)


@pytest.mark.parametrize("name, obj", PUBLIC, ids=[name for name, _ in PUBLIC])
def test_docstring_has_the_numpy_sections(name, obj):
    _skip_if_missing(obj)
    doc = obj.__doc__ or ""
    # a class documents its constructor's parameters and returns nothing
    sections = REFERENCE_SECTIONS if name.startswith("attnx.reference.") else SECTIONS
    wanted = [s for s in sections if not (s == "Parameters" and name in NO_PARAMETERS)
              and not (s == "Returns" and isinstance(obj, type))]
    found = _sections(doc)
    assert [s for s in found if s in wanted] == wanted, (
        f"{name}: sections {found}, expected {wanted} in that order")


@pytest.mark.parametrize("name, obj", PUBLIC, ids=[name for name, _ in PUBLIC])
def test_docstring_examples_run(name, obj):
    _skip_if_missing(obj)
    finder = doctest.DocTestFinder(recurse=False)
    tests = [t for t in finder.find(obj, name, globs={}) if t.examples]
    assert tests, f"{name} has no examples"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    before = attnx.get_num_threads()
    with np.printoptions(legacy=False):
        for test in tests:
            runner.run(test)
    attnx.set_num_threads(before)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"


def test_the_api_reference_lists_every_public_name():
    listed = set()
    for page in os.listdir(os.path.join(ROOT, "docs", "api")):
        if page.endswith(".rst"):
            with open(os.path.join(ROOT, "docs", "api", page), encoding="utf-8") as f:
                text = f.read()
            module = re.search(r"currentmodule:: (\S+)", text)
            if module:
                listed |= {f"{module.group(1)}.{entry}" for entry in
                           re.findall(r"^   ([A-Za-z_][\w.]*)$", text, re.M)}
    missing = [name for name, obj in PUBLIC if name not in listed and not isinstance(obj, str)]
    assert not missing, missing
