"""The on-disk and in-memory record: a safetensors file with a dist-workspace layout.

One record holds one rank's config (JSON, in the safetensors metadata) and tensors. It
is written and parsed here, never by pickle: a file that is not exactly this format is
refused before any of its bytes are interpreted as data.

Format decisions (the safetensors format leaves them open):

- The header is padded with spaces so that the data starts at a multiple of 64 bytes,
  and every tensor starts at a multiple of 64 bytes; padding between tensors is stored
  as ``U8`` entries named ``dist_workspace.pad.{n}`` (safetensors allows no holes).
  Aligned data lets a reader of shared memory hand out zero-copy tensors.
- Tensors that share storage (tied weights, a tensor and its transpose, views of one
  buffer) are stored once: the byte span of the storage that covers all of them
  becomes one ``U8`` entry named ``dist_workspace.shared.{n}``, and the layout
  metadata records each member's dtype, shape, stride and byte offset in it. Reading
  rebuilds them as views of one buffer, so the sharing comes back. Sharing is found
  on the tensors as given (their storage's device and address), before anything is
  copied to CPU: each copy off a GPU has a storage of its own, so looking after the
  copy would find no sharing at all. The span is then copied to CPU once.
- Any other tensor is written as its own elements only (``.contiguous()``): a narrow,
  chunk or slice of a large buffer costs its own size, not the buffer's.
- The metadata keys are ``dist_workspace.format`` (``"1"``), ``dist_workspace.config``
  (the config JSON), ``dist_workspace.layout`` (JSON: weight order, shared views,
  CRC-32 of every entry), ``dist_workspace.rank`` and ``dist_workspace.job``.
- A CRC-32 per entry (zlib, about 2.5 GB/s on one core) is checked on read; a flipped
  byte raises :class:`~dist_workspace.WorkspaceError` naming the tensor.

Plain safetensors readers can open the files (they then also see the pad and shared
entries).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import mmap
import os
import struct
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from dist_workspace.config_codec import CONFIG_TENSOR_PREFIX, decode_config, encode_config
from dist_workspace.errors import WorkspaceError
from dist_workspace.fsutil import is_local_filesystem, write_all

FORMAT_VERSION = "1"
ALIGNMENT = 64
PAD_PREFIX = "dist_workspace.pad."
SHARED_PREFIX = "dist_workspace.shared."
RESERVED_PREFIX = "dist_workspace."
META_FORMAT = "dist_workspace.format"
META_CONFIG = "dist_workspace.config"
META_LAYOUT = "dist_workspace.layout"
META_RANK = "dist_workspace.rank"
META_JOB = "dist_workspace.job"
_MAX_HEADER_BYTES = 256 * 1024 * 1024
_CHUNK_BYTES = 16 * 1024 * 1024
# Records at least this large are mapped rather than read when the file system is
# local: reading copies every byte into fresh pages, which cost as much as the copy.
MAP_MIN_BYTES = 4 * 1024 * 1024
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_CRC_PLACEHOLDER = "00000000"

# safetensors' dtype names, for the dtypes this torch build has.
_DTYPE_BY_NAME: dict[str, torch.dtype] = {
    name: getattr(torch, attribute)
    for name, attribute in [
        ("BOOL", "bool"),
        ("U8", "uint8"),
        ("I8", "int8"),
        ("I16", "int16"),
        ("U16", "uint16"),
        ("I32", "int32"),
        ("U32", "uint32"),
        ("I64", "int64"),
        ("U64", "uint64"),
        ("F16", "float16"),
        ("BF16", "bfloat16"),
        ("F32", "float32"),
        ("F64", "float64"),
        ("C64", "complex64"),
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"),
        ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
        ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
        ("F8_E8M0", "float8_e8m0fnu"),
    ]
    if hasattr(torch, attribute)
}
_NAME_BY_DTYPE: dict[torch.dtype, str] = {dtype: name for name, dtype in _DTYPE_BY_NAME.items()}


def dtype_from_name(name: str) -> torch.dtype | None:
    """The torch dtype of a safetensors dtype name, or None when unknown."""
    return _DTYPE_BY_NAME.get(name)


def supported_dtypes() -> list[torch.dtype]:
    """Every torch dtype a record can hold (those safetensors names)."""
    return list(_NAME_BY_DTYPE)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous CPU tensor's elements."""
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class _OverlappedCrc:
    """A CRC-32 over chunks fed in order, computed on a helper thread.

    zlib releases the GIL while it hashes, so hashing chunk k overlaps the read or
    write of chunk k+1 on another core; the chunks are hashed strictly in order by
    the single worker. Small inputs are hashed inline (no thread).
    """

    def __init__(self, total: int, crc: int = 0) -> None:
        self.value = crc
        self._pool = ThreadPoolExecutor(max_workers=1) if total > 2 * _CHUNK_BYTES else None
        self._pending: list[Future[None]] = []

    def _hash(self, chunk: memoryview) -> None:
        self.value = zlib.crc32(chunk, self.value)

    def feed(self, chunk: memoryview) -> None:
        """Adds the next chunk (which must stay unchanged until :meth:`result`)."""
        if self._pool is None:
            self._hash(chunk)
        else:
            self._pending.append(self._pool.submit(self._hash, chunk))

    def result(self) -> int:
        """The CRC of every chunk fed, once all are hashed."""
        if self._pool is not None:
            try:
                for future in self._pending:
                    future.result()
            finally:
                self._pool.shutdown(wait=True)
            self._pool = None
        return self.value


@dataclasses.dataclass(frozen=True)
class _Entry:
    name: str
    dtype_name: str
    shape: tuple[int, ...]
    nbytes: int
    data: torch.Tensor | None  # 1-D uint8 bytes to write; None for padding


@dataclasses.dataclass(frozen=True)
class PreparedRecord:
    """A record laid out and validated, ready to be written by :func:`write_record`."""

    entries: list[_Entry]
    metadata: dict[str, str]
    layout: dict[str, Any]
    header_size: int
    total_size: int
    checksums: bool

    @property
    def data_start(self) -> int:
        """Byte offset of the first tensor byte."""
        return 8 + self.header_size


def _check_weights(weights: dict[str, torch.Tensor]) -> None:
    if not isinstance(weights, dict):
        raise TypeError(f"weights must be a dict of str to torch.Tensor, got {type(weights)}")
    for name, tensor in weights.items():
        if not isinstance(name, str):
            raise TypeError(f"weights key {name!r} is a {type(name).__name__}, expected str")
        if name.startswith(RESERVED_PREFIX):
            raise ValueError(
                f"weights[{name!r}]: names starting with {RESERVED_PREFIX!r} are reserved "
                "for dist-workspace's own entries"
            )
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weights[{name!r}] is a {type(tensor).__name__}, not a torch.Tensor")


def _check_tensor(label: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.layout != torch.strided:
        raise TypeError(f"{label} has layout {tensor.layout}; only dense (strided) tensors")
    if tensor.device.type == "meta":
        raise TypeError(f"{label} is on the meta device and has no data to write")
    if tensor.dtype not in _NAME_BY_DTYPE:
        raise TypeError(
            f"{label} has dtype {tensor.dtype}, which safetensors cannot store; supported: "
            + ", ".join(str(dtype) for dtype in _NAME_BY_DTYPE)
        )
    tensor = tensor.detach()  # still on its device: sharing is found before any copy
    # A conjugate or negative view shares its storage with the tensor it views but
    # reads it with a lazy sign flip that raw bytes cannot carry: written as a view of
    # that storage it would come back as the original's values. Materialise it.
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` on CPU: itself when it is there already, else a copy (with a new storage).

    The only place a record moves data off a device; sharing between tensors must be
    found before it (see :func:`shared_groups`).
    """
    return tensor.to("cpu")


def _storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    """Where ``tensor``'s storage lives (device, address); None when it holds no bytes."""
    if tensor.numel() == 0:
        return None
    try:
        storage = tensor.untyped_storage()
        pointer = int(storage.data_ptr())
    except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
        return None
    if storage.nbytes() == 0 or pointer == 0:
        return None
    return str(tensor.device), pointer


def shared_groups(tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """Names of tensors that share a storage, grouped, in the order given.

    Decided on the tensors as given, on any device: two tensors share when their
    storages start at the same address on the same device (tied weights, a tensor and
    its transpose, rows of one matrix). Call it before any copy to CPU.
    """
    by_storage: dict[tuple[str, int], list[str]] = {}
    for name, tensor in tensors.items():
        key = _storage_key(tensor)
        if key is not None:
            by_storage.setdefault(key, []).append(name)
    return [names for names in by_storage.values() if len(names) > 1]


def prepare_record(
    weights: dict[str, torch.Tensor],
    config: Any,
    *,
    rank: int | None,
    job: str,
    checksums: bool = True,
) -> PreparedRecord:
    """Validates and lays out a record; raises before anything is written.

    Args:
        weights: Name to tensor; names starting with ``dist_workspace.`` are reserved.
        config: Any JSON value, tensors allowed (see :mod:`dist_workspace.config_codec`).
        rank: The writing rank, recorded in the metadata.
        job: The writing job's id, recorded in the metadata.
        checksums: Record a CRC-32 per entry (files); shared memory skips it.

    Raises:
        TypeError: The config is not JSON (the key path is named), a weight is not a
            tensor, or a dtype safetensors cannot store.
        ValueError: A reserved weight name.
    """
    config_text, config_tensors = encode_config(config)
    _check_weights(weights)
    logical: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        logical[name] = _check_tensor(f"weights[{name!r}]", tensor)
    for name, tensor in config_tensors.items():
        logical[name] = _check_tensor(f"the config's tensor {name}", tensor)

    groups = shared_groups(logical)
    blob_of: dict[str, int] = {}
    for index, names in enumerate(groups):
        for name in names:
            blob_of[name] = index

    views: dict[str, dict[str, Any]] = {}
    payloads: list[tuple[str, str, tuple[int, ...], torch.Tensor]] = []
    emitted_blobs: set[int] = set()
    for name, tensor in logical.items():
        block = blob_of.get(name)
        if block is None:
            data = to_host(tensor).contiguous()  # its own elements only, on CPU
            shape = tuple(int(dim) for dim in data.shape)
            payloads.append((name, _NAME_BY_DTYPE[data.dtype], shape, byte_view(data)))
            continue
        index = block
        if index in emitted_blobs:
            continue
        emitted_blobs.add(index)
        members = groups[index]
        # Storages made over one buffer (frombuffer, from_blob) may differ in length:
        # take the longest, which covers every member.
        storage = max(
            (logical[member].untyped_storage() for member in members),
            key=lambda candidate: candidate.nbytes(),
        )
        spans = []
        for member in members:
            view = logical[member]
            begin = view.storage_offset() * view.element_size()
            extent = sum(
                (size - 1) * stride for size, stride in zip(view.shape, view.stride(), strict=True)
            )
            spans.append((begin, begin + (extent + 1) * view.element_size()))
        start = min(begin for begin, _ in spans)
        start -= start % ALIGNMENT
        end = max(stop for _, stop in spans)
        blob_name = f"{SHARED_PREFIX}{index}"
        length = int(end - start)
        on_device = torch.empty(0, dtype=torch.uint8, device=storage.device)
        on_device.set_(storage, start, (length,), (1,))
        blob = to_host(on_device)  # one copy of the span for every member
        payloads.append((blob_name, "U8", (length,), blob))
        for member in members:
            view = logical[member]
            views[member] = {
                "blob": blob_name,
                "dtype": _NAME_BY_DTYPE[view.dtype],
                "shape": list(view.shape),
                "stride": list(view.stride()),
                "offset": view.storage_offset() * view.element_size() - start,
            }

    entries: list[_Entry] = []
    offset = 0
    for name, dtype_name, shape, data in payloads:
        if offset % ALIGNMENT:
            gap = ALIGNMENT - offset % ALIGNMENT
            entries.append(_Entry(f"{PAD_PREFIX}{len(entries)}", "U8", (gap,), gap, None))
            offset += gap
        entries.append(_Entry(name, dtype_name, shape, data.numel(), data))
        offset += data.numel()

    layout: dict[str, Any] = {"order": list(weights), "views": views}
    if checksums:
        layout["crc32"] = {
            entry.name: _CRC_PLACEHOLDER for entry in entries if entry.data is not None
        }
    metadata = {
        META_FORMAT: FORMAT_VERSION,
        META_CONFIG: config_text,
        META_RANK: "" if rank is None else str(rank),
        META_JOB: job,
    }
    header = _encode_header(entries, metadata, layout)
    return PreparedRecord(
        entries, metadata, layout, len(header), 8 + len(header) + offset, checksums
    )


def _encode_header(
    entries: list[_Entry], metadata: dict[str, str], layout: dict[str, Any]
) -> bytes:
    document: dict[str, Any] = {
        "__metadata__": {**metadata, META_LAYOUT: json.dumps(layout, separators=(",", ":"))}
    }
    offset = 0
    for entry in entries:
        document[entry.name] = {
            "dtype": entry.dtype_name,
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    raw = json.dumps(document, separators=(",", ":")).encode()
    padding = (-(8 + len(raw))) % ALIGNMENT
    return raw + b" " * padding


def write_record(fd: int, record: PreparedRecord) -> None:
    """Writes ``record`` at offset 0 of ``fd`` (a regular file or a shared-memory file).

    The data goes first, hashed chunk by chunk while it is written, and the header
    last, once the checksums are known (the placeholders keep its size unchanged).
    """
    position = record.data_start
    crcs: dict[str, str] = {}
    zeros = bytes(ALIGNMENT)
    for entry in record.entries:
        if entry.data is None:
            write_all(fd, memoryview(zeros)[: entry.nbytes], position)
            position += entry.nbytes
            continue
        hasher = _OverlappedCrc(entry.nbytes if record.checksums else 0)
        if entry.nbytes:
            view = memoryview(entry.data.numpy()).cast("B")  # type: ignore[arg-type]
            for begin in range(0, entry.nbytes, _CHUNK_BYTES):
                chunk = view[begin : begin + _CHUNK_BYTES]
                if record.checksums:
                    hasher.feed(chunk)
                write_all(fd, chunk, position + begin)
        position += entry.nbytes
        crcs[entry.name] = f"{hasher.result():08x}"
    layout = record.layout
    if record.checksums:
        layout = {**layout, "crc32": crcs}
    header = _encode_header(record.entries, record.metadata, layout)
    if len(header) != record.header_size:  # pragma: no cover - guarded by fixed-width CRCs
        raise AssertionError("record header changed size between layout and write")
    write_all(fd, memoryview(struct.pack("<Q", len(header)) + header), 0)


@dataclasses.dataclass(frozen=True)
class StoredEntry:
    """One entry of a parsed header: where its bytes are and what they are."""

    name: str
    dtype: torch.dtype
    dtype_name: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file or buffer
    end: int


@dataclasses.dataclass(frozen=True)
class RecordHeader:
    """A validated header: its entries in file order, its metadata and its layout."""

    entries: list[StoredEntry]
    metadata: dict[str, str]
    layout: dict[str, Any]
    data_start: int
    total_size: int

    @property
    def rank(self) -> int | None:
        """The rank recorded by the writer."""
        text = self.metadata.get(META_RANK, "")
        return int(text) if text.lstrip("-").isdigit() else None

    @property
    def job(self) -> str:
        """The job id recorded by the writer."""
        return self.metadata.get(META_JOB, "")

    def data_entries(self) -> list[StoredEntry]:
        """Entries that hold data (padding left out)."""
        return [entry for entry in self.entries if not entry.name.startswith(PAD_PREFIX)]


def _foreign(where: str, why: str) -> WorkspaceError:
    return WorkspaceError(
        f"{where}: not a dist-workspace record ({why}); it is truncated, corrupted or "
        "was written by something else. Nothing in it was loaded; remove it or run "
        "`dist-workspace clean` on the directory"
    )


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
        raise _foreign(where, f"{size} bytes, shorter than the 8-byte header length")
    (header_size,) = struct.unpack("<Q", read_at(0, 8))
    if header_size > min(size - 8, _MAX_HEADER_BYTES):
        raise _foreign(where, f"header length {header_size} does not fit in the {size}-byte file")
    raw = read_at(8, header_size)
    try:
        document = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _foreign(where, f"the header is not JSON: {error}") from None
    if not isinstance(document, dict):
        raise _foreign(where, "the header is not a JSON object")
    metadata = document.pop("__metadata__", None)
    if not isinstance(metadata, dict) or metadata.get(META_FORMAT) != FORMAT_VERSION:
        raise _foreign(where, f"no {META_FORMAT}={FORMAT_VERSION!r} in the safetensors metadata")
    try:
        layout = json.loads(metadata.get(META_LAYOUT, ""))
    except json.JSONDecodeError:
        raise _foreign(where, f"{META_LAYOUT} is not JSON") from None
    if not isinstance(layout, dict):
        raise _foreign(where, f"{META_LAYOUT} is not a JSON object")
    data_start = 8 + header_size
    entries: list[StoredEntry] = []
    for name, spec in document.items():
        try:
            dtype_name = spec["dtype"]
            shape = tuple(int(dim) for dim in spec["shape"])
            begin, end = (int(value) for value in spec["data_offsets"])
        except (TypeError, KeyError, ValueError):
            raise _foreign(where, f"entry {name!r} is malformed") from None
        dtype = _DTYPE_BY_NAME.get(dtype_name)
        if dtype is None:
            raise _foreign(where, f"entry {name!r} has the unknown dtype {dtype_name!r}")
        numel = 1
        for dim in shape:
            if dim < 0:
                raise _foreign(where, f"entry {name!r} has a negative dimension {shape}")
            numel *= dim
        if end - begin != numel * dtype.itemsize:
            raise _foreign(where, f"entry {name!r}: offsets {begin}..{end} do not fit {shape}")
        entries.append(
            StoredEntry(name, dtype, dtype_name, shape, data_start + begin, data_start + end)
        )
    entries.sort(key=lambda entry: (entry.begin, entry.end))
    position = data_start
    for entry in entries:
        if entry.begin != position:
            raise _foreign(where, f"entry {entry.name!r} starts at {entry.begin}, not {position}")
        position = entry.end
    if position != size:
        raise WorkspaceError(
            f"{where}: truncated or extended record: its header describes {position} bytes, "
            f"the file has {size}. Was it copied partially? Write it again"
        )
    return RecordHeader(
        entries, {str(k): str(v) for k, v in metadata.items()}, layout, data_start, size
    )


def read_into(fd: int, target: torch.Tensor, offset: int, crc: int = 0) -> int:
    """Fills a contiguous CPU tensor from ``fd`` at ``offset``; returns the running CRC."""
    view = memoryview(byte_view(target).numpy()).cast("B")  # type: ignore[arg-type]
    hasher = _OverlappedCrc(len(view), crc)
    done = 0
    try:
        while done < len(view):
            chunk = view[done : done + _CHUNK_BYTES]
            got = os.preadv(fd, [chunk], offset + done)
            if got == 0:
                raise EOFError(f"end of file at byte {offset + done}")
            hasher.feed(chunk[:got])
            done += got
    finally:
        crc = hasher.result()
    return crc


def load_entries(fd: int, header: RecordHeader, where: str) -> dict[str, torch.Tensor]:
    """Reads every data entry of a record into fresh memory, checking each CRC-32.

    Raises:
        WorkspaceError: A checksum does not match (naming the entry) or the file
            shrank while it was read.
    """
    tensors: dict[str, torch.Tensor] = {}
    for entry in header.data_entries():
        tensor = torch.empty(entry.shape, dtype=entry.dtype)
        try:
            crc = read_into(fd, tensor, entry.begin)
        except EOFError as error:
            raise WorkspaceError(
                f"{where}: truncated while reading {entry.name!r}: {error}"
            ) from None
        _check_crc(header, entry, crc, where)
        tensors[entry.name] = tensor
    return tensors


def _check_crc(header: RecordHeader, entry: StoredEntry, crc: int, where: str) -> None:
    expected = header.layout.get("crc32")
    if not isinstance(expected, dict):
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
            for begin in range(entry.begin, entry.end, _CHUNK_BYTES):
                crc = zlib.crc32(view[begin : min(begin + _CHUNK_BYTES, entry.end)], crc)
            _check_crc(header, entry, crc, where)
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
        for name, spec in header.layout.get("views", {}).items():
            blob = stored[spec["blob"]]
            dtype = _DTYPE_BY_NAME[spec["dtype"]]
            byte_offset = blob.storage_offset() + int(spec["offset"])
            if byte_offset % dtype.itemsize:
                raise ValueError(f"view {name!r} is misaligned")
            view = torch.empty(0, dtype=dtype).set_(
                blob.untyped_storage(), byte_offset // dtype.itemsize, spec["shape"], spec["stride"]
            )
            logical[name] = view
        order = [str(name) for name in header.layout.get("order", [])]
        weights = {name: logical[name] for name in order}
        config_tensors = {
            name: tensor
            for name, tensor in logical.items()
            if name.startswith(CONFIG_TENSOR_PREFIX)
        }
        config = decode_config(header.metadata.get(META_CONFIG, "null"), config_tensors, where)
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


def copy_through_record(
    weights: dict[str, torch.Tensor], config: Any, *, rank: int | None, job: str, where: str
) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(config, weights)`` exactly as a reader of their record gets them.

    The record is written into anonymous memory (``memfd_create``) and parsed back
    like a peer's segment: every tensor comes back on CPU, bit-exact, shared storage
    still shared, and none aliases the tensors passed in (writing to the result never
    changes them, nor they it). Tuples in the config come back as lists.

    Raises:
        TypeError, ValueError: As :func:`prepare_record`.
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
