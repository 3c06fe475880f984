"""The reconfigurable process group interface every ``dist_collectives.ft`` group implements."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    _register_process_group,
    _unregister_process_group,
)

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(seconds=60)


class StoreAddressReusedError(ValueError):
    """``configure`` was called twice on one group object with the same store address."""


class ProcessGroup(dist.ProcessGroup):
    """A torch process group whose members can change: call :meth:`configure` again.

    Each configuration rendezvouses on its own ``host:port/prefix`` of a store that runs
    in the job; a prefix must never be used twice, because the keys a previous
    configuration left there would make the rendezvous of the new one read stale
    addresses. Operations follow torch's ProcessGroup overloads (a tensor list with an
    options object, or a tensor with a :class:`~torch.distributed.ReduceOp`) and return
    :class:`~torch.distributed.Work`.

    The torch base is built as a group of rank 0 of 1 and is never reconfigured; this
    class answers :meth:`rank` and :meth:`size` from the current configuration.
    """

    def __init__(self) -> None:
        super().__init__(0, 1)  # type: ignore[call-arg]  # (rank, size) overload
        self._configured_rank = 0
        self._configured_world_size = 1
        self._used_store_addrs: set[str] = set()
        self._registered_name: GroupName | None = None

    # -- configuration ------------------------------------------------------------------

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Joins a new group of ``world_size`` members as ``rank``, leaving the old one.

        Args:
            store_addr: ``host:port/prefix`` of a running store, with a prefix that no
                configuration of this object has used before.
            rank: This member's rank in the new group.
            world_size: Number of members of the new group.

        Raises:
            StoreAddressReusedError: this object was configured on ``store_addr`` before.
            ValueError: ``rank`` is not in ``0..world_size-1``.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement configure")

    def _check_configuration(self, store_addr: str, rank: int, world_size: int) -> None:
        """Raises when :meth:`configure` must refuse these arguments; changes nothing.

        Every ``configure`` calls this (or :meth:`_claim_configuration`) before it
        touches the current configuration, so that a refused call leaves the group
        working as it was.
        """
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be at least 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} is not in 0..{world_size - 1} (world_size={world_size})")
        if store_addr in self._used_store_addrs:
            raise StoreAddressReusedError(
                f"{type(self).__name__} was already configured on store address "
                f"{store_addr!r}; every configuration needs a new prefix (for example "
                "append the quorum id) because the old keys would corrupt the rendezvous; "
                "the group keeps its current configuration"
            )

    def _claim_configuration(self, store_addr: str, rank: int, world_size: int) -> None:
        """Checks the arguments of :meth:`configure` and records the address as used.

        Call it before anything else in ``configure``: it raises without side effects.
        Once it returned, the address counts as used even if the configuration fails
        later (its keys may be in the store already). The rank and size answered by
        :meth:`rank` and :meth:`size` change only at :meth:`_set_configuration`.
        """
        self._check_configuration(store_addr, rank, world_size)
        self._used_store_addrs.add(store_addr)

    def _set_configuration(self, rank: int, world_size: int) -> None:
        """Records the rank and size of a configuration that is now in place."""
        self._configured_rank = rank
        self._configured_world_size = world_size

    # -- identity -----------------------------------------------------------------------

    def rank(self) -> int:
        """This member's rank in the current configuration."""
        return self._configured_rank

    def size(self) -> int:
        """Number of members in the current configuration."""
        return self._configured_world_size

    def getBackendName(self) -> str:
        """The name torch and functional collectives know this backend by."""
        raise NotImplementedError(f"{type(self).__name__} does not implement getBackendName")

    def register(self, name: str) -> ProcessGroup:
        """Registers this group under ``"<backend>:<name>"`` for functional collectives.

        After this, ``torch.distributed._functional_collectives`` and
        :class:`~torch.distributed.device_mesh.DeviceMesh` can find the group by name;
        the registration survives reconfiguration, since it is this object that is
        registered, not one configuration.

        Returns:
            This group, for chaining.

        Raises:
            RuntimeError: the group is already registered.
        """
        if self._registered_name is not None:
            raise RuntimeError(
                f"{type(self).__name__} is already registered as {self._registered_name!r}; "
                "call unregister() first"
            )
        group_name = cast("GroupName", f"{self.getBackendName()}:{name}")
        self._set_group_name(group_name)
        _register_process_group(group_name, self)
        self._registered_name = group_name
        return self

    @property
    def group_name(self) -> GroupName:
        """The name given by :meth:`register` (torch reads it to find the group)."""
        if self._registered_name is None:
            raise RuntimeError(
                f"{type(self).__name__} has no group name: call register(name) first"
            )
        return self._registered_name

    def unregister(self) -> None:
        """Removes the registration made by :meth:`register` (a no-op when not registered)."""
        if self._registered_name is None:
            return
        _unregister_process_group(self._registered_name)
        self._registered_name = None

    def shutdown(self) -> None:
        """Releases the current configuration's resources (a no-op by default)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank()}, world_size={self.size()})"


# Operations every wrapper forwards by name; they are torch ProcessGroup/Backend methods.
OPERATIONS = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "_allgather_base",
    "broadcast",
    "reduce_scatter",
    "alltoall_base",
    "barrier",
    "send",
    "recv",
)


def _unsupported(operation: str) -> Any:
    def refuse(self: ProcessGroup, *args: Any) -> dist.Work:
        raise NotImplementedError(f"{type(self).__name__} does not support {operation}")

    refuse.__name__ = operation
    return refuse


# Subclasses override what they support; the rest says so instead of reaching torch's
# base, which is a group of one member.
for _operation in OPERATIONS:
    setattr(ProcessGroup, _operation, _unsupported(_operation))


def reduce_op_name(op: Any) -> str:
    """``"SUM"``, ``"AVG"``, ... for a ReduceOp or the ``reduceOp`` of AllreduceOptions.

    Raises:
        ValueError: the op is none of SUM, AVG, PRODUCT, MIN, MAX.
    """
    if isinstance(op, dist.AllreduceOptions):
        op = op.reduceOp
    for name in ("SUM", "AVG", "PRODUCT", "MIN", "MAX"):
        if op == getattr(dist.ReduceOp, name):
            return name
    raise ValueError(f"reduce op {op!r} is not supported here")


def tensors_of(args: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors an operation's positional arguments name, flattened one level deep."""
    found: list[torch.Tensor] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, list | tuple):
            for item in arg:
                if isinstance(item, torch.Tensor):
                    found.append(item)
                elif isinstance(item, list | tuple):
                    found.extend(t for t in item if isinstance(t, torch.Tensor))
    return found
