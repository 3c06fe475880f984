"""Fixtures for the integration tests.

Two hosts on one machine: network namespaces joined by a veth pair.

Needs root and iproute2. Outside CI a test that lacks them is skipped; in CI (where
``CI`` is set and the job runs as root) it fails instead, so the cross-host path is
always exercised there.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

SUBNET = "10.231.{}.{}"


@dataclasses.dataclass(frozen=True)
class Host:
    """One namespace: its name, veth interface and address."""

    namespace: str
    interface: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=30)


def require_netns() -> None:
    """Skips (or, in CI, fails) when namespaces cannot be made here."""
    problem = None
    if os.geteuid() != 0:
        problem = "needs root to create network namespaces"
    elif shutil.which("ip") is None:
        problem = "needs iproute2 (the ip command)"
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"two-host test cannot run in CI: {problem}")
    pytest.skip(problem)


@pytest.fixture
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Creates two namespaces joined by a veth pair; removes them afterwards."""
    require_netns()
    tag = uuid.uuid4().hex[:6]
    octet = int(tag[:2], 16) % 200 + 20
    hosts = (
        Host(f"dist-a-{tag}", f"va{tag}", SUBNET.format(octet, 1)),
        Host(f"dist-b-{tag}", f"vb{tag}", SUBNET.format(octet, 2)),
    )
    created: list[str] = []
    try:
        for host in hosts:
            _ip("netns", "add", host.namespace)
            created.append(host.namespace)
        _ip("link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface)
        for host in hosts:
            _ip("link", "set", host.interface, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for namespace in created:
            subprocess.run(
                ["ip", "netns", "del", namespace], check=False, capture_output=True, timeout=30
            )


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
    """Runs examples/train.py on 4 ranks under dist-launch, once per test session."""
    base = tmp_path_factory.mktemp("demo")
    export_dir, report_dir = base / "export", base / "report"
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
    return DemoRun(export_dir, report_dir, output)
