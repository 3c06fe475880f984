"""What users import from dist-launch stays importable, wherever its code lives inside."""

from __future__ import annotations

import importlib
import importlib.util
import tomllib
from pathlib import Path

import pytest

import dist_launch

PUBLIC = [
    "ExitCode",
    "LaunchError",
    "__version__",
    "init_and_run",
    "launch_subprocesses",
    "report_progress",
]


def test_all_is_kept() -> None:
    assert sorted(dist_launch.__all__) == sorted(PUBLIC)
    assert set(PUBLIC) <= set(dir(dist_launch))
    for name in PUBLIC:
        assert getattr(dist_launch, name) is not None, name


def test_public_names_are_what_the_docs_say() -> None:
    assert issubclass(dist_launch.LaunchError, RuntimeError)
    assert dist_launch.ExitCode.PREEMPTED == 143 and dist_launch.ExitCode.HUNG == 75
    assert isinstance(dist_launch.__version__, str)
    for name in ("init_and_run", "launch_subprocesses", "report_progress"):
        assert callable(getattr(dist_launch, name)), name


def test_an_unknown_name_says_which() -> None:
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        _ = dist_launch.no_such_name  # type: ignore[attr-defined]


def test_the_command_line_entry_points_are_kept() -> None:
    # pyproject's console script, `python -m dist_launch`, and docs/cli.rst's parser.
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    script = tomllib.loads(pyproject.read_text())["project"]["scripts"]["dist-launch"]
    assert script == "dist_launch.cli:run"  # main(), then a prompt exit
    cli = importlib.import_module("dist_launch.cli")
    assert callable(cli.main) and callable(cli.run)
    assert cli.build_parser().prog == "dist-launch"
    assert importlib.util.find_spec("dist_launch.__main__") is not None


@pytest.mark.parametrize(
    ("alias", "home"),
    [
        ("dist_launch.guards", "dist_core.worker_guards"),
        ("dist_launch.records", "dist_core.rank_files"),
        ("dist_launch.supervisor", "dist_core.supervisor"),
    ],
)
def test_the_deprecated_aliases_still_name_dist_core_objects(alias: str, home: str) -> None:
    # CHANGELOG 0.2.0 promised these modules to code written against dist-launch 0.1.
    module = importlib.import_module(alias)
    original = importlib.import_module(home)
    assert module.__all__
    for name in module.__all__:
        assert getattr(module, name) is getattr(original, name), f"{alias}.{name}"
