"""Rank queries inside a real 4-process gloo group, and from the environment alone."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

import dist_core
from dist_core.testing import run_ranks


def _queries() -> dict[str, object]:
    return {
        "rank": dist_core.get_rank(),
        "global_rank": dist_core.get_global_rank(),
        "local_rank": dist_core.get_local_rank(),
        "node_rank": dist_core.get_node_rank(),
        "world_size": dist_core.get_world_size(),
        "local_world_size": dist_core.get_local_world_size(),
        "is_rank_zero": dist_core.is_rank_zero(),
        "is_initialized": dist_core.is_initialized(),
        "is_available": dist_core.is_available(),
    }


def _queries_answer_from_group_not_environment() -> dict[str, object]:
    """With the environment lying about the rank, the live group still wins."""
    os.environ["RANK"] = "0"
    os.environ["WORLD_SIZE"] = "1"
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    os.environ["LOCAL_RANK"] = "0"
    return {
        "rank": dist_core.get_rank(),
        "world_size": dist_core.get_world_size(),
        "torch_rank": dist.get_rank(),
    }


@pytest.mark.processes
def test_rank_queries_in_a_real_four_process_group() -> None:
    results = run_ranks(_queries, 4)
    for rank, result in enumerate(results):
        assert result == {
            "rank": rank,
            "global_rank": rank,
            "local_rank": rank,
            "node_rank": 0,
            "world_size": 4,
            "local_world_size": 4,
            "is_rank_zero": rank == 0,
            "is_initialized": True,
            "is_available": True,
        }


@pytest.mark.processes
def test_live_group_wins_over_environment() -> None:
    results = run_ranks(_queries_answer_from_group_not_environment, 4)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["world_size"] == 4 for r in results)


def test_queries_from_environment_without_group(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist_core.is_initialized()
    monkeypatch.setenv("RANK", "6")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert dist_core.get_rank() == 6
    assert dist_core.get_world_size() == 8
    assert dist_core.get_local_rank() == 2
    assert dist_core.get_node_rank() == 1
    assert dist_core.get_local_world_size() == 4
    assert not dist_core.is_rank_zero()


def test_queries_without_anything_are_rank_zero_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert (dist_core.get_rank(), dist_core.get_world_size()) == (0, 1)
    assert dist_core.is_rank_zero()
