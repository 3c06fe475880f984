"""The ``bench-figure`` directive: a benchmark's figure, drawn while the docs build.

In a page, ``.. bench-figure:: launch`` (in MyST, a ``{bench-figure}`` fenced block)
with the caption as its content. The figure is drawn by :mod:`bench_plots` from
``_data/bench/launch.json`` as SVG into the HTML output's image folder; the JSON file
is a dependency of the page, so a new benchmark run redraws it.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from bench_plots import DATA_DIR, DRAWERS, draw
from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)


class bench_figure(nodes.General, nodes.Element):
    """A benchmark's figure; its children are the caption."""


class BenchFigure(SphinxDirective):
    """``.. bench-figure:: NAME``: the figure drawn from ``_data/bench/NAME.json``."""

    required_arguments = 1
    has_content = True
    option_spec = {"alt": directives.unchanged}  # noqa: RUF012 (docutils' interface)

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        if name not in DRAWERS:
            raise self.error(f"bench-figure: no drawing for {name!r}; known: {sorted(DRAWERS)}")
        source = Path(self.env.srcdir) / DATA_DIR / f"{name}.json"
        if not source.is_file():
            raise self.error(f"bench-figure: {source} is missing (run `nox -s bench -- {name}`)")
        self.env.note_dependency(str(source))
        self.env.note_dependency(__file__)
        self.env.note_dependency(str(Path(__file__).with_name("bench_plots.py")))
        node = bench_figure(
            name=name, source=str(source), alt=self.options.get("alt", f"{name} benchmark figure")
        )
        self.set_source_info(node)
        self.state.nested_parse(self.content, self.content_offset, node)
        return [node]


def _visit_html(translator: Any, node: bench_figure) -> None:
    builder = translator.builder
    filename = f"bench-{node['name']}.svg"
    try:
        draw(node["name"], Path(node["source"]), Path(builder.outdir, builder.imagedir, filename))
    except Exception as error:  # a bad JSON file fails the build (-W), saying which
        logger.warning(
            "bench-figure %s: %s: %s", node["name"], type(error).__name__, error, location=node
        )
        raise nodes.SkipNode from error
    uri = f"{builder.imgpath}/{filename}"
    alt = html.escape(node["alt"])
    translator.body.append(
        f'<figure class="bench-figure"><a href="{uri}"><img src="{uri}" alt="{alt}"></a>'
        "<figcaption>"
    )


def _depart_html(translator: Any, node: bench_figure) -> None:
    translator.body.append("</figcaption></figure>\n")


def _skip(translator: Any, node: bench_figure) -> None:
    raise nodes.SkipNode


def setup(app: Sphinx) -> dict[str, Any]:
    """Registers the ``bench-figure`` directive (HTML only; other builders skip it)."""
    skip = (_skip, None)
    app.add_node(
        bench_figure,
        html=(_visit_html, _depart_html),
        latex=skip,
        text=skip,
        man=skip,
        texinfo=skip,
    )
    app.add_directive("bench-figure", BenchFigure)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
