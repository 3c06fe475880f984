"""Merging the rank files of a workspace into one plain safetensors file, streaming.

The output header is written by hand and each tensor's bytes are copied from its
rank file in chunks, so memory stays at one chunk (64 MiB), or one shared-storage
block when tensors of a rank share storage, whatever the total size. Every CRC-32 is
checked on the way; on any error the output is not created (it is written to a
temporary file and renamed at the end).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import torch

from dist_workspace.errors import WorkspaceError
from dist_workspace.format import RecordHeader, StoredEntry, ViewSpec, byte_view
from dist_workspace.fsutil import atomic_write, write_all
from dist_workspace.reader import load_entries, read_header_fd
from dist_workspace.workspace import RANK_FILE_PATTERN

_CHUNK_BYTES = 64 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class RankFile:
    """A rank's file and its validated header."""

    rank: int
    path: Path
    header: RecordHeader

    @property
    def where(self) -> str:
        """Rank and path, for messages."""
        return f"rank {self.rank}'s file {self.path}"


@dataclasses.dataclass(frozen=True)
class WeightInfo:
    """One logical weight of a rank: where its bytes come from."""

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    nbytes: int
    entry: StoredEntry | None  # stored as itself
    view: ViewSpec | None  # or a view into a shared block


def read_rank_files(directory: Path) -> list[RankFile]:
    """Every ``rank-{r}.safetensors`` of ``directory`` with its header, by rank.

    Raises:
        WorkspaceError: A file is not a complete dist-workspace record.
    """
    files = []
    for path in directory.iterdir():
        match = RANK_FILE_PATTERN.match(path.name)
        if not match:
            continue
        rank = int(match.group(1))
        where = f"rank {rank}'s file {path}"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as error:
            raise WorkspaceError(f"{where}: cannot be opened safely: {error}") from None
        try:
            header = read_header_fd(fd, where)
        finally:
            os.close(fd)
        files.append(RankFile(rank, path, header))
    return sorted(files, key=lambda item: item.rank)


def weights_of(rank_file: RankFile) -> list[WeightInfo]:
    """The logical weights of a rank file, in the order they were written."""
    header = rank_file.header
    stored = {entry.name: entry for entry in header.entries}
    views = header.layout.views
    result = []
    for name in header.layout.order:
        if name in views:
            spec = views[name]
            result.append(WeightInfo(name, spec.dtype_name, spec.shape, spec.nbytes, None, spec))
        elif name in stored:
            entry = stored[name]
            result.append(
                WeightInfo(
                    name, entry.dtype_name, entry.shape, entry.end - entry.begin, entry, None
                )
            )
        else:
            raise WorkspaceError(f"{rank_file.where}: weight {name!r} is in no entry")
    return result


def _merged_names(
    files: list[RankFile], rank_prefix: bool
) -> list[tuple[RankFile, WeightInfo, str]]:
    plan = []
    owner: dict[str, int] = {}
    for rank_file in files:
        for info in weights_of(rank_file):
            name = f"rank{rank_file.rank}.{info.name}" if rank_prefix else info.name
            if name in owner:
                raise WorkspaceError(
                    f"tensor {name!r} is in both rank {owner[name]} "
                    f"({files[0].path.parent / f'rank-{owner[name]}.safetensors'}) and "
                    f"{rank_file.where}; pass --rank-prefix to name them rank{{r}}.{{name}}"
                )
            owner[name] = rank_file.rank
            plan.append((rank_file, info, name))
    return plan


def _copy_checked(
    source: int, target: int, entry: StoredEntry, position: int, crc_hex: str | None, where: str
) -> None:
    crc = 0
    offset = entry.begin
    while offset < entry.end:
        chunk = os.pread(source, min(_CHUNK_BYTES, entry.end - offset), offset)
        if not chunk:
            raise WorkspaceError(f"{where}: truncated while copying {entry.name!r}")
        crc = zlib.crc32(chunk, crc)
        position = write_all(target, chunk, position)
        offset += len(chunk)
    if crc_hex is not None and crc_hex != f"{crc:08x}":
        raise WorkspaceError(f"{where}: checksum mismatch in tensor {entry.name!r}; merge aborted")


def merge_workspace(
    directory: Path, output: Path, *, rank_prefix: bool = False, mode: int = 0o600
) -> int:
    """Writes every rank's weights of ``directory`` into one safetensors file.

    Args:
        directory: A workspace directory.
        output: The safetensors file to create (replaced atomically).
        rank_prefix: Name tensors ``rank{r}.{name}`` instead of refusing duplicates.
        mode: Permission bits of the output.

    Returns:
        The number of tensors written.

    Raises:
        WorkspaceError: No rank files, a name in two ranks (naming both), or a
            truncated or corrupted rank file.
    """
    files = read_rank_files(directory)
    if not files:
        raise WorkspaceError(f"{directory} holds no rank-*.safetensors files to merge")
    plan = _merged_names(files, rank_prefix)
    document: dict[str, Any] = {
        "__metadata__": {
            "dist_workspace.merged_ranks": json.dumps([f.rank for f in files]),
            "dist_workspace.configs": json.dumps(
                {str(f.rank): f.header.config_text for f in files}
            ),
        }
    }
    offset = 0
    for _, info, name in plan:
        document[name] = {
            "dtype": info.dtype_name,
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    header = json.dumps(document, separators=(",", ":")).encode()
    header += b" " * ((-(8 + len(header))) % 8)
    data_start = 8 + len(header)

    def fill(target: int) -> None:
        write_all(target, struct.pack("<Q", len(header)) + header, 0)
        position = data_start
        for rank_file in files:
            entries = [(info, name) for f, info, name in plan if f is rank_file]
            source = os.open(rank_file.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                position = _copy_rank(source, target, rank_file, entries, position)
            finally:
                os.close(source)

    atomic_write(output, data_start + offset, fill, mode)
    return len(plan)


def _copy_rank(
    source: int,
    target: int,
    rank_file: RankFile,
    entries: list[tuple[WeightInfo, str]],
    position: int,
) -> int:
    crcs = rank_file.header.layout.crc32 or {}
    blobs: dict[str, torch.Tensor] = {}
    stored = {entry.name: entry for entry in rank_file.header.entries}
    for info, _ in entries:
        if info.entry is not None:
            _copy_checked(
                source, target, info.entry, position, crcs.get(info.entry.name), rank_file.where
            )
        else:
            assert info.view is not None
            blob_name = info.view.blob
            if blob_name not in blobs:
                blobs.clear()  # one shared block in memory at a time
                blobs.update(
                    load_entries(source, rank_file.header, rank_file.where, [stored[blob_name]])
                )
            blob = blobs[blob_name]
            view = torch.empty(0, dtype=info.view.dtype).set_(
                blob.untyped_storage(),
                info.view.offset // info.view.dtype.itemsize,
                info.shape,
                info.view.stride,
            )
            write_all(target, memoryview(byte_view(view.contiguous()).numpy()), position)  # type: ignore[arg-type]
        position += info.nbytes
    return position
