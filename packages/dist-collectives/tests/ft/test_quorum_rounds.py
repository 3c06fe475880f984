"""Quorum rounds on one in-process store: replicas as threads, no process, no network.

The round protocol (``dist_collectives.ft.quorum``) run for real, each replica a thread
with its own view of who is alive, on a ``HashStore`` all of them share.
"""

from __future__ import annotations

import concurrent.futures
from datetime import timedelta

import pytest
import torch.distributed as dist

from dist_collectives.ft.coordination.coordinator import Verdict, proposed_verdict
from dist_collectives.ft.quorum import (
    REGISTRY_VERSION_KEY,
    Liveness,
    Quorum,
    QuorumTimeoutError,
    compute_quorum,
)

HEARTBEAT_TIMEOUT = timedelta(seconds=60)  # nobody stops beating in these tests
WAIT = 30.0  # the bound on every wait for a thread's round


def _join(
    store: dist.Store,
    replica: str,
    step: int,
    *,
    join_timeout: timedelta = timedelta(seconds=30),
    timeout: timedelta = timedelta(seconds=20),
    previous: Quorum | None = None,
) -> Quorum:
    return compute_quorum(
        store,
        replica,
        step,
        liveness=Liveness(store, HEARTBEAT_TIMEOUT),
        min_replicas=2,
        join_timeout=join_timeout,
        timeout=timeout,
        previous=previous,
        tick=0.01,
    )


def test_a_replica_joining_after_its_round_closed_without_it_makes_the_members_hold_one() -> None:
    """The members reuse their quorum only while nobody waits to join it.

    ``c`` announces itself (as its Manager does when built) before the members' round
    closes, but asks to join only after the round closed without it on the join
    timeout (a slow start on a loaded machine). The members' next commit must not let
    them reuse the quorum: ``c`` would wait in a round nobody else joins, for ever.
    """
    store = dist.HashStore()
    for replica in ("a", "b", "c"):
        Liveness(store, HEARTBEAT_TIMEOUT).announce(replica)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = [pool.submit(_join, store, r, 0, join_timeout=timedelta(seconds=0.2)) for r in "ab"]
        quorum = first[0].result(timeout=WAIT)
        assert first[1].result(timeout=WAIT) == quorum
        assert quorum.members == ("a", "b")

        with pytest.raises(QuorumTimeoutError):  # alone in the next round: too few to close
            _join(store, "c", 0, timeout=timedelta(seconds=0.3))
        version = int(store.add(REGISTRY_VERSION_KEY, 0))
        members_commit = proposed_verdict(2, quorum, group_world_size=1, registry_version=version)
        assert members_commit == Verdict(committed=True, reuse_quorum=False), (
            "the members would reuse a quorum c waits to join"
        )

        second = [pool.submit(_join, store, "c", 0)]
        second += [pool.submit(_join, store, r, 1, previous=quorum) for r in "ab"]
        decisions = {future.result(timeout=WAIT) for future in second}
    assert len(decisions) == 1
    (joined,) = decisions
    assert joined.members == ("a", "b", "c")
    assert joined.is_behind("c")
