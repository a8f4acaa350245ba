"""Sphinx configuration: the design, guides and results (Markdown, via MyST) and an API
reference generated from the docstrings. Built by ``make docs`` with warnings as errors."""

project = "torchrec-lookahead"
author = "torchrec-lookahead developers"
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the docstrings' "Args:" sections (Google style)
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
myst_heading_anchors = 3
# Links from the docs to source files of the repository (benchmarks/, tests/) are meant
# for readers of the repository on its host, not pages of this site.
suppress_warnings = ["myst.xref_missing"]
html_theme = "alabaster"
