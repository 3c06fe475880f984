"""A Manager's settings, checked once: what every other part of the Manager reads."""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from dist_collectives.ft.errors import ManagerConfigError

DEFAULT_NAMESPACE = "dist_collectives_ft"


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
    min_replica_size: int = 1
    timeout: timedelta = timedelta(seconds=60)
    heartbeat_interval: timedelta = timedelta(milliseconds=100)
    heartbeat_timeout: timedelta = timedelta(seconds=2)
    join_timeout: timedelta = timedelta(seconds=10)
    first_quorum_window: timedelta = timedelta(seconds=2)
    namespace: str = DEFAULT_NAMESPACE
    group_rank: int = 0
    group_world_size: int = 1
    init_sync: bool = True

    def __post_init__(self) -> None:
        _check_sizes(self.min_replica_size, self.group_rank, self.group_world_size)

    @classmethod
    def from_arguments(
        cls,
        *,
        replica_id: str | None,
        store_addr: str | None,
        store_port: int | None,
        environ: Mapping[str, str],
        min_replica_size: int,
        group_rank: int,
        group_world_size: int,
        **settings: Any,
    ) -> ManagerConfig:
        """The config of a Manager built with these arguments, in this environment.

        Args:
            replica_id: The replica's name, or None for a fresh one.
            store_addr: Host of the job's store, or None for ``MASTER_ADDR``.
            store_port: Port of the job's store, or None for ``MASTER_PORT``.
            environ: The environment to read ``MASTER_ADDR`` and ``MASTER_PORT`` from.
            min_replica_size: A quorum needs at least this many replicas.
            group_rank: This process's rank in its replica group.
            group_world_size: The number of ranks in each replica group.
            **settings: The other fields, as the Manager's arguments name them.

        Raises:
            ManagerConfigError: what is wrong, with the values found; the sizes are
                checked first, the store last.
        """
        _check_sizes(min_replica_size, group_rank, group_world_size)
        if group_world_size > 1 and replica_id is None:
            raise ManagerConfigError(
                f"group_world_size={group_world_size} needs a replica_id shared by the ranks "
                "of the replica group (each rank would otherwise name a group of its own)"
            )
        host, port = resolve_store(store_addr, store_port, environ)
        return cls(
            replica_id=replica_id or default_replica_id(),
            host=host,
            port=port,
            min_replica_size=min_replica_size,
            group_rank=group_rank,
            group_world_size=group_world_size,
            **settings,
        )

    @property
    def label(self) -> str:
        """How the log names this process: the replica, and its rank when in a group."""
        if self.group_world_size == 1:
            return self.replica_id
        return f"{self.replica_id} rank {self.group_rank}"

    @property
    def grouped(self) -> bool:
        """Whether a replica is a group of several ranks."""
        return self.group_world_size > 1


def _check_sizes(min_replica_size: int, group_rank: int, group_world_size: int) -> None:
    if min_replica_size < 1:
        raise ManagerConfigError(f"min_replica_size={min_replica_size} must be at least 1")
    if group_world_size < 1 or not 0 <= group_rank < group_world_size:
        raise ManagerConfigError(
            f"group_rank={group_rank} with group_world_size={group_world_size}: the "
            f"group size must be at least 1 and the rank in [0, {group_world_size})"
        )
