"""``inspect --verify``: check every rank file's header and every tensor's CRC-32, streaming.

Each file's header is validated as a reader does (:func:`dist_workspace.merge.read_rank_file`:
the header digest, the layout, and agreement with safetensors' own parser), then every
data entry is read in chunks and its CRC-32 compared with the one the header records.
Memory stays at one chunk. A bad file does not stop the others from being checked; a
damaged entry is reported under the tensor names that use it (every member of a
shared block, or the config tensor).
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Callable
from pathlib import Path

from dist_workspace.config_codec import CONFIG_TENSOR_PREFIX
from dist_workspace.errors import WorkspaceError
from dist_workspace.format import RecordHeader, StoredEntry
from dist_workspace.merge import RankFile, rank_file_paths, read_rank_file
from dist_workspace.units import format_bytes

_CHUNK_BYTES = 16 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Damage:
    """One thing wrong with one file."""

    rank: int
    path: Path
    what: str  # "tensor 'w': checksum mismatch ..." or the header's refusal

    def describe(self) -> str:
        """A sentence naming the rank, the file and what is wrong."""
        return f"rank {self.rank}'s file {self.path}: {self.what}"


@dataclasses.dataclass
class VerifyReport:
    """What was checked, and what was found wrong."""

    files: list[RankFile] = dataclasses.field(default_factory=list)  # with intact headers
    checked_files: int = 0
    tensors: int = 0
    nbytes: int = 0
    damage: list[Damage] = dataclasses.field(default_factory=list)

    @property
    def intact(self) -> bool:
        """Whether nothing was found wrong."""
        return not self.damage

    def summary(self) -> str:
        """One line: what was checked and that it is intact, or what is not."""
        files = "file" if self.checked_files == 1 else "files"
        tensors = "tensor" if self.tensors == 1 else "tensors"
        checked = (
            f"{self.tensors} {tensors} in {self.checked_files} {files} "
            f"({format_bytes(self.nbytes)})"
        )
        if self.intact:
            return f"verified {checked}: checksums and headers intact"
        damaged = sorted({(item.rank, item.path) for item in self.damage})
        first = self.damage[0].describe()
        more = f" (and {len(self.damage) - 1} more problems)" if len(self.damage) > 1 else ""
        return (
            f"verification FAILED: {len(damaged)} of {self.checked_files} {files} damaged; "
            f"{first}{more}"
        )


def _users_of(header: RecordHeader, entry: StoredEntry) -> str:
    """The tensor names an entry's bytes belong to, for messages."""
    users = [name for name, view in header.layout.views.items() if view.blob == entry.name]
    if not users:
        if entry.name.startswith(CONFIG_TENSOR_PREFIX):
            return f"config tensor {entry.name!r}"
        return f"tensor {entry.name!r}"
    quoted = ", ".join(repr(name) for name in users)
    return (
        f"tensor {quoted} (sharing {entry.name!r})"
        if len(users) == 1
        else (f"tensors {quoted} (sharing {entry.name!r})")
    )


def _check_entries(
    fd: int, rank_file: RankFile, report: VerifyReport, advance: Callable[[int], None] | None
) -> None:
    header = rank_file.header
    recorded = header.layout.crc32 or {}
    for entry in header.data_entries():
        crc = 0
        offset = entry.begin
        while offset < entry.end:
            chunk = os.pread(fd, min(_CHUNK_BYTES, entry.end - offset), offset)
            if not chunk:
                break
            crc = zlib.crc32(chunk, crc)
            offset += len(chunk)
            report.nbytes += len(chunk)
            if advance is not None:
                advance(len(chunk))
        if offset < entry.end:
            what = f"{_users_of(header, entry)}: the file ends at byte {offset}, inside it"
            report.damage.append(Damage(rank_file.rank, rank_file.path, what))
            return
        if recorded.get(entry.name) != f"{crc:08x}":
            what = (
                f"{_users_of(header, entry)}: checksum mismatch (recorded "
                f"{recorded.get(entry.name)}, data hashes to {crc:08x})"
            )
            report.damage.append(Damage(rank_file.rank, rank_file.path, what))


def verify_directory(
    directory: Path, progress: Callable[[int], Callable[[int], None]] | None = None
) -> VerifyReport:
    """Checks every rank file of ``directory``; never raises for a bad file.

    Args:
        directory: A workspace directory.
        progress: Called with the total bytes to read; returns a function called
            with the bytes read as they are read.
    """
    report = VerifyReport()
    for rank, path in rank_file_paths(directory):
        report.checked_files += 1
        try:
            report.files.append(read_rank_file(rank, path))
        except WorkspaceError as error:
            what = str(error).removeprefix(f"rank {rank}'s file {path}: ")
            report.damage.append(Damage(rank, path, f"header: {what}"))
    total = sum(
        entry.end - entry.begin for item in report.files for entry in item.header.data_entries()
    )
    advance = progress(total) if progress is not None else None
    for rank_file in report.files:
        report.tensors += len(rank_file.header.layout.order)
        try:
            fd = os.open(rank_file.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as error:
            report.damage.append(
                Damage(rank_file.rank, rank_file.path, f"cannot be opened: {error}")
            )
            continue
        try:
            _check_entries(fd, rank_file, report, advance)
        finally:
            os.close(fd)
    return report
