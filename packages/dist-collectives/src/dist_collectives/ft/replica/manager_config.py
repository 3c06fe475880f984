"""A Manager's settings, checked once: what every other part of the Manager reads."""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from collections.abc import Mapping
from datetime import timedelta

import torch.distributed as dist

from dist_collectives.ft.coordination.coordinator import CoordinatorSettings
from dist_collectives.ft.errors import ManagerConfigError

# The store's key prefix when a Manager is given none.
DEFAULT_NAMESPACE = "dist_collectives_ft"
# How many times a live rank's heartbeat counter moves per heartbeat timeout: enough
# that a beat or two late under load is not a death, few enough that N replicas cost
# the store N / (timeout / 4) adds a second, not N / heartbeat_interval.
BEATS_PER_HEARTBEAT_TIMEOUT = 4


def default_replica_id() -> str:
    """A name no other process takes: host, pid and a random suffix."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def resolve_store(
    store_addr: str | None, store_port: int | None, environ: Mapping[str, str]
) -> tuple[str, int]:
    """The job's store: the arguments, else ``MASTER_ADDR`` and ``MASTER_PORT``.

    Raises:
        ManagerConfigError: neither names a store, or the port is not an integer.
    """
    host = store_addr or environ.get("MASTER_ADDR")
    port_text = str(store_port) if store_port is not None else environ.get("MASTER_PORT")
    if not host or not port_text:
        raise ManagerConfigError(
            "Manager needs the job's store: pass store_addr and store_port, or set "
            f"MASTER_ADDR and MASTER_PORT (found MASTER_ADDR={environ.get('MASTER_ADDR')!r}, "
            f"MASTER_PORT={environ.get('MASTER_PORT')!r})"
        )
    try:
        port = int(port_text)
    except ValueError:
        raise ManagerConfigError(f"MASTER_PORT={port_text!r} is not an integer") from None
    return host, port


@dataclasses.dataclass(frozen=True)
class ManagerConfig:
    """What a Manager was built with, checked (see :class:`~dist_collectives.ft.Manager`).

    Raises:
        ManagerConfigError: ``min_replica_size`` below 1, or a group rank or size out
            of range.
    """

    replica_id: str
    host: str
    port: int
    # No defaults: the Manager's signature is where they are decided and documented.
    min_replica_size: int
    timeout: timedelta
    heartbeat_interval: timedelta
    heartbeat_timeout: timedelta
    join_timeout: timedelta
    first_quorum_window: timedelta
    namespace: str
    group_rank: int
    group_world_size: int
    init_sync: bool

    def __post_init__(self) -> None:
        _check_sizes(self.min_replica_size, self.group_rank, self.group_world_size)

    @property
    def label(self) -> str:
        """How the log names this process: the replica, and its rank when in a group."""
        if self.group_world_size == 1:
            return self.replica_id
        return f"{self.replica_id} rank {self.group_rank}"

    @property
    def beat_interval(self) -> timedelta:
        """How often this rank beats: a quarter of the heartbeat timeout, or every tick.

        The watcher still ticks (polls for errors, expires futures) every
        ``heartbeat_interval``; only the heartbeat's counter moves less often.
        """
        return max(self.heartbeat_interval, self.heartbeat_timeout / BEATS_PER_HEARTBEAT_TIMEOUT)

    @property
    def grouped(self) -> bool:
        """Whether a replica is a group of several ranks."""
        return self.group_world_size > 1

    def coordinator_settings(self) -> CoordinatorSettings:
        """What the replica's coordinator needs of these settings."""
        return CoordinatorSettings(
            replica_id=self.replica_id,
            group_rank=self.group_rank,
            group_world_size=self.group_world_size,
            min_replicas=self.min_replica_size,
            timeout=self.timeout,
            heartbeat_timeout=self.heartbeat_timeout,
            join_timeout=self.join_timeout,
            first_quorum_window=self.first_quorum_window,
            init_sync=self.init_sync,
        )


def check_arguments(
    min_replica_size: int, group_rank: int, group_world_size: int, replica_id: str | None
) -> None:
    """Checks a Manager's sizes, ranks and name, before it looks for the store.

    Raises:
        ManagerConfigError: what is wrong, with the values found.
    """
    _check_sizes(min_replica_size, group_rank, group_world_size)
    if group_world_size > 1 and replica_id is None:
        raise ManagerConfigError(
            f"group_world_size={group_world_size} needs a replica_id shared by the ranks "
            "of the replica group (each rank would otherwise name a group of its own)"
        )


def check_group(pg: object) -> None:
    """Raises unless the Manager can move ``pg`` to new members.

    These groups can; so can torch's own reconfigurable ones (torch 2.14+, built with
    ``init_process_group(..., enable_reconfigure=True)``), which say so through
    ``supports_reconfigure``. Asked of a group without a backend, torch raises instead
    of answering: that is a no.

    Raises:
        ManagerConfigError: ``pg`` cannot be reconfigured; the message names it.
    """
    try:
        supported = bool(getattr(pg, "supports_reconfigure", False))
    except RuntimeError:  # torch: "Could not find the default backend type ..."
        supported = False
    if supported:
        return
    name = _torch_group_name(pg)
    named = f" named {name!r}" if name else ""
    raise ManagerConfigError(
        f"Manager: {type(pg).__module__}.{type(pg).__qualname__}{named} ({pg!r}) cannot be "
        "reconfigured, and the Manager moves its group to the live replicas at every "
        "quorum change: pass a dist_collectives.ft group (ProcessGroupGloo, "
        "ProcessGroupNCCL, ...) or a torch group created with "
        "init_process_group(..., enable_reconfigure=True) (torch 2.14+)"
    )


def _torch_group_name(pg: object) -> str | None:
    """The name torch registered ``pg`` under, or None (unregistered, or not a torch group)."""
    if not isinstance(pg, dist.ProcessGroup):
        return None
    try:
        return str(pg.group_name)
    except (AttributeError, RuntimeError):  # torch: "ProcessGroup name not set"
        return None


def _check_sizes(min_replica_size: int, group_rank: int, group_world_size: int) -> None:
    if min_replica_size < 1:
        raise ManagerConfigError(f"min_replica_size={min_replica_size} must be at least 1")
    if group_world_size < 1 or not 0 <= group_rank < group_world_size:
        raise ManagerConfigError(
            f"group_rank={group_rank} with group_world_size={group_world_size}: the "
            f"group size must be at least 1 and the rank in [0, {group_world_size})"
        )
