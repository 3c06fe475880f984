"""A prototype of dist-workspace 0.5's one wire path, measured before the package changes.

One gloo link per list of ranks, opened once (a ``ProcessGroupGloo`` on a
``PrefixStore`` of the default store, one device thread per process). A call:

- every sender posts a receive for its verdict, then sends one frame to the
  receiver: ``[u32 length][head JSON][zeros to 64][record]`` where the record (the
  package's own writer, without checksums) fits in ``LINK_MAX_BYTES``; above it the
  record goes into a fresh shared-memory segment as today and the head names it;
- the receiver posts a receive of ``LINK_MAX_BYTES`` + 4 KiB per sender first (one
  buffer per sender, kept by the link and reused: warm pages), copies its own value,
  waits for every frame, copies each record out of its frame into a buffer of its
  own size (the values must not pin a buffer of the largest size) and reads it with
  the package's reader (header digest, tiling, padding), or maps the segment;
- the receiver sends every sender a verdict and does not wait for those sends to
  finish: the next call reaps them.

What is left out here (the package has it): opening through the store with a
verdict on who came, failures, timeouts. ``gloo handshake``: one byte each way over
the same kind of link, no data and no record: the least a call that tells every
sender how it ended costs on this transport.

``--link-sweep`` times the link against a segment per call for records of 64 KiB to
16 MiB (the receiver reads every byte), which sets ``LINK_MAX_BYTES``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import struct
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

LINK_MAX_BYTES = 4 << 20
_HEAD_ROOM = 4096
_LENGTH = struct.Struct("<I")
_TIMEOUT = timedelta(seconds=60)
_HEAD, _VERDICT = 0, 1
_OK = b'{"ok": true}'


def _tag(seq: int, kind: int) -> int:
    return (seq % (1 << 29)) * 4 + kind


class _Link:
    """A gloo backend over ``ranks`` and the buffers it owns."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        store = getattr(store, "_store", store)  # the benchmark's counting wrapper's store
        options: Any = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009
        options._devices = [_device()]
        options._timeout = _TIMEOUT
        options._threads = 1
        self.ranks = ranks
        self.backend = dist.ProcessGroupGloo(
            dist.PrefixStore(f"bench-link/{','.join(map(str, ranks))}", store),
            ranks.index(dist.get_rank()),
            len(ranks),
            options,
        )
        self.seq = 0
        self.inbox: dict[int, torch.Tensor] = {}  # sender -> its frame buffer here
        self.outbox = torch.empty(_HEAD_ROOM + LINK_MAX_BYTES, dtype=torch.uint8)
        self.verdict = torch.empty(_HEAD_ROOM, dtype=torch.uint8)
        self.pending: list[tuple[Any, torch.Tensor]] = []  # sends not yet reaped

    def index(self, rank: int) -> int:
        return self.ranks.index(rank)

    def reap(self) -> None:
        for work, _ in self.pending:
            work.wait(_TIMEOUT)
        self.pending.clear()


_device_made: list[Any] = []
_links: dict[tuple[int, ...], _Link] = {}


def _device() -> Any:
    import torch.distributed as dist

    if not _device_made:
        _device_made.append(dist.ProcessGroupGloo.create_default_device())
    return _device_made[0]


def _link(ranks: list[int]) -> _Link:
    key = tuple(sorted(ranks))
    link = _links.get(key)
    if link is None:
        link = _links[key] = _Link(key)
    return link


def _frame_into(frame: torch.Tensor, head: dict[str, Any], record: Any | None) -> int:
    """Writes the head and the record into ``frame``; returns the bytes used."""
    from dist_workspace.writer import _write_with

    text = json.dumps(head).encode()
    at = -(-(_LENGTH.size + len(text)) // 64) * 64
    view = frame.numpy()
    view[: _LENGTH.size] = memoryview(_LENGTH.pack(len(text)))
    view[_LENGTH.size : _LENGTH.size + len(text)] = memoryview(text)
    view[_LENGTH.size + len(text) : at] = 0
    if record is None:
        return at

    def put(data: Any, position: int) -> None:
        view[at + position : at + position + len(data)] = memoryview(data)

    _write_with(put, record)
    return at + int(record.total_size)


def _head_of(frame: torch.Tensor) -> tuple[dict[str, Any], int]:
    raw = frame[: _LENGTH.size + 4096].numpy().tobytes()
    (length,) = _LENGTH.unpack_from(raw)
    head = json.loads(raw[_LENGTH.size : _LENGTH.size + length])
    return head, -(-(_LENGTH.size + length) // 64) * 64


def _values_of(frame: torch.Tensor, head: dict[str, Any], at: int, sender: int) -> Any:
    from dist_workspace.reader import assemble, parse_header, view_entries
    from dist_workspace.shm import map_segment

    size = int(head["size"])
    where = f"rank {sender}'s record"
    if "segment" in head:
        buffer: Any = map_segment(head["segment"], size, where)
    else:
        copy = torch.empty(size, dtype=torch.uint8)
        ctypes.memmove(copy.data_ptr(), frame.data_ptr() + at, size)
        buffer = copy.numpy()
    header = parse_header(lambda begin, length: bytes(buffer[begin : begin + length]), size, where)
    return assemble(view_entries(buffer, header), header, where)


def _sender_record(
    tensor: torch.Tensor, ranks: list[int], seq: int, route: str | None
) -> tuple[Any, dict[str, Any], Any]:
    """The record, its head, and its segment (None: it goes on the link)."""
    import torch.distributed as dist

    from dist_workspace.shm import create_segment
    from dist_workspace.writer import prepare_record, write_record

    rank = dist.get_rank()
    record = prepare_record({"tensor": tensor}, None, rank=rank, job="be4c4", checksums=False)
    head: dict[str, Any] = {"ok": True, "ranks": ranks, "size": record.total_size}
    head.update(shape=list(tensor.shape), dtype=str(tensor.dtype))
    if record.total_size <= LINK_MAX_BYTES if route is None else route == "link":
        return record, head, None
    segment = create_segment(record.total_size, job="be4c4", group="1114", seq=seq, rank=rank)
    write_record(segment.fd, record)
    segment.close()
    head["segment"] = segment.name
    return record, head, segment


@contextlib.contextmanager
def get_tensors_parallel(
    tensor: torch.Tensor, ranks: list[int], *, route: str | None = None
) -> Iterator[list[torch.Tensor]]:
    """The prototype's call: the receiver gets every rank's tensor, the others nothing."""
    import torch.distributed as dist

    from dist_workspace.own_value import own_tensor

    link = _link(ranks)
    link.reap()
    seq = link.seq
    link.seq += 1
    rank = dist.get_rank()
    receiver = ranks[0]
    backend = link.backend
    if rank != receiver:
        record, head, segment = _sender_record(tensor, ranks, seq, route)
        on_link = segment is None
        try:
            verdict = backend.recv([link.verdict], link.index(receiver), _tag(seq, _VERDICT))
            used = _frame_into(link.outbox, head, record if on_link else None)
            sent = backend.send([link.outbox[:used]], link.index(receiver), _tag(seq, _HEAD))
            verdict.wait(_TIMEOUT)
            sent.wait(_TIMEOUT)
            answer, _ = _head_of(link.verdict)
            if not answer.get("ok"):
                raise RuntimeError(f"rank {rank}: failed on receiver rank {receiver}")
        finally:
            if segment is not None:
                segment.unlink()
        yield []
        return
    senders = ranks[1:]
    works = {}
    for sender in senders:
        inbox = link.inbox.get(sender)
        if inbox is None:
            inbox = link.inbox[sender] = torch.empty(_HEAD_ROOM + LINK_MAX_BYTES, dtype=torch.uint8)
        works[sender] = backend.recv([inbox], link.index(sender), _tag(seq, _HEAD))
    own = own_tensor(tensor, "own")
    values = {receiver: own}
    for sender in senders:
        works[sender].wait(_TIMEOUT)
        head, at = _head_of(link.inbox[sender])
        if head["shape"] != list(tensor.shape) or head["dtype"] != str(tensor.dtype):
            raise RuntimeError(f"rank {sender} has shape {head['shape']} {head['dtype']}")
        _, weights = _values_of(link.inbox[sender], head, at, sender)
        values[sender] = weights["tensor"]
    verdict = torch.frombuffer(bytearray(_LENGTH.pack(len(_OK)) + _OK), dtype=torch.uint8)
    for sender in senders:
        work = backend.send([verdict], link.index(sender), _tag(seq, _VERDICT))
        link.pending.append((work, verdict))
    yield [values[r] for r in ranks]


# ---------------------------------------------------------------- the TCP variant

_FRAME = struct.Struct("<IBQIQ")  # magic, kind, seq, head bytes, body bytes
_MAGIC = 0x64777331
_tcp_links: dict[tuple[int, ...], _TcpLink] = {}


class _TcpLink:
    """One TCP connection between every two ranks of ``ranks``, opened through the store."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        import socket

        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        store = getattr(store, "_store", store)
        rank = dist.get_rank()
        prefix = f"bench-tcp/{','.join(map(str, ranks))}"
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(len(ranks))
        listener.settimeout(60)
        store.set(f"{prefix}/{rank}", str(listener.getsockname()[1]))
        keys = [f"{prefix}/{r}" for r in ranks]
        store.wait(keys, _TIMEOUT)
        ports = dict(zip(ranks, (int(v) for v in store.multi_get(keys)), strict=True))
        self.peers: dict[int, socket.socket] = {}
        for peer in ranks:
            if peer < rank:
                connection = socket.create_connection(("127.0.0.1", ports[peer]), 60)
                connection.sendall(struct.pack("<I", rank))
                self.peers[peer] = connection
        for _ in [peer for peer in ranks if peer > rank]:
            connection, _ = listener.accept()
            connection.settimeout(60)
            (peer,) = struct.unpack("<I", _read_exactly(connection, 4))
            self.peers[peer] = connection
        listener.close()
        for connection in self.peers.values():
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.seq = 0


def _read_exactly(connection: Any, size: int, into: Any = None) -> Any:
    buffer = bytearray(size) if into is None else into
    view = memoryview(buffer).cast("B")
    got = 0
    while got < size:
        count = connection.recv_into(view[got:], size - got)
        if count == 0:
            raise ConnectionError("Connection closed by peer")
        got += count
    return buffer


def _send_frame(connection: Any, kind: int, seq: int, head: bytes, pieces: list[Any]) -> None:
    """One frame: its fixed part, the head, then the body from its pieces (no copy)."""
    body = sum(len(piece) for piece in pieces)
    buffers = [memoryview(_FRAME.pack(_MAGIC, kind, seq, len(head), body) + head)]
    buffers += [memoryview(piece).cast("B") for piece in pieces if len(piece)]
    while buffers:
        sent = connection.sendmsg(buffers[:512])
        while sent and sent >= len(buffers[0]):
            sent -= len(buffers[0])
            buffers.pop(0)
        if sent:
            buffers[0] = buffers[0][sent:]


def _receive_frame(connection: Any) -> tuple[int, int, bytes, torch.Tensor | None]:
    fixed = _read_exactly(connection, _FRAME.size)
    magic, kind, seq, head_size, body_size = _FRAME.unpack(fixed)
    if magic != _MAGIC:
        raise ValueError("not a frame of this link")
    head = bytes(_read_exactly(connection, head_size))
    body = None
    if body_size:
        body = torch.empty(body_size, dtype=torch.uint8)
        _read_exactly(connection, body_size, body.numpy())
    return kind, seq, head, body


def _record_pieces(record: Any) -> list[Any]:
    """The record's bytes in order, from its tensors: header, data, zero padding, digest."""
    from dist_workspace.writer import record_buffers

    return record_buffers(record)


@contextlib.contextmanager
def get_tensors_parallel_tcp(
    tensor: torch.Tensor, ranks: list[int], *, route: str | None = None
) -> Iterator[list[torch.Tensor]]:
    """The prototype's call over TCP connections: the same protocol as the gloo one."""
    import select

    import torch.distributed as dist

    from dist_workspace.own_value import own_tensor
    from dist_workspace.reader import assemble, parse_header, view_entries
    from dist_workspace.shm import map_segment

    key = tuple(sorted(ranks))
    link = _tcp_links.get(key)
    if link is None:
        link = _tcp_links[key] = _TcpLink(key)
    seq = link.seq
    link.seq += 1
    rank = dist.get_rank()
    receiver = ranks[0]
    if rank != receiver:
        record, head, segment = _sender_record(tensor, ranks, seq, route)
        on_link = segment is None
        try:
            connection = link.peers[receiver]
            pieces = _record_pieces(record) if on_link else []
            _send_frame(connection, _HEAD, seq, json.dumps(head).encode(), pieces)
            _, _, answer, _ = _receive_frame(connection)
            if not json.loads(answer).get("ok"):
                raise RuntimeError(f"rank {rank}: failed on receiver rank {receiver}")
        finally:
            if segment is not None:
                segment.unlink()
        yield []
        return
    senders = ranks[1:]
    own = own_tensor(tensor, "own")
    values = {receiver: own}
    waiting = {link.peers[sender].fileno(): sender for sender in senders}
    poller = select.poll()
    for fd in waiting:
        poller.register(fd, select.POLLIN)
    while waiting:
        for fd, _ in poller.poll(60_000):
            sender = waiting.pop(fd)
            poller.unregister(fd)
            _, _, raw, body = _receive_frame(link.peers[sender])
            head = json.loads(raw)
            if head["shape"] != list(tensor.shape) or head["dtype"] != str(tensor.dtype):
                raise RuntimeError(f"rank {sender} has shape {head['shape']} {head['dtype']}")
            size = int(head["size"])
            where = f"rank {sender}'s record"
            buffer: Any = (
                map_segment(head["segment"], size, where) if body is None else body.numpy()
            )
            header = parse_header(lambda b, n, data=buffer: bytes(data[b : b + n]), size, where)
            values[sender] = assemble(view_entries(buffer, header), header, where)[1]["tensor"]
    for sender in senders:
        _send_frame(link.peers[sender], _VERDICT, seq, _OK, [])
    yield [values[r] for r in ranks]


@contextlib.contextmanager
def gloo_handshake(value: Any, ranks: list[int]) -> Iterator[list[Any]]:
    """One byte from every sender to the receiver, one byte back, over the link."""
    import torch.distributed as dist

    link = _link(ranks)
    seq = link.seq
    link.seq += 1
    backend = link.backend
    rank = dist.get_rank()
    byte = torch.zeros(1, dtype=torch.uint8)
    if rank == ranks[0]:
        inboxes = [torch.empty(1, dtype=torch.uint8) for _ in ranks[1:]]
        works = [
            backend.recv([inbox], link.index(sender), _tag(seq, _HEAD))
            for inbox, sender in zip(inboxes, ranks[1:], strict=True)
        ]
        for work in works:
            work.wait(_TIMEOUT)
        sends = [backend.send([byte], link.index(s), _tag(seq, _VERDICT)) for s in ranks[1:]]
        for work in sends:
            work.wait(_TIMEOUT)
    else:
        answer = torch.empty(1, dtype=torch.uint8)
        verdict = backend.recv([answer], link.index(ranks[0]), _tag(seq, _VERDICT))
        backend.send([byte], link.index(ranks[0]), _tag(seq, _HEAD)).wait(_TIMEOUT)
        verdict.wait(_TIMEOUT)
    yield []


def sweep(sizes_kib: list[int], repeats: int) -> dict[str, Any]:
    """Runs on every rank: per record size, ms per call on the link and through segments."""
    import time

    import torch.distributed as dist

    global LINK_MAX_BYTES
    LINK_MAX_BYTES = max(sizes_kib) * 1024  # the link's buffers hold the largest
    torch.set_num_threads(1)
    rank = dist.get_rank()
    ranks = list(range(dist.get_world_size()))
    results: dict[str, Any] = {}
    for kib in sizes_kib:
        size = kib * 1024
        calls = max(10, min(200, (256 << 20) // size))
        tensor = torch.full((size // 4,), float(rank))
        best: dict[str, float] = {}
        for _ in range(repeats):
            for route in ("link", "segment"):
                dist.barrier()
                began = time.perf_counter()
                for _ in range(calls):
                    with get_tensors_parallel_tcp(tensor, ranks, route=route) as values:
                        for value in values:
                            value.view(torch.uint8).max()
                spent = (time.perf_counter() - began) / calls
                best[route] = min(best.get(route, float("inf")), spent)
                dist.barrier()
        results[str(kib)] = {route: round(1e3 * ms, 4) for route, ms in best.items()}
    return results if rank == 0 else {}
