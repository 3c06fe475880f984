r"""Free TCP ports that no two concurrent callers on one host receive twice.

A port is only "free" until somebody binds it, so checking it is not enough: two
launchers that check at the same moment both see it free. Each port handed out is
therefore also *reserved* by binding a Linux abstract Unix socket named after it
(``\\0dist-core-port-<port>``). The abstract namespace is shared by every process and
user of the host (per network namespace, exactly like TCP ports), a name can be bound
by one socket only, and the kernel drops the name when the process that holds it
exits, so a crashed caller never leaks a reservation. The caller's process holds the
reservation for :data:`RESERVATION_SECONDS` (long enough to pass the port to its
workers and bind it), or until :func:`release_port`.

On systems without abstract sockets a lock file per port under the temporary
directory takes its place (held open by the caller, released by the kernel on exit).

Ports other than the preferred one are drawn at random from *below* the kernel's
ephemeral range (``net.ipv4.ip_local_port_range``, 32768-60999 by default), as
:func:`dist_core.slurm.slurm_master_port` does: the kernel hands ports in that range to
every outgoing connection and every bind to port 0 (gloo's listeners, TCPStore
clients), so an ephemeral port free at this check can be taken by another job's
connection before the caller's store binds it. Below the range only an explicit bind
can take it.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import socket
import sys
import tempfile
import threading
import time
from typing import IO

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29500
RESERVATION_SECONDS = 120.0
_ATTEMPTS = 200
# Lowest port drawn: above the registered services most hosts run, and a range of
# 22,768 ports below the default ephemeral range.
LOWEST_DRAWN_PORT = 10000
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_DEFAULT_EPHEMERAL_LOW = 32768

# A variable, not an inline platform check, so that type checkers on Linux still check
# the fallback below.
_HAS_ABSTRACT_SOCKETS = sys.platform.startswith("linux")

_lock = threading.Lock()
# port -> (reservation handle, time reserved)
_reservations: dict[int, tuple[socket.socket | IO[bytes], float]] = {}


def port_is_free(port: int) -> bool:
    """True when a TCP listener could bind ``port`` on every IPv4 (and IPv6) address now.

    SO_REUSEADDR matches what torch's TCPStore does, so a port in TIME_WAIT counts as
    free, as it is for the store. An address family the host lacks is skipped. This
    checks only: it reserves nothing (see :func:`get_unused_port` for that).

    Args:
        port: The TCP port to check.

    Returns:
        False when some process listens on (or holds) the port in either family.
    """
    families = [socket.AF_INET]
    if socket.has_ipv6:
        families.append(socket.AF_INET6)
    for family in families:
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # this family is not configured on the host
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(("", port))
            except OSError as error:
                if error.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                    continue
                return False
    return True


def ephemeral_range_start(text: str | None) -> int:
    """The first port of the kernel's ephemeral range, from its sysctl file's text.

    Args:
        text: The content of ``/proc/sys/net/ipv4/ip_local_port_range`` ("32768 60999"),
            or None where the file could not be read (Linux's default is assumed).

    Returns:
        The range's first port.
    """
    if text is not None:
        fields = text.split()
        if len(fields) == 2 and all(field.isdigit() for field in fields):
            return int(fields[0])
    return _DEFAULT_EPHEMERAL_LOW


def _read_ephemeral_range_start() -> int:
    try:
        with open(_EPHEMERAL_RANGE_FILE, encoding="ascii") as file:
            return ephemeral_range_start(file.read())
    except OSError:
        return ephemeral_range_start(None)


def _kernel_port() -> int:
    """A port the kernel considers free right now (its ephemeral allocator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        port: int = probe.getsockname()[1]
        return port


def _candidate_port(ephemeral_start: int) -> int:
    """A port to try: random below the ephemeral range, or the kernel's where none is."""
    if ephemeral_start - LOWEST_DRAWN_PORT < 1000:
        # A host whose ephemeral range starts low leaves no room below it.
        return _kernel_port()
    return random.randrange(LOWEST_DRAWN_PORT, ephemeral_start)


def _reserve(port: int) -> socket.socket | IO[bytes] | None:
    """Takes the host-wide reservation of ``port``; None when somebody holds it."""
    if _HAS_ABSTRACT_SOCKETS:
        holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            holder.bind(f"\0dist-core-port-{port}")
        except OSError:
            holder.close()
            return None
        return holder
    import fcntl  # noqa: PLC0415 - POSIX fallback only

    path = os.path.join(tempfile.gettempdir(), f"dist-core-port-{port}.lock")
    handle = open(path, "ab")  # noqa: SIM115 - kept open as the reservation
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    return handle


def _expire_old_reservations(now: float) -> None:
    for port, (holder, reserved_at) in list(_reservations.items()):
        if now - reserved_at > RESERVATION_SECONDS:
            holder.close()
            del _reservations[port]


def release_port(port: int) -> None:
    """Drops this process's reservation of ``port`` (harmless if it holds none)."""
    with _lock:
        entry = _reservations.pop(port, None)
    if entry is not None:
        entry[0].close()


def get_unused_port(preferred: int = DEFAULT_PORT) -> int:
    """Returns a TCP port that the caller can bind right away.

    ``preferred`` is returned when it is free and not reserved; otherwise a random free
    port below the kernel's ephemeral range (see the module docstring), or from the
    kernel's allocator on a host whose range leaves no room below it. The port is
    reserved host-wide for this process (see the module docstring), so that no other
    caller of this function on the host, in this process or another, receives it during
    the reservation, even when both ask at the same moment. A process that does not use
    this function can still bind the port between this check and the caller's bind;
    callers that bind should handle ``EADDRINUSE`` (dist-launch picks another port and
    goes on). Reads ``/proc/sys/net/ipv4/ip_local_port_range`` (no environment
    variables).

    Args:
        preferred: The port to try first; 0 for none.

    Returns:
        The port number.

    Raises:
        OSError: No free port was found after many attempts.
    """
    with _lock:
        now = time.monotonic()
        _expire_old_reservations(now)
        candidates: list[int] = [preferred] if preferred > 0 else []
        ephemeral_start = _read_ephemeral_range_start()
        for attempt in range(_ATTEMPTS):
            port = candidates.pop() if candidates else _candidate_port(ephemeral_start)
            if port in _reservations or not port_is_free(port):
                continue
            holder = _reserve(port)
            if holder is None:
                continue
            # Re-check after reserving: another host process may have bound it meanwhile.
            if not port_is_free(port):
                holder.close()
                continue
            _reservations[port] = (holder, now)
            logger.debug("reserved port %d after %d attempt(s)", port, attempt + 1)
            return port
    raise OSError(errno.EADDRINUSE, f"no free TCP port found after {_ATTEMPTS} attempts")
