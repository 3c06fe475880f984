"""Backend choice, process-group initialization and teardown.

The backend is ``TORCH_DISTRIBUTED_BACKEND`` when set, else :func:`default_backend`:
``nccl`` when every local rank gets a CUDA device of its own, the backend torch
registers for another accelerator (``xccl`` on XPU, ...) under the same condition, and
``gloo`` otherwise. NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so a
node with more local ranks than GPUs (4 ranks on a 1-GPU laptop) gets gloo, which moves
CUDA tensors too, and rank 0 says so in one log line. An explicit ``nccl`` on such a
node fails before any process group is created, naming both counts.

Nothing here initialises CUDA in the calling process before a worker binds its device
(see :mod:`dist_core.devices`), so a launcher may still fork.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dist_core.devices import accelerator, accelerator_type, device_count
from dist_core.env import DistEnv
from dist_core.errors import DistEnvError
from dist_core.log import INFOALL

logger = logging.getLogger(__name__)

BACKEND_VARIABLE = "TORCH_DISTRIBUTED_BACKEND"
INIT_METHOD_VARIABLE = "INIT_METHOD"
_LOCAL_WORLD_SIZE_VARIABLE = "LOCAL_WORLD_SIZE"

__all__ = [
    "BACKEND_VARIABLE",
    "INIT_METHOD_VARIABLE",
    "BackendChoice",
    "choose_backend",
    "default_backend",
    "destroy_dist",
    "get_distributed_backend",
    "get_init_method",
    "init_dist",
    "init_process_group_from_backend",
    "set_dist",
    "set_distributed_backend",
]


@dataclass(frozen=True)
class BackendChoice:
    """The default backend for a node, and why.

    Attributes:
        backend: ``nccl``, the accelerator's own backend, or ``gloo``.
        accelerator: The accelerator's device type (``cuda``, ...), None on CPU.
        devices: Accelerator devices this process sees (0 on CPU).
        local_world_size: Ranks on this node the choice was made for.
    """

    backend: str
    accelerator: str | None
    devices: int
    local_world_size: int

    @property
    def shares_devices(self) -> bool:
        """True when there is an accelerator but fewer devices than local ranks."""
        return self.accelerator is not None and self.devices < self.local_world_size

    def fallback_message(self) -> str:
        """The one line rank 0 logs when ranks share devices and gloo was chosen."""
        accelerator_backend = _accelerator_backend(self.accelerator)
        return (
            f"{self.local_world_size} ranks per node share {self.devices} "
            f"{self.accelerator} device(s): using gloo, since {accelerator_backend} needs "
            f"one device per rank ({self.accelerator} tensors still work over gloo); to use "
            f"{accelerator_backend}, start at most {self.devices} rank(s) per node, or set "
            f"{BACKEND_VARIABLE}={accelerator_backend} where each rank sees its own device"
        )


def _accelerator_backend(kind: str | None) -> str:
    if kind is None:
        return "gloo"
    if kind == "cuda":
        return "nccl"
    backend = dist.Backend.default_device_backend_map.get(kind)
    return str(backend) if backend is not None else "gloo"


def _local_world_size_from(environ: Mapping[str, str]) -> int:
    """``LOCAL_WORLD_SIZE`` (or what :class:`DistEnv` derives); 1 when unknown or malformed."""
    raw = environ.get(_LOCAL_WORLD_SIZE_VARIABLE, "").strip()
    explicit = int(raw) if raw.isdigit() and int(raw) > 0 else None
    try:
        env = DistEnv.from_environ(environ)
    except DistEnvError:
        return explicit or 1
    # Without a launcher's variables DistEnv describes one process, yet a
    # LOCAL_WORLD_SIZE set on its own still says how many ranks will share this node.
    if env.source == "default" and explicit is not None:
        return explicit
    return env.local_world_size


def choose_backend(
    local_world_size: int | None = None, environ: Mapping[str, str] | None = None
) -> BackendChoice:
    """The default backend for ``local_world_size`` ranks on this node, with the reason.

    Reads ``LOCAL_WORLD_SIZE`` (and the other variables :class:`DistEnv` reads) when
    ``local_world_size`` is None, and ``CUDA_VISIBLE_DEVICES`` through torch. Does not
    initialise CUDA.
    """
    if local_world_size is None:
        local_world_size = _local_world_size_from(os.environ if environ is None else environ)
    kind, devices = accelerator()
    backend = _accelerator_backend(kind)
    if kind is not None and devices < local_world_size:
        backend = "gloo"
    return BackendChoice(backend, kind, devices, local_world_size)


def default_backend(local_world_size: int | None = None) -> str:
    """The backend for this node: nccl when every local rank gets its own GPU, else gloo.

    The accelerator's own backend (``xccl``, ...) under the same condition on other
    accelerators. Reads ``LOCAL_WORLD_SIZE`` when ``local_world_size`` is None (1 when
    it is unset: a single process always gets the accelerator's backend).
    """
    return choose_backend(local_world_size).backend


def get_distributed_backend() -> str:
    """The backend to use: ``TORCH_DISTRIBUTED_BACKEND`` if set, else the default.

    Reads ``TORCH_DISTRIBUTED_BACKEND`` (set it to ``gloo`` to sidestep a broken NCCL).

    Raises:
        DistEnvError: The variable names a backend torch does not know.
    """
    raw = os.environ.get(BACKEND_VARIABLE, "").strip()
    if not raw:
        return default_backend()
    # A composite spec such as "cpu:gloo,cuda:nccl" is passed through to torch.
    names = [part.split(":")[-1].strip().lower() for part in raw.split(",")]
    known = {str(name).lower() for name in dist.Backend.backend_list}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise DistEnvError(
            f"{BACKEND_VARIABLE}={raw}: unknown backend {', '.join(unknown)}; torch knows "
            f"{', '.join(sorted(known))}"
        )
    return raw.lower()


def set_distributed_backend(backend: str) -> None:
    """Writes ``TORCH_DISTRIBUTED_BACKEND`` for this process and its children."""
    os.environ[BACKEND_VARIABLE] = backend


def get_init_method() -> str:
    """The rendezvous URL: ``INIT_METHOD`` when set, else ``env://``."""
    return os.environ.get(INIT_METHOD_VARIABLE, "").strip() or "env://"


def set_dist(
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    master_addr: str,
    master_port: int,
    init_method: str = "env://",
) -> DistEnv:
    """Validates the values and writes them to ``os.environ`` under torchrun's names.

    Writes ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``, ``GROUP_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``ROLE_RANK``,
    ``ROLE_WORLD_SIZE``, ``GROUP_WORLD_SIZE``
    and ``INIT_METHOD``.

    Raises:
        DistEnvError: The values disagree (a rank outside the world, ...).
    """
    env = DistEnv(
        rank=rank,
        local_rank=local_rank,
        node_rank=rank // local_world_size if local_world_size > 0 else 0,
        world_size=world_size,
        local_world_size=local_world_size,
        master_addr=master_addr,
        master_port=master_port,
        source="torchrun",
    )
    _write_environ(env, init_method)
    return env


def _write_environ(env: DistEnv, init_method: str) -> None:
    """Writes ``env`` under torchrun's names, and ``INIT_METHOD``, to ``os.environ``."""
    os.environ.update(env.to_environ())
    os.environ[INIT_METHOD_VARIABLE] = init_method


def _cuda_lost_in_fork() -> bool:
    """Whether this process was forked from one that had initialised CUDA.

    torch then refuses every CUDA call here ("Cannot re-initialize CUDA in forked
    subprocess"). A parent that only asked ``torch.cuda.is_available()`` counts: the
    question starts the driver without ``torch.cuda.is_initialized()`` turning true,
    so the parent cannot see it (seen on an H100 under pytest).
    """
    in_bad_fork = getattr(torch.cuda, "_is_in_bad_fork", None)
    return bool(in_bad_fork()) if callable(in_bad_fork) else False


def _bind_device(local_rank: int, backend: str) -> torch.device:
    """Makes the accelerator of ``local_rank`` current; the CPU when there is none.

    Also the CPU for a gloo group in a process forked after its parent initialised
    CUDA, where no device can be made current; an accelerator backend there raises.
    """
    kind = accelerator_type()
    if kind is None:
        return torch.device("cpu")
    if kind == "cuda" and _cuda_lost_in_fork():
        if _backend_names(backend) == {"gloo"}:
            logger.info(
                "this process was forked after its parent initialised CUDA: no GPU is bound, "
                "and CUDA tensors cannot be used here (gloo on CPU tensors works)"
            )
            return torch.device("cpu")
        raise RuntimeError(
            f"backend {backend!r} needs CUDA, but this process was forked from one that had "
            "already initialised CUDA (torch.cuda.is_available() does that too), and torch "
            "cannot use CUDA again in such a child; start the workers with 'spawn' or "
            "'forkserver' (dist-launch's default), or fork before the parent touches CUDA"
        )
    index = local_rank % device_count()
    if kind == "cuda":
        torch.cuda.set_device(index)
    else:
        torch.accelerator.set_device_index(index)
    return torch.device(kind, index)


def _backend_names(backend: str) -> set[str]:
    """``{"gloo", "nccl"}`` for ``"cpu:gloo,cuda:nccl"``; ``{"nccl"}`` for ``"nccl"``."""
    return {part.split(":")[-1].strip().lower() for part in backend.split(",") if part.strip()}


def _check_devices_for(backend: str, env: DistEnv, choice: BackendChoice) -> None:
    """Refuses an accelerator backend on a node with fewer devices than local ranks.

    Skipped when ``CUDA_VISIBLE_DEVICES`` is set and each process sees fewer devices
    than there are local ranks: a scheduler (SLURM's ``--gpus-per-task``, Kubernetes'
    device plugin) may have given every rank a device of its own, which one process
    cannot tell apart from ranks sharing one.
    """
    accelerator_backend = _accelerator_backend(choice.accelerator)
    wanted = _backend_names(backend) & {"nccl", accelerator_backend} - {"gloo"}
    if not wanted or not (choice.devices < env.local_world_size):
        return
    if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() and choice.devices > 0:
        logger.warning(
            "%s with LOCAL_WORLD_SIZE=%d and %d visible device(s) per process: assuming "
            "the scheduler gave each rank its own (CUDA_VISIBLE_DEVICES=%s)",
            backend,
            env.local_world_size,
            choice.devices,
            os.environ["CUDA_VISIBLE_DEVICES"],
        )
        return
    raise DistEnvError(
        f"backend {backend} needs one {choice.accelerator or 'CUDA'} device per local rank, "
        f"but LOCAL_WORLD_SIZE={env.local_world_size} ranks run on this node (node "
        f"{env.node_rank}) and it has {choice.devices} device(s); use gloo "
        f"({BACKEND_VARIABLE}=gloo, or leave it unset to get gloo by default) or start at "
        f"most {choice.devices} rank(s) per node"
    )


def env_rendezvous_variables(env: DistEnv, environ: Mapping[str, str]) -> dict[str, str]:
    """What torch's ``env://`` needs and ``environ`` lacks: the master's address and port.

    ``srun`` and ``mpirun`` set no ``MASTER_ADDR`` or ``MASTER_PORT``; :class:`DistEnv`
    derives them (the first host of the job's node list, a port derived from the job),
    and torch's ``env://`` reads them from the environment. Only the missing ones are
    returned: a value the launcher or the user set is never replaced. ``RANK`` and
    ``WORLD_SIZE`` are not, either: they are passed to torch directly, and writing
    them would make the torchrun variables this process's source from then on.

    Args:
        env: This process's environment, read from ``environ``.
        environ: The variables as they are (reads ``MASTER_ADDR`` and ``MASTER_PORT``).

    Returns:
        The variables to add; empty when both are set.
    """
    wanted = {"MASTER_ADDR": env.master_addr, "MASTER_PORT": str(env.master_port)}
    return {name: value for name, value in wanted.items() if not environ.get(name, "").strip()}


def init_process_group_from_backend(
    backend: str | None = None, timeout: timedelta | None = None
) -> None:
    """Initializes the default process group from the environment and checks it works.

    Reads the rank variables through :meth:`DistEnv.from_environ`, ``INIT_METHOD``,
    ``TORCH_DISTRIBUTED_BACKEND`` (when ``backend`` is None) and
    ``CUDA_VISIBLE_DEVICES`` (through torch). Binds this process to the device
    ``LOCAL_RANK % device_count`` when an accelerator exists and passes it to torch as
    ``device_id`` for an accelerator backend, then runs an all-reduce of ones and
    checks the sum equals the world size. Without a backend named anywhere, the backend
    is :func:`default_backend` for ``LOCAL_WORLD_SIZE`` ranks, and rank 0 logs one line
    when ranks share devices and gloo was chosen for that.

    With the ``env://`` init method, ``MASTER_ADDR`` and ``MASTER_PORT`` are written to
    ``os.environ`` when the launcher set none (``srun``, ``mpirun``): the values
    :class:`DistEnv` derived (:func:`env_rendezvous_variables`), so that torch's
    ``env://`` and everything else that reads them (a fault-tolerance manager's store)
    agree with it.

    Args:
        backend: The backend; :func:`get_distributed_backend` when None.
        timeout: Timeout of the group's operations; torch's default when None.

    Raises:
        DistEnvError: The environment is malformed, or an accelerator backend was asked
            for on a node with fewer devices than local ranks (before any group exists).
        RuntimeError: A group is already initialized, or the sanity all-reduce gave a
            wrong sum.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "a default process group is already initialized in this process; call "
            "dist_core.destroy_dist() before initializing another"
        )
    env = DistEnv.from_environ()
    choice = choose_backend(env.local_world_size)
    if backend is not None:
        chosen = backend
    elif os.environ.get(BACKEND_VARIABLE, "").strip():
        chosen = get_distributed_backend()
    else:
        chosen = choice.backend
        if choice.shares_devices and env.rank == 0:
            logger.info("%s", choice.fallback_message())
    _check_devices_for(chosen, env, choice)
    init_method = get_init_method()
    if init_method.startswith("env://"):
        os.environ.update(env_rendezvous_variables(env, os.environ))
    logger.log(
        INFOALL,
        "initializing rank %d/%d with %s via %s",
        env.rank,
        env.world_size,
        chosen,
        init_method,
    )
    device = _bind_device(env.local_rank, chosen)
    uses_accelerator_backend = device.type != "cpu" and _backend_names(chosen) != {"gloo"}
    dist.init_process_group(
        backend=chosen,
        init_method=init_method,
        world_size=env.world_size,
        rank=env.rank,
        timeout=timeout,
        # Binding the group to its device mutes torch's "using the device under current
        # context" warning at every barrier, and lets NCCL connect eagerly.
        device_id=device if uses_accelerator_backend else None,
    )
    # gloo is probed on the CPU: a CPU-only script on a GPU host never touches CUDA here.
    probe = torch.ones(1, device=device if uses_accelerator_backend else "cpu")
    dist.all_reduce(probe)
    if int(probe.item()) != env.world_size:
        raise RuntimeError(
            f"sanity all-reduce on rank {env.rank} gave {probe.item()}, expected "
            f"WORLD_SIZE={env.world_size}: the ranks disagree on the world size"
        )
    logger.info("process group ready: %d rank(s), backend %s", env.world_size, chosen)


def init_dist(
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    master_addr: str,
    master_port: int,
    init_method: str = "env://",
    backend: str | None = None,
    timeout: timedelta | None = None,
) -> None:
    """Writes the environment (:func:`set_dist`) and initializes the process group.

    Args:
        rank: Global rank of this process.
        local_rank: Rank on this node.
        world_size: Number of processes in the job.
        local_world_size: Number of processes on this node.
        master_addr: Host of the rendezvous store.
        master_port: Port of the rendezvous store.
        init_method: Rendezvous URL (``env://`` reads the variables just written).
        backend: The backend; ``TORCH_DISTRIBUTED_BACKEND`` or the default when None.
        timeout: Timeout of the group's operations; torch's default when None.
    """
    set_dist(rank, local_rank, world_size, local_world_size, master_addr, master_port, init_method)
    init_process_group_from_backend(backend, timeout=timeout)


def init_dist_env(
    env: DistEnv,
    init_method: str = "env://",
    backend: str | None = None,
    timeout: timedelta | None = None,
) -> None:
    """:func:`init_dist` for a validated :class:`DistEnv` (a launcher's resolved config).

    Writes ``env`` to ``os.environ`` under torchrun's names (and ``INIT_METHOD``), then
    initializes the process group as :func:`init_process_group_from_backend` does.
    """
    _write_environ(env, init_method)
    init_process_group_from_backend(backend, timeout=timeout)


def destroy_dist() -> None:
    """Destroys the default process group, if any, so that another can be initialized."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        logger.debug("process group destroyed")
