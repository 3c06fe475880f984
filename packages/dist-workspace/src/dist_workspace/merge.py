"""Merging the rank files of a workspace into plain safetensors, streaming.

Two layouts, both what torch and Hugging Face tools load:

- one file (``merge DIR model.safetensors``);
- a Hugging Face model directory (``--max-shard-size``): ``model.safetensors`` when
  everything fits in one shard, else ``model-00001-of-0000N.safetensors`` ... plus
  ``model.safetensors.index.json`` (``{"metadata": {"total_size": N}, "weight_map":
  {name: file}}``), as transformers' ``save_pretrained`` writes them. Tensors go
  into shards in order, a new shard starting when the next tensor would take the
  current one past the limit; a tensor larger than the limit gets a shard of its
  own (huggingface_hub's ``split_state_dict_into_shards_factory`` rule, keeping the
  order).

Every output file's metadata has ``"format": "pt"`` (transformers refuses a
safetensors file whose metadata lacks it); the first (or only) file also carries
``dist_workspace.merged_ranks`` and ``dist_workspace.configs``.

Output headers come from the format's one encoder (:mod:`dist_workspace.format`) and
each tensor's bytes are read from its rank file by the reader's chunked, CRC-checked
read (:func:`dist_workspace.reader.entry_chunks`, 16 MiB chunks), cast chunk by
chunk when a dtype is asked for, so memory stays at one chunk (or one shared-storage
block when tensors of a rank share storage), whatever the total size. Every CRC-32 is
checked on the way. Tensors that share storage in a rank file are written once per
name (safetensors cannot share).

Nothing is half-written: a file is written to a temporary and renamed over the
target; a directory is built beside the target and swapped in with one
``renameat2(RENAME_EXCHANGE)`` (two renames where the file system lacks it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import secrets
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from dist_workspace.crc import CHUNK_BYTES
from dist_workspace.errors import WorkspaceError
from dist_workspace.format import (
    RecordHeader,
    StoredEntry,
    ViewSpec,
    byte_view,
    dtype_name,
    encode_safetensors_header,
)
from dist_workspace.fsutil import (
    atomic_write,
    fsync_directory,
    put_directory_in_place,
    write_all,
)
from dist_workspace.reader import entry_chunks, load_entries, read_header_fd, view_in_block
from dist_workspace.shard_plan import pack_in_order
from dist_workspace.workspace import RANK_FILE_PATTERN

# A plain safetensors file (what torch and Hugging Face load) aligns its data to 8
# bytes; records align to 64 (format.ALIGNMENT).
_PLAIN_ALIGNMENT = 8
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"^model-[0-9]{5}-of-[0-9]{5}\.safetensors$")
# What --dtype casts: the IEEE-style floating types. Integers, bool, complex and the
# float8 types (quantized data whose scales live in other tensors) are left alone.
CASTABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DTYPE_NAMES = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}

Progress = Callable[[int], None]


def parse_dtype(text: str) -> torch.dtype:
    """The dtype ``--dtype`` names: ``bfloat16``/``bf16``, ``float16``/``fp16``/``half``, ...

    ``torch.``-prefixed names are accepted too.

    Raises:
        ValueError: Not one of the floating dtypes merge casts to.
    """
    name = text.strip().lower().removeprefix("torch.")
    if name not in _DTYPE_NAMES:
        raise ValueError(
            f"{text!r} is not a dtype merge casts to; use one of " + ", ".join(_DTYPE_NAMES)
        )
    return _DTYPE_NAMES[name]


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
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    entry: StoredEntry | None  # stored as itself
    view: ViewSpec | None  # or a view into a shared block


def rank_file_paths(directory: Path) -> list[tuple[int, Path]]:
    """``(rank, path)`` of every ``rank-{r}.safetensors`` in ``directory``, by rank."""
    found = []
    for path in directory.iterdir():
        match = RANK_FILE_PATTERN.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def read_rank_file(rank: int, path: Path) -> RankFile:
    """Opens ``path`` without following symlinks and validates its header.

    Raises:
        WorkspaceError: It is not a complete dist-workspace record.
    """
    where = f"rank {rank}'s file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise WorkspaceError(f"{where}: cannot be opened safely: {error}") from None
    try:
        header = read_header_fd(fd, where)
    finally:
        os.close(fd)
    return RankFile(rank, path, header)


def read_rank_files(directory: Path) -> list[RankFile]:
    """Every ``rank-{r}.safetensors`` of ``directory`` with its header, by rank.

    Raises:
        WorkspaceError: A file is not a complete dist-workspace record.
    """
    return [read_rank_file(rank, path) for rank, path in rank_file_paths(directory)]


def weights_of(rank_file: RankFile) -> list[WeightInfo]:
    """The logical weights of a rank file, in the order they were written."""
    header = rank_file.header
    stored = {entry.name: entry for entry in header.entries}
    views = header.layout.views
    result = []
    for name in header.layout.order:
        if name in views:
            spec = views[name]
            result.append(
                WeightInfo(name, spec.dtype_name, spec.dtype, spec.shape, spec.nbytes, None, spec)
            )
        elif name in stored:
            entry = stored[name]
            result.append(
                WeightInfo(
                    name,
                    entry.dtype_name,
                    entry.dtype,
                    entry.shape,
                    entry.end - entry.begin,
                    entry,
                    None,
                )
            )
        else:
            raise WorkspaceError(f"{rank_file.where}: weight {name!r} is in no entry")
    return result


@dataclasses.dataclass(frozen=True)
class MergeItem:
    """One output tensor: where it comes from, its name and dtype in the output."""

    rank_file: RankFile
    info: WeightInfo
    name: str
    dtype: torch.dtype

    @property
    def dtype_name(self) -> str:
        """The output dtype's safetensors name."""
        return dtype_name(self.dtype) or self.info.dtype_name

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor in the output."""
        return math.prod(self.info.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class MergeResult:
    """What a merge wrote."""

    tensors: int
    files: tuple[Path, ...]  # the output file(s), index included
    nbytes: int  # tensor bytes written


def plan_merge(
    files: list[RankFile], rank_prefix: bool, dtype: torch.dtype | None = None
) -> list[MergeItem]:
    """Every rank's weights, in rank order, with their output names and dtypes.

    Raises:
        WorkspaceError: A name is in two ranks (naming both) and ``rank_prefix`` is off.
    """
    plan = []
    owner: dict[str, RankFile] = {}
    for rank_file in files:
        for info in weights_of(rank_file):
            name = f"rank{rank_file.rank}.{info.name}" if rank_prefix else info.name
            if name in owner:
                raise WorkspaceError(
                    f"tensor {name!r} is in both {owner[name].where} and "
                    f"{rank_file.where}; pass --rank-prefix to name them rank{{r}}.{{name}}"
                )
            owner[name] = rank_file
            cast = dtype is not None and info.dtype in CASTABLE_DTYPES
            plan.append(MergeItem(rank_file, info, name, dtype if cast else info.dtype))  # type: ignore[arg-type]
    return plan


def split_into_shards(items: list[MergeItem], max_shard_size: int) -> list[list[MergeItem]]:
    """Groups ``items`` in order into shards of at most ``max_shard_size`` tensor bytes.

    A tensor larger than the limit gets a shard of its own; there is always at least
    one shard (empty when there are no tensors). See :func:`shard_plan.pack_in_order`.
    """
    shards = pack_in_order([item.nbytes for item in items], max_shard_size)
    return [[items[index] for index in shard] for shard in shards] or [[]]


def shard_file_names(count: int) -> list[str]:
    """``["model.safetensors"]`` for one shard, else ``model-00001-of-0000N.safetensors``..."""
    if count == 1:
        return [SAFE_WEIGHTS_NAME]
    return [f"model-{index:05d}-of-{count:05d}.safetensors" for index in range(1, count + 1)]


def is_merge_output_name(name: str) -> bool:
    """Whether ``name`` is a file merge writes into a model directory."""
    return name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME) or bool(_SHARD_NAME.match(name))


# check_output serves the CLI (merge --force) and Python callers (merge_workspace,
# export_sharded's overwrite=True): the refusal names both ways to replace.
_REPLACE_HINT = "pass overwrite=True (--force on the command line)"


def check_output(output: Path, *, directory: bool, overwrite: bool) -> None:
    """Refuses an output that exists (unless ``overwrite``) or that merge must not replace.

    A file output may replace a file; a directory output may replace an empty
    directory or one holding only what merge writes (``model*.safetensors``, the
    index), never a file or anyone else's files.

    Raises:
        WorkspaceError: Naming the existing path and what to do.
    """
    if not os.path.lexists(output):
        return
    if output.is_symlink():
        raise WorkspaceError(f"{output} is a symlink; merge does not write through one")
    if not directory:
        if output.is_dir():
            raise WorkspaceError(
                f"{output} is a directory; name a .safetensors file, or pass "
                "--max-shard-size to write a Hugging Face model directory"
            )
        if not overwrite:
            raise WorkspaceError(f"{output} exists; {_REPLACE_HINT} to replace it")
        return
    if not output.is_dir():
        raise WorkspaceError(
            f"{output} exists and is not a directory; --max-shard-size writes a directory"
        )
    names = sorted(os.listdir(output))
    if not names:
        return
    foreign = [name for name in names if not is_merge_output_name(name)]
    if foreign:
        raise WorkspaceError(
            f"{output} holds {foreign[0]!r}, which merge did not write; merge replaces a "
            "model directory as a whole, so write to a new directory and copy config "
            "files into it afterwards"
        )
    if not overwrite:
        raise WorkspaceError(
            f"{output} exists and holds {names[0]!r}; {_REPLACE_HINT} to replace the directory"
        )


def merge_workspace(
    directory: Path,
    output: Path,
    *,
    rank_prefix: bool = False,
    mode: int = 0o600,
    dtype: torch.dtype | None = None,
    max_shard_size: int | None = None,
    overwrite: bool = True,
    progress: Callable[[int], Progress] | None = None,
) -> MergeResult:
    """Writes every rank's weights of ``directory`` as plain safetensors.

    Args:
        directory: A workspace directory.
        output: The safetensors file to create, or with ``max_shard_size`` the model
            directory (see the module docstring for the layout).
        rank_prefix: Name tensors ``rank{r}.{name}`` instead of refusing duplicates.
        mode: Permission bits of the files written (a new directory gets 0700 plus
            the execute bits matching ``mode``'s read bits).
        dtype: Cast floating-point tensors (float16, bfloat16, float32, float64) to
            this dtype; other dtypes are written as they are.
        max_shard_size: Split into shards of at most this many tensor bytes.
        overwrite: Replace an existing output (atomically); False refuses it before
            reading anything.
        progress: Called once with the total bytes to write; returns a function
            called with the bytes written as they are written.

    Returns:
        What was written.

    Raises:
        WorkspaceError: An existing output (see :func:`check_output`), no rank files,
            a name in two ranks (naming both), or a truncated or corrupted rank file.
    """
    as_directory = max_shard_size is not None
    check_output(output, directory=as_directory, overwrite=overwrite)
    if dtype is not None and dtype not in CASTABLE_DTYPES:
        raise WorkspaceError(f"cannot cast to {dtype}: merge casts to {CASTABLE_DTYPES}")
    files = read_rank_files(directory)
    if not files:
        raise WorkspaceError(f"{directory} holds no rank-*.safetensors files to merge")
    items = plan_merge(files, rank_prefix, dtype)
    metadata = {
        "format": "pt",
        "dist_workspace.merged_ranks": json.dumps([f.rank for f in files]),
        "dist_workspace.configs": json.dumps({str(f.rank): f.header.config_text for f in files}),
    }
    total = sum(item.nbytes for item in items)
    advance = progress(total) if progress is not None else None
    copier = _Copier(advance)
    try:
        if max_shard_size is None:
            atomic_write(
                output,
                _file_size(items, metadata),
                lambda fd: copier.write_file(fd, items, metadata),
                mode,
            )
            written: tuple[Path, ...] = (output,)
        else:
            written = _write_model_directory(output, items, metadata, max_shard_size, mode, copier)
    finally:
        copier.close()
    return MergeResult(len(items), written, total)


def _write_model_directory(
    output: Path,
    items: list[MergeItem],
    metadata: dict[str, str],
    max_shard_size: int,
    mode: int,
    copier: _Copier,
) -> tuple[Path, ...]:
    shards = split_into_shards(items, max_shard_size)
    names = shard_file_names(len(shards))
    parent = output.parent
    building = parent / f".{output.name}.{secrets.token_hex(8)}.tmp"
    dir_mode = 0o700 | ((mode & 0o044) >> 2) | (mode & 0o044)
    os.mkdir(building, 0o700)
    try:
        os.chmod(building, dir_mode)
        for index, (name, shard) in enumerate(zip(names, shards, strict=True)):
            shard_metadata = metadata if index == 0 else {"format": "pt"}
            atomic_write(
                building / name,
                _file_size(shard, shard_metadata),
                functools.partial(copier.write_file, items=shard, metadata=shard_metadata),
                mode,
            )
        if len(shards) > 1:
            index_document = {
                "metadata": {"total_size": sum(item.nbytes for item in items)},
                "weight_map": {
                    item.name: name
                    for name, shard in zip(names, shards, strict=True)
                    for item in shard
                },
            }
            payload = (json.dumps(index_document, indent=2, sort_keys=True) + "\n").encode()

            def fill_index(fd: int) -> None:
                write_all(fd, payload, 0)

            atomic_write(building / SAFE_WEIGHTS_INDEX_NAME, len(payload), fill_index, mode)
            names = [*names, SAFE_WEIGHTS_INDEX_NAME]
        fsync_directory(building)
        put_directory_in_place(building, output)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    fsync_directory(parent)
    return tuple(output / name for name in names)


def _header_bytes(items: list[MergeItem], metadata: dict[str, str]) -> bytes:
    return encode_safetensors_header(
        ((item.name, item.dtype_name, item.info.shape, item.nbytes) for item in items),
        metadata,
        _PLAIN_ALIGNMENT,
    )


def _file_size(items: list[MergeItem], metadata: dict[str, str]) -> int:
    return 8 + len(_header_bytes(items, metadata)) + sum(item.nbytes for item in items)


class _Copier:
    """Copies (and casts) tensors from rank files, one rank file open at a time."""

    def __init__(self, advance: Progress | None) -> None:
        self.advance = advance
        self.buffer = bytearray(CHUNK_BYTES)
        self.rank_file: RankFile | None = None
        self.source = -1
        self.blobs: dict[str, torch.Tensor] = {}

    def close(self) -> None:
        if self.source >= 0:
            os.close(self.source)
            self.source = -1
        self.rank_file = None
        self.blobs.clear()

    def _open(self, rank_file: RankFile) -> int:
        if self.rank_file is not rank_file:
            self.close()
            self.source = os.open(rank_file.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            self.rank_file = rank_file
        return self.source

    def _done(self, nbytes: int) -> None:
        if self.advance is not None and nbytes:
            self.advance(nbytes)

    def write_file(self, target: int, items: list[MergeItem], metadata: dict[str, str]) -> None:
        header = _header_bytes(items, metadata)
        position = write_all(target, struct.pack("<Q", len(header)) + header, 0)
        for item in items:
            source = self._open(item.rank_file)
            if item.info.entry is not None:
                position = self._copy_entry(source, target, item, item.info.entry, position)
            else:
                position = self._copy_view(source, target, item, position)

    def _copy_entry(
        self, source: int, target: int, item: MergeItem, entry: StoredEntry, position: int
    ) -> int:
        header = item.rank_file.header
        cast = item.dtype != entry.dtype
        for chunk in entry_chunks(source, header, entry, item.rank_file.where, self.buffer):
            if cast:
                values = torch.frombuffer(
                    chunk, dtype=entry.dtype, count=len(chunk) // entry.dtype.itemsize
                )
                data = memoryview(byte_view(values.to(item.dtype)).numpy())  # type: ignore[arg-type]
            else:
                data = chunk
            position = write_all(target, data, position)
            self._done(len(data))
        return position

    def _copy_view(self, source: int, target: int, item: MergeItem, position: int) -> int:
        spec = item.info.view
        assert spec is not None
        rank_file = item.rank_file
        if spec.blob not in self.blobs:
            self.blobs.clear()  # one shared block in memory at a time
            stored = {entry.name: entry for entry in rank_file.header.entries}
            self.blobs.update(
                load_entries(source, rank_file.header, rank_file.where, [stored[spec.blob]])
            )
        try:
            view = view_in_block(spec, self.blobs[spec.blob])
        except ValueError as error:
            raise WorkspaceError(f"{rank_file.where}: {item.info.name!r}: {error}") from None
        data = view.to(item.dtype).contiguous()
        written = write_all(target, memoryview(byte_view(data).numpy()), position)  # type: ignore[arg-type]
        self._done(written - position)
        return written
