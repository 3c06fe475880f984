"""The records' last word on a suspected hang: do they show the ranks alive? (no process)"""

from __future__ import annotations

from dist_launch.diagnostics.flight_records import GroupRecords, Op, RankRecords
from dist_launch.diagnostics.records_alive import alive_at, latest_completed

SECOND = 1_000_000_000
NOW = 1_000 * SECOND


def group(enq: int, comp: int, at_ns: int, name: str = "0") -> GroupRecords:
    ops = {seq: Op("all_reduce", ((4,),), ("Float",), at_ns - (enq - seq)) for seq in (1, enq)}
    desc = "default_pg" if name == "0" else "undefined"
    return GroupRecords(name, desc, "gloo", enq, comp, ops)


def rank(r: int, *groups: GroupRecords, missing: str | None = None) -> RankRecords:
    return RankRecords(r, "2.13.0", {g.key: g for g in groups}, missing=missing)


def test_a_collective_completed_within_the_timeout_shows_the_ranks_alive() -> None:
    records = {r: rank(r, group(12, 12, NOW - 2 * SECOND)) for r in (0, 1)}
    assert alive_at(records, ranks=(0, 1), now_ns=NOW, within_s=5.0) == NOW - 2 * SECOND


def test_the_latest_group_counts_when_another_was_idle_for_long() -> None:
    records = {
        r: rank(r, group(12, 12, NOW - 60 * SECOND), group(3, 3, NOW - SECOND, name="1"))
        for r in (0, 1)
    }
    assert alive_at(records, ranks=(0, 1), now_ns=NOW, within_s=5.0) == NOW - SECOND
    latest = latest_completed(records)
    assert latest is not None and (latest[0].name, latest[1]) == ("1", 3)


def test_a_pending_collective_leaves_the_suspicion_standing() -> None:
    records = {0: rank(0, group(12, 11, NOW - SECOND)), 1: rank(1, group(11, 11, NOW - SECOND))}
    assert alive_at(records, ranks=(0, 1), now_ns=NOW, within_s=5.0) is None


def test_ranks_quiet_for_longer_than_the_timeout_outside_collectives_are_not_alive() -> None:
    records = {r: rank(r, group(12, 12, NOW - 6 * SECOND)) for r in (0, 1)}
    assert alive_at(records, ranks=(0, 1), now_ns=NOW, within_s=5.0) is None


def test_a_rank_without_records_may_be_the_stuck_one() -> None:
    records = {
        0: rank(0, group(12, 12, NOW - SECOND)),
        1: rank(1, missing="TORCH_FR_BUFFER_SIZE=0"),
    }
    assert alive_at(records, ranks=(0, 1), now_ns=NOW, within_s=5.0) is None
    del records[1]
    assert alive_at(records, ranks=(0, 1), now_ns=NOW, within_s=5.0) is None


def test_no_collective_at_all_is_no_sign_of_life() -> None:
    records = {r: rank(r) for r in (0, 1)}
    assert alive_at(records, ranks=(0, 1), now_ns=NOW, within_s=5.0) is None
