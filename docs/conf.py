"""Sphinx configuration: autodoc + napoleon, offline (no intersphinx inventories)."""

from importlib import metadata

project = "dist-*"
author = "the dist-* team"
copyright = "2026, the dist-* team"

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
myst_heading_anchors = 3
suppress_warnings = ["myst.xref_missing"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}
exclude_patterns = ["_build"]
html_theme = "alabaster"


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
