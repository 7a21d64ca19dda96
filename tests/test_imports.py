"""The import graph of the attnx package has no cycle.

The graph is read from the source with ``ast``, not by importing: a node
per module of attnx/ (a package is its ``__init__.py``), an edge A -> B for
every import statement of A that loads B, wherever it stands: at module
level, or inside a function (a lazy import still makes A depend on B; it
only moves the moment, so it counts). Relative imports and absolute
``attnx.`` ones are resolved alike:

* ``import attnx.x.y`` and ``from attnx.x import y`` where ``y`` is a
  module give the edge to ``attnx.x.y``; ``from attnx.x import name``
  where ``name`` is not a module gives the edge to ``attnx.x``.
* Python initialises a package before any module in it, so the packages
  above a module are no edges of that module. A package importing its
  children (``attnx/__init__.py`` re-exporting them) is an edge down.
* A child importing its package (``import attnx``, ``from attnx import
  softmax_attention``, ``from .. import name`` of a non-module) points up,
  at the package's ``__init__``. Within what ``attnx/__init__.py`` imports,
  that closes a cycle, and such modules import the submodule that defines
  the name instead. The front ends built on attnx's public numpy API
  (attnx.torch, attnx.dask, attnx.plot, ``python -m attnx``) may import
  ``attnx`` itself: nothing it imports reaches them.

Every import must point down by this rule: the graph is acyclic.
"""
import ast
import importlib.machinery
import os

import attnx

PACKAGE = os.path.dirname(os.path.abspath(attnx.__file__))


def _modules():
    """{module name: path} of every module of the package: its .py files
    and its compiled extension (attnx._C), which imports nothing of attnx."""
    found = {}
    root = os.path.dirname(PACKAGE)
    suffixes = [".py"] + importlib.machinery.EXTENSION_SUFFIXES
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            suffix = next((s for s in suffixes if file.endswith(s)), None)
            if suffix:
                path = os.path.join(folder, file)
                parts = os.path.relpath(path, root)[:-len(suffix)].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = path
    return found


def _resolve(module, is_package, level, name):
    """The absolute name of `name` imported `level` dots up from `module`."""
    if level == 0:
        return name
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph():
    """{module: set of the attnx modules it imports}."""
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        if not path.endswith(".py"):
            graph[module] = set()
            continue
        is_package = path.endswith("__init__.py")
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node.level, node.module)
                # a name that is a module is loaded as that module; any
                # other name is read from the base module
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            edges |= {target for target in targets if target in modules and target != module}
        graph[module] = edges
    return graph


def find_cycle(graph):
    """A cycle [a, b, ..., a] of `graph`, or None."""
    state = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target, path)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [])
            if cycle:
                return cycle
    return None


def test_the_attnx_import_graph_has_no_cycle():
    graph = import_graph()
    assert {"attnx", "attnx._C", "attnx.torch", "attnx.torch._common"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_reference_imports_nothing_of_attnx():
    """attnx/reference.py is numpy alone, an independent check of the C code."""
    assert import_graph()["attnx.reference"] == set()


def test_the_checker_finds_a_cycle():
    """The test above can fail: a cycle through a package's __init__ is seen."""
    assert find_cycle({"a": {"a.b"}, "a.b": {"a.c"}, "a.c": {"a"}}) == ["a", "a.b", "a.c", "a"]
    assert find_cycle({"a": {"a.b"}, "a.b": {"a.c"}, "a.c": set()}) is None
    assert _resolve("attnx.torch._softmax", False, 2, "_checks") == "attnx._checks"
    assert _resolve("attnx.torch", True, 1, "_common") == "attnx.torch._common"
    assert _resolve("attnx._linear", False, 1, None) == "attnx"
