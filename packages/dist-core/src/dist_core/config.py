"""``MultiprocessConfig``: what a launcher needs to start one process per device."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final

from dist_core.env import DEFAULT_MASTER_ADDR, DistEnv
from dist_core.ports import DEFAULT_PORT, get_unused_port


class _Missing:
    """The type of :data:`MISSING`: a field that :meth:`MultiprocessConfig.resolve` fills."""

    _instance: _Missing | None = None

    def __new__(cls) -> _Missing:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "MISSING"

    def __reduce__(self) -> str:
        return "MISSING"  # unpickles as this module's singleton


MISSING: Final[Any] = _Missing()


def is_missing(config: object, field_name: str) -> bool:
    """True when ``config.<field_name>`` is :data:`MISSING`."""
    return getattr(config, field_name) is MISSING


@dataclass
class MultiprocessConfig:
    """How many processes to start, where they meet, and with which backends.

    Fields left :data:`MISSING` are filled by :meth:`resolve`. ``rank`` and
    ``local_rank`` are -1 until a launcher assigns them to a worker.
    """

    rank: int = -1
    local_rank: int = -1
    world_size: int = MISSING
    local_world_size: int = MISSING
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = MISSING
    init_method: str = "env://"
    model_parallelism: int = 1
    pipeline_parallelism: int = 1
    backend: str | None = None
    model_parallel_backend: str | None = None
    pipeline_parallel_backend: str | None = None
    data_parallel_backend: str | None = None
    launch_method: str = "forkserver"

    @classmethod
    def resolve(cls, config: MultiprocessConfig) -> None:
        """Fills the missing fields of ``config`` in place (see :func:`resolved`).

        Raises:
            ValueError: ``local_world_size`` is larger than ``world_size``, or either
                is not positive.
        """
        filled = resolved(config)
        for field in dataclasses.fields(config):
            setattr(config, field.name, getattr(filled, field.name))

    def dist_env(self) -> DistEnv:
        """This worker's :class:`DistEnv`, from a resolved config with its rank set.

        The node rank is ``rank // local_world_size`` (nodes of equal size).

        Raises:
            DistEnvError: The rank or sizes disagree (a rank outside the world, ...).
        """
        return DistEnv(
            rank=self.rank,
            local_rank=self.local_rank,
            node_rank=self.rank // self.local_world_size,
            world_size=self.world_size,
            local_world_size=self.local_world_size,
            master_addr=self.master_addr,
            master_port=self.master_port,
            source="torchrun",
        )

    def replace(self, **changes: Any) -> MultiprocessConfig:
        """A copy with ``changes`` applied (the config itself is left alone)."""
        return dataclasses.replace(self, **changes)


def resolved(config: MultiprocessConfig) -> MultiprocessConfig:
    """A copy of ``config`` with its missing fields filled; ``config`` is left alone.

    ``world_size`` becomes the number of accelerator devices (1 on CPU);
    ``local_world_size`` becomes ``world_size``: every rank runs on this node unless
    the caller names ``local_world_size`` itself, as a multi-node launch does (one
    call per node, each with its ``rank_offset``). ``master_port`` becomes a free
    port (29500 when free, see :func:`dist_core.get_unused_port`). Reads
    ``CUDA_VISIBLE_DEVICES`` through torch, without initialising CUDA, so the caller
    can still fork workers that use it.

    Raises:
        ValueError: ``local_world_size`` is larger than ``world_size``, or either
            is not positive.
    """
    changes: dict[str, Any] = {}
    if is_missing(config, "world_size"):
        from dist_core.devices import device_count  # noqa: PLC0415 - imports torch

        changes["world_size"] = device_count()
    world_size = changes.get("world_size", config.world_size)
    local_world_size = (
        world_size if is_missing(config, "local_world_size") else config.local_world_size
    )
    changes["local_world_size"] = local_world_size
    if world_size < 1 or local_world_size < 1:
        raise ValueError(
            f"MultiprocessConfig(world_size={world_size}, local_world_size="
            f"{local_world_size}): both must be at least 1"
        )
    if local_world_size > world_size:
        raise ValueError(
            f"MultiprocessConfig(local_world_size={local_world_size}) is larger "
            f"than world_size={world_size}: a node cannot run more ranks than "
            "the whole job"
        )
    if is_missing(config, "master_port"):
        changes["master_port"] = get_unused_port(DEFAULT_PORT)
    return dataclasses.replace(config, **changes)
