"""Model, pipeline and data parallel process groups, and this rank's place in them.

:func:`init_parallelism` splits the world into groups following
:class:`~dist_collectives.layout.ParallelLayout` (model-parallel ranks adjacent, data
parallel outermost)::

    rank = (dp_rank * pp_size + pp_rank) * mp_size + mp_rank

It is collective: every rank of the default group must call it with the same
arguments. Before creating any group the ranks compare their arguments and raise on a
mismatch, rather than creating different groups and hanging. Every rank then creates
every group in the same order (all model-parallel groups, then all pipeline-parallel
groups, then all data-parallel groups), and checks that it sits in each of its groups
at the position its coordinate says.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dist_collectives._group import ProcessGroup
from dist_collectives.errors import CollectivesError
from dist_collectives.layout import ParallelLayout

logger = logging.getLogger(__name__)

__all__ = [
    "ParallelState",
    "destroy_parallelism",
    "get_dp_group",
    "get_dp_rank",
    "get_dp_ranks",
    "get_dp_size",
    "get_mp_group",
    "get_mp_rank",
    "get_mp_ranks",
    "get_mp_size",
    "get_parallel_state",
    "get_pp_group",
    "get_pp_rank",
    "get_pp_ranks",
    "get_pp_size",
    "init_parallelism",
    "is_parallelism_initialized",
]

MESH_DIM_NAMES = ("dp", "pp", "mp")


@dataclass(frozen=True)
class ParallelState:
    """This rank's coordinates and groups in a dp x pp x mp layout.

    Attributes:
        world_size: Ranks in the default group.
        dp_size: Data-parallel replicas (``world_size // (pp_size * mp_size)``).
        pp_size: Pipeline stages.
        mp_size: Model-parallel (tensor-parallel) shards.
        dp_rank: This rank's position in its data-parallel group.
        pp_rank: This rank's position in its pipeline-parallel group.
        mp_rank: This rank's position in its model-parallel group.
        dp_group: The ranks that share this rank's (pp_rank, mp_rank).
        pp_group: The ranks that share this rank's (dp_rank, mp_rank).
        mp_group: The ranks that share this rank's (dp_rank, pp_rank).
        dp_ranks: Global ranks of ``dp_group``, in group order.
        pp_ranks: Global ranks of ``pp_group``, in group order.
        mp_ranks: Global ranks of ``mp_group``, in group order.
    """

    world_size: int
    dp_size: int
    pp_size: int
    mp_size: int
    dp_rank: int
    pp_rank: int
    mp_rank: int
    dp_group: ProcessGroup
    pp_group: ProcessGroup
    mp_group: ProcessGroup
    dp_ranks: list[int]
    pp_ranks: list[int]
    mp_ranks: list[int]

    @property
    def layout(self) -> ParallelLayout:
        """The arithmetic of the layout (rank of any coordinate, every group)."""
        return ParallelLayout(self.world_size, mp_size=self.mp_size, pp_size=self.pp_size)

    def device_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """The same layout as a torch ``DeviceMesh`` with dims named dp, pp, mp.

        The mesh is ``arange(world_size).view(dp_size, pp_size, mp_size)`` (which is
        the layout formula) and reuses this state's groups: ``mesh.get_group("dp")``
        is ``dp_group``. No group is created, so ranks may call it independently.

        Args:
            device_type: The mesh's device type; None picks the accelerator whose
                default backend is the default group's (e.g. ``cuda`` for nccl),
                else ``cpu``.

        Returns:
            A 3-D ``torch.distributed.device_mesh.DeviceMesh``.
        """
        mesh = torch.arange(self.world_size, dtype=torch.int).view(
            self.dp_size, self.pp_size, self.mp_size
        )
        return DeviceMesh.from_group(
            [self.dp_group, self.pp_group, self.mp_group],
            device_type or _default_device_type(),
            mesh=mesh,
            mesh_dim_names=MESH_DIM_NAMES,
        )


def _default_device_type() -> str:
    backend = str(dist.get_backend())
    for device, device_backend in dist.Backend.default_device_backend_map.items():
        if device != "cpu" and device_backend == backend:
            return device
    return "cpu"


_state: ParallelState | None = None


def _plan(
    model_parallelism: Any,
    pipeline_parallelism: Any,
    mp_backend: Any,
    pp_backend: Any,
    dp_backend: Any,
) -> dict[str, Any]:
    return {
        "world_size": dist.get_world_size(),
        "model_parallelism": model_parallelism,
        "pipeline_parallelism": pipeline_parallelism,
        "mp_backend": mp_backend,
        "pp_backend": pp_backend,
        "dp_backend": dp_backend,
    }


def _check_plans_agree(plan: dict[str, Any]) -> None:
    """Raises on every rank when the ranks were not given the same arguments."""
    plans: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(plans, plan)
    if all(other == plans[0] for other in plans):
        return
    by_plan: dict[str, list[int]] = {}
    for rank, other in enumerate(plans):
        by_plan.setdefault(repr(other), []).append(rank)
    lines = "\n".join(f"  ranks {ranks}: {text}" for text, ranks in by_plan.items())
    raise CollectivesError(
        "init_parallelism: the ranks were called with different arguments, so they would "
        f"build different groups and hang; no group was created. Arguments by rank:\n{lines}"
    )


def _new_groups(groups: list[list[int]], backend: str | None, rank: int, kind: str) -> ProcessGroup:
    mine: ProcessGroup | None = None
    for ranks in groups:
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine = group
    if mine is None:  # the layout covers every rank, so this is a bug in it
        raise CollectivesError(f"init_parallelism: rank {rank} is in no {kind} group")
    return mine


def _verify_membership(
    kind: str, group: ProcessGroup, expected_ranks: list[int], coordinate: int, rank: int
) -> list[int]:
    """Checks that this rank is in ``group`` at ``coordinate``; returns its ranks."""
    actual_ranks = dist.get_process_group_ranks(group)
    position = dist.get_rank(group)
    if actual_ranks != expected_ranks or position != coordinate:
        raise CollectivesError(
            f"init_parallelism: global rank {rank} should be at position {coordinate} of the "
            f"{kind} group with ranks {expected_ranks}, but the group holds {actual_ranks} and "
            f"this rank is at position {position}"
        )
    return actual_ranks


def init_parallelism(
    model_parallelism: int = 1,
    pipeline_parallelism: int = 1,
    *,
    mp_backend: str | None = None,
    pp_backend: str | None = None,
    dp_backend: str | None = None,
) -> ParallelState:
    """Creates the model, pipeline and data parallel groups; collective over the world.

    Every rank of the default group must call it, with the same arguments. A previous
    state is destroyed and replaced. Reads no environment variables: the default
    process group must be initialized (``dist_core.init_process_group_from_backend``).

    Args:
        model_parallelism: Ranks per model-parallel group (adjacent ranks).
        pipeline_parallelism: Ranks per pipeline-parallel group.
        mp_backend: Backend of the model-parallel groups; None uses the default
            group's.
        pp_backend: Backend of the pipeline-parallel groups; None as above.
        dp_backend: Backend of the data-parallel groups; None as above.

    Returns:
        This rank's :class:`ParallelState`, also returned by
        :func:`get_parallel_state` until replaced or destroyed.

    Raises:
        CollectivesError: No default process group; the ranks passed different
            arguments (raised on every rank, before any group is created); or a group
            does not hold the ranks the layout says.
        ValueError: A size below 1, or ``world_size`` not divisible by
            ``model_parallelism * pipeline_parallelism``.
    """
    global _state
    if not (dist.is_available() and dist.is_initialized()):
        raise CollectivesError(
            "init_parallelism needs an initialized default process group; call "
            "dist_core.init_process_group_from_backend() (or launch through dist-launch's "
            "init_and_run) first"
        )
    _check_plans_agree(
        _plan(model_parallelism, pipeline_parallelism, mp_backend, pp_backend, dp_backend)
    )
    layout = ParallelLayout(
        dist.get_world_size(), mp_size=model_parallelism, pp_size=pipeline_parallelism
    )
    destroy_parallelism()
    rank = dist.get_rank()
    dp_rank, pp_rank, mp_rank = layout.coordinates(rank)
    # The same order on every rank: new_group is collective over the world.
    mp_group = _new_groups(layout.mp_groups(), mp_backend, rank, "model-parallel")
    pp_group = _new_groups(layout.pp_groups(), pp_backend, rank, "pipeline-parallel")
    dp_group = _new_groups(layout.dp_groups(), dp_backend, rank, "data-parallel")
    mp_ranks = _verify_membership(
        "model-parallel",
        mp_group,
        layout.mp_groups()[dp_rank * layout.pp_size + pp_rank],
        mp_rank,
        rank,
    )
    pp_ranks = _verify_membership(
        "pipeline-parallel",
        pp_group,
        layout.pp_groups()[dp_rank * layout.mp_size + mp_rank],
        pp_rank,
        rank,
    )
    dp_ranks = _verify_membership(
        "data-parallel",
        dp_group,
        layout.dp_groups()[pp_rank * layout.mp_size + mp_rank],
        dp_rank,
        rank,
    )
    _state = ParallelState(
        world_size=layout.world_size,
        dp_size=layout.dp_size,
        pp_size=layout.pp_size,
        mp_size=layout.mp_size,
        dp_rank=dp_rank,
        pp_rank=pp_rank,
        mp_rank=mp_rank,
        dp_group=dp_group,
        pp_group=pp_group,
        mp_group=mp_group,
        dp_ranks=dp_ranks,
        pp_ranks=pp_ranks,
        mp_ranks=mp_ranks,
    )
    logger.debug(
        "rank %d: dp %d/%d, pp %d/%d, mp %d/%d",
        rank,
        dp_rank,
        layout.dp_size,
        pp_rank,
        layout.pp_size,
        mp_rank,
        layout.mp_size,
    )
    return _state


def destroy_parallelism() -> None:
    """Destroys the groups :func:`init_parallelism` created; a no-op without them.

    Call it before destroying the default group. When the default group is already
    gone (which destroyed every group with it), the state is just forgotten.
    """
    global _state
    state, _state = _state, None
    if state is None or not (dist.is_available() and dist.is_initialized()):
        return
    for group in (state.mp_group, state.pp_group, state.dp_group):
        dist.destroy_process_group(group)


def is_parallelism_initialized() -> bool:
    """True between :func:`init_parallelism` and :func:`destroy_parallelism`."""
    return _current() is not None


def _current() -> ParallelState | None:
    global _state
    if _state is not None and not (dist.is_available() and dist.is_initialized()):
        # The default group was destroyed, and every subgroup with it.
        _state = None
    return _state


def get_parallel_state() -> ParallelState:
    """The state of the last :func:`init_parallelism` call.

    Raises:
        CollectivesError: ``init_parallelism`` has not been called, or its state was
            destroyed (with :func:`destroy_parallelism` or the default group).
    """
    state = _current()
    if state is None:
        raise CollectivesError(
            "parallel groups are not initialized; call "
            "dist_collectives.init_parallelism() on every rank first"
        )
    return state


def get_dp_rank() -> int:
    """This rank's position in its data-parallel group."""
    return get_parallel_state().dp_rank


def get_pp_rank() -> int:
    """This rank's position in its pipeline-parallel group (its pipeline stage)."""
    return get_parallel_state().pp_rank


def get_mp_rank() -> int:
    """This rank's position in its model-parallel group."""
    return get_parallel_state().mp_rank


def get_dp_size() -> int:
    """Number of data-parallel replicas."""
    return get_parallel_state().dp_size


def get_pp_size() -> int:
    """Number of pipeline stages."""
    return get_parallel_state().pp_size


def get_mp_size() -> int:
    """Number of model-parallel shards."""
    return get_parallel_state().mp_size


def get_dp_group() -> ProcessGroup:
    """This rank's data-parallel group."""
    return get_parallel_state().dp_group


def get_pp_group() -> ProcessGroup:
    """This rank's pipeline-parallel group."""
    return get_parallel_state().pp_group


def get_mp_group() -> ProcessGroup:
    """This rank's model-parallel group."""
    return get_parallel_state().mp_group


def get_dp_ranks() -> list[int]:
    """Global ranks of this rank's data-parallel group, in group order."""
    return list(get_parallel_state().dp_ranks)


def get_pp_ranks() -> list[int]:
    """Global ranks of this rank's pipeline-parallel group, in group order."""
    return list(get_parallel_state().pp_ranks)


def get_mp_ranks() -> list[int]:
    """Global ranks of this rank's model-parallel group, in group order."""
    return list(get_parallel_state().mp_ranks)
