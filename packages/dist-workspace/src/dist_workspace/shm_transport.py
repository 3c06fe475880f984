"""The shared-memory transport: one segment per sender, mapped by the receiver.

A record of at most :func:`inline_limit` bytes skips the segment: it travels inside
the sender's status, through the store, and the receiver copies it into private
memory. Below that size creating, mapping and removing a segment cost more than
the copy; the record is the same (header, digest, padding checked the same way).
Only where the store frees what the receiver deletes (a TCPStore, the default): a
FileStore keeps every value in its file for the rest of the job.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from dist_workspace.errors import WorkspaceError
from dist_workspace.reader import assemble, parse_header, view_entries
from dist_workspace.shm import Segment, create_segment, is_full, map_segment, too_small
from dist_workspace.writer import prepare_record, record_bytes, write_record

if TYPE_CHECKING:
    import mmap

    from dist_workspace.transport import CallId

DEFAULT_INLINE_BYTES = 64 * 1024


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


class SharedMemoryTransport:
    """Records in segments under the shared-memory directory (one host only)."""

    one_host = True

    def __init__(self, call: CallId, *, inline: bool = False) -> None:
        self._call = call
        self._inline = inline  # small records may travel in the status (the caller says)

    def send(self, weights: dict[str, torch.Tensor], config: Any) -> _SegmentParcel | _InlineParcel:
        """Writes the record into a new segment (unlinked again if writing fails).

        With ``inline`` set, a record of at most ``DIST_WORKSPACE_INLINE_BYTES`` (see
        :func:`inline_limit`) becomes the parcel's payload instead.
        """
        call = self._call
        record = prepare_record(weights, config, rank=call.rank, job=call.job, checksums=False)
        if self._inline and record.total_size <= inline_limit():
            return _InlineParcel(record_bytes(record))
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

        An inline record's values are over a private copy of its bytes instead.
        """
        inline = status.get("inline")
        if inline is not None:
            where = f"rank {sender}'s inline record"
            if inline != len(payload):
                raise WorkspaceError(
                    f"{where} has {len(payload)} bytes, the sender announced {inline!r:.40}"
                )
            return _values(bytearray(payload), len(payload), sender, where)
        name = str(status.get("segment"))
        size = int(status.get("size", -1))
        where = f"rank {sender}'s segment {name}"
        return _values(map_segment(name, size, where), size, sender, where)

    def close(self) -> None:
        """Nothing to drop: each sender unlinks its own segment."""


def _values(
    buffer: mmap.mmap | bytearray, size: int, sender: int, where: str
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The record in ``buffer`` (writable, private), checked to be ``sender``'s."""
    header = parse_header(lambda at, length: bytes(buffer[at : at + length]), size, where)
    if header.rank != sender:
        raise WorkspaceError(f"{where} says it was written by rank {header.rank}")
    return assemble(view_entries(buffer, header), header, where)
