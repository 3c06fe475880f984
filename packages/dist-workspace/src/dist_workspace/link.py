"""The link: one TCP connection between every two ranks of a list, opened once per job.

Every ``*_parallel`` call with one set of ranks (in any order) travels on it: each
sender's frame (a head, and the record when small, see :mod:`dist_workspace.protocol`)
to the receiver, the receiver's verdict back. The first call with a set opens it:

1. Every rank listens on the address its host reaches the store's server from
   (loopback for a store without one) and writes that address, a random token and
   the wire version under a store prefix of the job, the ranks and the attempt.
2. The receiver waits for every rank's key and writes the verdict
   (:func:`dist_workspace.protocol.decide_open`); a failed opening raises on every
   rank, and the next call tries the next attempt's prefix.
3. Every rank connects to the ranks before it and accepts the ones after it, each
   connection presenting the listener's token (so only readers of the store join).

No call uses the store after that. Every wait ends at its deadline; a frame of an
earlier call is dropped; a connection that ends is reported at once, in the words
launchers look for (``Connection closed by peer``). Not a gloo group: its send/recv
cost 40 times a socket's, and a gloo wait that times out closes every connection.
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
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch

from dist_workspace import protocol
from dist_workspace.errors import WorkspaceError

logger = logging.getLogger(__name__)

_IOV_MAX = 512  # buffers per sendmsg; Linux allows 1024


@dataclasses.dataclass(frozen=True)
class Frame:
    """One message of a call: a sender's head (and record) or a receiver's verdict."""

    kind: int  # protocol.HEAD or protocol.VERDICT
    seq: int  # the call's number on the link
    head: dict[str, Any]
    body: torch.Tensor | None = None  # the record's bytes, when it travels on the link


@dataclasses.dataclass(frozen=True)
class Closed:
    """A peer's connection ended or broke; ``why`` is what the socket said."""

    why: str


class Link(Protocol):
    """What a call needs of its link; :class:`SocketLink` is the real one."""

    def send(self, peer: int, frame: Frame, body: Sequence[Any], deadline: float) -> Closed | None:
        """Sends ``frame`` with ``body`` (buffers, in order) to ``peer``; None once sent."""
        ...

    def receive(
        self, peers: Sequence[int], kind: int, seq: int, deadline: float
    ) -> dict[int, Frame | Closed]:
        """The frames of ``kind`` and ``seq`` from ``peers`` that came by ``deadline``.

        Returns as soon as every peer sent one or any connection closed; a peer that
        did neither by the deadline is absent. Frames of earlier calls are dropped and
        the wait goes on.
        """
        ...


def _seconds_left(deadline: float) -> float:
    """Seconds until ``deadline``, at least a millisecond (0 makes a socket non-blocking)."""
    return max(deadline - time.monotonic(), 0.001)


def _read_exactly(sock: socket.socket, size: int, deadline: float, into: Any = None) -> Any:
    buffer = bytearray(size) if into is None else into
    view = memoryview(buffer).cast("B")
    got = 0
    while got < size:
        sock.settimeout(_seconds_left(deadline))
        count = sock.recv_into(view[got:], size - got)
        if count == 0:
            raise ConnectionError("Connection closed by peer")
        got += count
    return buffer


def _send_all(sock: socket.socket, buffers: list[memoryview], deadline: float) -> None:
    while buffers:
        sock.settimeout(_seconds_left(deadline))
        sent = sock.sendmsg(buffers[:_IOV_MAX])
        while buffers and sent >= len(buffers[0]):
            sent -= len(buffers[0])
            buffers.pop(0)
        if sent:
            buffers[0] = buffers[0][sent:]


def _read_frame(sock: socket.socket, deadline: float, peer: int) -> Frame:
    """The next whole frame on ``sock``, its body in memory of its own.

    Raises:
        OSError: The connection ended or broke, or ``deadline`` passed.
        WorkspaceError: The bytes are not a frame of this protocol (naming ``peer``).
    """
    fixed = bytes(_read_exactly(sock, protocol.FIXED_BYTES, deadline))
    kind, seq, head_size, body_size = protocol.decode_fixed(fixed, peer)
    head = protocol.decode_head(bytes(_read_exactly(sock, head_size, deadline)), peer)
    body = None
    if body_size:
        body = torch.empty(body_size, dtype=torch.uint8)
        _read_exactly(sock, body_size, deadline, body.numpy())
    return Frame(kind, seq, head, body)


class SocketLink:
    """The connections of one rank to every other rank of a list."""

    def __init__(self, peers: dict[int, socket.socket]) -> None:
        self._peers = peers
        self._closed: dict[int, Closed] = {}

    def _drop(self, peer: int, why: str | BaseException) -> Closed:
        """Closes ``peer``'s connection for good; every later use reports ``why``."""
        if isinstance(why, BaseException):
            why = str(why) or type(why).__name__
        sock = self._peers.pop(peer, None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        return self._closed.setdefault(peer, Closed(why))

    def send(self, peer: int, frame: Frame, body: Sequence[Any], deadline: float) -> Closed | None:
        """Sends ``frame``, then ``body`` from the caller's buffers (nothing is copied)."""
        sock = self._peers.get(peer)
        if sock is None:
            return self._closed[peer]
        views = [view for view in (memoryview(part).cast("B") for part in body) if len(view)]
        size = sum(len(view) for view in views)
        fixed = protocol.encode_frame(frame.kind, frame.seq, frame.head, size)
        try:
            _send_all(sock, [memoryview(fixed), *views], deadline)
        except OSError as error:  # a frame half sent is lost to the stream as well
            return self._drop(peer, error)
        return None

    def receive(
        self, peers: Sequence[int], kind: int, seq: int, deadline: float
    ) -> dict[int, Frame | Closed]:
        """See :meth:`Link.receive`."""
        got: dict[int, Frame | Closed] = {}
        for peer in peers:
            if peer not in self._peers:
                got[peer] = self._closed[peer]
                return got
        waiting = {self._peers[peer].fileno(): peer for peer in peers}
        poller = select.poll()  # not select(): a process may hold fds above 1024
        for fd in waiting:
            poller.register(fd, select.POLLIN)
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for fd, _ in poller.poll(max(1, int(left * 1000))):
                peer = waiting[fd]
                outcome = self._next_frame(peer, kind, seq, deadline)
                if outcome is None:
                    continue  # a stale frame; wait on
                got[peer] = outcome
                del waiting[fd]
                poller.unregister(fd)
                if isinstance(outcome, Closed):
                    return got
        return got

    def _next_frame(self, peer: int, kind: int, seq: int, deadline: float) -> Frame | Closed | None:
        """Reads ``peer``'s next frame: the one awaited, None for a stale one, or Closed."""
        # A frame that has begun is read to its end: the sender writes it whole.
        finish = max(deadline, time.monotonic()) + protocol.VERDICT_MARGIN_SECONDS
        try:
            frame = _read_frame(self._peers[peer], finish, peer)
        except (OSError, WorkspaceError) as error:  # gone, or not a frame of this protocol
            return self._drop(peer, error)
        if frame.seq < seq:  # the receiver of that call answered it when it gave up
            logger.debug("dropped rank %s's frame of call %s in call %s", peer, frame.seq, seq)
            return None
        if (frame.kind, frame.seq) != (kind, seq):
            return self._drop(peer, protocol.out_of_order(peer, frame.kind, frame.seq, seq))
        return frame

    def close(self) -> None:
        """Closes every connection."""
        for peer in list(self._peers):
            self._drop(peer, "the link was closed")


def host_id() -> str:
    """This host's name and boot: ranks with the same one share memory."""
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as handle:
        boot = handle.read().strip()
    return f"{socket.gethostname()}/{boot}"


@dataclasses.dataclass
class LinkState:
    """One list of ranks in this process: its call count, its link, this host."""

    attempt: int = 0  # openings that failed before; names the store keys of the next
    seq: int = 0  # the next call's number
    link: Link | None = None  # a SocketLink once opened
    # Read once: neither the host's name nor its boot changes while a process runs.
    host: str = dataclasses.field(default_factory=host_id)

    def next_seq(self) -> int:
        """The number of the call that starts now."""
        seq = self.seq
        self.seq += 1
        return seq


# (pid, job id, the ranks sorted) -> state; a forked child starts its own
_states: dict[tuple[int, str, tuple[int, ...]], LinkState] = {}


def state_for(job: str, ranks: Sequence[int]) -> LinkState:
    """This process's state of the link between ``ranks`` (made at the first call)."""
    key = (os.getpid(), job, tuple(sorted(ranks)))
    state = _states.get(key)
    if state is None:
        state = _states[key] = LinkState()
    return state


def _listen_address(store: Any) -> tuple[int, str]:
    """The address family and address this host reaches the store's server from.

    Looks through wrapping stores; loopback for a store without a server (FileStore,
    HashStore: one host) or without a route to it.
    """
    host = getattr(store, "host", None)
    while not (isinstance(host, str) and host) and store is not None:
        store = getattr(store, "underlying_store", None)
        host = getattr(store, "host", None)
    if not host:
        return socket.AF_INET, "127.0.0.1"
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)  # a datagram socket sends nothing to connect
            return family, str(probe.getsockname()[0])
    except OSError as error:
        logger.info("no route to the store's host %s (%s): listening on loopback", host, error)
        return socket.AF_INET, "127.0.0.1"


def _store_wait(store: Any, keys: list[str], deadline: float) -> list[str]:
    """Waits until ``deadline`` for ``keys``; returns those that are there."""
    try:
        store.wait(keys, timedelta(seconds=_seconds_left(deadline)))
    except RuntimeError:  # DistStoreError (a RuntimeError) at the timeout
        return [key for key in keys if store.check([key])]
    return keys


def open_link(store: Any, name: str, call: protocol.Call, state: LinkState) -> SocketLink:
    """Opens the link between ``call.ranks`` (see the module's docstring).

    ``name`` (the job's and the ranks' tags) and ``state.attempt`` prefix its store keys.

    Raises:
        WorkspaceError: A rank never came, runs another wire version, or could not
            connect; the next call tries again.
    """
    ranks = sorted(call.ranks)
    prefix = f"dist_workspace/link/{name}/{state.attempt}"
    family, address = _listen_address(store)
    token = secrets.token_hex(16)
    mine: dict[str, Any] = {"version": protocol.WIRE_VERSION, "token": token}
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((address, 0))
        listener.listen(len(ranks))
        mine["address"] = [address, listener.getsockname()[1]]
    except OSError as error:  # the receiver names this rank and why, to every rank
        mine["error"] = f"cannot listen on {address}: {error}"
    try:
        store.set(f"{prefix}/rank/{call.rank}", json.dumps(mine))
        infos = _agree(store, prefix, call, ranks)
        peers = _connect(listener, infos, call, token, prefix)
    except WorkspaceError:
        state.attempt += 1
        raise
    finally:
        listener.close()
    return SocketLink(peers)


def _agree(store: Any, prefix: str, call: protocol.Call, ranks: list[int]) -> dict[int, Any]:
    """Every rank's key, once the call's receiver has said all came."""
    keys = {rank: f"{prefix}/rank/{rank}" for rank in ranks}
    verdict_key = f"{prefix}/verdict"
    began = time.monotonic()

    def infos(came: list[int]) -> dict[int, Any]:
        raws = store.multi_get([keys[rank] for rank in came])
        return {rank: protocol.decode_head(raw, rank) for rank, raw in zip(came, raws, strict=True)}

    if call.rank != call.receiver:
        patience = call.timeout + protocol.VERDICT_MARGIN_SECONDS
        got = _store_wait(store, [verdict_key], began + patience)
        verdict = protocol.decode_head(store.get(verdict_key), call.receiver) if got else None
        failure = protocol.verdict_error(call, verdict)
        if failure is not None:
            raise WorkspaceError(failure)
        return infos(ranks)
    present = set(_store_wait(store, list(keys.values()), began + call.timeout))
    came = infos([rank for rank, key in keys.items() if key in present])
    failure = protocol.decide_open(call, came)
    store.set(verdict_key, json.dumps({"ok": failure is None, "error": failure}))
    if failure is not None:
        raise WorkspaceError(failure)
    return came


def _connect(
    listener: socket.socket, infos: dict[int, Any], call: protocol.Call, token: str, prefix: str
) -> dict[int, socket.socket]:
    """Connects to the ranks before this one, accepts those after it (a full mesh)."""
    deadline = time.monotonic() + call.timeout
    peers: dict[int, socket.socket] = {}
    expected = {rank for rank in infos if rank > call.rank}
    try:
        for peer in sorted(rank for rank in infos if rank < call.rank):
            host, port = infos[peer]["address"]
            sock = socket.create_connection((host, port), _seconds_left(deadline))
            peers[peer] = sock
            hello = {"link": prefix, "rank": call.rank, "token": infos[peer]["token"]}
            # create_connection left the socket's timeout set: sendall is bounded too
            sock.sendall(protocol.encode_frame(protocol.HEAD, 0, hello, 0))
        while expected:
            listener.settimeout(_seconds_left(deadline))
            sock, _ = listener.accept()
            try:
                said = _read_frame(sock, deadline, -1).head  # a frame of call 0
            except WorkspaceError:
                said = {}
            rank = said.get("rank")
            if said.get("token") != token or said.get("link") != prefix or rank not in expected:
                sock.close()  # not a rank of this link: it could not read the store
                continue
            peers[rank] = sock
            expected.discard(rank)
    except OSError as error:
        for sock in peers.values():
            sock.close()
        missing = sorted(rank for rank in infos if rank != call.rank and rank not in peers)
        raise WorkspaceError(protocol.could_not_connect(call, missing, error)) from None
    for sock in peers.values():
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return peers
