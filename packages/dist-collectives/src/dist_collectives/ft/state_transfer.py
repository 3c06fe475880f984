"""Sending a state dict to a healing replica over a process group, without pickle.

The structure of the state dict (nested dicts, lists, tuples, scalars, strings) travels
as JSON with each tensor replaced by its index, shape and dtype; the tensors follow as
raw bytes over point-to-point sends. The receiver rebuilds everything from that
description alone, so it needs no state of its own (a fresh optimizer has none yet)
and never executes anything it receives.

Devices and streams: the bytes travel on the group's transport device, the CPU for
gloo groups and the current CUDA device for NCCL groups (``getBackendName()``
containing ``nccl``), and the receiver gets its tensors on that device. The state
sent was written by the training thread, on whatever stream it uses, while this runs
on the Manager's quorum thread: before anything is read, every CUDA device holding a
tensor of the state is synchronised, and after the last send (and after the last
receive) the transport stream is synchronised too, so that neither side hands a
tensor to another thread, or lets it be overwritten, while the GPU still reads or
writes it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from dist_collectives.ft.errors import FTError
from dist_collectives.ft.process_group import ProcessGroup

logger = logging.getLogger(__name__)

_SCALARS = (bool, int, float, str, type(None))


class StateTransferError(FTError, RuntimeError):
    """A state dict could not be encoded, or what arrived does not describe one."""


def _encode(value: Any, tensors: list[torch.Tensor], path: str) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return {
            "tensor": len(tensors) - 1,
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "cuda": value.device.type == "cuda",
        }
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise StateTransferError(
                    f"state dict key {path}[{key!r}] is a {type(key).__name__}; only str "
                    "and int keys can be sent"
                )
            items.append([key, _encode(item, tensors, f"{path}[{key!r}]")])
        return {"dict": items}
    if isinstance(value, list | tuple):
        kind = "list" if isinstance(value, list) else "tuple"
        return {kind: [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, _SCALARS):
        if isinstance(value, float) and value != value:
            return {"float": "nan"}
        return {"scalar": value}
    raise StateTransferError(
        f"state dict entry {path} is a {type(value).__name__}; only tensors, dicts, "
        "lists, tuples, numbers, strings and None can be sent"
    )


def _dtype(name: str) -> torch.dtype:
    candidate = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(candidate, torch.dtype):
        raise StateTransferError(f"received an unknown dtype {name!r}")
    return candidate


def _decode(node: Any, tensors: list[torch.Tensor]) -> Any:
    if not isinstance(node, dict) or len(node) == 0:
        raise StateTransferError(f"received a malformed state description: {node!r:.80}")
    if "tensor" in node:
        return tensors[int(node["tensor"])]
    if "dict" in node:
        return {key: _decode(item, tensors) for key, item in node["dict"]}
    if "list" in node:
        return [_decode(item, tensors) for item in node["list"]]
    if "tuple" in node:
        return tuple(_decode(item, tensors) for item in node["tuple"])
    if "float" in node:
        return float("nan")
    if "scalar" in node:
        return node["scalar"]
    raise StateTransferError(f"received a malformed state description: {node!r:.80}")


def _tensor_specs(node: Any, specs: dict[int, tuple[list[int], torch.dtype, bool]]) -> None:
    if isinstance(node, dict):
        if "tensor" in node:
            shape = [int(d) for d in node["shape"]]
            specs[int(node["tensor"])] = (shape, _dtype(node["dtype"]), bool(node.get("cuda")))
            return
        for value in node.values():
            _tensor_specs(value, specs)
    elif isinstance(node, list):
        for value in node:
            _tensor_specs(value, specs)


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def transport_device(pg: ProcessGroup) -> torch.device:
    """The device the bytes of a state travel on over ``pg`` (see the module doc)."""
    if "nccl" in pg.getBackendName().lower():
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


def send_state(pg: ProcessGroup, state: Any, step: int, dst: int) -> None:
    """Sends ``state`` (and the step it belongs to) to rank ``dst`` of ``pg``; blocks.

    CUDA tensors of ``state`` are read only after their devices are synchronised, and
    the call returns only once the GPU is done reading them (see the module doc).

    Raises:
        StateTransferError: ``state`` holds something other than tensors, containers
            and scalars.
    """
    tensors: list[torch.Tensor] = []
    header = json.dumps({"step": step, "state": _encode(state, tensors, "state")}).encode()
    device = transport_device(pg)
    _synchronize({t.device for t in tensors})
    header_tensor = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    length = torch.tensor([header_tensor.numel()], dtype=torch.int64, device=device)
    pg.send([length], dst, 0).wait()
    pg.send([header_tensor], dst, 1).wait()
    for index, tensor in enumerate(tensors):
        if tensor.numel() > 0:
            # A blocking copy to the CPU (gloo); on NCCL the tensor itself, if on device.
            payload = tensor.to(device).contiguous()
            pg.send([_as_bytes(payload)], dst, 2 + index).wait()
    # On NCCL, wait() only made this thread's stream wait for the sends: the caller
    # may change the state as soon as this returns, so the GPU must be done with it.
    _synchronize({device})
    logger.info("sent step %d (%d tensors) to rank %d", step, len(tensors), dst)


def recv_state(pg: ProcessGroup, src: int) -> tuple[Any, int]:
    """Receives what :func:`send_state` sent from rank ``src``; returns (state, step).

    The tensors are on the group's transport device (the CPU for gloo groups), and
    the GPU is done writing them when this returns.

    Raises:
        StateTransferError: what arrived is not a state description.
    """
    device = transport_device(pg)
    length = torch.zeros(1, dtype=torch.int64, device=device)
    pg.recv([length], src, 0).wait()
    started = time.perf_counter()  # the sender is sending now: time the transfer alone
    header_tensor = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    pg.recv([header_tensor], src, 1).wait()
    try:
        header = json.loads(bytes(header_tensor.cpu().numpy()).decode())
        step = int(header["step"])
        description = header["state"]
    except (ValueError, KeyError, TypeError) as error:
        raise StateTransferError(f"rank {src} sent a malformed state header: {error}") from None
    specs: dict[int, tuple[list[int], torch.dtype, bool]] = {}
    _tensor_specs(description, specs)
    tensors: list[torch.Tensor] = []
    for index in range(len(specs)):
        if index not in specs:
            raise StateTransferError(f"rank {src} described no tensor number {index}")
        shape, dtype, _ = specs[index]
        tensor = torch.empty(shape, dtype=dtype, device=device)
        if tensor.numel() > 0:
            pg.recv([_as_bytes(tensor)], src, 2 + index).wait()
        tensors.append(tensor)
    # The state goes to load_state_dict on the training thread, whose stream has not
    # waited for these receives (on NCCL, wait() ordered only this thread's stream).
    _synchronize({device})
    if device.type == "cuda":
        # What was on the CPU goes back to the CPU (an optimizer's step counters must).
        tensors = [t if specs[i][2] else t.cpu() for i, t in enumerate(tensors)]
    seconds = time.perf_counter() - started
    size = sum(t.numel() * t.element_size() for t in tensors)
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
    return _decode(description, tensors), step
