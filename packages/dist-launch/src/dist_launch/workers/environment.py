"""The environment of each worker: what torchrun sets, and what every worker shares."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from dist_core.log import LAUNCHER_PREFIXES_VARIABLE
from dist_launch.in_worker.records import BUFFER_SIZE_VARIABLE, NCCL_BUFFER_SIZE_VARIABLE

# Entries per flight recorder (torch's own default where it records by default).
FLIGHT_RECORDER_ENTRIES = 2000

if TYPE_CHECKING:
    from dist_launch.plan.launch_plan import LaunchPlan
    from dist_launch.rendezvous.protocol import Assignment


# What a launcher's environment may hold that describes its node, not a worker.
_POD_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def node_environment(plan: LaunchPlan, base: Mapping[str, str]) -> dict[str, str]:
    """The variables every worker of this node shares in every attempt.

    ``OMP_NUM_THREADS=1`` unless set (as torchrun, when several workers share a node),
    ``PYTHONUNBUFFERED=1`` unless set (so that prefixed lines arrive as written),
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` unless set (as torchrun), and
    ``TORCH_FR_BUFFER_SIZE=2000`` when hang detection or the slow-rank report is on and
    neither it nor ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is set (torch's flight recorder then
    records for every backend; a user's value, 0 included, is kept).
    """
    env = dict(base)
    diagnosing = plan.hang_policy.enabled or plan.slow_ranks is not None
    if diagnosing and not ({BUFFER_SIZE_VARIABLE, NCCL_BUFFER_SIZE_VARIABLE} & set(env)):
        env[BUFFER_SIZE_VARIABLE] = str(FLIGHT_RECORDER_ENTRIES)
    if "OMP_NUM_THREADS" not in env and plan.nproc > 1:
        env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    # The launcher prefixes every line with the rank: dist_core.log adds no second one.
    env[LAUNCHER_PREFIXES_VARIABLE] = "1"
    # torchrun's flags reach no worker as PET_ variables, and a pod's own RANK and
    # WORLD_SIZE (PyTorchJob's node rank and pod count) none as its own: each worker
    # gets its process rank.
    for name in [key for key in env if key.startswith("PET_") or key in _POD_VARIABLES]:
        del env[name]
    return env


def worker_environment(
    plan: LaunchPlan, assignment: Assignment, base: dict[str, str]
) -> dict[str, str]:
    """The variables torchrun sets that every local worker of this round shares."""
    env = dict(base)
    env.update(
        {
            "GROUP_RANK": str(assignment.group_rank),
            "NODE_RANK": str(assignment.group_rank),
            "ROLE_NAME": plan.role,
            "WORLD_SIZE": str(assignment.world_size),
            "LOCAL_WORLD_SIZE": str(plan.nproc),
            "GROUP_WORLD_SIZE": str(assignment.group_world_size),
            "ROLE_WORLD_SIZE": str(assignment.world_size),
            "MASTER_ADDR": assignment.master_addr,
            "MASTER_PORT": str(assignment.master_port),
            # Counts on from a requeued SLURM job's restarts (plan.restart_base).
            "TORCHELASTIC_RESTART_COUNT": str(plan.restart_base + assignment.restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(plan.max_restarts),
            "TORCHELASTIC_RUN_ID": plan.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        }
    )
    return env


def rank_environment(
    plan: LaunchPlan, env: dict[str, str], rank: int, local_rank: int
) -> dict[str, str]:
    """``env`` plus one worker's rank variables.

    With ``--virtual-local-rank``, ``LOCAL_RANK`` is 0 and ``CUDA_VISIBLE_DEVICES`` names
    only this worker's device (the ``local_rank``-th of those visible to the launcher).
    """
    rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(local_rank), "ROLE_RANK": str(rank)}
    if plan.virtual_local_rank:
        visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        device = visible[local_rank] if local_rank < len(visible) else str(local_rank)
        rank_env["CUDA_VISIBLE_DEVICES"] = device
        rank_env["LOCAL_RANK"] = "0"
    return rank_env
