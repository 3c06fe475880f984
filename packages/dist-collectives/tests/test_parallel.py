"""init_parallelism on 4 and 8 ranks, every factorisation; the layout; plan checks."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_collectives as dc
from dist_collectives import ParallelLayout, ParallelState
from dist_core.testing import run_ranks


def _factorisations(world: int) -> list[tuple[int, int]]:
    """Every (model_parallelism, pipeline_parallelism) whose product divides world."""
    return [
        (mp, pp)
        for mp in range(1, world + 1)
        for pp in range(1, world + 1)
        if world % (mp * pp) == 0
    ]


def _expected(rank: int, world: int, mp: int, pp: int) -> dict[str, Any]:
    """The documented formula, written out independently of ParallelLayout."""
    dp = world // (mp * pp)
    mp_rank, pp_rank, dp_rank = rank % mp, (rank // mp) % pp, rank // (mp * pp)

    def at(d: int, p: int, m: int) -> int:
        return (d * pp + p) * mp + m

    return {
        "world_size": world,
        "dp_size": dp,
        "pp_size": pp,
        "mp_size": mp,
        "dp_rank": dp_rank,
        "pp_rank": pp_rank,
        "mp_rank": mp_rank,
        "dp_ranks": [at(d, pp_rank, mp_rank) for d in range(dp)],
        "pp_ranks": [at(dp_rank, p, mp_rank) for p in range(pp)],
        "mp_ranks": [at(dp_rank, pp_rank, m) for m in range(mp)],
    }


def _observe(state: ParallelState) -> dict[str, Any]:
    """What the state says, what its live groups do, and what its DeviceMesh holds."""
    rank = dist.get_rank()
    seen: dict[str, Any] = {
        name: getattr(state, name)
        for name in (
            "world_size",
            "dp_size",
            "pp_size",
            "mp_size",
            "dp_rank",
            "pp_rank",
            "mp_rank",
            "dp_ranks",
            "pp_ranks",
            "mp_ranks",
        )
    }
    mesh = state.device_mesh()
    assert mesh.mesh_dim_names == ("dp", "pp", "mp")
    assert mesh.mesh.shape == (state.dp_size, state.pp_size, state.mp_size)
    assert mesh.get_rank() == rank
    coordinate = mesh.get_coordinate()
    assert coordinate is not None
    assert list(coordinate) == [state.dp_rank, state.pp_rank, state.mp_rank], coordinate
    for kind in ("dp", "pp", "mp"):
        group = getattr(state, f"{kind}_group")
        ranks = getattr(state, f"{kind}_ranks")
        # The live group holds the ranks, this rank at its coordinate.
        assert dist.get_process_group_ranks(group) == ranks
        assert dist.get_rank(group) == getattr(state, f"{kind}_rank")
        # Communication really happens among exactly those ranks.
        total = dc.all_reduce(torch.tensor([rank]), "SUM", group=group).item()
        assert total == sum(ranks), (kind, total, ranks)
        # The DeviceMesh view holds the same ranks, in the same order.
        assert dist.get_process_group_ranks(mesh.get_group(kind)) == ranks
        assert mesh[kind].mesh.tolist() == ranks
    # The module-level getters answer from the same state.
    assert dc.get_parallel_state() is state
    assert (dc.get_dp_rank(), dc.get_pp_rank(), dc.get_mp_rank()) == (
        state.dp_rank,
        state.pp_rank,
        state.mp_rank,
    )
    assert (dc.get_dp_size(), dc.get_pp_size(), dc.get_mp_size()) == (
        state.dp_size,
        state.pp_size,
        state.mp_size,
    )
    assert (dc.get_dp_group(), dc.get_pp_group(), dc.get_mp_group()) == (
        state.dp_group,
        state.pp_group,
        state.mp_group,
    )
    assert (dc.get_dp_ranks(), dc.get_pp_ranks(), dc.get_mp_ranks()) == (
        state.dp_ranks,
        state.pp_ranks,
        state.mp_ranks,
    )
    return seen


def factorisations_worker() -> list[tuple[int, int, dict[str, Any]]]:
    world = dist.get_world_size()
    seen = []
    for mp, pp in _factorisations(world):
        # Called again and again: each call replaces the previous state.
        state = dc.init_parallelism(mp, pp, mp_backend="gloo" if mp > 1 else None)
        seen.append((mp, pp, _observe(state)))
    dc.destroy_parallelism()
    assert not dc.is_parallelism_initialized()
    with pytest.raises(dc.CollectivesError, match="not initialized"):
        dc.get_parallel_state()
    return seen


@pytest.mark.processes
@pytest.mark.parametrize("world", [1, 4, 8])
def test_every_factorisation(world: int) -> None:
    results = run_ranks(factorisations_worker, world, timeout=240)
    expected_cases = _factorisations(world)
    for rank, seen in enumerate(results):
        assert [(mp, pp) for mp, pp, _ in seen] == expected_cases
        for mp, pp, observed in seen:
            assert observed == _expected(rank, world, mp, pp), (rank, mp, pp)


def bad_plans_worker() -> list[str]:
    rank = dist.get_rank()
    checked = []
    # Rank 0 asks for a different layout: every rank raises, before any new_group.
    with pytest.raises(
        dc.CollectivesError, match=r"(?s)different arguments.*ranks \[0\]: .*model_parallelism.: 2"
    ):
        dc.init_parallelism(2 if rank == 0 else 1)
    checked.append("mismatch")
    with pytest.raises(dc.CollectivesError, match="different arguments"):
        dc.init_parallelism(2, mp_backend="gloo" if rank == 1 else None)
    checked.append("backend mismatch")
    with pytest.raises(
        ValueError,
        match=r"world_size=4 is not divisible by model_parallelism=3 \* pipeline_parallelism=1",
    ):
        dc.init_parallelism(3)
    checked.append("divisible")
    with pytest.raises(ValueError, match="pipeline_parallelism=0 must be a positive integer"):
        dc.init_parallelism(1, 0)
    checked.append("positive")
    # After the failures the ranks are still in step: a good call works.
    state = dc.init_parallelism(2, 2)
    assert state.mp_ranks == [rank - rank % 2, rank - rank % 2 + 1]
    dc.destroy_parallelism()
    checked.append("recovered")
    return checked


@pytest.mark.processes
def test_bad_plans_raise_on_every_rank() -> None:
    results = run_ranks(bad_plans_worker, 4, timeout=120)
    assert results == [["mismatch", "backend mismatch", "divisible", "positive", "recovered"]] * 4


def test_parallel_state_fields() -> None:
    assert [field.name for field in dataclasses.fields(ParallelState)] == [
        "world_size",
        "dp_size",
        "pp_size",
        "mp_size",
        "dp_rank",
        "pp_rank",
        "mp_rank",
        "dp_group",
        "pp_group",
        "mp_group",
        "dp_ranks",
        "pp_ranks",
        "mp_ranks",
    ]
    assert ParallelState.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_init_without_process_group_raises() -> None:
    assert not dist.is_initialized()
    with pytest.raises(dc.CollectivesError, match="initialized default process group"):
        dc.init_parallelism()
    with pytest.raises(dc.CollectivesError, match="not initialized"):
        dc.get_mp_group()


@pytest.mark.parametrize("world", [1, 4, 6, 8, 12])
def test_layout_formula_and_groups_partition(world: int) -> None:
    for mp, pp in _factorisations(world):
        layout = ParallelLayout(world, mp_size=mp, pp_size=pp)
        for rank in range(world):
            dp_rank, pp_rank, mp_rank = layout.coordinates(rank)
            assert rank == (dp_rank * pp + pp_rank) * mp + mp_rank
            assert layout.rank_of(dp_rank, pp_rank, mp_rank) == rank
        for groups, size in (
            (layout.mp_groups(), mp),
            (layout.pp_groups(), pp),
            (layout.dp_groups(), world // (mp * pp)),
        ):
            assert sorted(r for group in groups for r in group) == list(range(world))
            assert all(len(group) == size for group in groups)


def test_layout_documented_example() -> None:
    layout = ParallelLayout(8, mp_size=2, pp_size=2)
    assert layout.mp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.pp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert "rank 5: dp 1, pp 0, mp 1" in layout.describe()


def test_layout_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match=r"world_size=6 .* model_parallelism=2 \* pipeline_par"):
        ParallelLayout(6, mp_size=2, pp_size=2)
    with pytest.raises(ValueError, match="model_parallelism=0"):
        ParallelLayout(4, mp_size=0, pp_size=1)
    with pytest.raises(ValueError, match=r"rank=4 is outside 0\.\.3"):
        ParallelLayout(4, mp_size=2, pp_size=1).coordinates(4)
