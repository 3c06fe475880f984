"""A round's failure records and the restart count, shared by the nodes through a store.

Each node that saw its round fail writes its :class:`~dist_launch.rendezvous.protocol.
FailureRecord` under ``dist_launch/failure/<node>`` in the round's store; the first to
report counts the round once in the job's restart counter and writes the new total
under ``dist_launch/counted``, which the others read. A node whose record is a
consequence (its ranks only lost a peer) waits, bounded, for another node's record of
the cause, so that every node names the same first failure. Used by the c10d (and so
etcd) and the multi-node static rendezvous.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from datetime import timedelta

from dist_launch.rendezvous.protocol import FailureCount, FailureRecord
from dist_launch.rendezvous.store_deadline import RendezvousStore

# How often the wait for the cause reads the round's records.
CAUSE_POLL_SECONDS = 0.1


def round_failures(store: RendezvousStore, nodes: int) -> list[FailureRecord]:
    """The failure records of a round of ``nodes`` nodes: causes first, then earliest.

    A record the store cannot give (silent, or gone) is left out.
    """
    records: list[FailureRecord] = []
    for node in range(nodes):
        key = f"dist_launch/failure/{node}"
        with contextlib.suppress(Exception):
            if store.check([key]):
                records.append(FailureRecord(**json.loads(store.get(key))))
    return sorted(records, key=lambda r: r.precedence)


def count_round_failure(
    record: FailureRecord,
    round_store: RendezvousStore,
    count: tuple[RendezvousStore, str],
    nodes: int,
    waits: tuple[float, float],
    gone: Callable[[], set[int]] | None = None,
) -> FailureCount:
    """Shares ``record`` and counts the round once, job-wide.

    Args:
        record: This node's record of the round.
        round_store: The round's store (every call bounded by the caller's wrapper).
        count: The store holding the job's restart counter, and the counter's key.
        nodes: The round's node count.
        waits: How long a second reporter waits for the first's total (torch's
            ``read_timeout``), and how long a consequence waits for a cause.
        gone: The nodes known dead (their launchers stopped beating), if the store
            tells: a consequence stops waiting for the cause once every node that has
            not reported is among them (a dead node reports nothing).

    Raises:
        StoreDeadlineError: The store did not answer a call in time.
        Exception: torch's store errors (the store's node is gone).
    """
    job_store, restarts_key = count
    read_timeout, cause_wait = waits
    round_store.set(f"dist_launch/failure/{record.group_rank}", json.dumps(record.__dict__))
    if int(round_store.add("dist_launch/failed", 1)) == 1:
        total = int(job_store.add(restarts_key, 1))
        round_store.set("dist_launch/counted", str(total))
    else:
        # Another node counts this round: its total once it has written it (reading
        # the job's counter here could come before that node's increment).
        round_store.wait(["dist_launch/counted"], timedelta(seconds=read_timeout))
        total = int(round_store.get("dist_launch/counted"))
    if record.consequence:
        first = _wait_for_cause(round_store, nodes, cause_wait, gone)
    else:
        first = round_failures(round_store, nodes)
    named = first[0] if first else record
    return FailureCount(total, "job", named.describe(), named.kind)


def _wait_for_cause(
    store: RendezvousStore, nodes: int, seconds: float, gone: Callable[[], set[int]] | None
) -> list[FailureRecord]:
    """The round's records once one names a cause or every other node reported or died.

    Bounded by ``seconds``.
    """
    deadline = time.monotonic() + seconds
    while True:
        records = round_failures(store, nodes)
        silent = set(range(nodes)) - {r.group_rank for r in records}
        if (
            any(not r.consequence for r in records)
            or not silent
            or time.monotonic() >= deadline
            or (gone is not None and silent <= gone())
        ):
            return records
        time.sleep(CAUSE_POLL_SECONDS)
