"""A value exactly as a reader of its record gets it, through anonymous memory."""

from __future__ import annotations

import mmap
import os
from typing import Any

import torch

from dist_workspace.reader import assemble, parse_header, view_entries
from dist_workspace.writer import prepare_record, write_record


def copy_through_record(
    weights: dict[str, torch.Tensor], config: Any, *, rank: int | None, job: str, where: str
) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(config, weights)`` exactly as a reader of their record gets them.

    The record is written into anonymous memory (``memfd_create``) and parsed back
    like a peer's segment: every tensor comes back on CPU, bit-exact, shared storage
    still shared, and none aliases the tensors passed in (writing to the result never
    changes them, nor they it). Tuples in the config come back as lists.

    Raises:
        TypeError, ValueError: As :func:`~dist_workspace.writer.prepare_record`.
    """
    record = prepare_record(weights, config, rank=rank, job=job, checksums=False)
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None:
        fd = memfd_create("dist-workspace-own-value", os.MFD_CLOEXEC)
    else:  # pragma: no cover - every Linux since 3.17 has memfd_create
        import tempfile  # noqa: PLC0415

        fd, path = tempfile.mkstemp(prefix="dist-workspace-own-value-")
        os.unlink(path)
    try:
        os.ftruncate(fd, record.total_size)
        write_record(fd, record)
        mapping = mmap.mmap(
            fd, record.total_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    finally:
        os.close(fd)
    header = parse_header(
        lambda offset, length: mapping[offset : offset + length], record.total_size, where
    )
    return assemble(view_entries(mapping, header), header, where)
