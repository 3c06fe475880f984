"""The shared-memory transport: one segment per sender, mapped by the receiver.

A record of at most :data:`dist_workspace.protocol.LINK_MAX_BYTES` skips the segment:
it travels in the sender's frame on the link, straight from its tensors, and the
receiver reads it into fresh memory of its own that its values then view. Larger
records go into a segment each sender writes at once; the receiver maps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from dist_workspace import protocol
from dist_workspace.errors import WorkspaceError
from dist_workspace.reader import assemble, parse_header, view_entries
from dist_workspace.shm import Segment, create_segment, is_full, map_segment, too_small
from dist_workspace.writer import PreparedRecord, prepare_record, record_buffers, write_record

if TYPE_CHECKING:
    from dist_workspace.transport import CallId


class LinkParcel:
    """A record small enough for the sender's frame; nothing to release."""

    def __init__(self, record: PreparedRecord) -> None:
        self._record = record

    def status(self) -> dict[str, Any]:
        """The route and the record's size."""
        return {"route": "link", "size": self._record.total_size}

    def body(self) -> Sequence[Any]:
        """The record's bytes, from its tensors."""
        return record_buffers(self._record)

    def release(self) -> None:
        """Nothing is held outside this process."""


class _SegmentParcel:
    """A written segment; the creator unlinks it once the receiver has mapped it."""

    def __init__(self, segment: Segment, size: int) -> None:
        self._segment = segment
        self._size = size

    def status(self) -> dict[str, Any]:
        return {"route": "segment", "segment": self._segment.name, "size": self._size}

    def body(self) -> Sequence[Any]:
        return ()

    def release(self) -> None:
        self._segment.unlink()


class SharedMemoryTransport:
    """Records in segments under the shared-memory directory (one host only)."""

    one_host = True

    def __init__(self, call: CallId) -> None:
        self._call = call

    def send(self, weights: dict[str, torch.Tensor], config: Any) -> LinkParcel | _SegmentParcel:
        """The record in the frame, or written into a new segment (unlinked on failure)."""
        call = self._call
        record = prepare_record(weights, config, rank=call.rank, job=call.job, checksums=False)
        if protocol.route(record.total_size, None) == "link":
            return LinkParcel(record)
        return self._write_segment(record)

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
        self, sender: int, status: dict[str, Any], body: torch.Tensor | None
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """The sender's values: zero-copy over a private mapping of its segment.

        A record in the frame is over the frame's body instead, memory of this process.
        """
        if status.get("route") == "link":
            return frame_values(status, body, sender)
        name = str(status.get("segment"))
        size = int(status.get("size", -1))
        where = f"rank {sender}'s segment {name}"
        return values(map_segment(name, size, where), size, sender, where)

    def close(self) -> None:
        """Nothing to drop: each sender unlinks its own segment."""


def frame_values(
    status: dict[str, Any], body: torch.Tensor | None, sender: int
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The values of a record that came in ``sender``'s frame (over its body)."""
    where = f"rank {sender}'s record in its frame"
    size = 0 if body is None else body.numel()
    if status.get("size") != size or body is None:
        raise WorkspaceError(
            f"{where} has {size} bytes, the sender announced {status.get('size')!r:.40}"
        )
    return values(body.numpy(), size, sender, where)


def values(buffer: Any, size: int, sender: int, where: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """The record in ``buffer`` (writable, private), checked to be ``sender``'s."""
    header = parse_header(lambda at, length: bytes(buffer[at : at + length]), size, where)
    if header.rank != sender:
        raise WorkspaceError(f"{where} says it was written by rank {header.rank}")
    return assemble(view_entries(buffer, header), header, where)
