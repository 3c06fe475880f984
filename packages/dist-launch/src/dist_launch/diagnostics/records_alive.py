"""Do a suspected group's records show it alive? The records' last word before an alarm (pure).

A group is suspected hung when no rank showed progress for ``--hang-timeout``
(:mod:`dist_launch.watch.quiet_watch`). Before anything is signalled the round reads
every rank's flight records (:mod:`dist_launch.diagnostics.flight_records`); they
show the group alive when

- every rank sent records (a rank without them may be the stuck one),
- no rank has a collective pending in any group (enqueued and not completed), and
- the latest collective any rank completed was enqueued within the timeout (gloo
  records no completion time: the enqueue time is a lower bound on it).

Then the quiet interval was the sampler's miss, not a hang: the watch goes on from the
time of that collective. Anything else (a collective pending, ranks stuck for longer
than the timeout outside collectives, records missing) leaves the alarm standing and
the verdict (:mod:`dist_launch.diagnostics.verdict`) says which.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from dist_launch.diagnostics.flight_records import GroupRecords, Op, RankRecords


def latest_completed(
    records: Mapping[int, RankRecords],
) -> tuple[GroupRecords, int, Op] | None:
    """The latest collective any rank completed: its group, sequence number and op.

    "Latest" by when it was enqueued (wall clock); None when no rank's recorder still
    holds a completed collective.
    """
    latest: tuple[GroupRecords, int, Op] | None = None
    for rank_records in records.values():
        for group in rank_records.groups.values():
            op = group.ops.get(group.last_completed)
            if op is not None and (latest is None or op.created_ns > latest[2].created_ns):
                latest = (group, group.last_completed, op)
    return latest


def alive_at(
    records: Mapping[int, RankRecords],
    *,
    ranks: Collection[int],
    now_ns: int,
    within_s: float,
) -> int | None:
    """When the records show the ranks last alive, if they show them alive (see above).

    Args:
        records: Each rank's records, as collected for the suspicion.
        ranks: The ranks the suspicion is about (this node's).
        now_ns: The wall clock now, in ns.
        within_s: The hang timeout in seconds.

    Returns:
        The latest completed collective's enqueue time (wall clock, ns), or None when
        the records leave the suspicion standing.
    """
    own = {rank: records.get(rank) for rank in ranks}
    if not own or any(r is None or r.missing is not None for r in own.values()):
        return None
    present = {rank: r for rank, r in own.items() if r is not None}
    for rank_records in present.values():
        for group in rank_records.groups.values():
            if group.last_enqueued > group.last_completed:
                return None
    latest = latest_completed(present)
    if latest is None or now_ns - latest[2].created_ns > within_s * 1e9:
        return None
    return latest[2].created_ns
