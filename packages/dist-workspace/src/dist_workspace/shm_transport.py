"""The shared-memory transport: one segment per sender, mapped by the receiver."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from dist_workspace.errors import WorkspaceError
from dist_workspace.reader import assemble, parse_header, view_entries
from dist_workspace.shm import Segment, create_segment, is_full, map_segment, too_small
from dist_workspace.writer import prepare_record, write_record

if TYPE_CHECKING:
    from dist_workspace.transport import CallId


class _SegmentParcel:
    """A written segment; the creator unlinks it once the receiver has mapped it."""

    def __init__(self, segment: Segment, size: int) -> None:
        self._segment = segment
        self._size = size

    def status(self) -> dict[str, Any]:
        return {"segment": self._segment.name, "size": self._size}

    def release(self) -> None:
        self._segment.unlink()


class SharedMemoryTransport:
    """Records in segments under the shared-memory directory (one host only)."""

    one_host = True

    def __init__(self, call: CallId) -> None:
        self._call = call

    def send(self, weights: dict[str, torch.Tensor], config: Any) -> _SegmentParcel:
        """Writes the record into a new segment (unlinked again if writing fails)."""
        call = self._call
        record = prepare_record(weights, config, rank=call.rank, job=call.job, checksums=False)
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

    def receive(self, sender: int, status: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
        """Zero-copy tensors over a private mapping of the sender's segment."""
        name = str(status.get("segment"))
        size = int(status.get("size", -1))
        where = f"rank {sender}'s segment {name}"
        mapping = map_segment(name, size, where)
        header = parse_header(lambda offset, length: mapping[offset : offset + length], size, where)
        if header.rank != sender:
            raise WorkspaceError(f"{where} says it was written by rank {header.rank}")
        return assemble(view_entries(mapping, header), header, where)

    def close(self) -> None:
        """Nothing to drop: each sender unlinks its own segment."""
