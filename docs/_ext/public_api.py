"""Documents what a package exports, and fails the build when the reference drifts from it.

``.. public-api:: dist_core`` documents every name of ``dist_core.__all__`` under its
public name (``dist_core.get_rank``, not ``dist_core.ranks.get_rank``), each with the
autodoc directive its kind needs; ``:names: get_rank get_world_size`` documents a part
of it, so that a page can group the names by topic. Names are looked up with
``getattr``, so packages that import lazily (a module ``__getattr__``) work too.

For every module in the ``public_api_modules`` setting, the build checks that the pages
document each exported name exactly once and nothing else: a name added to ``__all__``
without a place in the reference is a warning, which ``-W`` makes an error.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective, switch_source_input
from sphinx.util.nodes import nested_parse_with_titles

logger = logging.getLogger(__name__)

VERSION_DOC = "This distribution's version, read from its installed metadata."


def exported(module_name: str) -> list[str]:
    """The module's ``__all__``, in its order."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        raise ValueError(f"{module_name} has no __all__: name what it exports with :names:")
    return list(names)


def _lines_for(module_name: str, name: str) -> list[str]:
    """The reST that documents ``module_name.name`` under that public name."""
    module = importlib.import_module(module_name)
    target = f"{module_name}.{name}"
    value = getattr(module, name)
    # py:data takes the module as an option: a dotted name would be read as relative to
    # the page's current module (dist_core.dist_core.INFOALL).
    if name == "__version__":
        return [
            f".. py:data:: {name}",
            f"   :module: {module_name}",
            "   :type: str",
            "",
            f"   {VERSION_DOC}",
            "",
        ]
    if inspect.isclass(value):
        kind = "exception" if issubclass(value, BaseException) else "class"
        return [f".. auto{kind}:: {target}", ""]
    if inspect.isroutine(value):
        return [f".. autofunction:: {target}", ""]
    if type(value).__module__ == "builtins":
        # A plain int or str has its type's docstring, not its own: show the value only.
        return [f".. py:data:: {name}", f"   :module: {module_name}", f"   :value: {value!r}", ""]
    return [f".. autodata:: {target}", ""]


class PublicApi(SphinxDirective):
    """``.. public-api:: MODULE`` with an optional ``:names:`` subset of its ``__all__``."""

    required_arguments = 1
    option_spec = {"names": directives.unchanged_required}  # noqa: RUF012 (docutils' API)

    def run(self) -> list[nodes.Node]:
        module_name = self.arguments[0]
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise self.error(f"public-api: cannot import {module_name}: {error}") from error
        all_names = getattr(module, "__all__", None)
        if "names" in self.options:
            names = self.options["names"].split()
        elif all_names is not None:
            names = list(all_names)
        else:
            raise self.error(f"public-api: {module_name} has no __all__; list names with :names:")
        if all_names is not None:
            unknown = [name for name in names if name not in all_names]
            if unknown:
                raise self.error(
                    f"public-api: {module_name}.__all__ does not export {', '.join(unknown)}"
                )
        documented = _documented(self.env)
        for name in names:
            documented.setdefault(module_name, {}).setdefault(name, []).append(self.env.docname)
        lines = [line for name in names for line in _lines_for(module_name, name)]
        content = StringList(lines, source=f"<public-api {module_name}>")
        container = nodes.container()
        with switch_source_input(self.state, content):
            nested_parse_with_titles(self.state, content, container)
        return container.children


def _documented(env: BuildEnvironment) -> dict[str, dict[str, list[str]]]:
    """module -> exported name -> the pages documenting it (kept in the environment)."""
    if not hasattr(env, "public_api_documented"):
        env.public_api_documented = {}  # type: ignore[attr-defined]
    return env.public_api_documented  # type: ignore[attr-defined, no-any-return]


def _purge(app: Sphinx, env: BuildEnvironment, docname: str) -> None:
    for names in _documented(env).values():
        for pages in names.values():
            while docname in pages:
                pages.remove(docname)


def _merge(app: Sphinx, env: BuildEnvironment, docnames: set[str], other: BuildEnvironment) -> None:
    for module_name, names in _documented(other).items():
        for name, pages in names.items():
            _documented(env).setdefault(module_name, {}).setdefault(name, []).extend(pages)


def _check(app: Sphinx, env: BuildEnvironment) -> None:
    documented = _documented(env)
    for module_name in app.config.public_api_modules:
        pages = {name: p for name, p in documented.get(module_name, {}).items() if p}
        for name in exported(module_name):
            if name not in pages:
                logger.warning(
                    "%s exports %s but no API page documents it (add it to a "
                    "`public-api:: %s` directive)",
                    module_name,
                    name,
                    module_name,
                )
            elif len(pages[name]) > 1:
                logger.warning(
                    "%s.%s is documented more than once: %s",
                    module_name,
                    name,
                    ", ".join(pages[name]),
                )


def setup(app: Sphinx) -> dict[str, Any]:
    """Registers ``public-api`` and the ``public_api_modules`` coverage check."""
    app.setup_extension("sphinx.ext.autodoc")
    app.add_config_value("public_api_modules", [], "env", types=[list])
    app.add_directive("public-api", PublicApi)
    app.connect("env-purge-doc", _purge)
    app.connect("env-merge-info", _merge)
    app.connect("env-check-consistency", _check)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
