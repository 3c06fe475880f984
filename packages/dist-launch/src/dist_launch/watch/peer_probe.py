"""Which peer hosts a node without a shared store cannot reach: asked of the network.

A static job has no job board (no heartbeats). At a hang, the launcher reads the
remote ends of its workers' TCP connections (``/proc/<pid>/fd`` sockets matched to
``/proc/<pid>/net/tcp``: the gloo peers, the master's store) and tries to connect to
each host: an answer, even a refusal, means it is reachable; silence until the
timeout means a cut cable or a dead host. The master's host is node 0; in a job of two
nodes the other host is node 1; beyond that a host's node is not known here and its
ranks are left unnamed.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path

from dist_launch.watch.partition import PeerNode, Unreachable

# How long a connection attempt waits for any answer.
PROBE_SECONDS = 1.0
_ESTABLISHED = "01"


def parse_tcp_table(text: str) -> dict[int, tuple[str, int]]:
    """``/proc/net/tcp``'s established IPv4 connections: socket inode -> remote (addr, port)."""
    found: dict[int, tuple[str, int]] = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != _ESTABLISHED:
            continue
        address_hex, port_hex = fields[2].split(":")
        packed = int(address_hex, 16).to_bytes(4, "little")
        found[int(fields[9])] = (socket.inet_ntoa(packed), int(port_hex, 16))
    return found


def socket_inodes(pid: int, proc: Path = Path("/proc")) -> set[int]:
    """The socket inodes process ``pid`` holds open (none when it is gone)."""
    inodes: set[int] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(proc / str(pid) / "fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(proc / str(pid) / "fd" / fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def worker_peers(pids: Iterable[int], proc: Path = Path("/proc")) -> dict[str, int]:
    """The remote hosts of the workers' TCP connections (not this host's): address -> a port."""
    peers: dict[str, int] = {}
    for pid in pids:
        try:
            table = parse_tcp_table((proc / str(pid) / "net" / "tcp").read_text())
        except OSError:
            continue
        for inode in socket_inodes(pid, proc):
            if inode in table:
                address, port = table[inode]
                if not address.startswith("127."):
                    peers.setdefault(address, port)
    return peers


def answers(address: str, port: int, seconds: float = PROBE_SECONDS) -> bool:
    """True when ``address`` answers a connection to ``port`` at all (a refusal too)."""
    try:
        with socket.create_connection((address, port), timeout=seconds):
            return True
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # a timeout, no route: nothing came back


def name_peer(
    address: str, master_addr: str, nodes: int, own: int, node_ranks: Mapping[int, tuple[int, ...]]
) -> PeerNode:
    """The node behind ``address``, as far as a static job can tell."""
    host = address
    with contextlib.suppress(OSError):
        host = socket.gethostbyaddr(address)[0]
    master = {master_addr}
    with contextlib.suppress(OSError):
        master.add(socket.gethostbyname(master_addr))
    node = -1
    if address in master:
        node = 0
    elif nodes == 2:
        node = 1 - own if own in (0, 1) else -1
    return PeerNode(node, host, address, node_ranks.get(node, ()))


def unreachable_peers(
    pids: Iterable[int],
    master_addr: str,
    master_port: int,
    nodes: int,
    own: int,
    node_ranks: Mapping[int, tuple[int, ...]],
    seen_from: str,
    since: float,
) -> list[Unreachable]:
    """The workers' peer hosts (and the master) that do not answer now.

    Args:
        pids: This node's workers.
        master_addr: The master's address (node 0).
        master_port: The master's port.
        nodes: The job's node count.
        own: This node's rank.
        node_ranks: Every node's global ranks, by node.
        seen_from: How the reports name this node.
        since: When the ranks last made progress (wall clock): the cut came after.
    """
    peers = worker_peers(pids)
    if own != 0:
        with contextlib.suppress(OSError):
            peers.setdefault(socket.gethostbyname(master_addr), master_port)
    lost = []
    for address, port in sorted(peers.items()):
        if not answers(address, port):
            peer = name_peer(address, master_addr, nodes, own, node_ranks)
            lost.append(Unreachable(peer, since, seen_from))
    return lost
