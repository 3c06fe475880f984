"""Hosts on one machine for a benchmark: network namespaces on one switch, each named.

The same layout as tests-integration/conftest.py's ``network`` (which is pytest's and
cannot be imported from here): a bridge in a "switch" namespace, one veth per host, a
hostname per host (``unshare --uts``) and a hosts file every host reads
(``ip netns exec`` bind-mounts ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

NETNS_ETC = Path("/etc/netns")


@dataclasses.dataclass(frozen=True)
class Host:
    """One namespace: its name, interface, address and hostname."""

    namespace: str
    interface: str
    address: str
    name: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace, under its hostname."""
        return [
            "ip", "netns", "exec", self.namespace, "unshare", "--uts",
            "sh", "-c", 'hostname "$0" && exec "$@"', self.name, *argv,
        ]  # fmt: skip

    def kill_everything(self) -> None:
        """SIGKILLs every process left in the namespace."""
        listed = subprocess.run(
            ["ip", "netns", "pids", self.namespace], capture_output=True, text=True, timeout=30
        )
        for pid in listed.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def why_not() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"needs {package} (the {tool} command)"
    return None


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def network(count: int) -> Iterator[tuple[Host, ...]]:
    """``count`` hosts on one switch, removed (with whatever still runs there) afterwards."""
    tag = uuid.uuid4().hex[:6]
    switch = f"bench-sw-{tag}"
    hosts = tuple(
        Host(f"bench-h{i}-{tag}", f"v{i}{tag}", f"10.232.7.{i + 1}", f"bench{i}-{tag}")
        for i in range(count)
    )
    hosts_file = "127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in hosts)
    created: list[str] = []
    try:
        for namespace in (switch, *(h.namespace for h in hosts)):
            _ip("netns", "add", namespace)
            created.append(namespace)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, host in enumerate(hosts):
            port = f"p{i}{tag}"
            _ip("-n", host.namespace, "link", "add", host.interface, "type", "veth",
                "peer", "name", port, "netns", switch)  # fmt: skip
            _ip("-n", switch, "link", "set", port, "master", "br0")
            _ip("-n", switch, "link", "set", port, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            (NETNS_ETC / host.namespace).mkdir(parents=True, exist_ok=True)
            (NETNS_ETC / host.namespace / "hosts").write_text(hosts_file)
        yield hosts
    finally:
        for host in hosts:
            if host.namespace in created:
                host.kill_everything()
            shutil.rmtree(NETNS_ETC / host.namespace, ignore_errors=True)
        for namespace in created:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
