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

# Seconds a member may take to accept a connection before the next member is tried.
CONNECT_SECONDS = 1.0


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
    sock = socket.create_connection((host, port), timeout=min(connect_seconds, timeout))
    try:
        sock.settimeout(timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname=host)
        connection = http.client.HTTPConnection(host, port, timeout=timeout)
        connection.sock = sock  # connected above: http.client sends on it as it is
        headers = {"Content-Type": "application/json"}
        connection.request("POST", path, body=data, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        sock.close()
