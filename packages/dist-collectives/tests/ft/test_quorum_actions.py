"""What the quorum worker does once a quorum is decided, and which requests it drops."""

from __future__ import annotations

from dist_collectives.ft.manager_decisions import (
    Configure,
    ReceiveState,
    SendState,
    describe_action,
    quorum_actions,
    request_is_stale,
)
from dist_collectives.ft.quorum import Quorum, kept_a_failed_quorum

STORE = "127.0.0.1:29500/ns"


def _quorum(quorum_id: int, steps: tuple[int, ...]) -> Quorum:
    members = tuple(f"r{i}" for i in range(len(steps)))
    return Quorum(round=3, quorum_id=quorum_id, members=members, steps=steps)


def _actions(quorum: Quorum, replica: str, configured: int | None, **group: int) -> tuple:
    return quorum_actions(
        quorum,
        replica,
        configured_id=configured,
        store_address=STORE,
        group_rank=group.get("group_rank", 0),
        group_world_size=group.get("group_world_size", 1),
    )


def test_a_new_quorum_id_configures_before_it_heals() -> None:
    quorum = _quorum(7, (5, 5, 3))
    assert _actions(quorum, "r2", configured=6) == (
        Configure(7, f"{STORE}/pg/7", 2, 3),
        ReceiveState(0),
    )
    sender = _actions(quorum, "r0", configured=6)
    assert sender == (Configure(7, f"{STORE}/pg/7", 0, 3), SendState((2,)))


def test_a_kept_quorum_id_configures_nothing_and_a_group_rank_has_its_own_address() -> None:
    assert _actions(_quorum(7, (5, 5)), "r1", configured=7) == ()
    grouped = _actions(_quorum(8, (5, 5)), "r1", configured=7, group_rank=1, group_world_size=2)
    assert grouped == (Configure(8, f"{STORE}/pg/8/1", 1, 2),)


def test_a_superseded_request_is_dropped_and_the_current_one_served() -> None:
    assert request_is_stale(4, 5)
    assert not request_is_stale(5, 5)


def test_a_stuck_action_is_named_for_the_timeout_message() -> None:
    assert describe_action(Configure(7, f"{STORE}/pg/7", 2, 3)) == (
        f"configuring the group for quorum 7 (rank 2 of 3 on {STORE}/pg/7)"
    )
    assert describe_action(ReceiveState(0)) == "receiving a state from rank 0"
    assert describe_action(SendState((1, 2))) == "sending its state to ranks [1, 2]"


def test_a_kept_quorum_id_of_a_failed_step_is_refused() -> None:
    assert kept_a_failed_quorum(_quorum(7, (5, 5)), failed_quorum_id=7)
    assert not kept_a_failed_quorum(_quorum(8, (5, 5)), failed_quorum_id=7)
    assert not kept_a_failed_quorum(_quorum(7, (5, 5)), failed_quorum_id=None)
