"""How tensors are packed into files by size: one rule for merge and export_sharded."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from dist_workspace.merge import split_into_shards
from dist_workspace.shard_plan import numbered, pack_in_order


def test_tensors_fill_files_in_order_up_to_the_limit() -> None:
    assert pack_in_order([40, 40, 20, 30, 70], 100) == [[0, 1, 2], [3, 4]]


def test_a_tensor_over_the_limit_gets_a_file_of_its_own() -> None:
    assert pack_in_order([10, 250, 10, 10], 100) == [[0], [1], [2, 3]]


def test_no_tensors_give_no_file_and_no_limit_gives_one() -> None:
    assert pack_in_order([], 100) == []
    assert pack_in_order([], None) == []
    assert pack_in_order([5, 500, 5], None) == [[0, 1, 2]]


def test_files_are_numbered_in_rank_order_without_gaps() -> None:
    # rank 1 holds nothing: rank 2's files follow rank 0's
    assert numbered([2, 0, 3, 1]) == [1, 3, 3, 6]


def test_merge_packs_as_export_does() -> None:
    # merge's items as far as packing looks at them: a name and a size
    items: list[Any] = [SimpleNamespace(name=f"t{i}", nbytes=n) for i, n in enumerate([60, 60, 30])]
    shards = split_into_shards(items, 100)
    assert [[item.name for item in shard] for shard in shards] == [["t0"], ["t1", "t2"]]
    assert split_into_shards([], 100) == [[]]  # merge always writes a file
