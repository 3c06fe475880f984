"""The receiver's own value: a CPU copy shaped as a peer's record would give it back.

A peer's value reaches the receiver as a record, so it comes back on CPU, with tuples
as lists, with tensors that shared a storage still sharing one, and aliasing nothing
of the sender's. The receiver's own value must look the same, but it need not take
the detour through a record: it is copied straight into one fresh anonymous buffer,
its pages allocated in the one ``mmap`` call (``MAP_POPULATE``: the copy writes every
page anyway), with one ``memmove`` per tensor (or shared span) on CPU. Not into
shared memory (a page of tmpfs costs more than an anonymous one), and not with huge
pages (a VM that takes freed memory back makes them slower to fault in again); the
measurements are on the benchmarks page.

Sharing is found as the record writer finds it (same device, same storage address,
see :func:`~dist_workspace.writer.shared_groups`) and each shared span is copied once.
"""

from __future__ import annotations

import ctypes
import mmap
from typing import Any

import torch

from dist_workspace.config_codec import decode_config, encode_config
from dist_workspace.writer import check_tensor, shared_groups

_ALIGNMENT = 64
# Below this a buffer comes from torch's allocator (malloc's heap, no system call).
_POPULATE_FROM_BYTES = 1024 * 1024
# Linux's flag; Python's mmap module has it from 3.10 on Linux only.
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def host_buffer(nbytes: int) -> torch.Tensor:
    """A fresh, writable 1-D uint8 CPU tensor of ``nbytes`` bytes, its pages allocated.

    From 1 MiB on it is a private anonymous mapping made with ``MAP_POPULATE`` (every
    page allocated in the one ``mmap`` call); the tensor holds the mapping, which is
    unmapped when the last tensor on it is freed. Where populating is not available
    the pages are faulted in as they are first written, as below 1 MiB.

    Raises:
        MemoryError: The system cannot map ``nbytes`` bytes.
    """
    if nbytes < _POPULATE_FROM_BYTES or not _MAP_POPULATE:
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE)
    except OSError as error:
        raise MemoryError(f"cannot map {nbytes} bytes for a CPU copy: {error}") from None
    return torch.frombuffer(mapping, dtype=torch.uint8)


def _copy(target: torch.Tensor, source: torch.Tensor) -> None:
    """Copies ``source`` into ``target`` (same shape, dtype and byte count).

    A CPU tensor whose elements are contiguous is copied with one ``memmove`` (ctypes
    releases the GIL): torch's ``copy_`` splits a copy over its intra-op threads, and
    while the senders keep every core busy each split waits for a thread to be
    scheduled (99 copies of a 256 MiB state dict: 28 ms on one thread, 100 ms to
    1.7 s on two on the development VM during an exchange).
    """
    if source.device.type == "cpu" and source.is_contiguous():
        nbytes = source.numel() * source.element_size()
        ctypes.memmove(target.data_ptr(), source.data_ptr(), nbytes)
    else:  # another device (one DMA copy) or strided elements
        target.copy_(source)


def _checked(label: str, tensor: Any) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{label} is a {type(tensor).__name__}, not a torch.Tensor")
    return check_tensor(label, tensor)  # the same checks and view resolution as a record's


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """Bytes ``[begin, end)`` of its storage that ``tensor`` reads."""
    begin = int(tensor.storage_offset()) * tensor.element_size()
    extent = sum(
        (int(size) - 1) * int(stride)
        for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return begin, begin + (extent + 1) * tensor.element_size()


def copy_to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU copies of ``tensors`` in one fresh buffer; tensors sharing a storage still do.

    Raises:
        TypeError: A value is not a dense tensor of a dtype a record can hold.
    """
    checked = {name: _checked(name, tensor) for name, tensor in tensors.items()}
    groups = shared_groups(checked)
    grouped = {name for names in groups for name in names}
    # Plan: every standalone tensor's elements, and each group's covering span, at
    # 64-byte aligned offsets of one buffer.
    plan: list[tuple[list[str], int, int, int]] = []  # names, span begin, length, offset
    offset = 0
    for names in [[name] for name in checked if name not in grouped] + groups:
        if len(names) == 1:
            begin, length = 0, checked[names[0]].numel() * checked[names[0]].element_size()
        else:
            spans = [_span(checked[name]) for name in names if checked[name].numel()]
            begin = min(start for start, _ in spans)
            begin -= begin % _ALIGNMENT
            length = max(stop for _, stop in spans) - begin
        offset += -offset % _ALIGNMENT
        plan.append((names, begin, length, offset))
        offset += length
    buffer = host_buffer(offset)
    copies: dict[str, torch.Tensor] = {}
    for names, begin, length, at in plan:
        target = buffer[at : at + length]
        if len(names) == 1:
            source = checked[names[0]]
            if length:
                copy = target.view(source.dtype).view(source.shape)
                _copy(copy, source)
                copies[names[0]] = copy
            else:
                copies[names[0]] = torch.empty(source.shape, dtype=source.dtype)
            continue
        members = [checked[name] for name in names]
        storage = max(
            (member.untyped_storage() for member in members), key=lambda item: item.nbytes()
        )
        span = torch.empty(0, dtype=torch.uint8, device=storage.device)
        span.set_(storage, begin, (length,), (1,))
        _copy(target, span)  # each shared span once, whatever its device
        for name, member in zip(names, members, strict=True):
            byte_offset = at + member.storage_offset() * member.element_size() - begin
            view = torch.empty(0, dtype=member.dtype)
            view.set_(
                buffer.untyped_storage(),
                byte_offset // member.element_size(),
                member.shape,
                member.stride(),
            )
            copies[name] = view
    return {name: copies[name] for name in tensors}


def own_tensor(tensor: Any, label: str) -> torch.Tensor:
    """A contiguous CPU copy of ``tensor`` that aliases nothing of the caller's."""
    return copy_to_host({label: tensor})[label]


def own_config(config: Any, where: str) -> Any:
    """``config`` as a peer's record gives it back: tuples as lists, tensors copied to CPU.

    Raises:
        TypeError: The config is not JSON (naming the key path), or holds a tensor a
            record cannot.
    """
    text, tensors = encode_config(config)
    labels = {name: f"the config's tensor {name}" for name in tensors}
    copies = copy_to_host({labels[name]: tensor for name, tensor in tensors.items()})
    return decode_config(text, {name: copies[labels[name]] for name in tensors}, where)
