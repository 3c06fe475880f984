"""The quorum's decisions as pure functions: healing, liveness, membership; no processes."""

from __future__ import annotations

import pytest

from dist_collectives.ft.quorum import (
    HeartbeatClock,
    Quorum,
    is_alive,
    is_stale,
    keeps_quorum_id,
    proposed_members,
    round_is_due,
)


def _quorum(steps: tuple[int, ...], *, init_sync: bool) -> Quorum:
    members = tuple(f"r{i}" for i in range(len(steps)))
    return Quorum(round=0, quorum_id=0, members=members, steps=steps, init_sync=init_sync)


def test_first_step_under_init_sync_copies_the_first_members_state_to_every_other() -> None:
    quorum = _quorum((0, 0, 0), init_sync=True)
    assert quorum.syncs_first_state
    assert quorum.receivers == ("r1", "r2")
    assert [quorum.heal_source(m) for m in quorum.receivers] == ["r0", "r0"]
    assert quorum.healers_of("r0") == ["r1", "r2"] and quorum.healers_of("r1") == []
    # They copy before they compute, so all of them take part in the step.
    assert quorum.participants == ("r0", "r1", "r2")
    assert not any(quorum.is_behind(m) for m in quorum.members)


@pytest.mark.parametrize(("steps", "init_sync"), [((0, 0, 0), False), ((4, 4), True), ((0,), True)])
def test_no_copy_without_init_sync_after_the_first_commit_or_alone(
    steps: tuple[int, ...], init_sync: bool
) -> None:
    quorum = _quorum(steps, init_sync=init_sync)
    assert not quorum.syncs_first_state
    assert quorum.receivers == ()
    assert quorum.participants == quorum.members


def test_a_member_behind_heals_from_a_participant_and_does_not_take_part() -> None:
    quorum = _quorum((5, 3, 5, 0), init_sync=True)
    assert quorum.receivers == ("r1", "r3")
    assert quorum.participants == ("r0", "r2")
    assert [quorum.is_behind(m) for m in quorum.members] == [False, True, False, True]
    assert quorum.heal_source("r1") == "r0" and quorum.heal_source("r3") == "r2"
    assert quorum.healers_of("r0") == ["r1"] and quorum.healers_of("r2") == ["r3"]


def test_the_next_step_of_a_first_quorum_copies_nothing() -> None:
    first = _quorum((0, 0), init_sync=True)
    assert first.syncs_first_state and not first.next_step().syncs_first_state


def test_init_sync_survives_the_store_and_old_decisions_read_as_off() -> None:
    quorum = _quorum((0, 0), init_sync=True)
    assert Quorum.from_json(quorum.to_json()) == quorum
    old = '{"round": 1, "quorum_id": 1, "members": ["a", "b"], "steps": [0, 0]}'
    assert not Quorum.from_json(old).init_sync


# -- liveness from heartbeats -----------------------------------------------------------------


def test_a_heartbeat_counter_is_quiet_only_from_the_time_it_stopped_moving() -> None:
    clock = HeartbeatClock()
    assert clock.quiet_for("hb/a", b"1", now=10.0) is None  # first seen: it just moved
    assert clock.quiet_for("hb/a", b"1", now=11.5) == 1.5
    assert clock.quiet_for("hb/a", b"2", now=12.0) is None  # moved: the quiet time restarts
    assert clock.quiet_for("hb/a", b"2", now=12.25) == 0.25
    assert clock.quiet_for("hb/b", b"2", now=13.0) is None  # each counter on its own


@pytest.mark.parametrize(
    ("quiet", "left", "alive"),
    [(None, False, True), (1.9, False, True), (2.0, False, False), (None, True, False)],
)
def test_a_replica_is_alive_while_its_counter_moves_within_the_timeout_and_it_did_not_leave(
    quiet: float | None, left: bool, alive: bool
) -> None:
    assert is_alive(quiet, left=left, timeout=2.0) is alive


@pytest.mark.parametrize(
    ("quiet", "counter", "stale"),
    [(5.0, 0, False), (None, 3, False), (1.9, 3, False), (2.0, 3, True)],
)
def test_a_group_rank_is_stale_once_it_beat_and_then_stood_still_for_the_timeout(
    quiet: float | None, counter: int, stale: bool
) -> None:
    assert is_stale(quiet, counter=counter, timeout=2.0) is stale


# -- quorum membership ------------------------------------------------------------------------


def _due(
    *,
    members: frozenset[str] = frozenset({"a", "b"}),
    alive: frozenset[str] = frozenset({"a", "b"}),
    min_replicas: int = 1,
    waited: float = 0.5,
    settled_for: float = 5.0,
    window: float = 0.0,
) -> bool:
    return round_is_due(
        members=members,
        alive=alive,
        min_replicas=min_replicas,
        waited=waited,
        join_timeout=10.0,
        settled_for=settled_for,
        window=window,
    )


def test_a_round_closes_once_every_live_replica_joined() -> None:
    assert _due()
    assert not _due(alive=frozenset({"a", "b", "c"}))


def test_a_round_closes_without_a_live_replica_that_did_not_join_in_time() -> None:
    assert _due(alive=frozenset({"a", "b", "c"}), waited=10.5)


def test_a_replica_that_stopped_beating_is_not_waited_for() -> None:
    assert _due(members=frozenset({"a"}), alive=frozenset({"a"}))


def test_a_round_never_closes_with_fewer_than_the_minimum_of_members() -> None:
    assert not _due(min_replicas=3)
    assert not _due(min_replicas=3, waited=60.0)


def test_the_first_round_waits_until_no_replica_announced_itself_for_its_window() -> None:
    assert not _due(window=2.0, settled_for=1.0)
    assert _due(window=2.0, settled_for=2.0)
    assert _due(window=2.0, settled_for=1.0, waited=10.5)  # but not past the join timeout


def test_members_are_ranked_by_name_with_their_steps() -> None:
    assert proposed_members({"b": 3, "a": 5, "c": 0}) == (("a", "b", "c"), (5, 3, 0))


def test_the_same_members_at_one_step_keep_the_quorum_id() -> None:
    previous = _quorum((4, 4), init_sync=False)  # members r0, r1
    assert keeps_quorum_id(previous, ("r0", "r1"), (5, 5))


@pytest.mark.parametrize(
    ("members", "steps"),
    [(("r0",), (5,)), (("r0", "r1", "r2"), (5, 5, 5)), (("r0", "r1"), (5, 0))],
)
def test_a_member_lost_joined_or_behind_gets_a_new_quorum_id(
    members: tuple[str, ...], steps: tuple[int, ...]
) -> None:
    assert not keeps_quorum_id(_quorum((4, 4), init_sync=False), members, steps)


def test_a_reconfiguration_uuid_is_the_same_for_one_address_and_differs_between_addresses() -> None:
    from dist_collectives.ft.reconfigurable import configuration_uuid

    first = configuration_uuid("127.0.0.1:29500/ft/pg/1")
    assert first == configuration_uuid("127.0.0.1:29500/ft/pg/1"), "every member agrees"
    uuids = {configuration_uuid(f"127.0.0.1:29500/ft/pg/{quorum}") for quorum in range(1000)}
    assert len(uuids) == 1000, "a new prefix gives a new uuid"
    assert all(0 <= uuid < 2**63 for uuid in uuids)
