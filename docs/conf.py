"""The docs site: Sphinx with MyST (the pages are Markdown), typer's own Markdown of the command line (its
reference) and autodoc (the Python API, from the docstrings). ``make docs`` builds it with warnings as errors,
so a broken link, cross-reference, include or docstring fails the build. Sphinx rather than MkDocs: MkDocs 1.x is
no longer maintained and Material for MkDocs reaches its end of life in 2027 (its build says both), while Sphinx,
MyST and autodoc are maintained, and Sphinx is what dp-accounting's docs build with.

The pages of the command line and of the registries (attacks, defences, models, protocols, specs, claims) are
written when the build starts (``gen_reference.write``), from the app and the registries the command line reads,
so they cannot drift from the code."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import gen_reference  # noqa: E402  (beside this file)

project = "splitleak"
author = "the splitleak developers"
extensions = ["myst_parser", "sphinx.ext.autodoc"]
source_suffix = {".md": "markdown"}
myst_enable_extensions = ["colon_fence", "attrs_block"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "reproduce/quick/report.json", "reproduce/quick/report.html"]
html_theme = "furo"
html_title = "splitleak"
html_static_path: list[str] = []
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": False}
suppress_warnings = ["myst.header"]

gen_reference.write(HERE)
