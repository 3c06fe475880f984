"""``dist_collectives.ft``'s subpackages import one another in one direction only.

The sources are read, not imported. The flat module names of before the grouping stay
importable, each as the very module object of its new home.
"""

from __future__ import annotations

import ast
import graphlib
import importlib
from pathlib import Path

import pytest

import dist_collectives.ft

PACKAGE = Path(dist_collectives.ft.__file__).resolve().parent

# Each subpackage and the ones it may import; every one may import ``ft.errors``.
LAYERS: dict[str, set[str]] = {
    "coordination": set(),
    "groups": {"coordination"},
    "replica": {"coordination", "groups"},
}
OWN_MODULES = {"__init__", "errors"}


def _aliases() -> list[str]:
    """The flat modules kept for the old import paths (everything but the package's own)."""
    return sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem not in OWN_MODULES)


def _imports(path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def test_every_subpackage_has_its_layer_and_the_layers_have_no_cycle() -> None:
    subpackages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert subpackages == set(LAYERS), "a new subpackage needs its place in LAYERS"
    graphlib.TopologicalSorter(LAYERS).prepare()


def test_subpackages_import_only_the_layers_below() -> None:
    wrong: list[str] = []
    for path in sorted(PACKAGE.glob("*/*.py")):
        home = path.parent.name
        for line, name in _imports(path):
            parts = name.split(".")
            if parts[:2] != ["dist_collectives", "ft"] or len(parts) < 3:
                continue
            target = parts[2]
            if target in OWN_MODULES or target == home or target in LAYERS[home]:
                continue
            wrong.append(f"{path.relative_to(PACKAGE)}:{line} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_no_module_of_the_package_imports_an_old_flat_path() -> None:
    aliases = set(_aliases())
    wrong = [
        f"{path.relative_to(PACKAGE)}:{line} imports {name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.parent != PACKAGE or path.stem in OWN_MODULES
        for line, name in _imports(path)
        if name.split(".")[:3][-1] in aliases and name.startswith("dist_collectives.ft.")
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", _aliases())
def test_an_old_import_path_is_the_module_of_its_new_home(name: str) -> None:
    old = importlib.import_module(f"dist_collectives.ft.{name}")
    homes = [layer for layer in LAYERS if (PACKAGE / layer / f"{name}.py").exists()]
    assert len(homes) == 1, f"ft/{name}.py has no single new home: {homes}"
    assert old is importlib.import_module(f"dist_collectives.ft.{homes[0]}.{name}")
