"""Rank queries that answer from the live process group, else from the environment.

The global rank and world size come from the initialized default group when there
is one. Local rank, node rank and local world size are not known to a process group;
they come from the environment (see :meth:`dist_core.DistEnv.from_environ`), which
every launcher sets, and which agrees with the group when the group was initialized
from it.
"""

from __future__ import annotations

import torch.distributed as dist

from dist_core.env import DistEnv


def is_available() -> bool:
    """True when this torch build has torch.distributed."""
    return dist.is_available()


def is_initialized() -> bool:
    """True when a default process group is initialized in this process."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """This process's global rank (reads ``RANK`` etc. when no group is initialized)."""
    if is_initialized():
        return dist.get_rank()
    return DistEnv.from_environ().rank


get_global_rank = get_rank


def get_world_size() -> int:
    """The number of ranks (reads ``WORLD_SIZE`` etc. when no group is initialized)."""
    if is_initialized():
        return dist.get_world_size()
    return DistEnv.from_environ().world_size


def _env_or_group_default() -> DistEnv | None:
    """The environment, or None when it says nothing but a group is live."""
    env = DistEnv.from_environ()
    if env.source == "default" and is_initialized() and dist.get_world_size() > 1:
        return None
    return env


def get_local_rank() -> int:
    """This process's rank on its node (reads ``LOCAL_RANK``, ``SLURM_LOCALID``, ...).

    With a live group and no launcher variables, the job is taken to be on one node.
    """
    env = _env_or_group_default()
    return dist.get_rank() if env is None else env.local_rank


def get_local_world_size() -> int:
    """Number of ranks on this node (reads ``LOCAL_WORLD_SIZE`` etc.)."""
    env = _env_or_group_default()
    return dist.get_world_size() if env is None else env.local_world_size


def get_node_rank() -> int:
    """Index of this node (reads ``NODE_RANK``/``GROUP_RANK``, ``SLURM_NODEID``, ...)."""
    env = _env_or_group_default()
    return 0 if env is None else env.node_rank


def is_rank_zero() -> bool:
    """True on global rank 0."""
    return get_rank() == 0
