"""The shared-memory transport: one segment per sender, mapped by the receiver.

A record of at most :func:`inline_limit` bytes skips the segment: it travels inside
the sender's status, through the store, and the receiver copies it into private
memory. Below that size creating, mapping and removing a segment cost more than
the copy; the record is the same (header, digest, padding checked the same way).
Only where the store frees what the receiver deletes (a TCPStore, the default): a
FileStore keeps every value in its file for the rest of the job.

A record of up to :data:`CROSS_MEMORY_MAX_BYTES` skips the segment too once a sender
knows that its receiver can read its memory (:mod:`dist_workspace.cross_memory`):
the header travels in the status, and the receiver copies the tensors' bytes
straight out of the sender's memory into its own, while the sender waits for the
verdict (so the bytes do not change under it). Writing a fresh segment costs most of
a small call (its tmpfs pages are allocated, then freed). A sender learns it in two
calls with a receiver: the first goes through a segment and its verdict names the
receiver's pid; the second goes through a segment too and offers its memory beside
it, naming that pid as its ptracer (Yama); the receiver tries the memory, falls back
to the segment where the kernel refuses, and the verdict says which. Larger records
keep the segment: every sender writes its own at once, where the receiver would copy
them one after the other.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import secrets
from typing import TYPE_CHECKING, Any

import torch

from dist_workspace import cross_memory
from dist_workspace.errors import WorkspaceError
from dist_workspace.format import DIGEST_BYTES
from dist_workspace.reader import assemble, parse_header, view_entries
from dist_workspace.shm import Segment, create_segment, is_full, map_segment, too_small
from dist_workspace.writer import (
    PreparedRecord,
    prepare_record,
    record_bytes,
    record_pieces,
    write_record,
)

if TYPE_CHECKING:
    from dist_workspace.transport import CallId

logger = logging.getLogger(__name__)

DEFAULT_INLINE_BYTES = 64 * 1024
CROSS_MEMORY_MAX_BYTES = 8 << 20  # above it segments were faster (see the README)
_TOKEN_BYTES = 16


@dataclasses.dataclass
class _Receiver:
    """What a sender knows of a receiver: its pid, and whether it read this memory."""

    pid: int
    reads_memory: bool | None = None  # None: not tried yet


# (job tag, receiver's global rank) -> what this process, as a sender, learnt of it
_receivers: dict[tuple[str, int], _Receiver] = {}


def _learn(call: CallId, verdict: dict[str, Any]) -> None:
    """Keeps what a verdict says of its receiver (its pid, memory reads).

    A new pid (the receiver was restarted) makes the next call a trial again.
    """
    pid = verdict.get("pid")
    if not isinstance(pid, int):
        return
    key = (call.job, call.receiver)
    known = _receivers.get(key)
    if known is None or known.pid != pid:
        known = _receivers[key] = _Receiver(pid)
    tried = verdict.get("memory", {})
    if isinstance(tried, dict) and str(call.rank) in tried:
        known.reads_memory = bool(tried[str(call.rank)])


def inline_limit() -> int:
    """Records up to this many bytes travel in the status: ``DIST_WORKSPACE_INLINE_BYTES``.

    64 KiB unless the variable says otherwise; 0 sends every record through a segment.

    Raises:
        WorkspaceError: The variable is not a non-negative integer.
    """
    text = os.environ.get("DIST_WORKSPACE_INLINE_BYTES")
    if text is None:
        return DEFAULT_INLINE_BYTES
    try:
        limit = int(text)
    except ValueError:
        limit = -1
    if limit < 0:
        raise WorkspaceError(
            f"DIST_WORKSPACE_INLINE_BYTES={text!r}: expected a number of bytes (0 or more)"
        )
    return limit


class _SegmentParcel:
    """A written segment; the creator unlinks it once the receiver has mapped it."""

    def __init__(self, segment: Segment, size: int) -> None:
        self._segment = segment
        self._size = size

    def status(self) -> dict[str, Any]:
        return {"segment": self._segment.name, "size": self._size}

    def payload(self) -> bytes:
        return b""

    def release(self) -> None:
        self._segment.unlink()


class _InlineParcel:
    """A small record carried in the status itself; nothing to release."""

    def __init__(self, record: bytearray) -> None:
        self._record = record

    def status(self) -> dict[str, Any]:
        return {"inline": len(self._record)}

    def payload(self) -> bytes:
        return bytes(self._record)

    def release(self) -> None:
        """Nothing is held outside this process."""


class _MemoryParcel:
    """A record left in this process's memory for the receiver to copy.

    Holds the record (its tensors, copies off a GPU included) and a random token,
    read in the same system call as the data: a token that matches proves the bytes
    came from this process, not from a later one given the same pid.
    """

    def __init__(self, record: PreparedRecord, reader: int) -> None:
        self._pieces = record_pieces(record)
        self._size = record.total_size
        self._token = ctypes.create_string_buffer(secrets.token_bytes(_TOKEN_BYTES), _TOKEN_BYTES)
        cross_memory.allow_reader(reader)

    def status(self) -> dict[str, Any]:
        spans = [[at, data.data_ptr(), data.numel()] for at, data in self._pieces.spans]
        return {
            "memory": {
                "pid": os.getpid(),
                "size": self._size,
                "token": self._token.raw.hex(),
                "token_at": ctypes.addressof(self._token),
                "spans": spans,
            }
        }

    def payload(self) -> bytes:
        return self._pieces.head + self._pieces.digest

    def release(self) -> None:
        """The receiver has copied (or given up): the tensors may change again."""


class _TrialParcel:
    """A segment, and this memory offered beside it: the receiver says which it read."""

    def __init__(self, segment: _SegmentParcel, memory: _MemoryParcel) -> None:
        self._segment = segment
        self._memory = memory

    def status(self) -> dict[str, Any]:
        return {**self._segment.status(), **self._memory.status()}

    def payload(self) -> bytes:
        return self._memory.payload()

    def release(self) -> None:
        self._segment.release()


class SharedMemoryTransport:
    """Records in segments under the shared-memory directory (one host only)."""

    one_host = True

    def __init__(self, call: CallId, *, inline: bool = False) -> None:
        self._call = call
        # The store frees deleted values (the caller says): small records and the
        # headers of records left in memory may travel in the status.
        self._inline = inline
        self._memory_reads: dict[str, bool] = {}  # receiver: sender rank -> read its memory
        self._records_seen = False  # receiver: a record came through a segment or memory

    def send(
        self, weights: dict[str, torch.Tensor], config: Any
    ) -> _SegmentParcel | _InlineParcel | _MemoryParcel | _TrialParcel:
        """Writes the record into a new segment (unlinked again if writing fails).

        With ``inline`` set, a record of at most ``DIST_WORKSPACE_INLINE_BYTES`` (see
        :func:`inline_limit`) becomes the parcel's payload instead. A record of at
        most :data:`CROSS_MEMORY_MAX_BYTES` stays in this process's memory for the
        receiver to copy, once the receiver has read it that way before (see the
        module's docstring); reads ``DIST_WORKSPACE_CROSS_MEMORY``.
        """
        call = self._call
        record = prepare_record(weights, config, rank=call.rank, job=call.job, checksums=False)
        if self._inline and record.total_size <= inline_limit():
            return _InlineParcel(record_bytes(record))
        receiver = None
        # The header travels in the status: only through a store that frees it.
        if self._inline and record.total_size <= CROSS_MEMORY_MAX_BYTES and cross_memory.enabled():
            receiver = _receivers.get((call.job, call.receiver))
        if receiver is not None and receiver.reads_memory:
            return _MemoryParcel(record, receiver.pid)
        segment = self._write_segment(record)
        if receiver is not None and receiver.reads_memory is None:
            return _TrialParcel(segment, _MemoryParcel(record, receiver.pid))
        return segment

    def settle(self, verdict: dict[str, Any]) -> None:
        """Sender: learns from a verdict the receiver's pid and whether it read memory."""
        _learn(self._call, verdict)

    def verdict(self) -> dict[str, Any]:
        """Receiver: its pid, and which senders' memory it read or failed to.

        Nothing when every record came inline (senders learn only what a larger
        record needs) or when ``DIST_WORKSPACE_CROSS_MEMORY`` turns reads off here.
        """
        if not self._records_seen or not cross_memory.enabled():
            return {}
        return {"pid": os.getpid(), "memory": self._memory_reads}

    def _write_segment(self, record: PreparedRecord) -> _SegmentParcel:
        call = self._call
        segment = create_segment(
            record.total_size, job=call.job, group=call.group, seq=call.seq, rank=call.rank
        )
        try:
            write_record(segment.fd, record)
            segment.close()
        except OSError as error:
            segment.unlink()
            if is_full(error):  # another process filled it since create_segment looked
                raise too_small(call.rank, record.total_size, segment.path.parent) from None
            raise
        except BaseException:
            segment.unlink()
            raise
        return _SegmentParcel(segment, record.total_size)

    def receive(
        self, sender: int, status: dict[str, Any], payload: bytes
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """The sender's values: zero-copy over a private mapping of its segment.

        An inline record's values are over a private copy of its bytes instead, and a
        record left in the sender's memory is copied into this process's.
        """
        inline = status.get("inline")
        if inline is not None:
            where = f"rank {sender}'s inline record"
            if inline != len(payload):
                raise WorkspaceError(
                    f"{where} has {len(payload)} bytes, the sender announced {inline!r:.40}"
                )
            return _values(bytearray(payload), len(payload), sender, where)
        self._records_seen = True
        memory = status.get("memory")
        if isinstance(memory, dict):
            where = f"rank {sender}'s memory (pid {memory.get('pid')!r:.20})"
            try:
                buffer, size = _copy_from_peer(memory, payload, where)
            except cross_memory.CrossMemoryError as error:
                self._memory_reads[str(sender)] = False  # the sender sends segments next
                if "segment" not in status:
                    raise WorkspaceError(
                        f"{where}: the kernel refused to copy it: {error}. Set "
                        "DIST_WORKSPACE_CROSS_MEMORY=0 to exchange through segments only"
                    ) from None
                logger.info("%s: cannot copy it (%s); reading its segment", where, error)
            else:
                if "segment" in status:
                    self._memory_reads[str(sender)] = True
                return _values(buffer, size, sender, where)
        name = str(status.get("segment"))
        size = int(status.get("size", -1))
        where = f"rank {sender}'s segment {name}"
        return _values(map_segment(name, size, where), size, sender, where)

    def close(self) -> None:
        """Nothing to drop: each sender unlinks its own segment."""


def _copy_from_peer(memory: dict[str, Any], payload: bytes, where: str) -> tuple[Any, int]:
    """The record a sender left in its memory, copied into a fresh buffer, and its size.

    The header and digest came in ``payload``; the spans name where each entry's data
    lies in the sender. Every other byte (alignment padding) is zero, as written.

    Raises:
        WorkspaceError: The spans do not fit the record, or the token does not match.
        cross_memory.CrossMemoryError: The kernel refused the copy.
    """
    try:
        pid = int(memory["pid"])
        size = int(memory["size"])
        token = bytes.fromhex(str(memory["token"]))
        token_at = int(memory["token_at"])
        spans = [(int(at), int(address), int(length)) for at, address, length in memory["spans"]]
    except (KeyError, TypeError, ValueError) as error:
        raise WorkspaceError(f"{where}: malformed status ({error!r})") from None
    head = len(payload) - DIGEST_BYTES
    end = size - DIGEST_BYTES
    if head < 8 or end < head or len(token) != _TOKEN_BYTES:
        raise WorkspaceError(f"{where}: {len(payload)} header bytes for a {size}-byte record")
    buffer = torch.empty(size, dtype=torch.uint8)
    base = buffer.data_ptr()
    buffer[:head] = torch.frombuffer(bytearray(payload[:head]), dtype=torch.uint8)
    buffer[end:] = torch.frombuffer(bytearray(payload[head:]), dtype=torch.uint8)
    filled = head
    for at, _, length in sorted(spans):
        if at < filled or length < 0 or at + length > end:
            raise WorkspaceError(f"{where}: span of {length} bytes at {at} is outside the record")
        buffer[filled:at].zero_()
        filled = at + length
    buffer[filled:end].zero_()
    seen = ctypes.create_string_buffer(_TOKEN_BYTES)
    copies = [(ctypes.addressof(seen), token_at, _TOKEN_BYTES)]
    copies += [(base + at, address, length) for at, address, length in spans]
    cross_memory.read_spans(pid, copies)
    if seen.raw != token:
        raise WorkspaceError(f"{where}: pid {pid} is not the sender any more (token mismatch)")
    return buffer.numpy(), size


def _values(buffer: Any, size: int, sender: int, where: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """The record in ``buffer`` (writable, private), checked to be ``sender``'s."""
    header = parse_header(lambda at, length: bytes(buffer[at : at + length]), size, where)
    if header.rank != sender:
        raise WorkspaceError(f"{where} says it was written by rank {header.rank}")
    return assemble(view_entries(buffer, header), header, where)
