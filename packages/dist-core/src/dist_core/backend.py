"""Backend choice, process-group initialization and teardown.

The backend is ``TORCH_DISTRIBUTED_BACKEND`` when set, else :func:`default_backend`:
``nccl`` on CUDA, the backend torch registers for another accelerator (``xccl`` on
XPU, ...), ``gloo`` on CPU.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from dist_core.env import DistEnv
from dist_core.errors import DistEnvError
from dist_core.log import INFOALL

logger = logging.getLogger(__name__)

BACKEND_VARIABLE = "TORCH_DISTRIBUTED_BACKEND"
INIT_METHOD_VARIABLE = "INIT_METHOD"


def _accelerator_type() -> str | None:
    """The device type of the accelerator torch sees (``cuda``, ``xpu``, ...), if any."""
    if torch.cuda.is_available():
        return "cuda"
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        current = accelerator.current_accelerator()
        if current is not None and current.type != "cpu":
            return str(current.type)
    return None


def device_count() -> int:
    """Number of accelerator devices on this node; 1 on a CPU-only node."""
    kind = _accelerator_type()
    if kind == "cuda":
        return torch.cuda.device_count()
    if kind is not None:
        return max(1, int(torch.accelerator.device_count()))
    return 1


def default_backend() -> str:
    """The backend for this node's devices: nccl on CUDA, the accelerator's own, else gloo."""
    kind = _accelerator_type()
    if kind is None:
        return "gloo"
    if kind == "cuda":
        return "nccl"
    backend = dist.Backend.default_device_backend_map.get(kind)
    return str(backend) if backend is not None else "gloo"


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
    os.environ.update(env.to_environ())
    os.environ[INIT_METHOD_VARIABLE] = init_method
    return env


def _bind_device(local_rank: int) -> torch.device:
    """Makes the accelerator of ``local_rank`` current; the CPU when there is none."""
    kind = _accelerator_type()
    if kind is None:
        return torch.device("cpu")
    index = local_rank % device_count()
    if kind == "cuda":
        torch.cuda.set_device(index)
    else:
        torch.accelerator.set_device_index(index)
    return torch.device(kind, index)


def init_process_group_from_backend(
    backend: str | None = None, timeout: timedelta | None = None
) -> None:
    """Initializes the default process group from the environment and checks it works.

    Reads the rank variables through :meth:`DistEnv.from_environ`, ``INIT_METHOD``
    and ``TORCH_DISTRIBUTED_BACKEND`` (when ``backend`` is None). Binds this process
    to the device ``LOCAL_RANK % device_count`` when an accelerator exists, then runs
    an all-reduce of ones and checks the sum equals the world size.

    Args:
        backend: The backend; :func:`get_distributed_backend` when None.
        timeout: Timeout of the group's operations; torch's default when None.

    Raises:
        DistEnvError: The environment is malformed.
        RuntimeError: A group is already initialized, or the sanity all-reduce gave a
            wrong sum.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "a default process group is already initialized in this process; call "
            "dist_core.destroy_dist() before initializing another"
        )
    env = DistEnv.from_environ()
    chosen = get_distributed_backend() if backend is None else backend
    init_method = get_init_method()
    logger.log(
        INFOALL,
        "initializing rank %d/%d with %s via %s",
        env.rank,
        env.world_size,
        chosen,
        init_method,
    )
    device = _bind_device(env.local_rank)
    dist.init_process_group(
        backend=chosen,
        init_method=init_method,
        world_size=env.world_size,
        rank=env.rank,
        timeout=timeout,
    )
    probe = torch.ones(1, device=device)
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


def destroy_dist() -> None:
    """Destroys the default process group, if any, so that another can be initialized."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        logger.debug("process group destroyed")
