"""Hosts on one machine: network namespaces on one switch, each with a name and address.

One L2 segment (a bridge inside a "switch" namespace, one veth per host), so that
nothing in the root namespace is touched. Every host resolves every host's name from
its hosts file, ``/etc/netns/<namespace>/hosts``, as on a cluster. Used by
tests-integration's fixtures, tests-cluster's multi-node SLURM cluster and the
benchmarks (which import this module by putting this folder on ``sys.path``: a conftest
cannot be imported by name).

Every namespace and hosts file :func:`network` made is removed on every way out,
including a SIGKILLed test process: a watcher process in a session of its own waits
for the test process's end (the end of a pipe) and removes what is left.

Namespaces are named ``<prefix>-h<i>-<tag>`` and ``<prefix>-sw-<tag>``, the prefix
``dist`` unless ``DIST_TEST_NETNS_PREFIX`` gives another (so that people sharing a
machine can tell theirs apart).

Needs root, iproute2 and util-linux (``unshare``, ``nsenter``). Outside CI a test that
lacks them is skipped; in CI (where ``CI`` is set and the job runs as root) it fails
instead, so the cross-host path is always exercised there.
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
from collections.abc import Iterator, Sequence
from pathlib import Path

SUBNET = "10.231.{}.{}"
NETNS_ETC = Path("/etc/netns")
NETNS_RUN = Path("/run/netns")  # where ip netns keeps its namespaces
MAX_HOSTS = 4
PREFIX_VARIABLE = "DIST_TEST_NETNS_PREFIX"

# Runs argv under a hostname of its own: ``ip netns exec`` gives a network namespace but
# keeps the machine's UTS namespace, and a launcher that names itself by
# ``socket.getfqdn()`` must not find its peers' name there.
_WITH_HOSTNAME = 'hostname "$0" && exec "$@"'
# The same without ``ip netns exec``, which remounts /sys (slurmd 22.05 then fails its
# cgroup check): a mount namespace of its own with the host's hosts file over
# /etc/hosts. $0 is the hosts file, $1 the hostname, the rest the command.
_AS_HOST = 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'

# The watcher: once its stdin ends (the test process is gone, however it ended), it
# kills what still runs in each namespace given and removes the namespace.
_WATCHER = """
import contextlib, os, shutil, subprocess, sys
sys.stdin.buffer.read()
for namespace in sys.argv[1:]:
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                          text=True, timeout=30, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(int(pid), 9)
    subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30,
                   check=False)
    shutil.rmtree(os.path.join("/etc/netns", namespace), ignore_errors=True)
"""


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

    def enter(self, argv: Sequence[str] = ()) -> list[str]:
        """``argv`` run as on this host, ``/sys`` untouched: its network namespace, its
        hostname and its hosts file over ``/etc/hosts`` (a mount namespace of its own).

        Every step execs the next, so the returned command's process is ``argv``'s.
        """
        return [
            "nsenter", f"--net={NETNS_RUN / self.namespace}",
            "unshare", "--mount", "--uts", "--propagation", "private",
            "sh", "-c", _AS_HOST, str(NETNS_ETC / self.namespace / "hosts"), self.name, *argv,
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


def why_not() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (the ip command)"
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return "needs util-linux (the unshare and nsenter commands)"
    return None


def require_netns() -> None:
    """Skips (or, in CI, fails) the calling test when namespaces cannot be made here.

    Reads ``CI``: set, a missing requirement fails the test instead of skipping it.
    """
    problem = why_not()
    if problem is None:
        return
    import pytest  # here alone: the benchmarks use this module without pytest

    if os.environ.get("CI"):
        pytest.fail(f"multi-host test cannot run in CI: {problem}")
    pytest.skip(problem)


def _watch(namespaces: Sequence[str]) -> subprocess.Popen[bytes]:
    """Starts the watcher that removes ``namespaces`` once this process is gone."""
    return subprocess.Popen(
        [sys.executable, "-c", _WATCHER, *namespaces],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # apart from a signal to the test's process group
    )


@contextlib.contextmanager
def network(count: int, names: Sequence[str] = ()) -> Iterator[Network]:
    """``count`` hosts on one switch; every namespace and hosts file removed afterwards.

    Reads ``DIST_TEST_NETNS_PREFIX``: the namespaces' prefix (``dist`` by default).

    Args:
        count: How many hosts (2 to :data:`MAX_HOSTS`).
        names: Their hostnames; by default ``node<i>-<tag>``, unique on this machine.
            Each host's hosts file names every host, whatever their names.
    """
    if not 2 <= count <= MAX_HOSTS:
        raise ValueError(f"network({count}): between 2 and {MAX_HOSTS} hosts")
    require_netns()
    tag = uuid.uuid4().hex[:6]
    names = tuple(names) or tuple(f"node{i}-{tag}" for i in range(count))
    if len(names) != count:
        raise ValueError(f"network({count}): {len(names)} names given")
    octet = int(tag[:2], 16) % 200 + 20
    prefix = os.environ.get(PREFIX_VARIABLE) or "dist"
    switch = f"{prefix}-sw-{tag}"
    hosts = tuple(
        Host(f"{prefix}-h{i}-{tag}", f"v{i}{tag}", SUBNET.format(octet, i + 1), names[i])
        for i in range(count)
    )
    ports = tuple(f"p{i}{tag}" for i in range(count))
    hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in hosts)
    namespaces = (switch, *(h.namespace for h in hosts))
    watcher = _watch(namespaces)
    created: list[str] = []
    try:
        for namespace in namespaces:
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
        # Nothing is left for the watcher: it ends at once.
        assert watcher.stdin is not None
        watcher.stdin.close()
        try:
            watcher.wait(30)
        except subprocess.TimeoutExpired:
            watcher.kill()
            watcher.wait(10)
