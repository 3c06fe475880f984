"""One JSON request to one etcd member, with a short bound on reaching the member.

A member that is out of reach because its network is cut (a pulled cable, a switch
port down) answers nothing, not even a refusal: a connection to it waits for the whole
timeout. The rendezvous tries members in turn, so one silent member in front of the
others would hold every call for that long, longer than a node's lease lives, and the
healthy nodes of the majority would take themselves for the cut-off side. A TCP
handshake is answered by the member's kernel, on a loaded host too, so it gets
:data:`CONNECT_SECONDS`; the request itself keeps the caller's timeout (a write waits
for etcd's quorum).
"""

from __future__ import annotations

import http.client
import socket
import ssl
import time
from collections.abc import Callable

# Seconds a member may take to accept a connection before the next member is tried.
CONNECT_SECONDS = 1.0
# Seconds one etcd request may take on one member before the next member is tried.
REQUEST_SECONDS = 5.0
# How long a healthy majority's etcd may leave a call without an answer: when etcd's
# leader is cut off, a request that a member forwarded to it waits out its timeout while
# the others elect a new one, and the lost member costs its connect bound. The silence
# that fences a node (cut off from etcd's majority) is this much longer than c10d's.
STALL_SECONDS = REQUEST_SECONDS + CONNECT_SECONDS
# Unanswered probes (one a second) after which a silent watch's member counts as gone.
PROBES = 3


def _connect(
    host: str, port: int, timeout: float, context: ssl.SSLContext | None, connect_seconds: float
) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=min(connect_seconds, timeout))
    sock.settimeout(timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if context is not None:
        sock = context.wrap_socket(sock, server_hostname=host)
    return sock


def post(
    host: str,
    port: int,
    path: str,
    data: bytes,
    *,
    timeout: float,
    context: ssl.SSLContext | None = None,
    connect_seconds: float = CONNECT_SECONDS,
) -> tuple[int, bytes]:
    """POSTs ``data`` (JSON) to ``path`` on ``host:port``; the HTTP status and body.

    Args:
        host: The member's host name or address.
        port: Its client port.
        path: The request's path (``/v3/kv/range``).
        data: The JSON body.
        timeout: Seconds for the whole request once connected.
        context: TLS settings for https; None for http.
        connect_seconds: Seconds to connect (bounded by ``timeout`` too).

    Raises:
        OSError: The member could not be reached in time, or the connection broke
            (timeouts, refusals, resets, TLS errors).
        http.client.HTTPException: The answer was not HTTP.
    """
    sock = _connect(host, port, timeout, context, connect_seconds)
    try:
        connection = http.client.HTTPConnection(host, port, timeout=timeout)
        connection.sock = sock  # connected above: http.client sends on it as it is
        headers = {"Content-Type": "application/json"}
        connection.request("POST", path, body=data, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        sock.close()


def _probe_when_idle(sock: socket.socket) -> None:
    """Has the kernel probe an idle connection each second: a member cut off fails it.

    A watch waits for changes, so a silent connection is normal; a member that is
    out of reach does not answer the probes, and after :data:`PROBES` of them the
    connection fails instead of waiting out the watch.
    """
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", PROBES)):
        if hasattr(socket, option):  # Linux names all three
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def post_lines(
    host: str,
    port: int,
    path: str,
    data: bytes,
    *,
    seconds: float,
    enough: Callable[[bytes], bool],
    context: ssl.SSLContext | None = None,
    connect_seconds: float = CONNECT_SECONDS,
) -> list[bytes]:
    """POSTs ``data`` to a streaming ``path`` (``/v3/watch``); its lines until one is enough.

    Reads the answer's lines (one JSON message each) until ``enough(line)`` holds or
    ``seconds`` have passed, then closes the connection. A member that stops
    answering the kernel's probes ends it sooner, with an error (about
    :data:`PROBES` + 1 seconds).

    Returns:
        The lines read, the last one ``enough`` when it came in time.

    Raises:
        OSError: The member could not be reached, or the connection broke.
        http.client.HTTPException: The answer was not HTTP, or not a 200.
    """
    deadline = time.monotonic() + seconds
    sock = _connect(host, port, max(seconds, 0.01), context, connect_seconds)
    _probe_when_idle(sock)
    lines: list[bytes] = []
    try:
        connection = http.client.HTTPConnection(host, port, timeout=seconds)
        connection.sock = sock
        connection.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise http.client.HTTPException(f"{path}: HTTP {response.status}")
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return lines
            sock.settimeout(left)
            try:
                line = response.readline()
            except TimeoutError as error:
                if error.errno is not None:  # ETIMEDOUT: the probes went unanswered
                    raise
                return lines  # the socket's own timeout: the time is up
            if not line:  # the member ended the stream before the time was up
                raise ConnectionResetError(f"{path}: the stream ended")
            lines.append(line)
            if enough(line):
                return lines
    finally:
        sock.close()
