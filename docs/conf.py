"""Sphinx configuration: autodoc + napoleon, offline (no intersphinx inventories).

Local extensions live in ``_ext/``: ``public_api`` documents each package's ``__all__``
and fails the build when the reference misses an exported name; ``bench_figures``
draws the benchmarks page's figures from ``_data/bench/*.json`` with matplotlib.
The command-line reference is generated from the argument parsers (sphinx-argparse).
"""

import sys
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "dist-*"
author = "the dist-* team"
copyright = "2026, the dist-* team"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
    "sphinxarg.ext",
    "public_api",
    "bench_figures",
]
myst_heading_anchors = 3
suppress_warnings = ["myst.xref_missing"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
exclude_patterns = ["_build"]
# Every exported name of these must be documented exactly once (public_api checks).
public_api_modules = [
    "dist_core",
    "dist_launch",
    "dist_collectives",
    "dist_collectives.ft",
    "dist_workspace",
]
html_theme = "alabaster"
# Wider than alabaster's 940 px so code and tables use a 1280 px screen; narrower
# windows get the theme's one-column layout. Long code lines wrap (_static/dist.css).
html_theme_options = {"page_width": "1180px", "body_max_width": "none"}
html_static_path = ["_static"]
html_css_files = ["dist.css"]


def _versions() -> str:
    found = []
    for name in ("dist-core", "dist-launch", "dist-collectives", "dist-workspace"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


release = _versions()
version = release
