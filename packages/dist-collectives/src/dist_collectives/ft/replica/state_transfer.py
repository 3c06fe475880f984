"""Sending a state dict to a healing replica over a process group, without pickle.

The structure of the state dict (nested dicts, lists, tuples, scalars, strings) travels
as JSON with each tensor replaced by its index, shape and dtype; the tensors follow as
raw bytes over point-to-point sends. The receiver rebuilds everything from that
description alone, so it needs no state of its own (a fresh optimizer has none yet)
and never executes anything it receives. The layout is :mod:`state_layout`'s:

1. tag 0: the header's length; tag 1: the header (JSON: format, step, description,
   message sizes).
2. tags 2 to 2 + M - 1: the M messages of :func:`~state_layout.plan_messages`. Large
   tensors go as slices of their own memory and arrive in the final tensors; small
   ones are packed. Up to ``WINDOW`` messages are in flight at once, and each side
   computes the checksum of one message while the transport moves the next.
3. tag 2 + M: the sender's checksum of every piece (int64). The receiver compares them
   with its own and raises :class:`StateTransferError` naming the tensor and byte
   range that differ, before anything is handed to ``load_state_dict``.

Fresh receive buffers are mapped before their receive is posted
(:mod:`host_pages`): a receive that faults in each page as it writes runs many times
slower than the transport.

Devices and streams: the bytes travel on the group's transport device, the CPU for
gloo groups and the current CUDA device for NCCL groups (``getBackendName()``
containing ``nccl``), and the receiver gets its tensors on that device. The state
sent was written by the training thread, on whatever stream it uses, while this runs
on the Manager's quorum worker: before anything is read, every CUDA device holding a
tensor of the state is synchronised, and after the last send (and after the last
receive) the transport stream is synchronised too, so that neither side hands a
tensor to another thread, or lets it be overwritten, while the GPU still reads or
writes it.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from dist_collectives.ft.replica import host_pages
from dist_collectives.ft.replica.state_layout import (
    CHECKSUM_WORDS,
    FORMAT,
    MASK,
    Message,
    Piece,
    StateTransferError,
    TensorSpec,
    checksum,
    describe,
    plan_messages,
    rebuild,
    tensor_specs,
    tensors_by_path,
)

__all__ = ["StateTransferError", "recv_state", "send_state", "transport_device"]

logger = logging.getLogger(__name__)

# The sender's choice, written in the header: the receiver follows what it reads.
CHUNK_BYTES = 32 << 20  # the largest message
PACK_BYTES = 4 << 20  # tensors below this are packed together, larger ones sent in place
WINDOW = 3  # messages in flight at once
_MAX_CHUNK_BYTES = 1 << 30  # what a receiver accepts from a header


def transport_device(pg: dist.ProcessGroup) -> torch.device:
    """The device the bytes of a state travel on over ``pg`` (see the module doc)."""
    backend_name = getattr(pg, "getBackendName", None) or pg.name  # torch's own groups: name()
    if "nccl" in backend_name().lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _synchronize(devices: set[torch.device]) -> None:
    """Waits for all queued work on each CUDA device in ``devices``, on every stream.

    The caller cannot know which stream wrote (or still reads) a tensor of the state:
    that happened on another thread. A state transfer heals a replica, which is rare,
    so the cost of a device-wide synchronisation does not matter.
    """
    for device in sorted(devices, key=str):
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class _Buffers:
    """Reused buffers for packed messages: a fresh one would fault in its pages each time."""

    def __init__(self, messages: list[Message], device: torch.device) -> None:
        self._size = max((m.nbytes for m in messages if not m.direct), default=0)
        self._device = device
        self._free: list[torch.Tensor] = []

    def take(self) -> torch.Tensor:
        if not self._free:
            buffer = torch.empty(self._size, dtype=torch.uint8, device=self._device)
            host_pages.prefer_huge_pages(buffer)
            host_pages.populate(buffer)
            self._free.append(buffer)
        return self._free.pop()

    def give(self, buffer: torch.Tensor | None) -> None:
        if buffer is not None:
            self._free.append(buffer)


def _piece(data: torch.Tensor, piece: Piece) -> torch.Tensor:
    return data[piece.offset : piece.offset + piece.stop - piece.start]


class _Source:
    """The bytes of each tensor to send, on the transport device and contiguous.

    The direct slices of one tensor come one after another: its copy (if it needs one,
    a GPU tensor over gloo or a strided one) is made once and kept until the next.
    """

    def __init__(self, tensors: list[torch.Tensor], device: torch.device) -> None:
        self._tensors = tensors
        self._device = device
        self._last: tuple[int, torch.Tensor] | None = None

    def bytes_of(self, piece: Piece) -> torch.Tensor:
        if self._last is None or self._last[0] != piece.tensor:
            tensor = self._tensors[piece.tensor].to(self._device).contiguous()
            self._last = (piece.tensor, _as_bytes(tensor))
        return self._last[1][piece.start : piece.stop]


def send_state(pg: dist.ProcessGroup, state: Any, step: int, dst: int) -> None:
    """Sends ``state`` (and the step it belongs to) to rank ``dst`` of ``pg``; blocks.

    CUDA tensors of ``state`` are read only after their devices are synchronised, and
    the call returns only once the GPU is done reading them (see the module doc).

    Raises:
        StateTransferError: ``state`` holds something other than tensors, containers
            and scalars.
    """
    description, tensors, specs = describe(state)
    header = json.dumps(
        {
            "format": FORMAT,
            "step": step,
            "state": description,
            "chunk_bytes": CHUNK_BYTES,
            "pack_bytes": PACK_BYTES,
        }
    ).encode()
    device = transport_device(pg)
    _synchronize({t.device for t in tensors})
    header_tensor = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    length = torch.tensor([header_tensor.numel()], dtype=torch.int64, device=device)
    pg.send([length], dst, 0).wait()
    pg.send([header_tensor], dst, 1).wait()
    messages = plan_messages([spec.nbytes for spec in specs], CHUNK_BYTES, PACK_BYTES)
    source = _Source(tensors, device)
    buffers = _Buffers(messages, device)
    in_flight: collections.deque[tuple[Any, torch.Tensor | None]] = collections.deque()
    sums: list[tuple[int, int, int]] = []
    for index, message in enumerate(messages):
        if message.direct:
            packed, data = None, source.bytes_of(message.pieces[0])
        else:
            packed = buffers.take()
            data = packed[: message.nbytes]
            for piece in message.pieces:
                _piece(data, piece).copy_(source.bytes_of(piece))
        in_flight.append((pg.send([data], dst, 2 + index), packed))
        # While the transport sends this message (and the ones before it).
        sums += [checksum(_piece(data, piece)) for piece in message.pieces]
        while len(in_flight) >= WINDOW or (in_flight and index == len(messages) - 1):
            work, done = in_flight.popleft()
            work.wait()
            buffers.give(done)
    if sums:
        pg.send([_sums_tensor(sums, device)], dst, 2 + len(messages)).wait()
    # On NCCL, wait() only made this thread's stream wait for the sends: the caller
    # may change the state as soon as this returns, so the GPU must be done with it.
    _synchronize({device})
    logger.info("sent step %d (%d tensors) to rank %d", step, len(tensors), dst)


def _read_header(raw: torch.Tensor, src: int) -> tuple[int, Any, int, int]:
    try:
        header = json.loads(bytes(raw.cpu().numpy()).decode())
        found = header.get("format")
        if found != FORMAT:
            raise StateTransferError(
                f"rank {src} sent a state in format {found!r}; this dist_collectives reads "
                f"format {FORMAT}: every replica of a job must run the same version"
            )
        step, chunk, pack = (int(header[k]) for k in ("step", "chunk_bytes", "pack_bytes"))
        description = header["state"]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise StateTransferError(f"rank {src} sent a malformed state header: {error}") from None
    if not 1 <= pack <= chunk <= _MAX_CHUNK_BYTES:
        raise StateTransferError(
            f"rank {src} sent chunk_bytes={chunk}, pack_bytes={pack}; expected "
            f"1 <= pack_bytes <= chunk_bytes <= {_MAX_CHUNK_BYTES}"
        )
    return step, description, chunk, pack


def _hex(values: tuple[int, ...]) -> str:
    return "/".join(f"{v:016x}" for v in values)


def _sums_tensor(sums: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
    """The checksums as int64 (two's complement of the unsigned 64-bit values)."""
    signed = [[v - (1 << 64) if v >= 1 << 63 else v for v in row] for row in sums]
    return torch.tensor(signed, dtype=torch.int64, device=device)


def _verify(
    src: int,
    step: int,
    specs: list[TensorSpec],
    pieces: list[Piece],
    ours: list[tuple[int, int, int]],
    theirs: list[tuple[int, ...]],
) -> None:
    bad = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    if not bad:
        return
    piece = pieces[bad[0]]
    raise StateTransferError(
        f"the state rank {src} sent for step {step} arrived corrupted: "
        f"{specs[piece.tensor].path} bytes [{piece.start}, {piece.stop}) have checksum "
        f"{_hex(ours[bad[0]])}, the sender's is {_hex(theirs[bad[0]])} ({len(bad)} of "
        f"{len(pieces)} pieces differ); the state is not returned"
    )


def _destinations(
    specs: list[TensorSpec], into: Any, device: torch.device
) -> tuple[list[torch.Tensor], set[int]]:
    """Where each spec's bytes go: ``into``'s tensor at its path, or a fresh one.

    ``into``'s tensor must take the bytes as they are: same shape and dtype,
    contiguous, on ``device``. Also returns the indices of the fresh ones.
    """
    by_path = tensors_by_path(into)
    tensors = []
    fresh = set()
    for index, spec in enumerate(specs):
        own = by_path.get(spec.path)
        if (
            own is not None
            and own.shape == spec.shape
            and own.dtype == spec.dtype
            and own.device == device
            and own.is_contiguous()
            and (device.type == "cpu" or spec.cuda)
        ):
            tensors.append(own)
        else:
            tensors.append(torch.empty(spec.shape, dtype=spec.dtype, device=device))
            fresh.add(index)
    return tensors, fresh


def recv_state(pg: dist.ProcessGroup, src: int, *, into: Any = None) -> tuple[Any, int]:
    """Receives what :func:`send_state` sent from rank ``src``; returns (state, step).

    The tensors are on the group's transport device (the CPU for gloo groups), and
    the GPU is done writing them when this returns.

    Args:
        pg: The group.
        src: The sender's rank in ``pg``.
        into: This replica's own (stale) state, or None. A tensor of it at the same
            path, with the same shape and dtype, contiguous and on the transport
            device, receives the bytes in place and is returned in the state; others
            are received into fresh tensors. In place skips mapping fresh memory and
            the copy ``load_state_dict`` makes, but if the checksums then fail, those
            tensors are already partly overwritten (a healing replica's state is stale
            either way, and it heals again).

    Raises:
        StateTransferError: what arrived is not a state description, or a tensor's
            bytes do not match the sender's checksum (the message names it).
    """
    device = transport_device(pg)
    length = torch.zeros(1, dtype=torch.int64, device=device)
    pg.recv([length], src, 0).wait()
    started = time.perf_counter()  # the sender is sending now: time the transfer alone
    raw_header = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    pg.recv([raw_header], src, 1).wait()
    step, description, chunk_bytes, pack_bytes = _read_header(raw_header, src)
    specs = tensor_specs(description)
    tensors, fresh = _destinations(specs, into, device)
    targets = [_as_bytes(tensor) for tensor in tensors]
    for index in fresh:
        host_pages.prefer_huge_pages(targets[index])
    messages = plan_messages([spec.nbytes for spec in specs], chunk_bytes, pack_bytes)
    buffers = _Buffers(messages, device)

    def post(index: int) -> tuple[Any, torch.Tensor, torch.Tensor | None]:
        message = messages[index]
        if message.direct:
            piece = message.pieces[0]
            packed, data = None, targets[piece.tensor][piece.start : piece.stop]
            if piece.tensor in fresh:  # mapped before the receive writes it (module doc)
                host_pages.populate(data)
        else:
            packed = buffers.take()
            data = packed[: message.nbytes]
        return pg.recv([data], src, 2 + index), data, packed

    in_flight = collections.deque(post(i) for i in range(min(WINDOW, len(messages))))
    sums: list[tuple[int, int, int]] = []
    for index, message in enumerate(messages):
        work, data, packed = in_flight.popleft()
        work.wait()
        if index + WINDOW < len(messages):
            in_flight.append(post(index + WINDOW))
        # While the transport receives the next messages.
        for piece in message.pieces:
            if packed is not None:
                targets[piece.tensor][piece.start : piece.stop].copy_(_piece(data, piece))
            sums.append(checksum(_piece(data, piece)))
        buffers.give(packed)
    pieces = [piece for message in messages for piece in message.pieces]
    if pieces:
        expected = torch.empty((len(pieces), CHECKSUM_WORDS), dtype=torch.int64, device=device)
        pg.recv([expected], src, 2 + len(messages)).wait()
        theirs = [tuple(v & MASK for v in row) for row in expected.cpu().tolist()]
        _verify(src, step, specs, pieces, sums, theirs)
    # The state goes to load_state_dict on the training thread, whose stream has not
    # waited for these receives (on NCCL, wait() ordered only this thread's stream).
    _synchronize({device})
    if device.type == "cuda":
        # What was on the CPU goes back to the CPU (an optimizer's step counters must).
        tensors = [t if spec.cuda else t.cpu() for spec, t in zip(specs, tensors, strict=True)]
    seconds = time.perf_counter() - started
    size = sum(spec.nbytes for spec in specs)
    # The size and time also go on the record (``record.state_bytes``,
    # ``record.state_seconds``), for a handler that measures recoveries.
    logger.info(
        "received step %d (%d tensors, %d bytes) from rank %d in %.3f s (%.2f GB/s)",
        step,
        len(tensors),
        size,
        src,
        seconds,
        size / seconds / 1e9 if seconds > 0 else float("inf"),
        extra={"state_bytes": size, "state_seconds": seconds},
    )
    return rebuild(description, tensors), step
