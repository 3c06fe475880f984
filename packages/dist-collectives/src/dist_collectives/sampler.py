"""A DistributedSampler for this rank, Composer's ``get_sampler`` with a group option."""

from __future__ import annotations

from typing import Any

import torch.utils.data

from dist_collectives._group import ProcessGroup, resolve_group

__all__ = ["get_sampler"]


def get_sampler(
    dataset: torch.utils.data.Dataset[Any],
    *,
    drop_last: bool = False,
    shuffle: bool = False,
    seed: int = 0,
    group: ProcessGroup | None = None,
) -> torch.utils.data.DistributedSampler[Any]:
    """A sampler giving this rank its share of ``dataset``.

    The dataset is divided among the ranks of ``group`` (the world when None): with
    model or pipeline parallelism, pass the data-parallel group
    (:func:`dist_collectives.get_dp_group`) so that ranks holding the same model
    replica shard see the same samples. Reads ``WORLD_SIZE`` (and the other launcher
    variables dist-core knows) only when no process group is initialized.

    Args:
        dataset: A map-style dataset (it has ``__len__``).
        drop_last: Drop the tail so that every rank gets the same number of samples,
            instead of padding with repeated samples.
        shuffle: Shuffle (call ``sampler.set_epoch(epoch)`` each epoch).
        seed: Shuffle seed; the same on every rank.
        group: The process group to divide among; None means the world.

    Returns:
        A ``torch.utils.data.DistributedSampler`` for this rank.

    Raises:
        ValueError: This rank is not in ``group``.
        dist_collectives.CollectivesError: The environment describes several ranks
            but no process group is initialized.
    """
    view = resolve_group(group, "get_sampler")
    return torch.utils.data.DistributedSampler(
        dataset,
        num_replicas=view.size,
        rank=view.rank,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
    )
