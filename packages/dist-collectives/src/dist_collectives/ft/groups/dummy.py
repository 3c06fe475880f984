"""A group of one member that completes every operation at once."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dist_collectives.ft.groups.process_group import OPERATIONS, ProcessGroup, tensors_of
from dist_collectives.ft.groups.work import DummyWork


class ProcessGroupDummy(ProcessGroup):
    """A stand-in group of one member: every operation completes at once, tensors unchanged.

    Useful where torch insists on a group (DDP's constructor) but the real communication
    happens elsewhere.

    Args:
        rank: Must be 0.
        world: Must be 1.

    Raises:
        ValueError: ``world`` is not 1 or ``rank`` is not 0.
    """

    def __init__(self, rank: int, world: int) -> None:
        if world != 1:
            raise ValueError(
                f"ProcessGroupDummy(rank={rank}, world={world}): a dummy group has exactly "
                "one member; world must be 1"
            )
        if rank != 0:
            raise ValueError(f"ProcessGroupDummy(rank={rank}, world=1): rank must be 0")
        super().__init__()
        self.configure_count = 0

    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Counts the call; a dummy group needs no store (world_size must stay 1)."""
        if world_size != 1:
            raise ValueError(f"ProcessGroupDummy cannot be configured with world_size={world_size}")
        self.configure_count += 1

    @property
    def reconfigure_count(self) -> int:
        """How many times the group was configured or reconfigured (torchft 0.3's name)."""
        return self.configure_count

    def getBackendName(self) -> str:
        """``"ft-dummy"``."""
        return "ft-dummy"


def _completing(operation: str) -> Any:
    def complete(self: ProcessGroupDummy, *args: Any) -> dist.Work:
        return DummyWork(tensors_of(args))

    complete.__name__ = operation
    complete.__doc__ = f"Completes ``{operation}`` at once, tensors unchanged."
    return complete


for _operation in OPERATIONS:
    setattr(ProcessGroupDummy, _operation, _completing(_operation))


def _allgather(self: ProcessGroupDummy, *args: Any) -> dist.Work:
    # With one member, gathering copies each input into the single output slot.
    outputs, inputs = args[0], args[1]
    for output_list, tensor in zip(outputs, inputs, strict=True):
        output_list[0].copy_(tensor)
    return DummyWork(outputs)


def _allgather_base(self: ProcessGroupDummy, *args: Any) -> dist.Work:
    output, tensor = args[0], args[1]
    output.copy_(tensor.reshape(output.shape))
    return DummyWork([output])


def _allgather_into_tensor_coalesced(self: ProcessGroupDummy, *args: Any) -> dist.Work:
    outputs, inputs = args[0], args[1]
    for output, tensor in zip(outputs, inputs, strict=True):
        output.copy_(tensor.reshape(output.shape))
    return DummyWork(list(outputs))


def _start_coalescing(self: ProcessGroupDummy, *args: Any) -> None:
    return None


# Overriding the loop's: with one member, gathering copies each input to its output.
setattr(ProcessGroupDummy, "allgather", _allgather)  # noqa: B010
setattr(ProcessGroupDummy, "_allgather_base", _allgather_base)  # noqa: B010
setattr(ProcessGroupDummy, "all_gather_single", _allgather_base)  # noqa: B010
setattr(ProcessGroupDummy, "allgather_into_tensor_coalesced", _allgather_into_tensor_coalesced)  # noqa: B010
setattr(ProcessGroupDummy, "all_gather_single_coalesced", _allgather_into_tensor_coalesced)  # noqa: B010
setattr(ProcessGroupDummy, "_start_coalescing", _start_coalescing)  # noqa: B010
