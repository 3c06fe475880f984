"""Composer-style helpers on real ranks, on a subgroup, and in a single process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_collectives as dc
from dist_core.testing import run_ranks


def helpers_worker() -> dict[str, Any]:
    """Three ranks; the subgroup holds global ranks [0, 2] so positions != global ranks."""
    rank = dist.get_rank()
    sub = dist.new_group([0, 2])
    out: dict[str, Any] = {}

    gathered = dc.all_gather(torch.tensor([rank, 10 * rank]))
    out["all_gather"] = [t.tolist() for t in gathered]
    out["all_gather_object"] = dc.all_gather_object({"rank": rank})

    results = {}
    for op in ("SUM", "MAX", "MIN", "PRODUCT", "AVG", "sum", dist.ReduceOp.MAX):
        t = torch.tensor([float(rank + 1)])
        returned = dc.all_reduce(t, op)
        assert returned is t
        results[str(op)] = t.item()
    out["all_reduce"] = results

    t = torch.tensor([float(rank)] * 2)
    assert dc.broadcast(t, src=2) is t
    out["broadcast"] = t.tolist()
    objects: list[Any] = [f"from {rank}", rank]
    assert dc.broadcast_object_list(objects, src=1) is None
    out["broadcast_object_list"] = objects
    dc.barrier()
    sampler = dc.get_sampler(list(range(12)), shuffle=True, seed=3)
    out["sampler"] = (sampler.num_replicas, sampler.rank, list(sampler))

    if rank == 1:
        with pytest.raises(ValueError, match="global rank 1 is not a member"):
            dc.all_gather(torch.zeros(1), group=sub)
        with pytest.raises(ValueError, match="not a member"):
            dc.get_sampler(list(range(4)), group=sub)
        with pytest.raises(ValueError, match="not a member"):
            dc.barrier(group=sub)
        return out
    with pytest.raises(ValueError, match=r"src=1 is not a global rank of the group .*\[0, 2\]"):
        dc.broadcast(torch.zeros(1), src=1, group=sub)
    out["sub_all_gather"] = [t.tolist() for t in dc.all_gather(torch.tensor([rank]), group=sub)]
    out["sub_all_gather_object"] = dc.all_gather_object(rank, group=sub)
    out["sub_all_reduce"] = dc.all_reduce(torch.tensor([rank + 1]), "SUM", group=sub).tolist()
    out["sub_broadcast"] = dc.broadcast(torch.tensor([rank]), src=2, group=sub).tolist()
    objects = [rank]
    dc.broadcast_object_list(objects, src=2, group=sub)
    out["sub_broadcast_object_list"] = objects
    dc.barrier(group=sub)
    sub_sampler = dc.get_sampler(list(range(6)), drop_last=True, group=sub)
    out["sub_sampler"] = (sub_sampler.num_replicas, sub_sampler.rank, list(sub_sampler))
    return out


@pytest.mark.processes
def test_helpers_on_three_ranks_and_a_subgroup() -> None:
    results = run_ranks(helpers_worker, 3, timeout=120)
    for rank, out in enumerate(results):
        assert out["all_gather"] == [[0, 0], [1, 10], [2, 20]]
        assert out["all_gather_object"] == [{"rank": 0}, {"rank": 1}, {"rank": 2}]
        assert out["all_reduce"] == {
            "SUM": 6.0,
            "MAX": 3.0,
            "MIN": 1.0,
            "PRODUCT": 6.0,
            "AVG": 2.0,
            "sum": 6.0,
            str(dist.ReduceOp.MAX): 3.0,
        }
        assert out["broadcast"] == [2.0, 2.0]
        assert out["broadcast_object_list"] == ["from 1", 1]
        replicas, sampler_rank, indices = out["sampler"]
        assert (replicas, sampler_rank) == (3, rank)
        assert len(indices) == 4
    # The world's shards cover the dataset exactly once.
    assert sorted(i for out in results for i in out["sampler"][2]) == list(range(12))
    for rank in (0, 2):
        out = results[rank]
        assert out["sub_all_gather"] == [[0], [2]]
        assert out["sub_all_gather_object"] == [0, 2]
        assert out["sub_all_reduce"] == [4]
        assert out["sub_broadcast"] == [2]
        assert out["sub_broadcast_object_list"] == [2]
        assert out["sub_sampler"][:2] == (2, rank // 2)
    assert results[0]["sub_sampler"][2] == [0, 2, 4]
    assert results[2]["sub_sampler"][2] == [1, 3, 5]


def test_single_process_acts_as_one_rank() -> None:
    assert not dist.is_initialized()
    t = torch.tensor([1.0, 2.0])
    gathered = dc.all_gather(t)
    assert len(gathered) == 1
    assert torch.equal(gathered[0], t)
    assert gathered[0] is not t
    assert dc.all_gather_object({"a": 1}) == [{"a": 1}]
    for op in ("SUM", "MAX", "MIN", "PRODUCT", "AVG", dist.ReduceOp.SUM):
        assert dc.all_reduce(t, op) is t
    assert t.tolist() == [1.0, 2.0]
    assert dc.broadcast(t, src=0) is t
    objects = ["x"]
    dc.broadcast_object_list(objects)
    assert objects == ["x"]
    dc.barrier()
    sampler = dc.get_sampler(list(range(5)))
    assert (sampler.num_replicas, sampler.rank, list(sampler)) == (1, 0, [0, 1, 2, 3, 4])


def test_single_process_bad_input() -> None:
    with pytest.raises(ValueError, match=r"unknown reduce operation 'MEAN'.*'SUM'"):
        dc.all_reduce(torch.zeros(1), "MEAN")
    with pytest.raises(ValueError, match="src=1 is not a global rank of a single process"):
        dc.broadcast(torch.zeros(1), src=1)
    with pytest.raises(ValueError, match="src=3"):
        dc.broadcast_object_list([None], src=3)


@pytest.mark.parametrize(
    "call",
    [
        lambda: dc.all_gather(torch.zeros(1)),
        lambda: dc.all_gather_object(1),
        lambda: dc.all_reduce(torch.zeros(1)),
        lambda: dc.barrier(),
        lambda: dc.broadcast(torch.zeros(1)),
        lambda: dc.broadcast_object_list([1]),
        lambda: dc.get_sampler([1, 2]),
    ],
    ids=[
        "all_gather",
        "all_gather_object",
        "all_reduce",
        "barrier",
        "broadcast",
        "broadcast_object_list",
        "get_sampler",
    ],
)
def test_several_ranks_in_environment_without_group_raises(
    monkeypatch: pytest.MonkeyPatch, call: Any
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(dc.CollectivesError, match="WORLD_SIZE=4 but no process group"):
        call()


def test_group_without_default_group_raises() -> None:
    with pytest.raises(dc.CollectivesError, match="no default process group is initialized"):
        dc.barrier(group=object())  # type: ignore[arg-type]
