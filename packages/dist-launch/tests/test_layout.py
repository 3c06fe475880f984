"""dist-launch's subpackages import one another in one direction only (read, not imported)."""

from __future__ import annotations

import ast
import graphlib
import importlib.util
import re
import sys
from pathlib import Path

import dist_launch

PACKAGE = Path(dist_launch.__file__).resolve().parent

# Each subpackage and the subpackages it may import: a layer looks only down.
ALLOWED: dict[str, set[str]] = {
    # Runs inside the workers: the standard library and dist-core only, so they start light.
    "in_worker": set(),
    "output": set(),
    "diagnostics": set(),
    "plan": {"output"},
    "rendezvous": {"plan", "diagnostics"},
    "watch": {"plan", "rendezvous", "diagnostics", "in_worker"},
    # The launcher's side of the workers names in_worker's modules and variables.
    "workers": {"plan", "rendezvous", "output", "in_worker"},
    "agent": {"plan", "rendezvous", "watch", "workers", "diagnostics", "output", "in_worker"},
    "cli": {"agent", "plan", "workers", "output"},
    "library": {"diagnostics", "output"},
}
# Modules of the package itself: its names, its exception, its exit codes, and
# deprecated aliases.
TOP_LEVEL = {"__init__", "__main__", "errors", "exit_codes", "guards", "records", "supervisor"}
# Any subpackage may raise the package's exception and name its exit codes.
SHARED = {"errors", "exit_codes"}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _subpackage(path: Path) -> str | None:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else None


def _imported(tree: ast.Module, *, top_level_only: bool = False) -> list[tuple[int, str]]:
    """(line, dotted name) of every import, ``from X import y`` giving ``X.y``."""
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: list[tuple[int, str]] = []
    for node in nodes:
        if isinstance(node, ast.If) and top_level_only:  # if TYPE_CHECKING: ...
            found += _imported(ast.Module(body=node.body, type_ignores=[]), top_level_only=True)
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def test_the_package_has_no_flat_modules_but_its_own() -> None:
    flat = {path.stem for path in PACKAGE.glob("*.py")}
    assert flat == TOP_LEVEL
    subpackages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert subpackages == set(ALLOWED), "a new subpackage needs its place in ALLOWED"


def test_the_allowed_imports_form_layers() -> None:
    graphlib.TopologicalSorter(ALLOWED).prepare()  # raises CycleError on a cycle


def test_subpackages_import_downward() -> None:
    wrong: list[str] = []
    for path in _modules():
        home = _subpackage(path)
        if home is None:
            continue
        for line, name in _imported(ast.parse(path.read_text(), str(path))):
            parts = name.split(".")
            if parts[0] != "dist_launch" or len(parts) < 2:
                continue
            target = parts[1]
            if target in (home, *SHARED) or target in ALLOWED[home]:
                continue
            wrong.append(f"{path.relative_to(PACKAGE)}:{line} imports {name}")
    assert not wrong, "\n".join(wrong)


def test_in_worker_imports_only_the_standard_library_and_dist_core() -> None:
    # At module level: what a worker pays for before the script starts. torch may be
    # imported inside a function that runs after the script imported it.
    heavy: list[str] = []
    for path in sorted((PACKAGE / "in_worker").glob("*.py")):
        for line, name in _imported(ast.parse(path.read_text()), top_level_only=True):
            root = name.split(".")[0]
            inside = name.startswith("dist_launch.in_worker.") or root == "dist_core"
            if not (inside or root in sys.stdlib_module_names or root == "__future__"):
                heavy.append(f"in_worker/{path.name}:{line} imports {name}")
    assert not heavy, "\n".join(heavy)


_MODULE_PATH = re.compile(r"dist_launch(\.[A-Za-z_]\w*)+")


def test_module_paths_in_strings_exist() -> None:
    # argv's `-m dist_launch....`, the fork server's preload list, __init__'s lazy names.
    seen: set[str] = set()
    missing: list[str] = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            value = node.value if isinstance(node, ast.Constant) else None
            if not (isinstance(value, str) and _MODULE_PATH.fullmatch(value)):
                continue
            seen.add(value)
            if importlib.util.find_spec(value) is None:
                missing.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {value}")
    assert not missing, "\n".join(missing)
    assert {"dist_launch.in_worker.bootstrap", "dist_launch.in_worker.fork_server"} <= seen
