"""The record format: its constants, the dtype table and the typed header layout.

A record is a safetensors file (or shared-memory segment) holding one rank's config
and tensors. This module says what its header means; :mod:`dist_workspace.writer`
writes records and :mod:`dist_workspace.reader` parses and loads them.

Format decisions (the safetensors format leaves them open):

- The header is padded with spaces so that the data starts at a multiple of 64 bytes,
  and every tensor starts at a multiple of 64 bytes; padding between tensors is stored
  as ``U8`` entries named ``dist_workspace.pad.{n}`` (safetensors allows no holes).
  Aligned data lets a reader of shared memory hand out zero-copy tensors.
- Tensors that share storage (tied weights, a tensor and its transpose, views of one
  buffer) are stored once: the byte span of the storage that covers all of them
  becomes one ``U8`` entry named ``dist_workspace.shared.{n}``, and the layout records
  each member's dtype, shape, stride and byte offset in it (a :class:`ViewSpec`).
- Any other tensor is written as its own elements only (``.contiguous()``).
- The metadata keys are ``dist_workspace.format`` (:data:`FORMAT_VERSION`),
  ``dist_workspace.config`` (the config JSON), ``dist_workspace.layout`` (the
  :class:`Layout` as JSON: weight order, shared views, CRC-32 of every entry),
  ``dist_workspace.rank`` and ``dist_workspace.job``, and nothing else.
- Integrity (format 2): the CRC-32 of every data entry is in the layout, hence in the
  header, and the last entry, ``dist_workspace.integrity`` (``U8``, 32 bytes, the
  file's last 32 bytes), holds the SHA-256 of the 8-byte header length and the
  header. So every byte a reader trusts is covered: a change to a name, dtype,
  shape, offset, the config or the layout breaks the digest, a change to tensor
  data breaks its CRC-32, and padding must be zeros. Format 1 (dist-workspace 0.2
  and earlier) had no header digest and is refused with a message that says so.

Plain safetensors readers can open the files (they then also see the pad and shared
entries).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from dist_workspace.errors import WorkspaceError
from dist_workspace.safejson import JsonRefused, loads

FORMAT_VERSION = "2"
ALIGNMENT = 64
PAD_PREFIX = "dist_workspace.pad."
SHARED_PREFIX = "dist_workspace.shared."
RESERVED_PREFIX = "dist_workspace."
INTEGRITY_ENTRY = "dist_workspace.integrity"
DIGEST_BYTES = 32  # SHA-256
# safetensors refuses headers over 100 MB (about a million entries); so do we.
MAX_HEADER_BYTES = 100_000_000
# Nesting of the JSON documents a header holds: the header itself is
# {"name": {"shape": [...]}}, the layout {"views": {"name": {"shape": [...]}}}.
HEADER_DEPTH = 3
LAYOUT_DEPTH = 4
# torch sizes and strides are int64; anything larger cannot be a tensor.
_MAX_EXTENT = 2**62
META_FORMAT = "dist_workspace.format"
META_CONFIG = "dist_workspace.config"
META_LAYOUT = "dist_workspace.layout"
META_RANK = "dist_workspace.rank"
META_JOB = "dist_workspace.job"

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


def dtype_from_name(name: object) -> torch.dtype | None:
    """The torch dtype of a safetensors dtype name, or None when unknown (or not a str)."""
    return _DTYPE_BY_NAME.get(name) if isinstance(name, str) else None


def dtype_name(dtype: torch.dtype) -> str | None:
    """The safetensors name of a torch dtype, or None when safetensors cannot store it."""
    return _NAME_BY_DTYPE.get(dtype)


def supported_dtypes() -> list[torch.dtype]:
    """Every torch dtype a record can hold (those safetensors names)."""
    return list(_NAME_BY_DTYPE)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous CPU tensor's elements."""
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def header_digest(length_and_header: bytes | memoryview) -> bytes:
    """What the integrity entry holds: SHA-256 of the 8-byte length and the header."""
    return hashlib.sha256(length_and_header).digest()


def encode_safetensors_header(
    tensors: Iterable[tuple[str, str, Sequence[int], int]],
    metadata: dict[str, str],
    alignment: int,
) -> bytes:
    """A safetensors header, without its 8-byte length, for tensors stored back to back.

    Args:
        tensors: ``(name, safetensors dtype name, shape, bytes)`` in storage order.
        metadata: The ``__metadata__`` strings.
        alignment: The JSON is padded with spaces so that the data after the length
            and the header starts at a multiple of this (records: :data:`ALIGNMENT`;
            plain safetensors files: 8).
    """
    document: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        document[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(document, separators=(",", ":")).encode()
    return raw + b" " * ((-(8 + len(raw))) % alignment)


def foreign(where: str, why: str) -> WorkspaceError:
    """The error for bytes that are not a (complete, intact) dist-workspace record."""
    return WorkspaceError(
        f"{where}: not a dist-workspace record ({why}); it is truncated, corrupted or "
        "was written by something else. Nothing in it was loaded; remove it or run "
        "`dist-workspace clean` on the directory"
    )


@dataclasses.dataclass(frozen=True)
class ViewSpec:
    """A tensor stored as a view of a shared block (``dist_workspace.shared.{n}``)."""

    blob: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # bytes from the start of the block

    @property
    def dtype_name(self) -> str:
        """The dtype's safetensors name."""
        return _NAME_BY_DTYPE[self.dtype]

    @property
    def nbytes(self) -> int:
        """Bytes of the view's elements (its size once made contiguous)."""
        return math.prod(self.shape) * self.dtype.itemsize

    def to_json(self) -> dict[str, Any]:
        """The JSON form written into the layout."""
        return {
            "blob": self.blob,
            "dtype": self.dtype_name,
            "shape": list(self.shape),
            "stride": list(self.stride),
            "offset": self.offset,
        }


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the safetensors entries mean: weight order, shared views, checksums."""

    order: tuple[str, ...]
    views: dict[str, ViewSpec]
    crc32: dict[str, str] | None  # entry name -> 8 hex digits; None when not recorded

    def to_json(self) -> str:
        """The compact JSON stored under ``dist_workspace.layout``."""
        document: dict[str, Any] = {
            "order": list(self.order),
            "views": {name: view.to_json() for name, view in self.views.items()},
        }
        if self.crc32 is not None:
            document["crc32"] = self.crc32
        return json.dumps(document, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, where: str) -> Layout:
        """Parses and type-checks the layout JSON (its references are checked by the reader).

        Raises:
            WorkspaceError: It is not a layout of this format.
        """
        try:
            document = loads(text, max_depth=LAYOUT_DEPTH)
        except JsonRefused as error:
            raise foreign(where, f"{META_LAYOUT} is refused: {error}") from None
        if not isinstance(document, dict) or not set(document) <= {"order", "views", "crc32"}:
            raise foreign(where, f"{META_LAYOUT} is not an object of order, views, crc32")
        order = document.get("order")
        if not isinstance(order, list) or not all(isinstance(name, str) for name in order):
            raise foreign(where, f"{META_LAYOUT}'s order is not a list of names")
        if len(set(order)) != len(order):
            raise foreign(where, f"{META_LAYOUT}'s order names a weight twice")
        raw_views = document.get("views")
        if not isinstance(raw_views, dict):
            raise foreign(where, f"{META_LAYOUT}'s views is not a JSON object")
        views = {name: _view_from_json(name, spec, where) for name, spec in raw_views.items()}
        crc32 = document.get("crc32")
        if crc32 is not None and (
            not isinstance(crc32, dict)
            or not all(isinstance(v, str) and _CRC_TEXT.fullmatch(v) for v in crc32.values())
        ):
            raise foreign(where, f"{META_LAYOUT}'s crc32 is not an object of 8 hex digits each")
        return cls(tuple(order), views, crc32)


_CRC_TEXT = re.compile(r"[0-9a-f]{8}")


def int_list(value: object) -> tuple[int, ...] | None:
    """``value`` as a tuple of ints in [0, 2**62], or None when it is anything else."""
    if not isinstance(value, list):
        return None
    for item in value:
        if type(item) is not int or not 0 <= item <= _MAX_EXTENT:
            return None
    return tuple(value)


def numel_within(shape: tuple[int, ...], limit: int) -> int | None:
    """The element count of ``shape``, or None when it exceeds ``limit``.

    Stops multiplying as soon as the count passes the limit, so a hostile shape of
    many huge dimensions costs no big-integer arithmetic.
    """
    if 0 in shape:
        return 0
    count = 1
    for dim in shape:
        count *= dim
        if count > limit:
            return None
    return count


def _view_from_json(name: str, spec: object, where: str) -> ViewSpec:
    if not isinstance(spec, dict) or set(spec) != {"blob", "dtype", "shape", "stride", "offset"}:
        raise foreign(where, f"view {name!r:.200} is malformed")
    dtype = dtype_from_name(spec["dtype"])
    shape = int_list(spec["shape"])
    stride = int_list(spec["stride"])
    blob = spec["blob"]
    offset = spec["offset"]
    if (
        dtype is None
        or shape is None
        or stride is None
        or len(shape) != len(stride)
        or numel_within(shape, _MAX_EXTENT) is None
        or not isinstance(blob, str)
        or type(offset) is not int
        or not 0 <= offset <= _MAX_EXTENT
    ):
        raise foreign(where, f"view {name!r:.200} is malformed: {spec!r:.200}")
    return ViewSpec(blob, dtype, shape, stride, offset)


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
    """A validated header: its entries in file order, what they mean and who wrote them."""

    entries: tuple[StoredEntry, ...]
    layout: Layout
    config_text: str  # the config as JSON (tensors referenced by entry name)
    rank: int | None  # the rank recorded by the writer
    job: str  # the job id recorded by the writer
    data_start: int
    total_size: int

    def data_entries(self) -> list[StoredEntry]:
        """Entries that hold tensor data (padding and the integrity digest left out)."""
        return [entry for entry in self.entries if is_data_entry(entry.name)]


def is_data_entry(name: str) -> bool:
    """Whether an entry of this name holds tensor data (not padding, not the digest)."""
    return not name.startswith(PAD_PREFIX) and name != INTEGRITY_ENTRY
