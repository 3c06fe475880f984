"""The reconfigurable process group interface every ``dist_collectives.ft`` group implements."""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
import threading
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    _register_process_group,
    _unregister_process_group,
)
from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, not re-exported in the stubs

from dist_collectives.ft.errors import FTError, UnsupportedOperationError
from dist_collectives.ft.groups.reconfigure import (
    Rendezvous,
    backend_group_name,
    configuration_uuid,
    make_handle,
    rendezvous_of,
)
from dist_collectives.ft.groups.work import DummyWork

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
    """A torch process group whose members can change.

    Two ways to move it to new members, both rebuilding its backend:

    - torchft 0.3's (and torch 2.14's): every member hands out
      :meth:`get_reconfigure_handle`, the handles are exchanged (a Manager's quorum, or
      :func:`~dist_collectives.ft.reconfigure_with_store`), and every member calls
      :meth:`reconfigure` with the same ``uuid`` and the handles in rank order;
    - torchft 0.2's: :meth:`configure` with a ``host:port/prefix`` of a store that runs
      in the job, a rank and a world size.

    Each configuration rendezvouses on its own ``host:port/prefix``; a prefix must never
    be used twice, because the keys a previous configuration left there would make the
    rendezvous of the new one read stale addresses (:meth:`reconfigure` names its
    prefix after the ``uuid``). Operations follow torch's ProcessGroup overloads (a
    tensor list with an options object, or a tensor with a
    :class:`~torch.distributed.ReduceOp`) and return :class:`~torch.distributed.Work`.

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
        #: The arguments of the last successful :meth:`configure` or :meth:`reconfigure`,
        #: or None.
        self.configuration: Configuration | None = None
        self._handle_lock = threading.Lock()
        self._reconfigure_id = uuid.uuid4().hex
        self._handle_store: TCPStore | None = None
        self._rank_info: RankInfo | None = None
        # The communicator a configuration being built belongs to (see _build).
        self._communicator: Communicator | None = None

    # -- torchft 0.3's reconfiguration by handles ------------------------------------------

    @property
    def supports_reconfigure(self) -> bool:
        """True: :meth:`reconfigure` moves this group to the members its handles name."""
        return True

    def set_rank_info(
        self,
        replica_id: str,
        group_rank: int,
        group_world_size: int,
        global_rank: int | None = None,
    ) -> None:
        """Tells the group who this process is (torchft 0.3; a Manager calls it).

        The global rank goes into :meth:`get_reconfigure_handle`, so every member
        learns the job-wide ranks of the group (torch's flight recorder reads them);
        with ``group_rank`` and ``group_world_size`` known, each configuration's
        backend is named ``torchft_<uuid>_rank_<group_rank % group_world_size>``.

        Args:
            replica_id: The replica (group) this process belongs to.
            group_rank: This process's rank within its replica group.
            group_world_size: The number of ranks in a replica group.
            global_rank: This process's job-wide rank, or None.

        Raises:
            ValueError: ``group_rank`` is not in ``0..group_world_size-1``.
        """
        owner = type(self).__name__
        if group_world_size < 1 or not 0 <= group_rank < group_world_size:
            raise ValueError(
                f"{owner}.set_rank_info: group_rank={group_rank} is not in "
                f"0..{group_world_size - 1} (group_world_size={group_world_size})"
            )
        self._rank_info = RankInfo(replica_id, group_rank, group_world_size, global_rank)

    @property
    def rank_info(self) -> RankInfo | None:
        """What :meth:`set_rank_info` was last told, or None."""
        return self._rank_info

    def _handle_id(self) -> str:
        """The ``id`` in this group's handles: fixed for the object's lifetime (torchft's name)."""
        return self._reconfigure_id

    def get_reconfigure_handle(self) -> str:
        """This member's handle: who it is, a store it hosts, its global rank.

        torchft's JSON (``{"id": ..., "store": "host:port", "global_rank": ...}``). The
        first call starts the store (a TCPStore server on this host, any free port);
        the members of a reconfiguration whose first handle is this one rendezvous on
        it, so it lives as long as this object.
        """
        with self._handle_lock:
            if self._handle_store is None:
                self._handle_store = TCPStore(
                    host_name=socket.gethostname(),
                    port=0,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=self._timeout,
                )
            store = f"{socket.gethostname()}:{self._handle_store.port}"
        info = self._rank_info
        return make_handle(self._handle_id(), store, None if info is None else info.global_rank)

    def reconfigure(self, opts: Any) -> dist.Work:
        """Joins the members ``opts.handles`` names, as the index of this group's handle.

        Every member passes the same options (``uuid``, ``handles`` in rank order); they
        rendezvous on ``<store of the first handle>/torchft/<uuid>`` and the backend is
        built as :meth:`configure` builds it. Blocks until it is; errors raise here.

        Args:
            opts: A :class:`~dist_collectives.ft.ReconfigureOptions` (torch's own on
                torch 2.14+).

        Returns:
            A completed :class:`~torch.distributed.Work`.

        Raises:
            ValueError: the handles are not a list, or do not include this group's.
            RendezvousTimeoutError: some members did not arrive within the timeout.
            StoreAddressReusedError: this group was reconfigured with this ``uuid``
                and first store before.
        """
        plan = rendezvous_of(opts, self._handle_id())
        self._build(plan.store_addr, plan.rank, plan.world_size, communicator_of(plan))
        info = self._rank_info
        self.configuration = Configuration(
            plan.store_addr,
            plan.rank,
            plan.world_size,
            replica_id=None if info is None else info.replica_id,
            quorum_id=plan.uuid,
            group_rank=None if info is None else info.group_rank,
            group_world_size=None if info is None else info.group_world_size,
            global_ranks=None if plan.global_ranks is None else tuple(plan.global_ranks),
        )
        return DummyWork()

    def _build(
        self, store_addr: str, rank: int, world_size: int, communicator: Communicator
    ) -> None:
        """:meth:`_configure` for ``communicator``, which names the backend it builds."""
        previous, self._communicator = self._communicator, communicator
        try:
            self._configure(store_addr, rank, world_size)
        except BaseException:
            self._communicator = previous
            raise

    def backend_group_name(self) -> str | None:
        """``torchft_<uuid>_rank_<n>`` for the configuration being built; None without rank info."""
        info, communicator = self._rank_info, self._communicator
        if info is None or communicator is None:
            return None
        return backend_group_name(communicator.uuid, info.group_rank, info.group_world_size)

    def backend_global_ranks(self) -> list[int] | None:
        """The job-wide ranks of the members of the configuration being built, if known."""
        communicator = self._communicator
        if communicator is None or communicator.global_ranks is None:
            return None
        return list(communicator.global_ranks)

    # -- configuration ------------------------------------------------------------------

    def configure(self, store_addr: str, *args: Any, **kwargs: Any) -> None:
        """Joins a new group of ``world_size`` members as ``rank``, leaving the old one.

        torchft 0.2's form of :meth:`reconfigure`, kept. Two signatures, told apart by
        the type of the second argument:

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
        communicator = Communicator(
            configuration_uuid(configuration.store_addr), configuration.global_ranks
        )
        self._build(
            configuration.store_addr, configuration.rank, configuration.world_size, communicator
        )
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
# of moving data: torch 2.14's ``reconfigure``, which each group answers itself
# (ProcessGroup.reconfigure) rather than forwarding it to one configuration.
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


@dataclasses.dataclass(frozen=True)
class RankInfo:
    """Who this process is, as :meth:`ProcessGroup.set_rank_info` was told."""

    replica_id: str
    group_rank: int
    group_world_size: int
    global_rank: int | None = None


@dataclasses.dataclass(frozen=True)
class Communicator:
    """The communicator one configuration builds: its ``uuid`` and members' global ranks."""

    uuid: int
    global_ranks: tuple[int, ...] | None = None


def communicator_of(plan: Rendezvous) -> Communicator:
    """The :class:`Communicator` that a :class:`~.reconfigure.Rendezvous` builds."""
    ranks = None if plan.global_ranks is None else tuple(plan.global_ranks)
    return Communicator(plan.uuid, ranks)


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
