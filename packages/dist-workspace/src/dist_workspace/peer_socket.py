"""Direct Unix-socket connections between each sender and its receiver on one host.

The handshake of a call (every sender's status, then the receiver's verdict) went
through the store's server: on a 4-rank call of 4 KiB, its round trips (a wait, a
read, the verdict, and the deletes that keep the store from growing) were most of
the call. On one host a sender talks to its receiver directly instead:

- The receiver listens on one abstract Unix socket per process (its name starts
  with a NUL byte: the kernel frees it when the process exits, so nothing is left
  on disk). Its address, host and a random token travel in the verdict of a call
  through the store.
- After a successful verdict that carries them, a sender on the same host connects
  and sends a hello with the token and the call's key prefix: one connection per
  sender, receiver and list of ranks, so every connection carries one ordered
  sequence of calls.
- From the next call on, that sender writes its status (the same JSON and payload
  as through the store, with the call's number) to the connection and reads the
  verdict from it. The receiver waits on every connection at once with ``poll``; no
  key is written, so none is deleted.

What a call guarantees stays: every wait is bounded by the call's timeout; a sender
whose connection closes (it exited) is named at once rather than at the timeout; a
status of an earlier, failed call (a late sender) is answered with a failed verdict
and never taken for the current one; a sender that cannot connect (another network
namespace: abstract names are per namespace) keeps the store. Anyone who can read
the store learns the token, as they could read or write the statuses there: the
socket trusts no one the store does not. ``DIST_WORKSPACE_PEER_SOCKETS=0`` keeps
every handshake in the store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from dist_workspace.errors import WorkspaceError

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
_MAX_FRAME = 1 << 31  # a status carries at most an inline record: larger is garbage
_HELLO_SECONDS = 5.0  # a connected peer writes its hello at once
_FIRST_SLICE = 0.0005  # seconds between looks at the store for senders without a link
_LAST_SLICE = 0.05


def enabled() -> bool:
    """Whether handshakes may leave the store: ``DIST_WORKSPACE_PEER_SOCKETS`` (``0``: no)."""
    return os.environ.get("DIST_WORKSPACE_PEER_SOCKETS", "1") != "0"


class PeerClosed(WorkspaceError):
    """The other end of a connection closed it (its process exited, most likely)."""


def _send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _receive_exactly(sock: socket.socket, size: int) -> bytes | None:
    """``size`` bytes, or None at end of stream; raises TimeoutError past the timeout."""
    first = sock.recv(size)  # a frame is written whole: it mostly comes whole
    if len(first) == size or not first:
        return first or None
    buffer = bytearray(size)
    buffer[: len(first)] = first
    view = memoryview(buffer)
    got = len(first)
    while got < size:
        count = sock.recv_into(view[got:], size - got)
        if count == 0:
            return None
        got += count
    return bytes(buffer)


def _receive_frame(sock: socket.socket, seconds: float) -> bytes | None:
    """One frame, or None when the peer closed the connection."""
    sock.settimeout(max(seconds, 0.001))
    head = _receive_exactly(sock, _LENGTH.size)
    if head is None:
        return None
    (size,) = _LENGTH.unpack(head)
    if size > _MAX_FRAME:
        raise WorkspaceError(f"a peer sent a frame of {size} bytes: not a dist-workspace peer")
    return b"" if size == 0 else _receive_exactly(sock, size)


def _seq_of(frame: bytes) -> int:
    """The call number in a frame's JSON (the first line)."""
    head = json.loads(frame.partition(b"\n")[0])
    seq = head.get("seq") if isinstance(head, dict) else None
    if not isinstance(seq, int):
        raise WorkspaceError("a peer sent a frame without a call number")
    return seq


def with_seq(seq: int, value: dict[str, Any], payload: bytes = b"") -> bytes:
    """A frame's bytes: the JSON with the call's number, a newline, the payload."""
    text = json.dumps({"seq": seq, **value}).encode()
    return text + b"\n" + payload if payload else text


# ---------------------------------------------------------------- receiver


@dataclasses.dataclass
class _Stream:
    """One sender's connection for one list of ranks."""

    sock: socket.socket
    sender: int


class Listener:
    """A receiver's socket and the connections its senders opened to it."""

    def __init__(self, host: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._name = f"dist_workspace/{os.getpid()}/{secrets.token_hex(8)}"
        self._sock.bind(b"\0" + self._name.encode())
        self._sock.listen(1024)
        self._sock.setblocking(False)
        self._token = secrets.token_hex(16)
        self._host = host
        self._streams: dict[str, dict[int, _Stream]] = {}  # prefix -> sender -> stream
        self._unnamed: list[socket.socket] = []  # accepted, hello not read yet
        self._offered: set[str] = set()  # prefixes whose senders were told the endpoint

    def endpoint(self) -> dict[str, str]:
        """What a verdict tells senders so they can connect."""
        return {"address": self._name, "host": self._host, "token": self._token}

    def offer(self, prefix: str) -> dict[str, str]:
        """The endpoint, for a verdict posted to the store; remembers it was offered."""
        self._offered.add(prefix)
        return self.endpoint()

    def offered(self, prefix: str) -> bool:
        """Whether senders of these ranks may write directly: once told, they may."""
        return prefix in self._offered

    def linked(self, prefix: str) -> set[int]:
        """The senders of these ranks that write to this receiver directly."""
        return set(self._streams.get(prefix, {}))

    def collect(
        self,
        prefix: str,
        seq: int,
        senders: list[int],
        seconds: float,
        from_store: Callable[[list[int]], dict[int, bytes]],
    ) -> dict[int, bytes]:
        """Every sender's status of call ``seq``, by rank, as far as they came in time.

        Reads linked senders' connections; asks ``from_store`` (rank -> posted value,
        for those that have posted) for the others, at growing intervals, while any
        is missing. Raises :class:`PeerClosed` naming a sender whose connection closed.
        """
        deadline = time.monotonic() + seconds
        got: dict[int, bytes] = {}
        pause = _FIRST_SLICE
        while True:
            missing = [r for r in senders if r not in got]
            streams = self._streams.setdefault(prefix, {})
            unlinked = [r for r in missing if r not in streams]
            if unlinked:
                got.update(from_store(unlinked))
                unlinked = [r for r in unlinked if r not in got]
                missing = [r for r in missing if r not in got]
            if not missing:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                return got
            wait = min(left, pause) if unlinked else left
            pause = min(pause * 2, _LAST_SLICE)
            self._wait_once(prefix, seq, [r for r in missing if r in streams], wait, got)

    def _wait_once(
        self, prefix: str, seq: int, linked: list[int], seconds: float, got: dict[int, bytes]
    ) -> None:
        streams = self._streams[prefix]
        poller = select.poll()
        by_fd: dict[int, Any] = {self._sock.fileno(): None}
        poller.register(self._sock, select.POLLIN)
        for sock in self._unnamed:
            by_fd[sock.fileno()] = sock
            poller.register(sock, select.POLLIN)
        for sender in linked:
            sock = streams[sender].sock
            by_fd[sock.fileno()] = streams[sender]
            poller.register(sock, select.POLLIN)
        for fd, _ in poller.poll(max(seconds, 0.0) * 1000):
            target = by_fd[fd]
            if target is None:
                self._accept()
            elif isinstance(target, socket.socket):
                self._read_hello(target)
            else:
                self._read_status(prefix, seq, target, seconds, got)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            self._unnamed.append(sock)

    def _read_hello(self, sock: socket.socket) -> None:
        self._unnamed.remove(sock)
        try:
            frame = _receive_frame(sock, _HELLO_SECONDS)
            hello = json.loads(frame) if frame else None
        except (OSError, ValueError, WorkspaceError) as error:
            logger.debug("dropped a connection with no valid hello: %s", error)
            hello = None
        if (
            not isinstance(hello, dict)
            or hello.get("token") != self._token
            or not isinstance(hello.get("prefix"), str)
            or not isinstance(hello.get("rank"), int)
        ):
            sock.close()
            return
        streams = self._streams.setdefault(hello["prefix"], {})
        old = streams.get(hello["rank"])
        if old is not None:
            old.sock.close()
        streams[hello["rank"]] = _Stream(sock, hello["rank"])

    def _read_status(
        self, prefix: str, seq: int, stream: _Stream, seconds: float, got: dict[int, bytes]
    ) -> None:
        try:
            frame = _receive_frame(stream.sock, max(seconds, _HELLO_SECONDS))
        except (OSError, WorkspaceError) as error:
            frame, how = None, f" ({error})"
        else:
            # The words of a closed socket elsewhere: launchers (dist-core's
            # is_peer_failure) then take the sender, not this rank, as the root cause.
            how = " (Connection closed by peer)"
        if frame is None:
            self._drop(prefix, stream.sender)
            raise PeerClosed(
                f"rank(s) [{stream.sender}] never wrote their value: its connection to this "
                f"receiver was lost{how} during the call (did rank {stream.sender} exit or "
                "fail?)"
            )
        sent_for = _seq_of(frame)
        if sent_for < seq:
            # A late sender of a call this receiver already failed: it waits for that
            # call's verdict on this connection, so it gets one.
            late = {"ok": False, "error": f"the receiver had given up on call {sent_for}"}
            self.answer(prefix, [stream.sender], with_seq(sent_for, late))
            return
        if sent_for > seq:
            raise WorkspaceError(
                f"rank {stream.sender} sent its value for call {sent_for} while the receiver "
                f"was at call {seq}: did the ranks call in different orders?"
            )
        got[stream.sender] = frame

    def answer(self, prefix: str, senders: list[int], frame: bytes) -> None:
        """Sends ``frame`` (a verdict) to each of ``senders`` that has a connection."""
        streams = self._streams.get(prefix, {})
        for sender in senders:
            stream = streams.get(sender)
            if stream is None:
                continue
            try:
                stream.sock.settimeout(_HELLO_SECONDS)
                _send_frame(stream.sock, frame)
            except OSError as error:
                logger.debug("could not send a verdict to rank %s: %s", sender, error)
                self._drop(prefix, sender)

    def sweep(self) -> None:
        """Takes in the connections and hellos already waiting, without blocking."""
        self._accept()
        if not self._unnamed:
            return
        poller = select.poll()  # not select(): a process may hold fds above 1024
        by_fd = {sock.fileno(): sock for sock in self._unnamed}
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        for fd, _ in poller.poll(0):
            self._read_hello(by_fd[fd])

    def _drop(self, prefix: str, sender: int) -> None:
        stream = self._streams.get(prefix, {}).pop(sender, None)
        if stream is not None:
            stream.sock.close()


_listeners: dict[int, Listener | None] = {}  # by pid: a forked child makes its own


def listener(host: str) -> Listener | None:
    """This process's listener, opened at its first call as a receiver.

    None where no socket can be opened (the calls keep the store); logged once.
    """
    pid = os.getpid()
    if pid not in _listeners:
        try:
            _listeners[pid] = Listener(host)
        except OSError as error:
            logger.info("no Unix socket for direct connections (%s): calls use the store", error)
            _listeners[pid] = None
    return _listeners[pid]


# ---------------------------------------------------------------- sender


class Link:
    """A sender's connection to its receiver for one list of ranks."""

    def __init__(self, sock: socket.socket, receiver: int) -> None:
        self._sock = sock
        self._receiver = receiver

    def post(self, frame: bytes, seconds: float) -> None:
        """Sends a status frame, waiting up to ``seconds`` for room in the connection.

        Raises:
            PeerClosed: The receiver is gone, or did not take the frame in time.
        """
        try:
            self._sock.settimeout(max(seconds, 0.001))
            _send_frame(self._sock, frame)
        except OSError as error:
            raise PeerClosed(
                f"could not write to receiver rank {self._receiver}'s connection ({error}): "
                "did it exit?"
            ) from error

    def verdict(self, seq: int, seconds: float) -> bytes | None:
        """The receiver's verdict of call ``seq``; None when it did not come in time."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                frame = _receive_frame(self._sock, deadline - time.monotonic())
            except TimeoutError:
                return None
            except OSError as error:
                frame = None
                logger.debug("reading a verdict failed: %s", error)
            if frame is None:
                raise PeerClosed(
                    f"receiver rank {self._receiver} closed its connection before its "
                    "verdict (Connection closed by peer): did it exit or fail?"
                )
            if _seq_of(frame) == seq:
                return frame
            # A verdict of an earlier call this sender stopped waiting for.

    def close(self) -> None:
        """Closes the connection; the receiver sees it end."""
        with contextlib.suppress(OSError):
            self._sock.close()


_links: dict[tuple[int, str], Link] = {}  # (pid, key prefix) -> link


def link_for(prefix: str) -> Link | None:
    """The connection this sender writes calls with these ranks to, if it has one."""
    return _links.get((os.getpid(), prefix))


def connect(prefix: str, rank: int, receiver: int, endpoint: Any, host: str) -> None:
    """Opens this sender's connection from a verdict's ``endpoint``, where it can.

    Nothing happens when the endpoint is missing or on another host, and a failure to
    connect leaves the calls in the store; both are logged, neither raises.
    """
    key = (os.getpid(), prefix)
    if key in _links or not isinstance(endpoint, dict) or endpoint.get("host") != host:
        return
    address = endpoint.get("address")
    if not isinstance(address, str):
        return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(_HELLO_SECONDS)
        sock.connect(b"\0" + address.encode())
        hello = {"token": endpoint.get("token"), "prefix": prefix, "rank": rank}
        _send_frame(sock, json.dumps(hello).encode())
    except OSError as error:
        sock.close()
        logger.info(
            "rank %s: no direct connection to receiver rank %s (%s); its calls keep "
            "going through the store",
            rank,
            receiver,
            error,
        )
        return
    _links[key] = Link(sock, receiver)


def forget(prefix: str) -> None:
    """Closes this sender's connection for ``prefix`` (its receiver went away)."""
    link = _links.pop((os.getpid(), prefix), None)
    if link is not None:
        link.close()
