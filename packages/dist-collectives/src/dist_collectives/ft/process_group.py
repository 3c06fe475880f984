"""The reconfigurable process group interface every ``dist_collectives.ft`` group implements."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    _register_process_group,
    _unregister_process_group,
)

from dist_collectives.ft.errors import FTError, UnsupportedOperationError

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(seconds=60)


# The group a register() call is making torch's next group, by backend name: torch
# calls the backend's factory from inside new_group.
_registering: dict[str, ProcessGroup] = {}


def _registered_group_factory(backend: str) -> Any:
    def create(store: Any, rank: int, world_size: int, timeout: Any) -> ProcessGroup:
        return _registering[backend]

    return create


class StoreAddressReusedError(FTError, ValueError):
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
        self._registered_with_default_group = False
        self._torch_group_name: GroupName | None = None
        self._timeout = DEFAULT_TIMEOUT
        #: The arguments of the last successful :meth:`configure`, or None.
        self.configuration: Configuration | None = None

    # -- configuration ------------------------------------------------------------------

    def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
        """Joins a new group of ``world_size`` members as ``rank``, leaving the old one.

        Two signatures, told apart by the type of the second argument:

        - ``configure(store_addr, rank, world_size)``;
        - torchft 0.2.0's ``configure(store_addr, replica_id, rank, world_size,
          quorum_id=None, group_rank=None, group_world_size=None, global_ranks=None)``,
          where ``replica_id`` is a ``str``. The extra arguments describe the
          configuration (the replica's name, the quorum's id, this rank's place in its
          replica group, the job-wide ranks of the members); they are checked and kept
          in :attr:`configuration`, and change nothing about how the group is built.

        Args:
            store_addr: ``host:port/prefix`` of a running store, with a prefix that no
                configuration of this object has used before.
            *args: ``rank, world_size`` (this member's rank in the new group and the
                number of its members), or torchft's ``replica_id, rank, world_size``
                and what follows.
            **kwargs: The same by name.

        Raises:
            TypeError: the arguments match neither signature.
            StoreAddressReusedError: this object was configured on ``store_addr`` before.
            ValueError: ``rank`` is not in ``0..world_size-1``, or ``global_ranks`` does
                not have ``world_size`` entries.
        """
        configuration = parse_configure_args(type(self).__name__, store_addr, args, kwargs)
        self._configure(configuration.store_addr, configuration.rank, configuration.world_size)
        self.configuration = configuration

    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """What :meth:`configure` does once its arguments are parsed (see there)."""
        raise UnsupportedOperationError(f"{type(self).__name__} does not support configure")

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
        """Registers this group with torch, so functional collectives and DeviceMesh find it.

        As in torchft: with a default group initialised (``init_process_group``), the
        group is made torch's next group through ``dist.new_group`` on a backend named
        ``"<getBackendName()>:<name>"`` whose factory returns this object, and torch
        names it: right after, :attr:`group_name` is ``str(dist.get_pg_count() - 1)``.
        Every rank of the default group must call it (``new_group`` is collective).
        Without a default group torch keeps no numbering; the group is then registered
        under ``name`` itself. Either way the registration survives reconfiguration,
        since it is this object that is registered, not one configuration.

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
        if not dist.is_initialized():
            group_name = cast("GroupName", name)
            self._set_group_name(group_name)
            _register_process_group(group_name, self)
            self._registered_name = group_name
            self._registered_with_default_group = False
            return self
        backend = f"{self.getBackendName()}:{name}"
        _registering[backend] = self
        if not hasattr(dist.Backend, backend.upper()):
            devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
            factory = _registered_group_factory(backend)
            dist.Backend.register_backend(backend, factory, devices=devices)
        try:
            group = dist.new_group(
                ranks=[dist.get_rank()], backend=backend, group_desc=backend, timeout=self._timeout
            )
        finally:
            _registering.pop(backend, None)
        if id(group) != id(self):  # compared by id: `is` would narrow self to Any
            raise RuntimeError(f"torch registered {group!r} instead of {self!r} for {backend!r}")
        self._registered_name = self._torch_group_name
        self._registered_with_default_group = True
        return self

    def _set_group_name(self, name: GroupName) -> None:
        """Called by torch with the name its registry gives the group (:attr:`group_name`)."""
        super()._set_group_name(name)
        self._torch_group_name = name

    @property
    def group_name(self) -> GroupName:
        """The name :meth:`register` gave the group (torch reads it to find the group)."""
        if self._registered_name is None:
            raise RuntimeError(
                f"{type(self).__name__} has no group name: call register(name) first"
            )
        return self._registered_name

    def unregister(self) -> None:
        """Removes the registration made by :meth:`register` (a no-op when not registered).

        A group registered through the default group is destroyed there as torchft
        does (``dist.destroy_process_group``), which leaves this object usable.
        """
        if self._registered_name is None:
            return
        if self._registered_with_default_group:
            dist.destroy_process_group(self)
        else:
            _unregister_process_group(self._registered_name)
        self._registered_name = None

    def shutdown(self) -> None:
        """Releases the current configuration's resources (a no-op by default)."""

    def errored(self) -> Exception | None:
        """An error that happened outside an operation's Work and needs a ``configure``.

        None by default; groups that record such errors (the error-swallowing wrapper,
        the baby groups) return the recorded one.
        """
        return None

    def set_timeout(self, timeout: timedelta) -> None:
        """Sets the timeout of the configurations made from the next :meth:`configure` on.

        It bounds the rendezvous and each operation of those configurations; the
        current configuration keeps the timeout it was built with.

        Raises:
            ValueError: ``timeout`` is not a positive :class:`~datetime.timedelta`.
        """
        if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
            raise ValueError(f"timeout={timeout!r} must be a positive datetime.timedelta")
        self._timeout = timeout

    def broadcast_one(self, tensor: torch.Tensor, root: int) -> dist.Work:
        """Broadcasts ``tensor`` from rank ``root`` of this group (torchft's shorthand)."""
        options = dist.BroadcastOptions()
        options.rootRank = root
        try:
            return self.broadcast([tensor], options)
        except UnsupportedOperationError as error:
            # Named for what the caller called, as torchft's refusals are.
            raise UnsupportedOperationError(f"{refuse(self, 'broadcast_one')} ({error})") from None

    def __repr__(self) -> str:
        """``ProcessGroupGloo()``: the class name, as torchft writes it (see :meth:`rank`)."""
        return f"{type(self).__name__}()"


# The collectives of torch 2.4-2.13's ProcessGroup (those returning a Work), and the
# coalescing pair; torch_collectives() adds any that a newer torch declares.
KNOWN_COLLECTIVES = (
    "allreduce",
    "allreduce_coalesced",
    "reduce",
    "broadcast",
    "allgather",
    "all_gather_single",
    "_allgather_base",
    "allgather_coalesced",
    "all_gather_single_coalesced",
    "allgather_into_tensor_coalesced",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_single",
    "_reduce_scatter_base",
    "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced",
    "all_to_all_single",
    "alltoall_base",
    "alltoall",
    "send",
    "recv",
    "recv_anysource",
    "barrier",
    "_start_coalescing",
    "_end_coalescing",
)

# Operations of torch's ProcessGroup that return a Work but manage the group instead
# of moving data: torch 2.14's in-place ``reconfigure``. These groups are rebuilt by
# ``configure``, so it is refused by name rather than forwarded to one configuration.
GROUP_MANAGEMENT = ("reconfigure",)

_RETURNS_WORK = re.compile(r"->\s*\S*Work\b")


def torch_collectives() -> tuple[str, ...]:
    """The names of the collectives of torch's ``ProcessGroup`` (operations returning a Work).

    Read from the signatures torch's bindings document, so a collective that a newer
    torch adds is forwarded (or refused by name) without a change here; the known ones
    come first, in a fixed order.
    """
    declared = []
    for name, member in vars(dist.ProcessGroup).items():
        if name.startswith("__") or not callable(member):
            continue
        if _RETURNS_WORK.search(getattr(member, "__doc__", None) or ""):
            declared.append(name)
    added = set(declared) - set(KNOWN_COLLECTIVES) - set(GROUP_MANAGEMENT)
    return KNOWN_COLLECTIVES + tuple(sorted(added))


OPERATIONS = torch_collectives()


def refuse(group: object, operation: str) -> UnsupportedOperationError:
    """The error for ``operation`` on ``group``: ``<Class> does not support <op>``."""
    return UnsupportedOperationError(f"{type(group).__name__} does not support {operation}")


def _unsupported(operation: str) -> Any:
    def unsupported(self: ProcessGroup, *args: Any, **kwargs: Any) -> dist.Work:
        raise refuse(self, operation)

    unsupported.__name__ = operation
    unsupported.__doc__ = f"Raises :class:`UnsupportedOperationError` naming ``{operation}``."
    return unsupported


# Subclasses override what they support; the rest says so instead of reaching torch's
# base, which has no backend ("No backend type associated with device type cpu").
for _operation in OPERATIONS:
    setattr(ProcessGroup, _operation, _unsupported(_operation))


def _reconfigure(self: ProcessGroup, *args: Any, **kwargs: Any) -> dist.Work:
    """Refused: torch 2.14's in-place reconfiguration; these groups use :meth:`configure`."""
    raise UnsupportedOperationError(
        f"{refuse(self, 'reconfigure')}: torch's in-place reconfiguration does not apply; "
        "call configure(store_addr, rank, world_size) with a new store prefix instead"
    )


def _supports_reconfigure(self: ProcessGroup) -> bool:
    """False: torch 2.14's ``reconfigure`` is refused (see :meth:`configure`)."""
    return False


# setattr: torch before 2.14 declares neither, so its stubs know neither.
setattr(ProcessGroup, "reconfigure", _reconfigure)  # noqa: B010
setattr(ProcessGroup, "supports_reconfigure", property(_supports_reconfigure))  # noqa: B010


@dataclasses.dataclass(frozen=True)
class Configuration:
    """The arguments of one :meth:`ProcessGroup.configure` call.

    ``replica_id`` and the fields after it are set by torchft's signature only.
    """

    store_addr: str
    rank: int
    world_size: int
    replica_id: str | None = None
    quorum_id: int | None = None
    group_rank: int | None = None
    group_world_size: int | None = None
    global_ranks: tuple[int, ...] | None = None


_TORCHFT_PARAMETERS = (
    "replica_id",
    "rank",
    "world_size",
    "quorum_id",
    "group_rank",
    "group_world_size",
    "global_ranks",
)


def _integer(owner: str, name: str, value: object, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}.configure: {name} must be an int, got {value!r}")
    return value


def check_rank(owner: str, rank_name: str, rank: int, size_name: str, size: int) -> None:
    """Raises ValueError unless ``0 <= rank < size``."""
    if not 0 <= rank < size:
        raise ValueError(
            f"{owner}.configure: {rank_name}={rank} is not in 0..{size - 1} ({size_name}={size})"
        )


def parse_configure_args(
    owner: str, store_addr: str, args: Sequence[Any], kwargs: dict[str, Any]
) -> Configuration:
    """Reads either signature of :meth:`ProcessGroup.configure` (see there).

    Raises:
        TypeError: the arguments match neither signature.
        ValueError: ``global_ranks`` does not have ``world_size`` entries, or
            ``group_rank`` is not in ``0..group_world_size-1``.
    """
    usage = (
        f"{owner}.configure takes (store_addr, rank, world_size) or torchft's "
        "(store_addr, replica_id, rank, world_size, quorum_id=None, group_rank=None, "
        "group_world_size=None, global_ranks=None)"
    )
    if not isinstance(store_addr, str):
        raise TypeError(f"{usage}; store_addr must be a str, got {store_addr!r}")
    if args and (isinstance(args[0], bool) or not isinstance(args[0], str | int)):
        raise TypeError(
            f"{usage}; the second argument must be a rank (int) or a replica_id (str), "
            f"got {args[0]!r}"
        )
    torchft = bool(args and isinstance(args[0], str)) or (not args and "replica_id" in kwargs)
    names = _TORCHFT_PARAMETERS if torchft else ("rank", "world_size")
    if len(args) > len(names):
        raise TypeError(f"{usage}; got {len(args) + 1} positional arguments")
    values: dict[str, Any] = dict(zip(names, args, strict=False))
    for name, value in kwargs.items():
        if name not in names or name in values:
            raise TypeError(f"{usage}; unexpected or repeated argument {name}={value!r}")
        values[name] = value
    missing = [name for name in names[: 3 if torchft else 2] if name not in values]
    if missing:
        raise TypeError(f"{usage}; missing {', '.join(missing)}")
    rank = _integer(owner, "rank", values["rank"])
    world_size = _integer(owner, "world_size", values["world_size"])
    assert rank is not None and world_size is not None
    if not torchft:
        return Configuration(store_addr, rank, world_size)
    global_ranks: tuple[int, ...] | None = None
    if values.get("global_ranks") is not None:
        global_ranks = tuple(
            int(_integer(owner, "global_ranks[]", r) or 0) for r in values["global_ranks"]
        )
        if len(global_ranks) != world_size:
            raise ValueError(
                f"{owner}.configure: global_ranks={list(global_ranks)} has "
                f"{len(global_ranks)} entries; expected one per member (world_size={world_size})"
            )
    group_rank = _integer(owner, "group_rank", values.get("group_rank"), optional=True)
    group_world_size = _integer(
        owner, "group_world_size", values.get("group_world_size"), optional=True
    )
    if group_rank is not None and group_world_size is not None:
        check_rank(owner, "group_rank", group_rank, "group_world_size", group_world_size)
    return Configuration(
        store_addr,
        rank,
        world_size,
        replica_id=values["replica_id"],
        quorum_id=_integer(owner, "quorum_id", values.get("quorum_id"), optional=True),
        group_rank=group_rank,
        group_world_size=group_world_size,
        global_ranks=global_ranks,
    )


def reduce_op_name(op: Any) -> str:
    """``"SUM"``, ``"AVG"``, ... for a ReduceOp or the ``reduceOp`` of (coalesced) options.

    Raises:
        ValueError: the op is none of SUM, AVG, PRODUCT, MIN, MAX.
    """
    if not isinstance(op, dist.ReduceOp | dist.ReduceOp.RedOpType) and hasattr(op, "reduceOp"):
        op = op.reduceOp  # AllreduceOptions, AllreduceCoalescedOptions
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
