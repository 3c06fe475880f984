"""Reading records: parsing and validating the header, then loading, mapping or viewing data.

A file that is not exactly a record of this format is refused before any of its bytes
are interpreted as data. Large records on local file systems are mapped privately
(copy-on-write) rather than read; every entry's CRC-32 is checked where one is
recorded.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import mmap
import os
import re
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from safetensors import safe_open

from dist_workspace.config_codec import CONFIG_TENSOR_PREFIX, decode_config
from dist_workspace.crc import CHUNK_BYTES, OverlappedCrc
from dist_workspace.errors import WorkspaceError
from dist_workspace.format import (
    ALIGNMENT,
    DIGEST_BYTES,
    FORMAT_VERSION,
    HEADER_DEPTH,
    INTEGRITY_ENTRY,
    MAX_HEADER_BYTES,
    META_CONFIG,
    META_FORMAT,
    META_JOB,
    META_LAYOUT,
    META_RANK,
    PAD_PREFIX,
    RESERVED_PREFIX,
    SHARED_PREFIX,
    Layout,
    RecordHeader,
    StoredEntry,
    ViewSpec,
    byte_view,
    dtype_from_name,
    foreign,
    header_digest,
    int_list,
    is_data_entry,
    numel_within,
)
from dist_workspace.fsutil import is_local_filesystem
from dist_workspace.safejson import JsonRefused, loads

# Records at least this large are mapped rather than read when the file system is
# local: reading copies every byte into fresh pages, which cost as much as the copy.
MAP_MIN_BYTES = 4 * 1024 * 1024
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_METADATA_KEYS = frozenset({META_FORMAT, META_CONFIG, META_LAYOUT, META_RANK, META_JOB})
_ENTRY_KEYS = frozenset({"dtype", "shape", "data_offsets"})
_RANK_TEXT = re.compile(r"-?[0-9]{1,18}")


def parse_header(
    read_at: Callable[[int, int], bytes],
    size: int,
    where: str,
    *,
    require_checksums: bool = False,
) -> RecordHeader:
    """Reads and validates a record's header without interpreting any tensor data.

    Everything a reader later trusts is checked here: the header's SHA-256 against the
    integrity entry, every entry's dtype, shape and offsets (they tile the data
    exactly, aligned), the layout's references (every weight is an entry or a view
    inside a shared block, every checksum names a data entry), and that padding is
    zeros. JSON is parsed with bounded nesting and without duplicate keys.

    Args:
        read_at: Returns ``length`` bytes at ``offset`` (fewer at the end of the data).
        size: Total size of the file or buffer in bytes.
        where: Rank and path for error messages.
        require_checksums: Refuse a record without per-entry CRC-32s (files always
            have them; shared-memory segments do not).

    Raises:
        WorkspaceError: The bytes are not a complete, intact dist-workspace record of
            this format; the message starts with ``where``.
    """
    with _cyclic_gc_paused():
        header, _ = _parse(read_at, size, where, require_checksums)
    return header


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pauses the cyclic garbage collector while a header is parsed.

    A header of 20000 entries makes some 100000 small acyclic containers, which set
    off full collections over every object torch keeps alive: two thirds of the
    parse time (400 ms instead of 140 ms here). Nothing parsed here forms a cycle.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _parse(
    read_at: Callable[[int, int], bytes], size: int, where: str, require_checksums: bool
) -> tuple[RecordHeader, dict[str, str]]:
    if size < 8:
        raise foreign(where, f"{size} bytes, shorter than the 8-byte header length")
    length_bytes = bytes(read_at(0, 8))
    (header_size,) = struct.unpack("<Q", length_bytes)
    if header_size > min(size - 8, MAX_HEADER_BYTES):
        raise foreign(
            where,
            f"header length {header_size} does not fit in the {size}-byte file "
            f"(at most {MAX_HEADER_BYTES})",
        )
    raw = bytes(read_at(8, header_size))
    if len(raw) != header_size:
        raise WorkspaceError(f"{where}: truncated while its header was read. Write it again")
    key = (raw, size, require_checksums)
    known = _validated.get(key)
    if known is not None:
        _check_digest(read_at, known[0].entries[-1], length_bytes + raw, where)
        _check_padding(read_at, known[0].entries, where)
        return known
    known = _parse_text(read_at, length_bytes, raw, size, where, require_checksums)
    if header_size <= _VALIDATED_MAX_HEADER_BYTES:
        if len(_validated) >= _VALIDATED_MAX:
            del _validated[next(iter(_validated))]  # the oldest
        _validated[key] = known
    return known


# Headers already validated, by their exact bytes and the record's size: a record
# whose header is byte for byte one parsed before describes the same entries (the
# validation is a function of those bytes and the size alone), so only what lies
# outside the header (its digest, the padding) is checked again. A loop of calls
# exchanging tensors of one shape sends the same header every time: parsing it again
# was most of a small call's cost on the receiver.
_VALIDATED_MAX = 256
_VALIDATED_MAX_HEADER_BYTES = 16 * 1024
_validated: dict[tuple[bytes, int, bool], tuple[RecordHeader, dict[str, str]]] = {}


def _parse_text(
    read_at: Callable[[int, int], bytes],
    length_bytes: bytes,
    raw: bytes,
    size: int,
    where: str,
    require_checksums: bool,
) -> tuple[RecordHeader, dict[str, str]]:
    """Validates the header ``raw`` of a record of ``size`` bytes, and its digest and padding."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise foreign(
            where, f"the header is not UTF-8: {error.reason} at byte {8 + error.start}"
        ) from None
    try:
        document = loads(text, max_depth=HEADER_DEPTH)
    except JsonRefused as error:
        raise foreign(where, f"the header is refused: {error}") from None
    if not isinstance(document, dict):
        raise foreign(where, "the header is not a JSON object")
    metadata = document.pop("__metadata__", None)
    if not isinstance(metadata, dict):
        raise foreign(where, f"it has no safetensors metadata, so no {META_FORMAT}")
    _check_format(metadata.get(META_FORMAT), where)

    data_start = 8 + len(raw)
    if data_start % ALIGNMENT:
        raise foreign(where, f"its data starts at byte {data_start}, not a multiple of 64")
    entries = [
        _entry(name, spec, data_start, size - data_start, where) for name, spec in document.items()
    ]
    entries.sort(key=_begin_end)
    position = data_start
    for entry in entries:
        if entry.begin != position:
            raise foreign(
                where, f"entry {entry.name!r:.200} starts at byte {entry.begin}, not {position}"
            )
        position = entry.end
    if position != size:
        raise WorkspaceError(
            f"{where}: truncated or extended record: its header describes {position} bytes, "
            f"the file has {size}. Was it copied partially? Write it again"
        )
    last = entries[-1] if entries else None
    if (
        last is None
        or last.name != INTEGRITY_ENTRY
        or last.shape != (DIGEST_BYTES,)
        or last.dtype_name != "U8"
    ):
        raise foreign(where, f"its last entry is not the {DIGEST_BYTES}-byte {INTEGRITY_ENTRY}")
    _check_digest(read_at, last, length_bytes + raw, where)

    if set(metadata) != _METADATA_KEYS or not all(isinstance(v, str) for v in metadata.values()):
        raise foreign(
            where, f"its metadata keys are {sorted(metadata)!r:.300}, not {sorted(_METADATA_KEYS)}"
        )
    rank_text = metadata[META_RANK]
    if rank_text and not _RANK_TEXT.fullmatch(rank_text):
        raise foreign(where, f"{META_RANK} is {rank_text!r:.40}, not a rank")
    layout = Layout.from_json(metadata[META_LAYOUT], where)
    _check_references(entries, layout, where, require_checksums)
    _check_padding(read_at, entries, where)
    header = RecordHeader(
        entries=tuple(entries),
        layout=layout,
        config_text=metadata[META_CONFIG],
        rank=int(rank_text) if rank_text else None,
        job=metadata[META_JOB],
        data_start=data_start,
        total_size=size,
    )
    return header, metadata


def _check_digest(
    read_at: Callable[[int, int], bytes],
    last: StoredEntry,
    length_and_header: bytes,
    where: str,
) -> None:
    """The digest recorded in the integrity entry (``last``) is the header's."""
    if bytes(read_at(last.begin, DIGEST_BYTES)) != header_digest(length_and_header):
        raise WorkspaceError(
            f"{where}: header checksum mismatch: the SHA-256 of its header differs from the "
            f"one recorded in {INTEGRITY_ENTRY}, so a name, dtype, shape, offset, the "
            "config or the layout changed after it was written (corruption or tampering). "
            "Nothing from it was loaded. Write it again"
        )


def _check_padding(
    read_at: Callable[[int, int], bytes],
    entries: Sequence[StoredEntry],
    where: str,
) -> None:
    """Every padding entry is zeros."""
    for entry in entries:
        if entry.name.startswith(PAD_PREFIX) and any(read_at(entry.begin, entry.end - entry.begin)):
            raise WorkspaceError(
                f"{where}: padding {entry.name!r} is not zeros: the file changed after "
                "it was written. Write it again"
            )


def _begin_end(entry: StoredEntry) -> tuple[int, int]:
    return entry.begin, entry.end


def _check_format(found: object, where: str) -> None:
    if found == FORMAT_VERSION:
        return
    if found is None:
        raise foreign(where, f"no {META_FORMAT} in the safetensors metadata")
    if found == "1":
        raise WorkspaceError(
            f"{where}: written in dist-workspace record format 1 (dist-workspace 0.2 and "
            f"earlier), whose header has no checksum; this dist-workspace reads format "
            f"{FORMAT_VERSION} only. Write it again with this version (rerun the step that "
            "wrote it), or read it with dist-workspace<0.3"
        )
    raise WorkspaceError(
        f"{where}: written in dist-workspace record format {found!r:.40}, which this "
        f"dist-workspace does not know (it reads format {FORMAT_VERSION}); was it written "
        "by a newer version? Upgrade dist-workspace where it is read, or write it again "
        "with this version"
    )


def _entry(name: str, spec: object, data_start: int, data_size: int, where: str) -> StoredEntry:
    if type(spec) is not dict or spec.keys() != _ENTRY_KEYS:
        raise foreign(where, f"entry {name!r:.200} is not an object of dtype, shape, data_offsets")
    dtype_text = spec["dtype"]
    dtype = dtype_from_name(dtype_text)
    if dtype is None:
        raise foreign(where, f"entry {name!r:.200} has the unknown dtype {dtype_text!r:.40}")
    shape = int_list(spec["shape"])
    offsets = int_list(spec["data_offsets"])
    if shape is None or offsets is None or len(offsets) != 2:
        raise foreign(where, f"entry {name!r:.200} has a malformed shape or data_offsets")
    begin, end = offsets
    if not begin <= end <= data_size:
        raise foreign(
            where,
            f"entry {name!r:.200}: offsets {begin}..{end} are outside the {data_size} data bytes",
        )
    numel = numel_within(shape, end - begin)
    if numel is None or numel * dtype.itemsize != end - begin:
        raise foreign(
            where,
            f"entry {name!r:.200}: {end - begin} bytes do not hold shape "
            f"{shape!r:.100} of {dtype_text}",
        )
    return StoredEntry(name, dtype, dtype_text, shape, data_start + begin, data_start + end)


def _check_references(
    entries: list[StoredEntry], layout: Layout, where: str, require_checksums: bool
) -> None:
    """Every entry is accounted for by the layout, and everything it names exists."""
    by_name = {entry.name: entry for entry in entries}
    order = set(layout.order)
    for entry in entries:
        name = entry.name
        if not name.startswith(RESERVED_PREFIX):
            if name not in order:
                raise foreign(where, f"entry {name!r:.200} is not a weight of the layout")
        elif name.startswith(PAD_PREFIX):
            if entry.dtype_name != "U8" or entry.end - entry.begin >= ALIGNMENT:
                raise foreign(where, f"padding {name!r:.200} is not 1 to 63 bytes of U8")
        elif name.startswith(SHARED_PREFIX):
            if entry.dtype_name != "U8" or len(entry.shape) != 1:
                raise foreign(where, f"shared block {name!r:.200} is not 1-D U8")
        elif not name.startswith(CONFIG_TENSOR_PREFIX) and name != INTEGRITY_ENTRY:
            raise foreign(where, f"entry {name!r:.200} has a reserved name this format lacks")
        if is_data_entry(name) and entry.begin % ALIGNMENT:
            raise foreign(where, f"entry {name!r:.200} is not 64-byte aligned")
    for name in layout.order:
        if name.startswith(RESERVED_PREFIX):
            raise foreign(where, f"the layout names the reserved {name!r:.200} as a weight")
        if (name in by_name) == (name in layout.views):
            raise foreign(where, f"weight {name!r:.200} must be exactly one entry or one view")
    referenced: set[str] = set()
    for name, view in layout.views.items():
        if name in by_name or not (name in order or name.startswith(CONFIG_TENSOR_PREFIX)):
            raise foreign(where, f"view {name!r:.200} is not a weight or config tensor")
        blob = by_name.get(view.blob)
        if blob is None or not view.blob.startswith(SHARED_PREFIX):
            raise foreign(where, f"view {name!r:.200} is in {view.blob!r:.200}, no shared block")
        referenced.add(view.blob)
        itemsize = view.dtype.itemsize
        if view.offset % itemsize:
            raise foreign(where, f"view {name!r:.200} is misaligned for {view.dtype_name}")
        if 0 not in view.shape:
            last = sum(
                (size - 1) * step for size, step in zip(view.shape, view.stride, strict=True)
            )
            if view.offset + (last + 1) * itemsize > blob.end - blob.begin:
                raise foreign(where, f"view {name!r:.200} reaches past the end of {view.blob!r}")
    for entry in entries:
        if entry.name.startswith(SHARED_PREFIX) and entry.name not in referenced:
            raise foreign(where, f"shared block {entry.name!r:.200} is in no view")
    if layout.crc32 is None:
        if require_checksums:
            raise foreign(where, "it records no checksums, which every workspace file has")
    elif layout.crc32.keys() != {entry.name for entry in entries if is_data_entry(entry.name)}:
        raise foreign(where, "its checksums do not name exactly its data entries")


def read_header_fd(fd: int, where: str) -> RecordHeader:
    """Parses and validates the header of an open record file, twice.

    Once by :func:`parse_header` (with checksums required, as every file has them)
    and once by ``safetensors.safe_open``, whose parser is written in Rust and fuzzed,
    on ``/proc/self/fd/{fd}`` (the very file opened, not a path that may have been
    replaced since). Both must accept it and agree on every entry's name, dtype and
    shape and on the metadata; each already checks that the entries tile the data.

    Raises:
        WorkspaceError: Either parser refuses it, or they read it differently.
    """
    size = os.fstat(fd).st_size
    with _cyclic_gc_paused():
        header, metadata = _parse(
            lambda offset, length: os.pread(fd, length, offset), size, where, True
        )
        _agree_with_safetensors(fd, header, metadata, where)
    return header


def _agree_with_safetensors(
    fd: int, header: RecordHeader, metadata: dict[str, str], where: str
) -> None:
    path = f"/proc/self/fd/{fd}"
    try:
        try:
            # Reads the header with pread: no mapping, so nothing to fault on NFS.
            handle = safe_open(path, framework="pt", backend="pread")
        except TypeError:  # safetensors before 0.8 has no backend: it maps the file
            handle = safe_open(path, framework="pt")
        with handle:
            theirs_metadata = handle.metadata()  # type: ignore[no-untyped-call]
            theirs = {}
            for name in handle.offset_keys():  # type: ignore[no-untyped-call]
                piece = handle.get_slice(name)  # type: ignore[no-untyped-call]
                theirs[name] = (piece.get_dtype(), list(piece.get_shape()))
    except Exception as error:
        raise foreign(where, f"safetensors refuses it: {error}") from None
    ours = {entry.name: (entry.dtype_name, list(entry.shape)) for entry in header.entries}
    if theirs != ours or theirs_metadata != metadata:
        raise foreign(where, "safetensors reads its header differently from this package")


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


def entry_chunks(
    fd: int, header: RecordHeader, entry: StoredEntry, where: str, buffer: bytearray
) -> Iterator[memoryview]:
    """An entry's bytes, read into ``buffer`` a chunk at a time (streaming, no copy).

    Each chunk is valid until the next is read. The CRC-32 is checked after the last
    chunk (so a consumer that writes the chunks must be able to discard what it wrote:
    merge writes to a temporary file). Hashed inline: the buffer is reused, so a
    chunk cannot be hashed on another thread while the next is read.

    Raises:
        WorkspaceError: The file ends early, or the checksum does not match (naming
            the entry).
    """
    crc = 0
    offset = entry.begin
    while offset < entry.end:
        want = min(len(buffer), entry.end - offset)
        chunk = memoryview(buffer)[:want]
        got = 0
        while got < want:
            count = os.preadv(fd, [chunk[got:]], offset + got)
            if count == 0:
                raise WorkspaceError(
                    f"{where}: truncated while reading {entry.name!r}: end of file at byte "
                    f"{offset + got}"
                )
            got += count
        crc = zlib.crc32(chunk, crc)
        yield chunk
        offset += want
    check_crc(header, entry, crc, where)


def view_in_block(spec: ViewSpec, block: torch.Tensor) -> torch.Tensor:
    """The tensor ``spec`` describes, as a view of its shared block's bytes.

    Raises:
        ValueError: The view does not start on a multiple of its element size.
    """
    byte_offset = block.storage_offset() + spec.offset
    if byte_offset % spec.dtype.itemsize:
        raise ValueError(f"view of {spec.blob!r} at byte {spec.offset} is misaligned")
    return torch.empty(0, dtype=spec.dtype).set_(
        block.untyped_storage(), byte_offset // spec.dtype.itemsize, spec.shape, spec.stride
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
            logical[name] = view_in_block(spec, stored[spec.blob])
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
    header = read_header_fd(fd, where)
    size = header.total_size
    if mappable and size >= MAP_MIN_BYTES and header.data_entries():
        with contextlib.suppress(ValueError):  # mmap refuses some files: read them instead
            mapped = map_entries(fd, size, header, where)
            if mapped:
                return header, mapped
    return header, load_entries(fd, header, where)
