"""Quorum ids: the integer of torchft 0.2 and the UUID of torchft 0.3, new together."""

from __future__ import annotations

import concurrent.futures
import uuid
from datetime import timedelta

import torch.distributed as dist

from dist_collectives.ft.coordination.quorum import Liveness, Quorum, compute_quorum
from dist_collectives.ft.replica.manager_decisions import Configure, quorum_actions

HEARTBEAT_TIMEOUT = timedelta(seconds=60)
WAIT = 30.0


def _round(store: dist.Store, names: str, step: int, previous: Quorum | None) -> Quorum:
    def join(name: str) -> Quorum:
        return compute_quorum(
            store,
            name,
            step,
            liveness=Liveness(store, HEARTBEAT_TIMEOUT),
            min_replicas=len(names),
            join_timeout=timedelta(seconds=20),
            timeout=timedelta(seconds=WAIT / 2),
            previous=previous,
            tick=0.02,
        )

    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        decided = set(pool.map(join, names, timeout=WAIT))
    assert len(decided) == 1, "the members read different decisions"
    return decided.pop()


def test_a_quorum_keeps_its_uuid_with_its_id_and_gets_a_new_one_with_a_new_id() -> None:
    store = dist.HashStore()
    for name in "ab":
        Liveness(store, HEARTBEAT_TIMEOUT).announce(name)
    first = _round(store, "ab", 0, None)
    assert str(uuid.UUID(first.quorum_uuid)) == first.quorum_uuid
    assert isinstance(first.quorum_id, int), "torchft 0.2's integer id stays"
    same = _round(store, "ab", 1, first.next_step())
    assert (same.quorum_id, same.quorum_uuid) == (first.quorum_id, first.quorum_uuid)
    Liveness(store, HEARTBEAT_TIMEOUT).announce("c")
    grown = _round(store, "abc", 1, same)
    assert grown.quorum_id == same.quorum_id + 1
    assert grown.quorum_uuid != same.quorum_uuid
    assert Quorum.from_json(grown.to_json()) == grown


def test_the_group_of_a_quorum_of_single_processes_is_named_from_its_uuid() -> None:
    quorum = Quorum(
        round=3, quorum_id=2, members=("a", "b"), steps=(5, 5), quorum_uuid=str(uuid.uuid4())
    )
    assert quorum.communicator_uuid == uuid.UUID(quorum.quorum_uuid).int & ((1 << 63) - 1)
    (single,) = quorum_actions(
        quorum, "b", configured_id=1, store_address="h:1/ns", group_rank=0, group_world_size=1
    )
    assert single == Configure(2, "h:1/ns/pg/2", 1, 2, quorum.communicator_uuid)
    (grouped,) = quorum_actions(
        quorum, "b", configured_id=1, store_address="h:1/ns", group_rank=1, group_world_size=2
    )
    assert grouped.communicator_uuid is None, "the groups of rank i would share one prefix"
    old = Quorum.from_json('{"round": 0, "quorum_id": 0, "members": ["a"], "steps": [0]}')
    assert (old.quorum_uuid, old.communicator_uuid) == ("", None)
