"""Sphinx configuration of attnx's documentation site.

The API reference is built from the docstrings (numpydoc format, rendered by
the numpydoc extension, which also validates them: see
numpydoc_validation_checks), the pages are the Markdown files of this folder
(myst-parser), and the theme is the pydata-sphinx-theme, the numpy
ecosystem's. Build: ``pip install -e ".[docs]"`` then
``python -m sphinx -b html -W --keep-going -n docs docs/_build/html``
(.ci/run does this; .readthedocs.yaml publishes the same build).
"""
import attnx

project = "attnx"
author = "the attnx developers"
copyright = "the attnx developers"
version = release = attnx.__version__

extensions = [
    "myst_parser",
    "numpydoc",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
]

root_doc = "index"
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]

# the Markdown pages link each other by file name ([softmax.md](softmax.md));
# myst resolves those to the pages, and -n reports any that do not exist
myst_heading_anchors = 3

autosummary_generate = True
# a class page shows the class's own docstring (its sections list what it
# has), not every method it inherits (torch.nn.Module's, tuple's)
templates_path = ["_templates"]
autodoc_default_options = {"members": False}
# the signatures come from the functions (the C ones carry theirs in the
# docstring's first line)
autodoc_typehints = "none"

# numpydoc: the build fails (-W) when a public name has no docstring, or its
# docstring misses a parameter, documents one that does not exist, or lacks
# Returns, See Also or Examples. numpydoc has no check for Raises and Notes:
# tests/test_docstrings.py checks every section, and runs the Examples
numpydoc_show_class_members = False
numpydoc_xref_param_type = False
numpydoc_validation_checks = {"PR01", "PR02", "RT01", "SA01", "EX01", "GL08"}

html_theme = "pydata_sphinx_theme"
html_title = f"attnx {release}"
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
}

# every cross-reference must resolve (the -n of the build command, kept here
# for builds without it, such as Read the Docs')
nitpicky = True
