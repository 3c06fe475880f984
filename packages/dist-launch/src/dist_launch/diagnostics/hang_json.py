"""``hang.json``: the hang verdict and every rank's stack and records, for tools (pure).

Written beside ``hang.txt`` in the attempt's log directory. Its keys (version 1; lists
of ranks are sorted global ranks, rank keys are strings)::

    {"version": 1, "reason": "...", "node": "host (node 0)", "attempt": 0,
     "time": "2026-01-01T12:00:00+00:00", "source": "flight recorder",
     "collect_s": 1.2,
     "collective": {"group": "default", "backend": "gloo", "seq": 6,
                    "op": "all_reduce", "sizes": [[4]], "members": [0, 1, 2, 3]},
     "waiting": [0, 1, 3], "behind": [2], "unknown": [],
     "desync": [{"group": "default", "seq": 2, "ops": {"0": "all_reduce [4]", ...}}],
     "groups": [{"group": "1", "backend": "gloo", "members": [1, 2], "seq": 1,
                 "op": "all_reduce", "waiting": [2], "behind": [1], "unknown": []}],
     "ranks": {"2": {"node": 0, "host": "h", "local_rank": 2,
                     "stack": ["/job/train.py:9 in <module>"],
                     "groups": {"default": {"backend": "gloo", "last_enqueued": 5,
                                            "last_completed": 5},
                                "1": {"backend": "gloo", "last_enqueued": 1,
                                      "last_completed": 0,
                                      "pending": {"seq": 1, "op": "all_reduce",
                                                  "sizes": [[4]]}}},
                     "records": null}},
     "unreachable": [{"node": 1, "host": "node1", "address": "10.0.0.2",
                      "ranks": [2, 3], "since": 1767268803.2, "seen_from": "node0"}]}

``unreachable`` lists the nodes the writing node could not reach (a cut cable, a dead
node) since ``since`` (Unix time); their ranks' ``records`` say ``node unreachable``
and they are not among ``unknown``, which keeps the reachable ranks that sent none.
``collective`` is null when no collective is pending anywhere or no rank sent records
(``source`` then says ``stacks only: <why>``); a rank's ``records`` is null when it
sent them, else why not. ``stack`` is the main thread's frames, most recent first,
without the launcher's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dist_launch.diagnostics.flight_records import GroupRecords, RankRecords
from dist_launch.diagnostics.stacks import main_thread_frames, without_launcher_frames
from dist_launch.diagnostics.verdict import GroupVerdict, HangVerdict

HANG_JSON_VERSION = 1


@dataclass(frozen=True)
class RankPlace:
    """Where a rank runs: its node's rank and host, and its local rank."""

    node: int
    host: str
    local_rank: int


def stack_frames(stack: str) -> list[str]:
    """The main thread's frames of a faulthandler dump: ``file:line in function``."""
    frames = main_thread_frames(without_launcher_frames(stack))
    return [f"{frame.file}:{frame.line} in {frame.function}" for frame in frames]


def _group_label(group: GroupRecords) -> str:
    return "default" if group.is_default else group.name


def _sizes(sizes: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    return [list(shape) for shape in sizes]


def _rank_groups(records: RankRecords) -> dict[str, Any]:
    groups: dict[str, Any] = {}
    for group in records.groups.values():
        entry: dict[str, Any] = {
            "backend": group.backend,
            "last_enqueued": group.last_enqueued,
            "last_completed": group.last_completed,
        }
        pending = group.ops.get(group.last_enqueued)
        if group.last_enqueued > group.last_completed and pending is not None:
            entry["pending"] = {
                "seq": group.last_enqueued,
                "op": pending.op,
                "sizes": _sizes(pending.sizes),
            }
        label = _group_label(group)
        # One group with two backends (cpu:gloo,cuda:nccl) has two counters.
        groups[label if label not in groups else f"{label} ({group.backend})"] = entry
    return groups


def _group(verdict: GroupVerdict) -> dict[str, Any]:
    op = verdict.op
    return {
        "group": verdict.label,
        "backend": verdict.backend,
        "members": list(verdict.members),
        "seq": verdict.seq,
        "op": None if op is None else op.op,
        "sizes": None if op is None else _sizes(op.sizes),
        "waiting": list(verdict.waiting),
        "behind": list(verdict.behind),
        "unknown": list(verdict.unknown),
    }


def hang_document(
    *,
    reason: str,
    node: str,
    attempt: int,
    time: str,
    verdict: HangVerdict,
    records: Mapping[int, RankRecords],
    stacks: Mapping[int, str],
    places: Mapping[int, RankPlace],
    collect_s: float | None = None,
    unreachable: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The contents of ``hang.json`` (see the module docstring).

    Args:
        reason: Why the group counts as hung.
        node: The node that wrote the file (``host (node 0)``).
        attempt: The attempt's number.
        time: When the hang was found (ISO 8601).
        verdict: The verdict.
        records: Each rank's records, on every node the verdict covers.
        stacks: Each rank's stack (faulthandler's dump).
        places: Each rank's node and local rank.
        collect_s: Seconds from the alarm to the records in hand.
        unreachable: The nodes this node could not reach (``node``, ``host``,
            ``address``, ``ranks``, ``since``, ``seen_from``).
    """
    cut_off = {int(rank) for node in unreachable for rank in node["ranks"]}
    collective = None
    if verdict.collective is not None:
        chosen = _group(verdict.collective)
        collective = {
            key: chosen[key] for key in ("group", "backend", "seq", "op", "sizes", "members")
        }
    ranks: dict[str, Any] = {}
    for rank in sorted(set(records) | set(stacks) | set(places)):
        place = places.get(rank)
        rank_records = records.get(rank)
        ranks[str(rank)] = {
            "node": None if place is None else place.node,
            "host": None if place is None else place.host,
            "local_rank": None if place is None else place.local_rank,
            "stack": stack_frames(stacks.get(rank, "")),
            "groups": {} if rank_records is None else _rank_groups(rank_records),
            "records": (
                ("node unreachable" if rank in cut_off else "no records received")
                if rank_records is None
                else rank_records.missing
            ),
        }
    return {
        "version": HANG_JSON_VERSION,
        "reason": reason,
        "node": node,
        "attempt": attempt,
        "time": time,
        "source": verdict.source,
        "collect_s": None if collect_s is None else round(collect_s, 3),
        "collective": collective,
        "waiting": list(verdict.waiting),
        "behind": list(verdict.behind),
        "unknown": [rank for rank in verdict.unknown if rank not in cut_off],
        "desync": [
            {
                "group": desync.group.label,
                "seq": desync.seq,
                "ops": {str(rank): op for rank, op in sorted(desync.ops.items())},
            }
            for desync in verdict.desyncs
        ],
        "groups": [_group(group) for group in verdict.groups],
        "ranks": ranks,
        "unreachable": [dict(node) for node in unreachable],
    }
