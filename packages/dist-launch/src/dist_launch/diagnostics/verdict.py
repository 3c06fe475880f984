"""The hang verdict: which collective the ranks wait in, and which ranks never came (pure).

From every rank's flight records (:mod:`dist_launch.diagnostics.flight_records`), per
process group with members M (global ranks):

- rank r *entered* collective s when its last enqueued sequence number ``enq_r >= s``
  and *completed* it when ``comp_r >= s``;
- the group's pending collective is ``s* = max enq_r`` over the members with
  ``enq_r > comp_r`` (the most advanced one some rank waits in);
- *waiting*: the members with ``enq_r >= s* > comp_r``; *behind*: those with
  ``enq_r < s*``, which never entered it and are usually the cause; *unknown*: members
  that sent no records;
- a *desync*: ranks whose records of one sequence number differ in op or sizes.

The verdict's collective is the pending one the most ranks wait in (ties: one with
ranks behind, then the default group, then the lowest name). Each behind rank is
described by where it is: waiting in another group's collective, or, from its stack,
the line it is at. Without any records (every rank missing them, or ``--no-python``),
the verdict falls back to the stacks: the ranks outside the largest group of identical
stacks are behind, and the verdict says which records were missing and why.

Membership: what ranks declared (every member declares the same list); the default
group is the job's ranks (what the launcher knows); a group nobody declared has the
ranks that recorded it. torch's flight recorder does not say which ranks belong to a
group (on gloo its group table is empty).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dist_launch.diagnostics.flight_records import GroupKey, GroupRecords, Op, RankRecords
from dist_launch.diagnostics.hang_report import describe_place
from dist_launch.diagnostics.records_alive import latest_completed
from dist_launch.diagnostics.stacks import format_rank_ranges, group_stacks, main_thread_frames

SOURCE_RECORDS = "flight recorder"


def ranks_phrase(ranks: Sequence[int]) -> str:
    """``rank 2`` or ``ranks 0-1, 3``."""
    return ("rank " if len(ranks) == 1 else "ranks ") + format_rank_ranges(ranks)


@dataclass(frozen=True)
class GroupVerdict:
    """One process group's pending collective, its waiting, behind and unknown ranks."""

    name: str
    desc: str
    backend: str
    members: tuple[int, ...]
    seq: int | None = None  # None: nothing pending in the group
    op: Op | None = None
    waiting: tuple[int, ...] = ()
    behind: tuple[int, ...] = ()
    unknown: tuple[int, ...] = ()

    @property
    def is_default(self) -> bool:
        """True for the default (world) group."""
        return self.desc == "default_pg"

    @property
    def label(self) -> str:
        """How hang.json names the group: ``default``, or torch's name."""
        return "default" if self.is_default else self.name

    def describe(self) -> str:
        """``the default group`` or ``group 1``."""
        return "the default group" if self.is_default else f"group {self.name}"

    def collective(self) -> str:
        """``all_reduce #6 on the default group``."""
        op = self.op.op if self.op is not None else "a collective"
        return f"{op} #{self.seq} on {self.describe()}"


@dataclass(frozen=True)
class Desync:
    """Ranks that recorded one sequence number of one group as different collectives."""

    group: GroupVerdict
    seq: int
    ops: Mapping[int, str]  # rank -> "all_reduce [4]"

    def describe(self) -> str:
        """``desync on the default group at #2: ranks 0-1 run all_reduce [4], rank 2 ...``."""
        by_op: dict[str, list[int]] = {}
        for rank, op in sorted(self.ops.items()):
            by_op.setdefault(op, []).append(rank)
        parts = [
            f"{ranks_phrase(ranks)} {'runs' if len(ranks) == 1 else 'run'} {op}"
            for op, ranks in sorted(by_op.items(), key=lambda item: item[1][0])
        ]
        return f"desync on {self.group.describe()} at #{self.seq}: " + ", ".join(parts)


@dataclass(frozen=True)
class HangVerdict:
    """What the ranks' records say about a hang.

    Attributes:
        source: ``flight recorder``, or ``stacks only: <why>``.
        collective: The group and collective the most ranks wait in; None without one.
        waiting: The ranks waiting in it (global, sorted).
        behind: The ranks that never entered it (or, from stacks, the odd ones).
        unknown: Members of its group that sent no records.
        groups: Every group with a pending collective.
        desyncs: Sequence numbers that ranks recorded as different collectives.
        places: Where each behind rank is, as the headline says it; with no collective
            pending, where every rank is.
        missing: Why each rank without records has none.
        last_completed: With no collective pending, the latest collective the ranks
            completed (``all_reduce #12 on the default group``), if the records hold it.
    """

    source: str
    collective: GroupVerdict | None = None
    waiting: tuple[int, ...] = ()
    behind: tuple[int, ...] = ()
    unknown: tuple[int, ...] = ()
    groups: tuple[GroupVerdict, ...] = ()
    desyncs: tuple[Desync, ...] = ()
    places: Mapping[int, str] = field(default_factory=dict)
    missing: Mapping[int, str] = field(default_factory=dict)
    last_completed: str | None = None

    def headline(self) -> str:
        """The verdict's first line (after ``dist-launch: hang: ``)."""
        parts: list[str] = []
        if self.collective is None and self.source == SOURCE_RECORDS:
            return self._idle_headline()
        if self.collective is None:
            parts.append(self.source.replace("stacks only: ", "no flight records (", 1) + ")")
            if self.behind:
                places = "; ".join(
                    f"rank {rank} {self.places.get(rank, 'is elsewhere')}" for rank in self.behind
                )
                parts.append(f"from the stacks: {places}")
            return "; ".join(parts)
        collective = self.collective
        if self.behind:
            wait = "waits" if len(self.waiting) == 1 else "wait"
            parts.append(f"{ranks_phrase(self.behind)} never entered {collective.collective()}")
            parts.append(f"{ranks_phrase(self.waiting)} {wait} in it")
            parts += [
                f"rank {rank} {self.places[rank]}" for rank in self.behind if rank in self.places
            ]
        else:
            parts.append(
                f"{ranks_phrase(self.waiting)} entered {collective.collective()} "
                "and none completed it"
            )
        if self.unknown:
            parts.append(f"{ranks_phrase(self.unknown)} sent no records")
        return "; ".join(parts)

    def _idle_headline(self) -> str:
        """No collective pending: the ranks are stuck outside collectives, and where."""
        parts = ["no collective is pending"]
        by_place: dict[str, list[int]] = {}
        for rank, place in sorted(self.places.items()):
            by_place.setdefault(place, []).append(rank)
        for place, ranks in by_place.items():
            verb = place if len(ranks) == 1 else _plural(place)
            parts.append(f"{ranks_phrase(ranks)} {verb}")
        if self.last_completed is not None:
            parts.append(f"the last collective completed was {self.last_completed}")
        if self.unknown:
            parts.append(f"{ranks_phrase(self.unknown)} sent no records")
        return "; ".join(parts)

    def lines(self) -> list[str]:
        """The headline, then one line per desync."""
        return [self.headline(), *(desync.describe() for desync in self.desyncs)]


def _plural(place: str) -> str:
    """``is at x.py:3`` -> ``are at x.py:3``; ``waits in ...`` -> ``wait in ...``."""
    if place.startswith("is "):
        return "are " + place.removeprefix("is ")
    if place.startswith("waits "):
        return "wait " + place.removeprefix("waits ")
    return place


def _members(
    name: str,
    records: Mapping[int, RankRecords],
    job_ranks: Sequence[int],
    default: bool,
) -> tuple[int, ...]:
    if default:
        return tuple(sorted(job_ranks))
    declared: set[int] = set()
    recorded: set[int] = set()
    for rank_records in records.values():
        for group in rank_records.groups.values():
            if group.name != name:
                continue
            recorded.add(rank_records.rank)
            if group.members is not None:
                declared.update(group.members)
    return tuple(sorted(declared or recorded))


def _group_verdict(
    key: GroupKey,
    records: Mapping[int, RankRecords],
    job_ranks: Sequence[int],
) -> tuple[GroupVerdict, list[Desync]]:
    name, backend = key
    own: dict[int, GroupRecords] = {}
    for rank, rank_records in records.items():
        group = rank_records.groups.get(key)
        if group is not None:
            own[rank] = group
    desc = next((group.desc for group in own.values() if group.desc), "")
    default = any(group.is_default for group in own.values())
    members = _members(name, records, job_ranks, default)
    unknown = tuple(rank for rank in members if rank not in records or records[rank].missing)
    known = [rank for rank in members if rank not in unknown]
    # A member with records but none of this group never entered any of its collectives.
    enq = {rank: own[rank].last_enqueued if rank in own else 0 for rank in known}
    comp = {rank: own[rank].last_completed if rank in own else 0 for rank in known}
    base = GroupVerdict(name, desc, backend, members, unknown=unknown)
    desyncs = _desyncs(base, own)
    pending = [rank for rank in known if enq[rank] > comp[rank]]
    if not pending:
        return base, desyncs
    seq = max(enq[rank] for rank in pending)
    waiting = tuple(rank for rank in known if enq[rank] >= seq > comp[rank])
    behind = tuple(rank for rank in known if enq[rank] < seq)
    op = next((own[rank].ops.get(seq) for rank in waiting if seq in own[rank].ops), None)
    verdict = GroupVerdict(name, desc, backend, members, seq, op, waiting, behind, unknown)
    return verdict, [Desync(verdict, d.seq, d.ops) for d in desyncs]


def _desyncs(group: GroupVerdict, own: Mapping[int, GroupRecords]) -> list[Desync]:
    seqs: Counter[int] = Counter()
    for records in own.values():
        seqs.update(records.ops.keys())
    found = []
    for seq in sorted(s for s, count in seqs.items() if count >= 2):
        ops = {rank: records.ops[seq] for rank, records in own.items() if seq in records.ops}
        if len({(op.op, op.sizes) for op in ops.values()}) > 1:
            found.append(Desync(group, seq, {rank: op.describe() for rank, op in ops.items()}))
    return found


def _weight(group: GroupVerdict) -> tuple[int, bool, bool, str]:
    return (len(group.waiting), bool(group.behind), group.is_default, group.name)


def _pick(groups: Sequence[GroupVerdict]) -> GroupVerdict | None:
    """The pending collective the most ranks wait in (ties: see the module docstring)."""
    if not groups:
        return None
    most = max(len(group.waiting) for group in groups)
    tied = [group for group in groups if len(group.waiting) == most]
    tied.sort(key=lambda g: (not g.behind, not g.is_default, _name_order(g.name)))
    return tied[0]


def _name_order(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if name.isdigit() else (1, name)


def _place(
    rank: int, chosen: GroupVerdict, groups: Sequence[GroupVerdict], stacks: Mapping[int, str]
) -> str:
    """Where a behind rank is: in another group's collective, else the line it is at."""
    for group in groups:
        if group is not chosen and rank in group.waiting:
            return f"waits in {group.collective()}"
    stack = stacks.get(rank)
    if stack and main_thread_frames(stack):
        place = describe_place(stack)
        return f"waits {place}" if place.startswith("in ") else f"is at {place}"
    return "never entered it"


def _idle_place(stack: str) -> str:
    """Where a rank with no collective pending is: ``is at train.py:5 in <module>``."""
    if not main_thread_frames(stack):
        return "has no Python stack"
    place = describe_place(stack)
    return f"waits {place}" if place.startswith("in ") else f"is at {place}"


def _last_completed(records: Mapping[int, RankRecords]) -> str | None:
    """The latest completed collective the records hold, as the headline names it."""
    latest = latest_completed(records)
    if latest is None:
        return None
    group, seq, op = latest
    where = "the default group" if group.is_default else f"group {group.name}"
    return f"{op.op} #{seq} on {where}"


def decide_verdict(
    records: Mapping[int, RankRecords],
    *,
    job_ranks: Sequence[int],
    stacks: Mapping[int, str],
) -> HangVerdict:
    """The verdict on a hang (see the module docstring).

    Args:
        records: Each rank's records (a rank missing here sent none).
        job_ranks: Every global rank of the job (the default group's members).
        stacks: Each rank's Python stack as faulthandler dumped it.
    """
    missing = {rank: r.missing for rank, r in records.items() if r.missing is not None}
    with_records = {rank: r for rank, r in records.items() if r.missing is None}
    if not with_records:
        return _from_stacks(records, job_ranks, stacks, missing)
    keys = sorted({key for r in with_records.values() for key in r.groups})
    verdicts: list[GroupVerdict] = []
    desyncs: list[Desync] = []
    for key in keys:
        verdict, found = _group_verdict(key, with_records, job_ranks)
        desyncs += found
        if verdict.seq is not None:
            verdicts.append(verdict)
    chosen = _pick(verdicts)
    unknown_everywhere = tuple(sorted(set(job_ranks) - set(with_records)))
    if chosen is None:
        return HangVerdict(
            SOURCE_RECORDS,
            unknown=unknown_everywhere,
            desyncs=tuple(desyncs),
            places={rank: _idle_place(stacks[rank]) for rank in sorted(stacks)},
            missing=missing,
            last_completed=_last_completed(with_records),
        )
    places = {rank: _place(rank, chosen, verdicts, stacks) for rank in chosen.behind}
    return HangVerdict(
        SOURCE_RECORDS,
        collective=chosen,
        waiting=chosen.waiting,
        behind=chosen.behind,
        unknown=chosen.unknown,
        groups=tuple(verdicts),
        desyncs=tuple(desyncs),
        places=places,
        missing=missing,
    )


def _from_stacks(
    records: Mapping[int, RankRecords],
    job_ranks: Sequence[int],
    stacks: Mapping[int, str],
    missing: Mapping[int, str],
) -> HangVerdict:
    """The fallback: no rank sent records; the odd ranks of the stacks are behind."""
    reasons: dict[str, list[int]] = {}
    for rank in sorted(set(job_ranks) | set(missing)):
        reason = missing.get(rank, "no records received")
        reasons.setdefault(reason, []).append(rank)
    why = "; ".join(f"{reason} on {ranks_phrase(ranks)}" for reason, ranks in reasons.items())
    groups = group_stacks(stacks)
    waiting: tuple[int, ...] = ()
    behind: tuple[int, ...] = ()
    places: dict[int, str] = {}
    if len(groups) > 1:
        main = max(groups, key=lambda g: (len(g[0]), _in_library(g[1]), -g[0][0]))
        waiting = tuple(main[0]) if _in_library(main[1]) else ()
        behind = tuple(
            sorted(rank for ranks, _ in groups if ranks is not main[0] for rank in ranks)
        )
        for rank in behind:
            place = describe_place(stacks[rank])
            places[rank] = f"waits {place}" if place.startswith("in ") else f"is at {place}"
    return HangVerdict(
        f"stacks only: {why}",
        waiting=waiting,
        behind=behind,
        unknown=tuple(sorted(set(job_ranks) - set(stacks))),
        places=places,
        missing=missing,
    )


def _in_library(stack: str) -> bool:
    frames = main_thread_frames(stack)
    return bool(frames) and frames[0].is_library
