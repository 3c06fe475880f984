"""Reading records: parsing and validating the header, then loading, mapping or viewing data.

A file that is not exactly a record of this format is refused before any of its bytes
are interpreted as data. Large records on local file systems are mapped privately
(copy-on-write) rather than read; every entry's CRC-32 is checked where one is
recorded.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import struct
import zlib
from collections.abc import Callable
from typing import Any

import torch

from dist_workspace.config_codec import CONFIG_TENSOR_PREFIX, decode_config
from dist_workspace.crc import CHUNK_BYTES, OverlappedCrc
from dist_workspace.errors import WorkspaceError
from dist_workspace.format import (
    FORMAT_VERSION,
    META_CONFIG,
    META_FORMAT,
    META_JOB,
    META_LAYOUT,
    META_RANK,
    SHARED_PREFIX,
    Layout,
    RecordHeader,
    StoredEntry,
    byte_view,
    dtype_from_name,
    foreign,
)
from dist_workspace.fsutil import is_local_filesystem

_MAX_HEADER_BYTES = 256 * 1024 * 1024
# Records at least this large are mapped rather than read when the file system is
# local: reading copies every byte into fresh pages, which cost as much as the copy.
MAP_MIN_BYTES = 4 * 1024 * 1024
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)


def parse_header(read_at: Callable[[int, int], bytes], size: int, where: str) -> RecordHeader:
    """Reads and validates a record's header without interpreting any tensor data.

    Args:
        read_at: Returns ``length`` bytes at ``offset`` (fewer at the end of the data).
        size: Total size of the file or buffer in bytes.
        where: Rank and path for error messages.

    Raises:
        WorkspaceError: The bytes are not a complete dist-workspace record.
    """
    if size < 8:
        raise foreign(where, f"{size} bytes, shorter than the 8-byte header length")
    (header_size,) = struct.unpack("<Q", read_at(0, 8))
    if header_size > min(size - 8, _MAX_HEADER_BYTES):
        raise foreign(where, f"header length {header_size} does not fit in the {size}-byte file")
    raw = read_at(8, header_size)
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise foreign(where, f"the header is not JSON: {error}") from None
    if not isinstance(document, dict):
        raise foreign(where, "the header is not a JSON object")
    metadata = document.pop("__metadata__", None)
    if not isinstance(metadata, dict) or metadata.get(META_FORMAT) != FORMAT_VERSION:
        raise foreign(where, f"no {META_FORMAT}={FORMAT_VERSION!r} in the safetensors metadata")
    layout = Layout.from_json(metadata.get(META_LAYOUT, ""), where)
    data_start = 8 + header_size
    entries: list[StoredEntry] = []
    for name, spec in document.items():
        try:
            dtype_name = spec["dtype"]
            shape = tuple(int(dim) for dim in spec["shape"])
            begin, end = (int(value) for value in spec["data_offsets"])
        except (TypeError, KeyError, ValueError):
            raise foreign(where, f"entry {name!r} is malformed") from None
        dtype = dtype_from_name(dtype_name)
        if dtype is None:
            raise foreign(where, f"entry {name!r} has the unknown dtype {dtype_name!r}")
        numel = 1
        for dim in shape:
            if dim < 0:
                raise foreign(where, f"entry {name!r} has a negative dimension {shape}")
            numel *= dim
        if end - begin != numel * dtype.itemsize:
            raise foreign(where, f"entry {name!r}: offsets {begin}..{end} do not fit {shape}")
        entries.append(
            StoredEntry(name, dtype, dtype_name, shape, data_start + begin, data_start + end)
        )
    entries.sort(key=lambda entry: (entry.begin, entry.end))
    position = data_start
    for entry in entries:
        if entry.begin != position:
            raise foreign(where, f"entry {entry.name!r} starts at {entry.begin}, not {position}")
        position = entry.end
    if position != size:
        raise WorkspaceError(
            f"{where}: truncated or extended record: its header describes {position} bytes, "
            f"the file has {size}. Was it copied partially? Write it again"
        )
    rank_text = str(metadata.get(META_RANK, ""))
    return RecordHeader(
        entries=tuple(entries),
        layout=layout,
        config_text=str(metadata.get(META_CONFIG, "null")),
        rank=int(rank_text) if rank_text.lstrip("-").isdigit() else None,
        job=str(metadata.get(META_JOB, "")),
        data_start=data_start,
        total_size=size,
    )


def read_into(fd: int, target: torch.Tensor, offset: int, crc: int = 0) -> int:
    """Fills a contiguous CPU tensor from ``fd`` at ``offset``; returns the running CRC."""
    view = memoryview(byte_view(target).numpy()).cast("B")  # type: ignore[arg-type]
    hasher = OverlappedCrc(len(view), crc)
    done = 0
    try:
        while done < len(view):
            chunk = view[done : done + CHUNK_BYTES]
            got = os.preadv(fd, [chunk], offset + done)
            if got == 0:
                raise EOFError(f"end of file at byte {offset + done}")
            hasher.feed(chunk[:got])
            done += got
    finally:
        crc = hasher.result()
    return crc


def load_entries(
    fd: int, header: RecordHeader, where: str, entries: list[StoredEntry] | None = None
) -> dict[str, torch.Tensor]:
    """Reads data entries of a record into fresh memory, checking each CRC-32.

    Args:
        fd: The open record.
        header: Its parsed header.
        where: What to call the file in errors.
        entries: The entries to read; every data entry when None.

    Raises:
        WorkspaceError: A checksum does not match (naming the entry) or the file
            shrank while it was read.
    """
    tensors: dict[str, torch.Tensor] = {}
    for entry in header.data_entries() if entries is None else entries:
        tensor = torch.empty(entry.shape, dtype=entry.dtype)
        try:
            crc = read_into(fd, tensor, entry.begin)
        except EOFError as error:
            raise WorkspaceError(
                f"{where}: truncated while reading {entry.name!r}: {error}"
            ) from None
        check_crc(header, entry, crc, where)
        tensors[entry.name] = tensor
    return tensors


def check_crc(header: RecordHeader, entry: StoredEntry, crc: int, where: str) -> None:
    """Raises when ``crc`` is not what the header records for ``entry``.

    Raises:
        WorkspaceError: A mismatch, naming the entry.
    """
    expected = header.layout.crc32
    if expected is None:
        return
    recorded = expected.get(entry.name)
    if recorded != f"{crc:08x}":
        raise WorkspaceError(
            f"{where}: checksum mismatch in tensor {entry.name!r}: recorded "
            f"{recorded}, data hashes to {crc:08x}. The file is corrupted; "
            "nothing from it was returned. Write it again"
        )


def map_entries(fd: int, size: int, header: RecordHeader, where: str) -> dict[str, torch.Tensor]:
    """Tensors over a private (copy-on-write) mapping of the file, each CRC-checked.

    No byte is copied: the tensors share the page cache until they are written to.
    The mapping is filled at once, so a file truncated meanwhile is an error here.

    Returns:
        The entries, or an empty dict when this kernel cannot pre-fill a mapping
        (before Linux 5.14); the caller then reads instead.

    Raises:
        WorkspaceError: A checksum does not match, or the file shrank.
    """
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        mapping.madvise(_MADV_POPULATE_READ)
    except OSError as error:
        mapping.close()
        if error.errno == errno.EINVAL:
            return {}
        raise WorkspaceError(f"{where}: truncated while it was mapped: {error}") from None
    view = memoryview(mapping)
    try:
        for entry in header.data_entries():
            crc = 0
            for begin in range(entry.begin, entry.end, CHUNK_BYTES):
                crc = zlib.crc32(view[begin : min(begin + CHUNK_BYTES, entry.end)], crc)
            check_crc(header, entry, crc, where)
    finally:
        view.release()
    return view_entries(mapping, header)


def view_entries(buffer: Any, header: RecordHeader) -> dict[str, torch.Tensor]:
    """Zero-copy tensors over a writable buffer (a private mmap) for each data entry."""
    tensors: dict[str, torch.Tensor] = {}
    for entry in header.data_entries():
        numel = 1
        for dim in entry.shape:
            numel *= dim
        if numel == 0:
            tensors[entry.name] = torch.empty(entry.shape, dtype=entry.dtype)
            continue
        flat = torch.frombuffer(buffer, dtype=entry.dtype, count=numel, offset=entry.begin)
        tensors[entry.name] = flat.view(entry.shape)
    return tensors


def assemble(
    stored: dict[str, torch.Tensor], header: RecordHeader, where: str
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Rebuilds (config, weights) from stored entries: shared views, order, config tensors.

    Raises:
        WorkspaceError: The layout references entries the record lacks.
    """
    try:
        logical: dict[str, torch.Tensor] = {
            name: tensor for name, tensor in stored.items() if not name.startswith(SHARED_PREFIX)
        }
        for name, spec in header.layout.views.items():
            blob = stored[spec.blob]
            byte_offset = blob.storage_offset() + spec.offset
            if byte_offset % spec.dtype.itemsize:
                raise ValueError(f"view {name!r} is misaligned")
            view = torch.empty(0, dtype=spec.dtype).set_(
                blob.untyped_storage(),
                byte_offset // spec.dtype.itemsize,
                spec.shape,
                spec.stride,
            )
            logical[name] = view
        weights = {name: logical[name] for name in header.layout.order}
        config_tensors = {
            name: tensor
            for name, tensor in logical.items()
            if name.startswith(CONFIG_TENSOR_PREFIX)
        }
        config = decode_config(header.config_text, config_tensors, where)
    except (KeyError, ValueError, TypeError, RuntimeError) as error:
        raise WorkspaceError(f"{where}: the record's layout is inconsistent: {error!r}") from None
    return config, weights


def read_record_file(
    path: str | os.PathLike[str], where: str
) -> tuple[Any, dict[str, torch.Tensor], RecordHeader]:
    """Opens, validates and fully reads a record file (without following symlinks).

    Raises:
        FileNotFoundError: There is no file at ``path``.
        WorkspaceError: It is not a complete, intact dist-workspace record.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        mappable = is_local_filesystem(os.path.dirname(os.path.abspath(path)))
        header, stored = read_record_fd(fd, where, mappable=mappable)
    finally:
        os.close(fd)
    config, weights = assemble(stored, header, where)
    return config, weights, header


def read_record_fd(
    fd: int, where: str, *, mappable: bool = False
) -> tuple[RecordHeader, dict[str, torch.Tensor]]:
    """Parses the header of an open record file and loads its entries.

    Args:
        fd: The open file.
        where: What to call the file in errors.
        mappable: The file is on a local file system: a large record is then mapped
            (see :func:`map_entries`) instead of read.
    """
    size = os.fstat(fd).st_size
    header = parse_header(lambda offset, length: os.pread(fd, length, offset), size, where)
    if mappable and size >= MAP_MIN_BYTES and header.data_entries():
        with contextlib.suppress(ValueError):  # mmap refuses some files: read them instead
            mapped = map_entries(fd, size, header, where)
            if mapped:
                return header, mapped
    return header, load_entries(fd, header, where)
