"""Consistently late ranks from the records' enqueue times (no process)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from dist_launch.diagnostics.flight_records import GroupRecords, Op, RankRecords
from dist_launch.diagnostics.slow_ranks import find_slow_ranks, last_seqs
from dist_launch.watch.rank_requests import RankRequests
from dist_launch.watch.slow_rank_watch import SlowRankWatch

STEP_NS = 50_000_000  # 50 ms steps


def records(
    delays_ms: dict[int, float],
    *,
    steps: int = 40,
    jitter_ms: float = 10.0,
    name: str = "0",
    members: tuple[int, ...] | None = None,
    skip: dict[int, set[int]] | None = None,
    seed: int = 0,
) -> dict[int, RankRecords]:
    """Ranks entering ``steps`` all_reduces; rank r ``delays_ms[r]`` late, plus jitter."""
    rng = random.Random(seed)
    desc = "default_pg" if name == "0" else "undefined"
    out: dict[int, RankRecords] = {}
    for rank, delay in delays_ms.items():
        ops = {}
        for seq in range(1, steps + 1):
            if seq in (skip or {}).get(rank, set()):
                continue
            jitter = rng.uniform(-jitter_ms, jitter_ms)
            at = seq * STEP_NS + int((delay + jitter) * 1e6)
            ops[seq] = Op("all_reduce", ((4,),), ("Float",), at)
        group = GroupRecords(name, desc, "gloo", steps, steps - 1, ops, members)
        out[rank] = RankRecords(rank, "2.13.0", {group.key: group})
    return out


def test_a_balanced_job_names_no_rank() -> None:
    assert find_slow_ranks(records({0: 0, 1: 0, 2: 0, 3: 0}), job_ranks=range(4)) == []


def test_a_rank_late_to_every_collective_is_named_with_its_median_lag() -> None:
    (slow,) = find_slow_ranks(records({0: 0, 1: 240, 2: 0}), job_ranks=range(3))
    assert (slow.rank, slow.group, slow.op, slow.samples) == (1, "default", "all_reduce", 40)
    assert 0.22 < slow.lag_s < 0.26
    assert slow.share_late == 1.0
    assert slow.describe(60) == (
        f"rank 1 enters all_reduce {slow.lag_s * 1000:.0f} ms after the others "
        "(median of 40 on the default group, last 60 s)"
    )


def test_a_rank_late_only_half_of_the_time_is_not_slow() -> None:
    late = records({0: 0, 1: 240, 2: 0}, steps=20, seed=1)
    on_time = records({0: 0, 1: 0, 2: 0}, steps=20, seed=2)
    # Seqs 1-20 late, 21-40 on time: rank 1 is late in half of them.
    for rank, rank_records in late.items():
        ((key, group),) = rank_records.groups.items()
        (other,) = on_time[rank].groups.values()
        shifted = {seq + 20: op for seq, op in other.ops.items()}
        ops = {**group.ops, **shifted}
        late[rank] = RankRecords(
            rank, "2.13.0", {key: GroupRecords(*key[:1], group.desc, "gloo", 40, 39, ops)}
        )
    assert find_slow_ranks(late, job_ranks=range(3)) == []


def test_collectives_a_member_did_not_record_are_skipped() -> None:
    data = records({0: 0, 1: 240, 2: 0}, skip={2: set(range(1, 38))})
    assert find_slow_ranks(data, job_ranks=range(3)) == []  # 3 common samples: too few
    data = records({0: 0, 1: 240, 2: 0}, skip={2: {3, 4}})
    (slow,) = find_slow_ranks(data, job_ranks=range(3))
    assert slow.samples == 38


def test_only_collectives_after_the_last_window_count() -> None:
    data = records({0: 0, 1: 240, 2: 0})
    assert last_seqs(data) == {("0", "gloo"): 40}
    assert find_slow_ranks(data, job_ranks=range(3), after={("0", "gloo"): 37}) == []


def test_a_subgroup_is_judged_among_its_own_members() -> None:
    data = records({2: 0, 3: 300}, name="1", members=(2, 3))
    (slow,) = find_slow_ranks(data, job_ranks=range(4))
    assert (slow.rank, slow.group) == (3, "1")


def test_a_whole_node_late_may_be_a_clock_offset() -> None:
    data = records({0: 0, 1: 0, 2: 200, 3: 200})
    slow = find_slow_ranks(data, job_ranks=range(4), nodes={0: 0, 1: 0, 2: 1, 3: 1})
    # Ranks 2-3 are each late against the median of the other three.
    assert [s.rank for s in slow] == [2, 3]
    assert all(s.clock_note for s in slow)
    assert slow[0].describe(60).endswith("(a clock offset between nodes looks the same)")


def test_a_costly_dump_stretches_the_window(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    watch = SlowRankWatch(
        60.0, RankRequests(tmp_path), lambda call: None, job_ranks=range(2), nodes={0: 0, 1: 0}
    )
    watch._stretch(0.04)  # 2000 entries: 40 ms, under 1% of 60 s
    assert watch._interval == 60.0
    watch._stretch(4.0)  # a TORCH_FR_BUFFER_SIZE of 200000
    assert watch._interval == 400.0
    assert "a window every 400 s keeps that under 1% of its time" in caplog.text
