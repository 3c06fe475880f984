"""get_unused_port: bindable, and never the same port for two concurrent callers."""

from __future__ import annotations

import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import dist_core
from dist_core.ports import LOWEST_DRAWN_PORT, ephemeral_range_start, release_port

CALLERS = 50

_CHILD = """
import sys
from dist_core import get_unused_port
sys.stdin.readline()  # start together
print(get_unused_port(), flush=True)
sys.stdin.readline()  # hold the reservation until every caller has answered
"""


def test_port_is_bindable_right_away() -> None:
    port = dist_core.get_unused_port()
    with socket.socket() as server:
        # As torch's TCPStore binds: a port another test left in TIME_WAIT is free for
        # the store (port_is_free says so), but not for a bind without SO_REUSEADDR.
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
    release_port(port)


def test_preferred_port_is_used_when_free_and_skipped_when_taken() -> None:
    with socket.socket() as holder:
        holder.bind(("", 0))
        free = holder.getsockname()[1]
    assert dist_core.get_unused_port(free) == free
    # This process now holds the reservation: asking again gives another port.
    assert dist_core.get_unused_port(free) != free
    release_port(free)
    with socket.socket() as server:
        server.bind(("", 0))
        server.listen()
        taken = server.getsockname()[1]
        assert dist_core.get_unused_port(taken) != taken


@pytest.mark.processes
def test_fifty_concurrent_processes_get_fifty_distinct_ports() -> None:
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(CALLERS)
    ]
    try:
        for child in children:  # every child is started before any asks
            assert child.stdin is not None
            child.stdin.write("go\n")
            child.stdin.flush()
        ports = []
        for child in children:
            assert child.stdout is not None
            ports.append(int(child.stdout.readline()))
        assert len(set(ports)) == CALLERS, sorted(ports)
        # All asked for the same preferred port; exactly one received it.
        assert ports.count(29500) <= 1
    finally:
        for child in children:
            if child.stdin is not None:
                child.stdin.close()
            child.wait(timeout=60)


def test_fifty_concurrent_threads_get_fifty_distinct_ports() -> None:
    with ThreadPoolExecutor(max_workers=CALLERS) as pool:
        ports = list(pool.map(lambda _: dist_core.get_unused_port(), range(CALLERS)))
    assert len(set(ports)) == CALLERS
    for port in ports:
        release_port(port)


@pytest.mark.processes
def test_reservation_dies_with_its_process() -> None:
    completed = subprocess.run(
        [sys.executable, "-c", "from dist_core import get_unused_port; print(get_unused_port(0))"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    port = int(completed.stdout)
    assert dist_core.get_unused_port(port) == port
    release_port(port)


def test_port_is_free_sees_a_listener_on_ipv4_and_on_ipv6() -> None:
    port = dist_core.get_unused_port()
    assert dist_core.port_is_free(port)
    families = [(socket.AF_INET, "127.0.0.1")]
    if socket.has_ipv6:
        families.append((socket.AF_INET6, "::1"))
    for family, host in families:
        try:
            server = socket.socket(family, socket.SOCK_STREAM)
            server.bind((host, port))
        except OSError:
            continue  # the host lacks this family
        with server:
            server.listen()
            assert not dist_core.port_is_free(port), family
    release_port(port)


@pytest.mark.parametrize(
    ("text", "start"),
    [("32768\t60999\n", 32768), ("40000 50000", 40000), ("garbage", 32768), (None, 32768)],
)
def test_ephemeral_range_start_is_read_from_the_sysctl_text(text: str | None, start: int) -> None:
    assert ephemeral_range_start(text) == start


def test_ports_other_than_the_preferred_lie_below_the_ephemeral_range() -> None:
    # A port in the ephemeral range can be taken by any outgoing connection or bind to
    # port 0 (a gloo listener, a store client) before the caller's store binds it.
    with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as file:
        start = ephemeral_range_start(file.read())
    if start - LOWEST_DRAWN_PORT < 1000:
        pytest.skip(f"this host's ephemeral range starts at {start}: no room below it")
    ports = [dist_core.get_unused_port(0) for _ in range(CALLERS)]
    try:
        assert all(LOWEST_DRAWN_PORT <= port < start for port in ports), sorted(ports)
        assert len(set(ports)) == CALLERS
    finally:
        for port in ports:
            release_port(port)
