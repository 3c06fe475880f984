"""How a state dict is laid out for a transfer: its JSON description, messages, checksums.

No I/O here (:mod:`dist_collectives.ft.replica.state_transfer` sends and receives); both sides
compute the same layout from the description alone, and tests call these functions
without processes.

1. :func:`describe` turns a state dict into a JSON-able description in which each tensor
   is replaced by its index, shape and dtype, and lists the tensors with their paths
   (``state['model']['weight']``); :func:`tensor_specs` reads the tensors back out of a
   received description and :func:`rebuild` puts received tensors in their places.
2. :func:`plan_messages` cuts the tensors' bytes into point-to-point messages: a tensor
   of at least ``pack_bytes`` goes in slices of at most ``chunk_bytes``, sent from (and
   received into) the tensor's own memory; smaller ones are packed together into
   messages of at most ``chunk_bytes``. Few, large messages are what a transport moves
   at full speed; a copy is paid only for the small tensors.
3. Each piece of a message (one tensor's bytes in it) has a checksum (:func:`checksum`):
   the receiver names the tensor and the byte range that arrived changed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from dist_collectives.ft.errors import FTError

FORMAT = 2  # bumped whenever the description or the layout changes meaning
_SCALARS = (bool, int, float, str, type(None))


class StateTransferError(FTError, RuntimeError):
    """A state dict could not be encoded, or what arrived does not describe one or is corrupt."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a described state: what the receiver allocates, and where it goes."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    cuda: bool  # whether the sender held it on a GPU (the receiver keeps CPU ones on the CPU)

    @property
    def nbytes(self) -> int:
        """The tensor's size in bytes."""
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class Piece:
    """Bytes ``[start, stop)`` of tensor ``tensor``, at ``offset`` in their message."""

    tensor: int
    start: int
    stop: int
    offset: int


@dataclasses.dataclass(frozen=True)
class Message:
    """One point-to-point message: a slice of one tensor (``direct``) or packed tensors."""

    nbytes: int
    pieces: tuple[Piece, ...]
    direct: bool


def describe(state: Any) -> tuple[Any, list[torch.Tensor], list[TensorSpec]]:
    """The JSON-able description of ``state``, its tensors (detached) and their specs.

    Raises:
        StateTransferError: ``state`` holds something other than tensors, dicts, lists,
            tuples, numbers, strings and None, or a dict key that is not a str or int.
    """
    tensors: list[torch.Tensor] = []
    specs: list[TensorSpec] = []
    description = _encode(state, tensors, specs, "state")
    return description, tensors, specs


def _encode(value: Any, tensors: list[torch.Tensor], specs: list[TensorSpec], path: str) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        cuda = value.device.type == "cuda"
        specs.append(TensorSpec(path, tuple(value.shape), value.dtype, cuda))
        return {
            "tensor": len(tensors) - 1,
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "cuda": cuda,
        }
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise StateTransferError(
                    f"state dict key {path}[{key!r}] is a {type(key).__name__}; only str "
                    "and int keys can be sent"
                )
            items.append([key, _encode(item, tensors, specs, f"{path}[{key!r}]")])
        return {"dict": items}
    if isinstance(value, list | tuple):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_encode(v, tensors, specs, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, _SCALARS):
        if isinstance(value, float) and value != value:
            return {"float": "nan"}
        return {"scalar": value}
    raise StateTransferError(
        f"state dict entry {path} is a {type(value).__name__}; only tensors, dicts, "
        "lists, tuples, numbers, strings and None can be sent"
    )


def _dtype(name: Any) -> torch.dtype:
    candidate = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(candidate, torch.dtype):
        raise StateTransferError(f"received an unknown dtype {name!r}")
    return candidate


def _malformed(node: Any) -> StateTransferError:
    return StateTransferError(f"received a malformed state description: {node!r:.80}")


def tensor_specs(description: Any) -> list[TensorSpec]:
    """The tensors a received description holds, by index (see :func:`describe`).

    Raises:
        StateTransferError: the description is malformed (an index missing or repeated,
            a negative size, an unknown dtype).
    """
    found: dict[int, TensorSpec] = {}
    _collect(description, found, "state")
    if sorted(found) != list(range(len(found))):
        raise StateTransferError(
            f"received a state description whose tensor numbers are {sorted(found)[:8]}...; "
            f"expected 0 to {len(found) - 1}"
        )
    return [found[index] for index in range(len(found))]


def _collect(node: Any, found: dict[int, TensorSpec], path: str) -> None:
    if not isinstance(node, dict) or len(node) == 0:
        raise _malformed(node)
    try:
        if "tensor" in node:
            index = int(node["tensor"])
            shape = tuple(int(size) for size in node["shape"])
            if index in found or any(size < 0 for size in shape):
                raise _malformed(node)
            found[index] = TensorSpec(path, shape, _dtype(node["dtype"]), bool(node.get("cuda")))
        elif "dict" in node:
            for key, item in node["dict"]:
                _collect(item, found, f"{path}[{key!r}]")
        elif "list" in node or "tuple" in node:
            items = node["list"] if "list" in node else node["tuple"]
            for i, item in enumerate(items):
                _collect(item, found, f"{path}[{i}]")
    except (TypeError, ValueError):
        raise _malformed(node) from None


def tensors_by_path(state: Any, path: str = "state") -> dict[str, torch.Tensor]:
    """The tensors of a (nested) state by their :func:`describe` path; the rest ignored."""
    if isinstance(state, torch.Tensor):
        return {path: state.detach()}
    found: dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        for key, item in state.items():
            found.update(tensors_by_path(item, f"{path}[{key!r}]"))
    elif isinstance(state, list | tuple):
        for i, item in enumerate(state):
            found.update(tensors_by_path(item, f"{path}[{i}]"))
    return found


def rebuild(node: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The state a description stands for, with ``tensors`` in their places."""
    if not isinstance(node, dict) or len(node) == 0:
        raise _malformed(node)
    if "tensor" in node:
        return tensors[int(node["tensor"])]
    if "dict" in node:
        return {key: rebuild(item, tensors) for key, item in node["dict"]}
    if "list" in node:
        return [rebuild(item, tensors) for item in node["list"]]
    if "tuple" in node:
        return tuple(rebuild(item, tensors) for item in node["tuple"])
    if "float" in node:
        return float("nan")
    if "scalar" in node:
        return node["scalar"]
    raise _malformed(node)


def plan_messages(sizes: Sequence[int], chunk_bytes: int, pack_bytes: int) -> list[Message]:
    """The messages that carry tensors of ``sizes`` bytes (see the module doc).

    Empty tensors travel in no message. The order is a pure function of the arguments,
    so sender and receiver agree on it.
    """
    if chunk_bytes < 1 or not 1 <= pack_bytes <= chunk_bytes:
        raise StateTransferError(
            f"chunk_bytes={chunk_bytes}, pack_bytes={pack_bytes}: expected "
            "1 <= pack_bytes <= chunk_bytes"
        )
    messages: list[Message] = []
    packed: list[Piece] = []
    fill = 0
    for index, size in enumerate(sizes):
        if size == 0:
            continue
        if size >= pack_bytes:
            for start in range(0, size, chunk_bytes):
                stop = min(start + chunk_bytes, size)
                messages.append(Message(stop - start, (Piece(index, start, stop, 0),), True))
            continue
        if fill + size > chunk_bytes:
            messages.append(Message(fill, tuple(packed), False))
            packed, fill = [], 0
        packed.append(Piece(index, 0, size, fill))
        fill += size
    if packed:
        messages.append(Message(fill, tuple(packed), False))
    return messages


_BLOCK_WORDS = 512  # 4 KiB blocks of 8-byte words
_POSITIONS = torch.arange(1, _BLOCK_WORDS + 1, dtype=torch.int64)
MASK = (1 << 64) - 1
CHECKSUM_WORDS = 3  # int64 values per piece


def checksum(data: torch.Tensor) -> tuple[int, int, int]:
    """A position-aware 64-bit checksum of a contiguous uint8 tensor, as three integers.

    The bytes are read as 8-byte words ``w`` in 4 KiB blocks of 512; with ``b_k`` the
    sum of block ``k`` (all sums modulo 2**64)::

        (sum of w, sum of (k + 1) * b_k, sum over blocks of sum of (j + 1) * w[k, j])

    and the bytes past the last whole word go into the first sum as a little-endian
    word. Any change of a single word changes the first sum; blocks out of place and
    words moved within a block change the others. torch computes it at memory speed
    (several times CRC-32's rate on one core), which is the difference on a machine
    whose cores are busy moving the bytes. A GPU tensor is copied to the CPU first.
    """
    if data.device.type != "cpu":
        data = data.cpu()  # ordered after the stream's writes; blocks until copied
    nbytes = data.numel()
    whole = nbytes - nbytes % 8
    if data.storage_offset() % 8:
        data = data.clone()  # int64 views need aligned storage
    tail = int.from_bytes(data[whole:].numpy().tobytes(), "little")
    words = data[:whole].view(torch.int64)
    full = words.numel() - words.numel() % _BLOCK_WORDS
    blocks = words[:full].view(-1, _BLOCK_WORDS)
    rest = words[full:]
    sums = blocks.sum(dim=1)
    total = int(sums.sum()) + int(rest.sum()) + tail
    rows = torch.arange(1, sums.numel() + 2, dtype=torch.int64)
    placed = int(sums @ rows[:-1]) + int(rest.sum()) * int(rows[-1])
    within = int((blocks @ _POSITIONS).sum()) + int(rest @ _POSITIONS[: rest.numel()])
    return total & MASK, placed & MASK, within & MASK
