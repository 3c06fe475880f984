"""The quorum's decisions as pure functions of one stored decision: no processes."""

from __future__ import annotations

import pytest

from dist_collectives.ft.quorum import Quorum


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
