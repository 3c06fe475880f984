"""Composer-style collective helpers that also work in a single process.

Each helper takes an optional ``group`` and sizes its results by that group (not by
the world, which is where Composer's ``all_gather`` fails on a subgroup). With no
process group initialized, a process whose environment describes one rank behaves as
that rank: gathers return a list of one, reductions and broadcasts leave the tensor
as it is, ``barrier`` returns at once. A process whose environment describes several
ranks (``WORLD_SIZE > 1``) but has no group raises
:class:`~dist_collectives.CollectivesError` instead of quietly computing one rank's
answer.

The object collectives pickle on the sender and unpickle on every receiver, as
torch's do: use them only between the ranks of your own job, never with data from
outside it.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
import torch.distributed as dist

from dist_collectives._group import GroupView, ProcessGroup, group_ranks, resolve_group

logger = logging.getLogger(__name__)

__all__ = [
    "ReduceOpName",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
]

ReduceOpName = Literal["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]

_REDUCE_OPS: dict[str, Any] = {
    "SUM": dist.ReduceOp.SUM,
    "AVG": dist.ReduceOp.AVG,
    "PRODUCT": dist.ReduceOp.PRODUCT,
    "MIN": dist.ReduceOp.MIN,
    "MAX": dist.ReduceOp.MAX,
    "BAND": dist.ReduceOp.BAND,
    "BOR": dist.ReduceOp.BOR,
    "BXOR": dist.ReduceOp.BXOR,
}


def _reduce_op(op: str | dist.ReduceOp) -> Any:
    if not isinstance(op, str):
        return op
    found = _REDUCE_OPS.get(op.upper())
    if found is None:
        raise ValueError(
            f"all_reduce: unknown reduce operation {op!r}; expected one of "
            f"{sorted(_REDUCE_OPS)} or a torch.distributed.ReduceOp"
        )
    return found


def _check_src(src: int, view: GroupView, operation: str) -> None:
    ranks = group_ranks(view)
    if src not in ranks:
        where = "a single process" if view.is_single else f"the group with global ranks {ranks}"
        raise ValueError(
            f"{operation}: src={src} is not a global rank of {where}; src is a global "
            "rank, as in torch.distributed"
        )


def all_gather(tensor: torch.Tensor, group: ProcessGroup | None = None) -> list[torch.Tensor]:
    """Gathers ``tensor`` from every rank of ``group``.

    Every rank must pass a tensor of the same shape and dtype. Reads ``WORLD_SIZE``
    (and the other launcher variables dist-core knows) only when no process group is
    initialized.

    Args:
        tensor: This rank's tensor.
        group: The process group; None means the default (world) group.

    Returns:
        One tensor per rank of ``group``, in group order (entry ``i`` from the rank at
        position ``i``). In a single process, a list holding a copy of ``tensor``:
        the result never aliases the input, as with several ranks.

    Raises:
        ValueError: This rank is not in ``group``.
        dist_collectives.CollectivesError: The environment describes several ranks
            but no process group is initialized.
    """
    view = resolve_group(group, "all_gather")
    if view.is_single:
        return [tensor.clone()]
    gathered = [torch.empty_like(tensor) for _ in range(view.size)]
    dist.all_gather(gathered, tensor.contiguous(), group=view.group)
    return gathered


def all_gather_object(obj: Any, group: ProcessGroup | None = None) -> list[Any]:
    """Gathers a picklable object from every rank of ``group``.

    Reads ``WORLD_SIZE`` (and the other launcher variables dist-core knows) only when
    no process group is initialized.

    Args:
        obj: This rank's object (pickled; unpickled on every other rank).
        group: The process group; None means the default (world) group.

    Returns:
        One object per rank of ``group``, in group order; ``[obj]`` in a single process.

    Raises:
        ValueError: This rank is not in ``group``.
        dist_collectives.CollectivesError: The environment describes several ranks
            but no process group is initialized.
    """
    view = resolve_group(group, "all_gather_object")
    if view.is_single:
        return [obj]
    gathered: list[Any] = [None] * view.size
    dist.all_gather_object(gathered, obj, group=view.group)
    return gathered


def all_reduce(
    tensor: torch.Tensor,
    op: ReduceOpName | str | dist.ReduceOp = "SUM",
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Reduces ``tensor`` across ``group`` in place, and returns it.

    ``op`` is a name (``'SUM'``, ``'MAX'``, ``'MIN'``, ``'PRODUCT'``, ``'AVG'``,
    ``'BAND'``, ``'BOR'``, ``'BXOR'``, any case) or a ``torch.distributed.ReduceOp``.
    ``'AVG'`` is passed to the backend, which raises where it lacks it. Reads
    ``WORLD_SIZE`` (and the other launcher variables dist-core knows) only when no
    process group is initialized.

    Args:
        tensor: This rank's tensor; it receives the result.
        op: The reduction.
        group: The process group; None means the default (world) group.

    Returns:
        ``tensor`` itself, reduced (unchanged in a single process).

    Raises:
        ValueError: An unknown operation name, or this rank is not in ``group``.
        dist_collectives.CollectivesError: The environment describes several ranks
            but no process group is initialized.
    """
    reduce_op = _reduce_op(op)
    view = resolve_group(group, "all_reduce")
    if view.is_single:
        return tensor
    dist.all_reduce(tensor, op=reduce_op, group=view.group)
    return tensor


def barrier(group: ProcessGroup | None = None) -> None:
    """Waits until every rank of ``group`` has called it; returns at once in one process.

    Reads ``WORLD_SIZE`` (and the other launcher variables dist-core knows) only when
    no process group is initialized.

    Args:
        group: The process group; None means the default (world) group.

    Raises:
        ValueError: This rank is not in ``group``.
        dist_collectives.CollectivesError: The environment describes several ranks
            but no process group is initialized.
    """
    view = resolve_group(group, "barrier")
    if view.is_single:
        return
    dist.barrier(group=view.group)


def broadcast(
    tensor: torch.Tensor, src: int = 0, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Copies ``tensor`` from global rank ``src`` to every rank of ``group``, in place.

    Reads ``WORLD_SIZE`` (and the other launcher variables dist-core knows) only when
    no process group is initialized.

    Args:
        tensor: The data on ``src``; the buffer that receives it elsewhere (same shape
            and dtype on every rank).
        src: The sender's global rank (as in torch), a member of ``group``.
        group: The process group; None means the default (world) group.

    Returns:
        ``tensor`` itself, now holding the sender's data.

    Raises:
        ValueError: ``src`` is not a rank of ``group``, or this rank is not in it.
        dist_collectives.CollectivesError: The environment describes several ranks
            but no process group is initialized.
    """
    view = resolve_group(group, "broadcast")
    _check_src(src, view, "broadcast")
    if view.is_single:
        return tensor
    dist.broadcast(tensor, src=src, group=view.group)
    return tensor


def broadcast_object_list(
    object_list: list[Any], src: int = 0, group: ProcessGroup | None = None
) -> None:
    """Replaces ``object_list``'s items with those of global rank ``src``, in place.

    Every rank passes a list of the same length. Reads ``WORLD_SIZE`` (and the other
    launcher variables dist-core knows) only when no process group is initialized.

    Args:
        object_list: Picklable objects on ``src``; placeholders elsewhere.
        src: The sender's global rank (as in torch), a member of ``group``.
        group: The process group; None means the default (world) group.

    Raises:
        ValueError: ``src`` is not a rank of ``group``, or this rank is not in it.
        dist_collectives.CollectivesError: The environment describes several ranks
            but no process group is initialized.
    """
    view = resolve_group(group, "broadcast_object_list")
    _check_src(src, view, "broadcast_object_list")
    if view.is_single:
        return
    dist.broadcast_object_list(object_list, src=src, group=view.group)
