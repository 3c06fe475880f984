"""Writes a benchmark's measurements as JSON, for the figures of the docs' benchmarks page.

Every benchmark writes ``docs/_data/bench/<name>.json`` unless told otherwise
(``--json PATH``, or ``--json -`` to write nothing). The files are committed, so the
docs build draws its figures without running a benchmark; ``nox -s bench`` replaces
them. ``null`` stands for a value the run did not measure (torchft not installed, ...).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parents[2] / "docs" / "_data" / "bench"


def add_json_argument(parser: argparse.ArgumentParser, name: str) -> None:
    """Adds ``--json PATH`` (default ``docs/_data/bench/<name>.json``; ``-`` skips)."""
    parser.add_argument(
        "--json",
        default=str(DATA_DIR / f"{name}.json"),
        metavar="PATH",
        help="write the measurements here for the docs' figures ('-': do not write; "
        f"default: docs/_data/bench/{name}.json)",
    )


def describe_run() -> str:
    """When, how and where this run was made, in one line (shown under each figure)."""
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        torch_version = "not installed"
    command = " ".join(["python", os.path.relpath(sys.argv[0]), *sys.argv[1:]])
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    return (
        f"{today}, `{command}` on {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"torch {torch_version}"
    )


def write_results(target: str, benchmark: str, data: dict[str, Any]) -> None:
    """Writes ``data`` with the benchmark's name and :func:`describe_run` to ``target``."""
    if target == "-":
        return
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"benchmark": benchmark, "run": describe_run(), **data}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nmeasurements written to {path}")
