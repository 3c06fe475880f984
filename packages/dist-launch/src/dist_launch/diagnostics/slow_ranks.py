"""Ranks that are consistently late to their collectives, from the flight records (pure).

Every rank's flight recorder notes when the rank enqueued each collective (wall clock,
ns). For one collective of a group, rank r's *lag* is its time less the median of the
other members' times: a rank that is late to every collective costs every other rank
that wait. Over a window of collectives, rank r is *slow* when the median of its lags
is at least ``min_lag_s`` and its lag was at least that in ``min_share`` of them, over
at least ``min_samples`` collectives that every member recorded. A balanced job names
no rank: its lags scatter around zero. Two ranks late together are each late against
the median of the others, so both are named.

Across nodes the lag includes the hosts' clock offset (NTP keeps it near a
millisecond): when every rank of a node is named slow, the report adds that a clock
offset between nodes looks the same.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dist_launch.diagnostics.flight_records import GroupKey, RankRecords

MIN_LAG_SECONDS = 0.05
MIN_SHARE_LATE = 0.75
MIN_SAMPLES = 5


@dataclass(frozen=True)
class SlowRank:
    """A rank found consistently late in one group's collectives."""

    rank: int
    group: str  # "default" or torch's group name
    backend: str
    op: str  # the commonest op among the samples
    lag_s: float  # the median lag
    samples: int
    share_late: float  # how often its lag was at least the minimum
    clock_note: bool = False  # every rank of its node is late: a clock offset looks the same

    def describe(self, window_s: float) -> str:
        """``rank 1 enters all_reduce 240 ms after the others (median of 40 ...)``."""
        group = "the default group" if self.group == "default" else f"group {self.group}"
        note = " (a clock offset between nodes looks the same)" if self.clock_note else ""
        return (
            f"rank {self.rank} enters {self.op} {self.lag_s * 1000:.0f} ms after the others "
            f"(median of {self.samples} on {group}, last {window_s:g} s){note}"
        )


@dataclass(frozen=True)
class _Sample:
    times: dict[int, int]
    op: str


def _members(
    key: GroupKey, records: Mapping[int, RankRecords], job_ranks: Sequence[int]
) -> list[int]:
    declared: set[int] = set()
    recorded: set[int] = set()
    default = False
    for rank, rank_records in records.items():
        group = rank_records.groups.get(key)
        if group is None:
            continue
        recorded.add(rank)
        default = default or group.is_default
        if group.members is not None:
            declared.update(group.members)
    if default:
        return sorted(job_ranks)
    return sorted(declared or recorded)


def last_seqs(records: Mapping[int, RankRecords]) -> dict[GroupKey, int]:
    """Each group's highest sequence number any rank recorded (where the next window starts)."""
    last: dict[GroupKey, int] = {}
    for rank_records in records.values():
        for key, group in rank_records.groups.items():
            if group.ops:
                last[key] = max(last.get(key, 0), max(group.ops))
    return last


def find_slow_ranks(
    records: Mapping[int, RankRecords],
    *,
    job_ranks: Sequence[int],
    after: Mapping[GroupKey, int] | None = None,
    nodes: Mapping[int, int] | None = None,
    min_lag_s: float = MIN_LAG_SECONDS,
    min_share: float = MIN_SHARE_LATE,
    min_samples: int = MIN_SAMPLES,
) -> list[SlowRank]:
    """The consistently late ranks of a window (see the module docstring).

    Args:
        records: Each rank's records of the window.
        job_ranks: Every global rank of the job (the default group's members).
        after: Per group, the last sequence number of the previous window: only later
            collectives count.
        nodes: Each rank's node, for the clock-offset note.
        min_lag_s: The median lag that makes a rank slow.
        min_share: How often a slow rank's lag must be at least ``min_lag_s``.
        min_samples: How many collectives every member recorded, at least.

    Returns:
        The slow ranks, by group then rank.
    """
    after = after or {}
    found: list[SlowRank] = []
    keys = sorted({key for r in records.values() for key in r.groups})
    for key in keys:
        members = _members(key, records, job_ranks)
        if len(members) < 2 or any(rank not in records for rank in members):
            continue
        own = {rank: records[rank].groups.get(key) for rank in members}
        if any(group is None for group in own.values()):
            continue
        common = set.intersection(*(set(group.ops) for group in own.values() if group))
        samples = [
            _Sample(
                {rank: group.ops[seq].created_ns for rank, group in own.items() if group},
                next(iter(own.values())).ops[seq].op,  # type: ignore[union-attr]
            )
            for seq in sorted(common)
            if seq > after.get(key, 0)
        ]
        if len(samples) < min_samples:
            continue
        label = "default" if any(g is not None and g.is_default for g in own.values()) else key[0]
        for rank in members:
            lags: list[float] = []
            late = 0
            ops: Counter[str] = Counter()
            for sample in samples:
                others = [t for other, t in sample.times.items() if other != rank]
                lag = (sample.times[rank] - statistics.median(others)) / 1e9
                lags.append(lag)
                late += lag >= min_lag_s
                ops[sample.op] += 1
            median = statistics.median(lags)
            share = late / len(samples)
            if median >= min_lag_s and share >= min_share:
                found.append(
                    SlowRank(
                        rank, label, key[1], ops.most_common(1)[0][0], lag, len(samples), share
                    )
                )
    if nodes:
        slow = {s.rank for s in found}
        by_node: dict[int, set[int]] = {}
        for rank, node in nodes.items():
            by_node.setdefault(node, set()).add(rank)
        whole = {n for n, ranks in by_node.items() if len(by_node) > 1 and ranks <= slow}
        found = [
            SlowRank(
                s.rank, s.group, s.backend, s.op, s.lag_s, s.samples, s.share_late,
                clock_note=nodes.get(s.rank) in whole,
            )
            for s in found
        ]  # fmt: skip
    return found
