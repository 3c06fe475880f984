"""Fixtures for the integration tests.

Hosts on one machine: network namespaces, each with its own hostname, on one L2 segment
(a bridge inside a "switch" namespace, one veth per host), so that nothing in the root
namespace is touched. Every host resolves every host's name (``ip netns exec``
bind-mounts ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts``), as on a cluster.

Needs root and iproute2. Outside CI a test that lacks them is skipped; in CI (where
``CI`` is set and the job runs as root) it fails instead, so the cross-host path is
always exercised there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

SUBNET = "10.231.{}.{}"
NETNS_ETC = Path("/etc/netns")
NETNS_RUN = Path("/run/netns")  # where ip netns keeps its namespaces
MAX_HOSTS = 4

# Runs argv under a hostname of its own: ``ip netns exec`` gives a network namespace but
# keeps the machine's UTS namespace, and a launcher that names itself by
# ``socket.getfqdn()`` must not find its peers' name there.
_WITH_HOSTNAME = 'hostname "$0" && exec "$@"'


@dataclasses.dataclass(frozen=True)
class Host:
    """One namespace: its name, veth interface, address and hostname."""

    namespace: str
    interface: str
    address: str
    name: str = ""

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace (under its hostname, when it has one)."""
        if not self.name:
            return ["ip", "netns", "exec", self.namespace, *argv]
        return [
            "ip", "netns", "exec", self.namespace,
            "unshare", "--uts", "sh", "-c", _WITH_HOSTNAME, self.name, *argv,
        ]  # fmt: skip

    def processes(self) -> list[int]:
        """Every process running inside this host's namespace (none once it is removed)."""
        if not (NETNS_RUN / self.namespace).exists():
            return []
        listed = subprocess.run(
            ["ip", "netns", "pids", self.namespace],
            check=True, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        return [int(pid) for pid in listed.stdout.split()]

    def kill_everything(self, signum: int = signal.SIGKILL) -> None:
        """Signals every process of this host: SIGKILL, as if the machine had lost power;
        SIGTERM, as a scheduler stops (preempts) every process of a node's job step."""
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)


@dataclasses.dataclass(frozen=True)
class Network:
    """Hosts on one switch (a bridge in its own namespace)."""

    switch: str
    hosts: tuple[Host, ...]
    ports: tuple[str, ...]  # the switch-side end of each host's veth, by host index

    def cut(self, host: Host) -> None:
        """Pulls the host's cable: its switch port goes down, its packets go nowhere."""
        _ip("-n", self.switch, "link", "set", self.ports[self.hosts.index(host)], "down")

    def restore(self, host: Host) -> None:
        """Plugs the host's cable back in."""
        _ip("-n", self.switch, "link", "set", self.ports[self.hosts.index(host)], "up")


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=30)


def require_netns() -> None:
    """Skips (or, in CI, fails) when namespaces cannot be made here."""
    problem = None
    if os.geteuid() != 0:
        problem = "needs root to create network namespaces"
    elif shutil.which("ip") is None:
        problem = "needs iproute2 (the ip command)"
    elif shutil.which("unshare") is None:
        problem = "needs util-linux (the unshare command)"
    if problem is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"multi-host test cannot run in CI: {problem}")
    pytest.skip(problem)


@contextlib.contextmanager
def network(count: int) -> Iterator[Network]:
    """``count`` hosts on one switch; every namespace and hosts file removed afterwards."""
    if not 2 <= count <= MAX_HOSTS:
        raise ValueError(f"network({count}): between 2 and {MAX_HOSTS} hosts")
    require_netns()
    tag = uuid.uuid4().hex[:6]
    octet = int(tag[:2], 16) % 200 + 20
    switch = f"dist-sw-{tag}"
    hosts = tuple(
        Host(f"dist-h{i}-{tag}", f"v{i}{tag}", SUBNET.format(octet, i + 1), f"node{i}-{tag}")
        for i in range(count)
    )
    ports = tuple(f"p{i}{tag}" for i in range(count))
    hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in hosts)
    created: list[str] = []
    try:
        for namespace in (switch, *(h.namespace for h in hosts)):
            _ip("netns", "add", namespace)
            created.append(namespace)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for host, port in zip(hosts, ports, strict=True):
            # Made inside the host's namespace with its peer in the switch's: the root
            # namespace never sees either end.
            _ip("-n", host.namespace, "link", "add", host.interface, "type", "veth",
                "peer", "name", port, "netns", switch)  # fmt: skip
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            (NETNS_ETC / host.namespace).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / host.namespace / "hosts").write_text(hosts_file)
        yield Network(switch, hosts, ports)
    finally:
        for host in hosts:
            if host.namespace in created:
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    host.kill_everything()  # a namespace is freed with its last process
            shutil.rmtree(NETNS_ETC / host.namespace, ignore_errors=True)
        for namespace in created:
            subprocess.run(
                ["ip", "netns", "del", namespace], check=False, capture_output=True, timeout=30
            )


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
