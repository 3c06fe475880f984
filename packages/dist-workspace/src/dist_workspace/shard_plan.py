"""Which file each tensor goes into when a checkpoint is split by size: one rule.

``dist-workspace merge --max-shard-size`` and ``export_sharded(max_shard_size=...)``
both pack tensors in order into files of at most a given number of tensor bytes, as
``save_pretrained`` does: a tensor larger than the limit gets a file of its own.
"""

from __future__ import annotations

from collections.abc import Sequence


def pack_in_order(sizes: Sequence[int], limit: int | None) -> list[list[int]]:
    """The indices of ``sizes``, in order, grouped into shards of at most ``limit`` bytes.

    A size over the limit gets a shard of its own; no sizes give no shard; a limit of
    None puts everything into one shard.
    """
    shards: list[list[int]] = []
    total = 0
    for index, size in enumerate(sizes):
        if not shards or (limit is not None and shards[-1] and total + size > limit):
            shards.append([])
            total = 0
        shards[-1].append(index)
        total += size
    return shards


def numbered(counts: Sequence[int]) -> list[int]:
    """The number of the first file of each rank, given how many files each writes.

    Files are numbered 1 to N in rank order, without gaps; a rank that writes none
    gets the number its successor starts at.
    """
    first = []
    next_number = 1
    for count in counts:
        first.append(next_number)
        next_number += count
    return first
