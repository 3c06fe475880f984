"""Writing records: validating and laying out weights and a config, then writing them.

Sharing is found on the tensors as given (their storage's device and address), before
anything is copied to CPU: each copy off a GPU has a storage of its own, so looking
after the copy would find no sharing at all. Each shared span is then copied to CPU
once. The layout is decided first (:func:`prepare_record`, which raises before a byte
is written), then :func:`write_record` writes the data, hashing it on the way, and the
header last.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from typing import Any

import torch

from dist_workspace.config_codec import encode_config
from dist_workspace.crc import CHUNK_BYTES, OverlappedCrc
from dist_workspace.format import (
    ALIGNMENT,
    DIGEST_BYTES,
    FORMAT_VERSION,
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
    ViewSpec,
    byte_view,
    dtype_name,
    encode_safetensors_header,
    header_digest,
    supported_dtypes,
)
from dist_workspace.fsutil import write_all

_CRC_PLACEHOLDER = "00000000"


@dataclasses.dataclass(frozen=True)
class PlannedEntry:
    """One safetensors entry to write: its name, dtype, shape and bytes."""

    name: str
    dtype_name: str
    shape: tuple[int, ...]
    nbytes: int
    data: torch.Tensor | None  # 1-D uint8 bytes; None for padding and the digest


@dataclasses.dataclass(frozen=True)
class PreparedRecord:
    """A record laid out and validated, ready to be written by :func:`write_record`."""

    entries: tuple[PlannedEntry, ...]
    metadata: dict[str, str]  # every metadata key but the layout
    layout: Layout  # with placeholder checksums when ``checksums``
    header_size: int
    total_size: int
    checksums: bool
    header: bytes  # as encoded by the layout; final when not ``checksums``

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


def check_tensor(label: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached, ready to store: refused by name if it cannot be, lazy views resolved."""
    if tensor.layout != torch.strided:
        raise TypeError(f"{label} has layout {tensor.layout}; only dense (strided) tensors")
    if tensor.device.type == "meta":
        raise TypeError(f"{label} is on the meta device and has no data to write")
    if dtype_name(tensor.dtype) is None:
        raise TypeError(
            f"{label} has dtype {tensor.dtype}, which safetensors cannot store; supported: "
            + ", ".join(str(dtype) for dtype in supported_dtypes())
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


def _name_of(dtype: torch.dtype) -> str:
    name = dtype_name(dtype)
    assert name is not None, "checked by check_tensor"
    return name


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
        logical[name] = check_tensor(f"weights[{name!r}]", tensor)
    for name, tensor in config_tensors.items():
        logical[name] = check_tensor(f"the config's tensor {name}", tensor)

    groups = shared_groups(logical)
    blob_of: dict[str, int] = {}
    for index, names in enumerate(groups):
        for name in names:
            blob_of[name] = index

    views: dict[str, ViewSpec] = {}
    payloads: list[tuple[str, str, tuple[int, ...], torch.Tensor]] = []
    emitted_blobs: set[int] = set()
    for name, tensor in logical.items():
        block = blob_of.get(name)
        if block is None:
            data = to_host(tensor).contiguous()  # its own elements only, on CPU
            shape = tuple(int(dim) for dim in data.shape)
            payloads.append((name, _name_of(data.dtype), shape, byte_view(data)))
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
            views[member] = ViewSpec(
                blob=blob_name,
                dtype=view.dtype,
                shape=tuple(int(dim) for dim in view.shape),
                stride=tuple(int(step) for step in view.stride()),
                offset=int(view.storage_offset() * view.element_size() - start),
            )

    entries: list[PlannedEntry] = []
    offset = 0

    def align() -> None:
        nonlocal offset
        if offset % ALIGNMENT:
            gap = ALIGNMENT - offset % ALIGNMENT
            entries.append(PlannedEntry(f"{PAD_PREFIX}{len(entries)}", "U8", (gap,), gap, None))
            offset += gap

    for name, entry_dtype, shape, data in payloads:
        align()
        entries.append(PlannedEntry(name, entry_dtype, shape, data.numel(), data))
        offset += data.numel()
    align()  # the digest last, so that it is the file's last 32 bytes
    entries.append(PlannedEntry(INTEGRITY_ENTRY, "U8", (DIGEST_BYTES,), DIGEST_BYTES, None))
    offset += DIGEST_BYTES

    crc32 = (
        {entry.name: _CRC_PLACEHOLDER for entry in entries if entry.data is not None}
        if checksums
        else None
    )
    layout = Layout(tuple(weights), views, crc32)
    metadata = {
        META_FORMAT: FORMAT_VERSION,
        META_CONFIG: config_text,
        META_RANK: "" if rank is None else str(rank),
        META_JOB: job,
    }
    header = encode_header(entries, metadata, layout)
    if len(header) > MAX_HEADER_BYTES:
        raise ValueError(
            f"the record's header would take {len(header)} bytes, over the "
            f"{MAX_HEADER_BYTES} that safetensors (and this reader) accept: "
            f"{len(entries)} entries; write fewer, larger tensors or a smaller config"
        )
    return PreparedRecord(
        tuple(entries), metadata, layout, len(header), 8 + len(header) + offset, checksums, header
    )


def encode_header(
    entries: tuple[PlannedEntry, ...] | list[PlannedEntry],
    metadata: dict[str, str],
    layout: Layout,
) -> bytes:
    """The safetensors header (JSON padded with spaces to the alignment), without its length."""
    return encode_safetensors_header(
        ((entry.name, entry.dtype_name, entry.shape, entry.nbytes) for entry in entries),
        {**metadata, META_LAYOUT: layout.to_json()},
        ALIGNMENT,
    )


def write_record(fd: int, record: PreparedRecord) -> None:
    """Writes ``record`` at offset 0 of ``fd`` (a regular file or a shared-memory file).

    The data goes first, hashed chunk by chunk while it is written, then the header,
    once the checksums are known (the placeholders keep its size unchanged), and the
    header's digest into the last entry.
    """
    _write_with(lambda data, position: write_all(fd, data, position), record)


def record_buffers(record: PreparedRecord) -> list[Any]:
    """``record`` (laid out without checksums) as the buffers of its bytes, in order.

    The length and header, each entry's data straight from its tensor (nothing is
    copied), the zeros between them and the header's digest: what a socket sends
    with one ``sendmsg`` and a reader gets as :func:`write_record` would write it.
    """
    if record.checksums:
        raise ValueError("record_buffers needs a record laid out without checksums")
    head = struct.pack("<Q", len(record.header)) + record.header
    buffers: list[Any] = [head]  # the data starts right after it
    for entry in record.entries:
        if entry.name == INTEGRITY_ENTRY:
            buffers.append(header_digest(head))
        elif entry.data is None:
            buffers.append(bytes(entry.nbytes))  # padding: zeros
        elif entry.nbytes:
            buffers.append(entry.data.numpy())
    return buffers


def _write_with(put: Callable[[memoryview | bytes, int], object], record: PreparedRecord) -> None:
    position = record.data_start
    digest_position = -1
    crcs: dict[str, str] = {}
    zeros = bytes(ALIGNMENT)
    for entry in record.entries:
        if entry.name == INTEGRITY_ENTRY:
            digest_position = position
            position += entry.nbytes
            continue
        if entry.data is None:
            put(memoryview(zeros)[: entry.nbytes], position)
            position += entry.nbytes
            continue
        hasher = OverlappedCrc(entry.nbytes if record.checksums else 0)
        if entry.nbytes:
            view = memoryview(entry.data.numpy()).cast("B")  # type: ignore[arg-type]
            for begin in range(0, entry.nbytes, CHUNK_BYTES):
                chunk = view[begin : begin + CHUNK_BYTES]
                if record.checksums:
                    hasher.feed(chunk)
                put(chunk, position + begin)
        position += entry.nbytes
        crcs[entry.name] = f"{hasher.result():08x}"
    header = record.header
    if record.checksums:  # the placeholders are replaced by the CRCs now known
        layout = dataclasses.replace(record.layout, crc32=crcs)
        header = encode_header(record.entries, record.metadata, layout)
    if len(header) != record.header_size:  # pragma: no cover - guarded by fixed-width CRCs
        raise AssertionError("record header changed size between layout and write")
    length_and_header = struct.pack("<Q", len(header)) + header
    put(memoryview(length_and_header), 0)
    put(header_digest(length_and_header), digest_position)
