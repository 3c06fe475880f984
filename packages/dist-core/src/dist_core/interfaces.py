"""The network interfaces of this host, and the ones gloo and NCCL would pick by default.

What a multi-node job that cannot connect needs to know first. The choices follow the
backends' documented defaults; they are a report, not a decision of ours:

- gloo: ``GLOO_SOCKET_IFNAME`` when set; else the address this host's name resolves
  to (a name that resolves to a loopback address makes a multi-node job fail).
- NCCL: ``NCCL_SOCKET_IFNAME`` when set; else ``ib*`` interfaces first, then any
  interface but loopback and ``docker*``.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass

_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface


@dataclass(frozen=True)
class Interface:
    """One network interface with an IPv4 address."""

    name: str
    address: str

    @property
    def is_loopback(self) -> bool:
        """Whether the address is in 127.0.0.0/8."""
        return ipaddress.ip_address(self.address).is_loopback


def ipv4_interfaces() -> list[Interface]:
    """Every interface of this host that has an IPv4 address, in the kernel's order."""
    found: list[Interface] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address (or not up)
                continue
            found.append(Interface(name, socket.inet_ntoa(reply[20:24])))
    return found


def gloo_choice(environ: Mapping[str, str], interfaces: list[Interface]) -> str:
    """What gloo would use, in words. Reads ``GLOO_SOCKET_IFNAME``."""
    named = environ.get("GLOO_SOCKET_IFNAME", "").strip()
    if named:
        return f"{named} (GLOO_SOCKET_IFNAME)"
    hostname = socket.gethostname()
    try:
        address = socket.gethostbyname(hostname)
    except OSError as error:
        return (
            f"none: the host name {hostname!r} does not resolve ({error}); set GLOO_SOCKET_IFNAME"
        )
    owner = next((i.name for i in interfaces if i.address == address), "no local interface")
    choice = f"{address} on {owner} (the host name {hostname!r} resolves to it)"
    if ipaddress.ip_address(address).is_loopback:
        choice += "; loopback: a multi-node job cannot connect, set GLOO_SOCKET_IFNAME"
    return choice


def nccl_choice(environ: Mapping[str, str], interfaces: list[Interface]) -> str:
    """What NCCL's socket transport would use, in words. Reads ``NCCL_SOCKET_IFNAME``."""
    named = environ.get("NCCL_SOCKET_IFNAME", "").strip()
    if named:
        return f"{named} (NCCL_SOCKET_IFNAME)"
    infiniband = [i.name for i in interfaces if i.name.startswith("ib")]
    if infiniband:
        return ", ".join(infiniband) + " (ib* first)"
    others = [i.name for i in interfaces if not i.is_loopback and not i.name.startswith("docker")]
    if others:
        return f"{others[0]} (the first interface that is not loopback or docker*)"
    return "lo (no other interface: single-node only)"
