"""The distributed environment of this process: who it is, and where the master is.

:class:`DistEnv` is read from the variables a launcher sets. Sources are tried in this
order, and the first one present wins:

1. **torchrun / Composer / dist-launch** when any of ``RANK``, ``WORLD_SIZE`` or
   ``LOCAL_RANK`` is set. A torchrun started by ``srun`` therefore describes its own
   workers, not the SLURM task that started it.
2. **Open MPI** when ``OMPI_COMM_WORLD_RANK`` is set. Only ``mpirun`` (and the daemons
   it starts) sets it, so it describes the innermost launcher: an ``mpirun`` inside a
   SLURM step or batch script gives every rank the step's ``SLURM_PROCID`` (all the
   same), and its own ranks are the ones that count.
3. **SLURM** inside a job step, when ``SLURM_PROCID`` and ``SLURM_STEP_ID`` (or
   ``SLURM_STEPID``) are set. A batch script has ``SLURM_PROCID=0`` and the job's
   ``SLURM_NTASKS`` too, but no step id: a program run there directly is not one of
   the job's tasks, and falls through to the default (one rank, as
   ``torchrun --standalone`` would be there).
4. **Single rank**: rank 0 of 1 on ``127.0.0.1:29500``, as Composer does.

The innermost launcher wins: torchrun over Open MPI over a SLURM step.

``MASTER_ADDR`` and ``MASTER_PORT`` are honoured by every source when set.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from dist_core.errors import DistEnvError
from dist_core.openmpi import openmpi_master_port
from dist_core.slurm import expand_hostlist, parse_tasks_per_node, slurm_master_port

logger = logging.getLogger(__name__)

EnvSource = Literal["torchrun", "slurm", "openmpi", "default"]

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def _read_int(
    environ: Mapping[str, str], name: str, *, minimum: int = 0, default: int | None = None
) -> int:
    """Reads an integer variable, naming it and its value when it is malformed."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise DistEnvError(f"{name} is not set; the launcher should set it")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise DistEnvError(f"{name}={raw} is not an integer") from None
    if value < minimum:
        raise DistEnvError(f"{name}={raw} must be at least {minimum}")
    return value


def _read_optional_int(environ: Mapping[str, str], name: str, *, minimum: int = 0) -> int | None:
    if environ.get(name, "").strip() == "":
        return None
    return _read_int(environ, name, minimum=minimum)


def _read_port(environ: Mapping[str, str], name: str, default: int) -> int:
    port = _read_int(environ, name, minimum=1, default=default)
    if port > 65535:
        raise DistEnvError(f"{name}={environ[name]} is not a TCP port (1-65535)")
    return port


def _read_master_addr(environ: Mapping[str, str], default: str) -> str:
    raw = environ.get("MASTER_ADDR")
    if raw is None:
        return default
    if raw.strip() == "" or any(char.isspace() for char in raw.strip()):
        raise DistEnvError(f"MASTER_ADDR={raw} is not a host name or address")
    return raw.strip()


def in_slurm_step(environ: Mapping[str, str]) -> bool:
    """True in a task of a SLURM job step (``srun``), not in the batch script itself.

    Reads ``SLURM_PROCID`` and ``SLURM_STEP_ID`` (``SLURM_STEPID`` on older SLURM):
    SLURM gives a batch script a ``SLURM_PROCID`` of 0 but no step id.
    """
    has_step = any(environ.get(name, "").strip() for name in ("SLURM_STEP_ID", "SLURM_STEPID"))
    return has_step and bool(environ.get("SLURM_PROCID", "").strip())


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in a distributed job.

    Attributes:
        rank: Global rank, ``0 <= rank < world_size``.
        local_rank: Rank on this node, ``0 <= local_rank < local_world_size``.
        node_rank: Index of this node.
        world_size: Number of processes in the job.
        local_world_size: Number of processes on this node.
        master_addr: Host of the rendezvous store (rank 0's host).
        master_port: Port of the rendezvous store.
        source: Which launcher's variables the values came from (not compared).
    """

    rank: int = 0
    local_rank: int = 0
    node_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = DEFAULT_MASTER_PORT
    source: EnvSource = field(default="default", compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks that the values agree with each other.

        Raises:
            DistEnvError: A value is out of range, naming both values involved.
        """
        names = _names_for(self.source)
        if self.world_size < 1:
            raise DistEnvError(f"{names.world_size}={self.world_size} must be at least 1")
        if not 0 <= self.rank < self.world_size:
            raise DistEnvError(
                f"{names.rank}={self.rank} with {names.world_size}={self.world_size}: "
                f"the rank must be in [0, {self.world_size})"
            )
        if not 1 <= self.local_world_size <= self.world_size:
            raise DistEnvError(
                f"{names.local_world_size}={self.local_world_size} with "
                f"{names.world_size}={self.world_size}: a node cannot hold more ranks "
                "than the job, nor none"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise DistEnvError(
                f"{names.local_rank}={self.local_rank} with "
                f"{names.local_world_size}={self.local_world_size}: the local rank must "
                f"be in [0, {self.local_world_size})"
            )
        if self.node_rank < 0:
            raise DistEnvError(f"{names.node_rank}={self.node_rank} must be at least 0")
        if not 1 <= self.master_port <= 65535:
            raise DistEnvError(f"MASTER_PORT={self.master_port} is not a TCP port (1-65535)")
        if not self.master_addr:
            raise DistEnvError("MASTER_ADDR is empty")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Reads the environment of the launcher that started this process.

        Reads the torchrun/Composer variables ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``
        or ``GROUP_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
        ``MASTER_PORT``; else Open MPI's ``OMPI_COMM_WORLD_RANK``,
        ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``,
        ``OMPI_COMM_WORLD_LOCAL_SIZE`` and, for the master port of a one-host job,
        ``OMPI_MCA_ess_base_jobid`` or ``PMIX_NAMESPACE``
        (:func:`~dist_core.openmpi.openmpi_master_port`); else, in a SLURM job step
        (``SLURM_STEP_ID`` or ``SLURM_STEPID``), SLURM's ``SLURM_PROCID``,
        ``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_NTASKS``,
        ``SLURM_NTASKS_PER_NODE`` or ``SLURM_TASKS_PER_NODE``, ``SLURM_JOB_NODELIST``
        (or ``SLURM_NODELIST``), ``SLURM_JOB_ID`` and the step id (the master port,
        :func:`~dist_core.slurm.slurm_master_port`). The module docstring gives the
        precedence.

        Args:
            environ: The variables to read; ``os.environ`` when None.

        Returns:
            The environment, with ``source`` naming where it came from.

        Raises:
            DistEnvError: A value is malformed or inconsistent; the message names the
                variable and its value.
        """
        env = os.environ if environ is None else environ
        if any(env.get(name, "").strip() for name in TORCHRUN_VARIABLES):
            return _from_torchrun(env)
        if env.get("OMPI_COMM_WORLD_RANK", "").strip():
            return _from_openmpi(env)
        if in_slurm_step(env):
            return _from_slurm(env)
        return cls(
            master_addr=_read_master_addr(env, DEFAULT_MASTER_ADDR),
            master_port=_read_port(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
            source="default",
        )

    @property
    def num_nodes(self) -> int:
        """Number of nodes, assuming every node runs ``local_world_size`` ranks."""
        return -(-self.world_size // self.local_world_size)

    def to_environ(self) -> dict[str, str]:
        """Returns the torchrun variables that describe this environment.

        Nothing is written: update ``os.environ`` (or a child's environment) with the
        result, or call :func:`dist_core.set_dist`.
        """
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "NODE_RANK": str(self.node_rank),
            "GROUP_RANK": str(self.node_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "GROUP_WORLD_SIZE": str(self.num_nodes),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


@dataclass(frozen=True)
class _VariableNames:
    rank: str
    local_rank: str
    node_rank: str
    world_size: str
    local_world_size: str


_NAMES: dict[str, _VariableNames] = {
    "torchrun": _VariableNames("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
    "default": _VariableNames("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
    "slurm": _VariableNames(
        "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE"
    ),
    "openmpi": _VariableNames(
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "node_rank",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
}


def _names_for(source: str) -> _VariableNames:
    return _NAMES.get(source, _NAMES["default"])


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    world_size = _read_optional_int(env, "WORLD_SIZE", minimum=1)
    rank = _read_optional_int(env, "RANK")
    if world_size is None:
        if rank not in (None, 0):
            raise DistEnvError(f"RANK={rank} but WORLD_SIZE is not set; set both")
        world_size = 1
    if rank is None:
        if world_size > 1:
            raise DistEnvError(f"WORLD_SIZE={world_size} but RANK is not set; set both")
        rank = 0
    if rank >= world_size:
        raise DistEnvError(
            f"RANK={rank} with WORLD_SIZE={world_size}: the rank must be in [0, {world_size})"
        )
    local_world_size = _read_int(env, "LOCAL_WORLD_SIZE", minimum=1, default=world_size)
    local_rank = _read_int(env, "LOCAL_RANK", default=rank % local_world_size)
    node_rank = _read_optional_int(env, "NODE_RANK")
    group_rank = _read_optional_int(env, "GROUP_RANK")
    if node_rank is not None and group_rank is not None and node_rank != group_rank:
        raise DistEnvError(
            f"NODE_RANK={node_rank} with GROUP_RANK={group_rank}: both name this node; "
            "they must agree"
        )
    if node_rank is None:
        node_rank = group_rank if group_rank is not None else rank // local_world_size
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        node_rank=node_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        master_addr=_read_master_addr(env, DEFAULT_MASTER_ADDR),
        master_port=_read_port(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
        source="torchrun",
    )


def _slurm_local_world_size(env: Mapping[str, str], node_rank: int, world_size: int) -> int:
    per_node = _read_optional_int(env, "SLURM_NTASKS_PER_NODE", minimum=1)
    if per_node is not None:
        return per_node
    compressed = env.get("SLURM_TASKS_PER_NODE", "").strip()
    if not compressed:
        return world_size
    counts = parse_tasks_per_node(compressed)
    if node_rank >= len(counts):
        raise DistEnvError(
            f"SLURM_NODEID={node_rank} with SLURM_TASKS_PER_NODE={compressed}: "
            f"the task counts cover only {len(counts)} node(s)"
        )
    return counts[node_rank]


def _slurm_master_addr(env: Mapping[str, str]) -> str:
    if env.get("MASTER_ADDR") is not None:
        return _read_master_addr(env, DEFAULT_MASTER_ADDR)
    for variable in ("SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        hostlist = env.get(variable, "").strip()
        if hostlist:
            return expand_hostlist(hostlist, variable)[0]
    return DEFAULT_MASTER_ADDR


def _slurm_master_port(env: Mapping[str, str]) -> int:
    if env.get("MASTER_PORT", "").strip():
        return _read_port(env, "MASTER_PORT", DEFAULT_MASTER_PORT)
    job_id = _read_optional_int(env, "SLURM_JOB_ID")
    if job_id is None:
        return DEFAULT_MASTER_PORT
    step = "SLURM_STEP_ID" if env.get("SLURM_STEP_ID", "").strip() else "SLURM_STEPID"
    return slurm_master_port(job_id, _read_optional_int(env, step))


def _from_slurm(env: Mapping[str, str]) -> DistEnv:
    rank = _read_int(env, "SLURM_PROCID")
    world_size = _read_int(env, "SLURM_NTASKS", minimum=1, default=1)
    if rank >= world_size:
        raise DistEnvError(
            f"SLURM_PROCID={rank} with SLURM_NTASKS={world_size}: the rank must be in "
            f"[0, {world_size})"
        )
    node_rank = _read_int(env, "SLURM_NODEID", default=0)
    local_world_size = _slurm_local_world_size(env, node_rank, world_size)
    local_rank = _read_int(env, "SLURM_LOCALID", default=rank % local_world_size)
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        node_rank=node_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        master_addr=_slurm_master_addr(env),
        master_port=_slurm_master_port(env),
        source="slurm",
    )


def _from_openmpi(env: Mapping[str, str]) -> DistEnv:
    rank = _read_int(env, "OMPI_COMM_WORLD_RANK")
    world_size = _read_int(env, "OMPI_COMM_WORLD_SIZE", minimum=1)
    if rank >= world_size:
        raise DistEnvError(
            f"OMPI_COMM_WORLD_RANK={rank} with OMPI_COMM_WORLD_SIZE={world_size}: the rank "
            f"must be in [0, {world_size})"
        )
    local_world_size = _read_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", minimum=1, default=world_size)
    local_rank = _read_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", default=rank % local_world_size)
    multi_node = world_size > local_world_size
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name, "").strip()]
    if multi_node and missing:
        raise DistEnvError(
            f"OMPI_COMM_WORLD_SIZE={world_size} with OMPI_COMM_WORLD_LOCAL_SIZE="
            f"{local_world_size} spans several nodes but {' and '.join(missing)} "
            "not set; export MASTER_ADDR (rank 0's host) and MASTER_PORT to every rank, "
            "e.g. mpirun -x MASTER_ADDR -x MASTER_PORT"
        )
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        node_rank=rank // local_world_size,
        world_size=world_size,
        local_world_size=local_world_size,
        master_addr=_read_master_addr(env, DEFAULT_MASTER_ADDR),
        master_port=_openmpi_master_port(env),
        source="openmpi",
    )


def _openmpi_master_port(env: Mapping[str, str]) -> int:
    if env.get("MASTER_PORT", "").strip():
        return _read_port(env, "MASTER_PORT", DEFAULT_MASTER_PORT)
    port = openmpi_master_port(env)
    if port is None:
        logger.info(
            "no MASTER_PORT, %s or %s: master port %d (two such mpirun jobs on one "
            "host collide; export MASTER_PORT)",
            "OMPI_MCA_ess_base_jobid",
            "PMIX_NAMESPACE",
            DEFAULT_MASTER_PORT,
        )
        return DEFAULT_MASTER_PORT
    return port
