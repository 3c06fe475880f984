"""Fixtures for the integration tests.

Hosts on one machine (:mod:`netns`): network namespaces, each with its own hostname, on
one L2 segment, so that nothing in the root namespace is touched; every host resolves
every host's name, as on a cluster.

Needs root and iproute2. Outside CI a test that lacks them is skipped; in CI (where
``CI`` is set and the job runs as root) it fails instead, so the cross-host path is
always exercised there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from netns import Host, Network, network

__all__ = ["Host", "Network", "network"]


@pytest.fixture
def hosts() -> Iterator[Callable[[int], Network]]:
    """A factory: ``hosts(3)`` gives a network of 3 hosts, torn down after the test."""
    with contextlib.ExitStack() as stack:
        yield lambda count: stack.enter_context(network(count))


@pytest.fixture
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Two hosts on one switch; removed afterwards."""
    with network(2) as net:
        first, second = net.hosts
        yield first, second


ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def console_script(name: str) -> str:
    """Path of a console script installed beside this interpreter (or on PATH)."""
    beside = Path(sys.executable).with_name(name)
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"console script {name} is not installed")
    return found


@dataclasses.dataclass(frozen=True)
class DemoRun:
    """The demo trainer's outputs: the export directory and per-rank reports."""

    export_dir: Path
    report_dir: Path
    output: str


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """Runs examples/train.py on 4 ranks under dist-launch, once per pytest run.

    pytest-xdist's workers share the run's base directory: the first worker that needs
    the demo runs it there, under a lock, and the others wait for it and read its
    outputs (it trains for a minute or two on a loaded machine: once is enough).
    """
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's base is a folder of the run's; alone, it is the run's.
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "demo"
    shared.mkdir(exist_ok=True)
    export_dir, report_dir = shared / "export", shared / "report"
    done = shared / "output.txt"
    with (shared / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # bounded by the demo's own 300 s timeout
        if not done.exists():
            completed = subprocess.run(
                [
                    console_script("dist-launch"),
                    "-n",
                    "4",
                    str(EXAMPLES / "train.py"),
                    "--steps",
                    "20",
                    "--export-dir",
                    str(export_dir),
                    "--report-dir",
                    str(report_dir),
                ],
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            output = completed.stdout + completed.stderr
            assert completed.returncode == 0, output
            done.write_text(output)
    return DemoRun(export_dir, report_dir, done.read_text())
