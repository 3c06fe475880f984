"""The Manager's decisions as pure functions: the vote, reuse, healing, the watcher's verdicts.

No processes and no store: each test hands a decider what the executor would have read.
"""

from __future__ import annotations

from datetime import timedelta

import pytest

from dist_collectives.ft import ReplicaError
from dist_collectives.ft import manager_decisions as decide
from dist_collectives.ft.coordination.coordinator import Verdict, proposed_verdict
from dist_collectives.ft.coordination.quorum import Quorum, group_step, watched_group_ranks
from dist_collectives.ft.coordination.store_coordinator import (
    Keys,
    decode_verdict,
    encode_verdict,
)

TIMEOUT = timedelta(seconds=60)


def _quorum(
    steps: tuple[int, ...],
    *,
    quorum_id: int = 3,
    registry_version: int = 7,
    init_sync: bool = False,
) -> Quorum:
    members = tuple(f"r{i}" for i in range(len(steps)))
    return Quorum(
        round=5,
        quorum_id=quorum_id,
        members=members,
        steps=steps,
        registry_version=registry_version,
        init_sync=init_sync,
    )


# -- the commit vote ----------------------------------------------------------------------


def test_keys_of_a_step_name_its_quorum_and_step() -> None:
    quorum = _quorum((4, 4))
    assert Keys.commit(quorum) == "commit/3/4"
    assert Keys.votes(quorum) == "votes/3/4"
    assert Keys.error(quorum) == "err/3"


SAME = Verdict(committed=True, reuse_quorum=True)
FULL = Verdict(committed=True, reuse_quorum=False)


@pytest.mark.parametrize("votes", [1, 2])
def test_only_the_last_voter_proposes_a_decision(votes: int) -> None:
    quorum = _quorum((4, 4, 4))
    assert proposed_verdict(votes, quorum, group_world_size=1, registry_version=7) is None
    assert proposed_verdict(3, quorum, group_world_size=1, registry_version=7) is not None


def test_every_rank_of_every_group_votes_before_the_decision() -> None:
    quorum = _quorum((4, 4))
    assert proposed_verdict(3, quorum, group_world_size=2, registry_version=7) is None
    assert proposed_verdict(4, quorum, group_world_size=2, registry_version=7) == SAME


def test_the_last_voter_keeps_the_quorum_when_nobody_announced_itself() -> None:
    quorum = _quorum((4, 4), registry_version=7)
    assert proposed_verdict(2, quorum, group_world_size=1, registry_version=7) == SAME
    # The watcher may not have read the registry since the quorum was decided.
    assert proposed_verdict(2, quorum, group_world_size=1, registry_version=0) == SAME


def test_the_last_voter_asks_for_a_round_when_a_replica_announced_itself() -> None:
    quorum = _quorum((4, 4), registry_version=7)
    assert proposed_verdict(2, quorum, group_world_size=1, registry_version=8) == FULL


@pytest.mark.parametrize("verdict", [SAME, FULL, Verdict(committed=False)])
def test_a_stored_verdict_reads_back_as_written(verdict: Verdict) -> None:
    raw = encode_verdict(verdict)
    assert decode_verdict(raw.encode()) == verdict
    assert not raw.startswith(("ok", "fail"))  # a JSON record, not a prefix code


# -- the next step's quorum -----------------------------------------------------------------


def test_a_reused_quorum_is_the_last_one_step_on() -> None:
    last = _quorum((3, 4))
    quorum = decide.reused_quorum(last, reuse=True, group_broken=False)
    assert quorum is not None
    assert quorum.members == last.members and quorum.quorum_id == last.quorum_id
    assert quorum.steps == (5, 5)


@pytest.mark.parametrize(
    ("has_last", "reuse", "broken"),
    [(True, False, False), (True, True, True), (False, True, False)],
)
def test_a_round_decides_without_reuse_a_last_quorum_or_with_a_broken_group(
    has_last: bool, reuse: bool, broken: bool
) -> None:
    last = _quorum((4, 4)) if has_last else None
    assert decide.reused_quorum(last, reuse=reuse, group_broken=broken) is None


# -- who heals from whom --------------------------------------------------------------------


def test_a_replica_behind_receives_from_a_participant_and_sends_nothing() -> None:
    quorum = _quorum((5, 3, 5, 0))
    assert decide.heal_plan(quorum, "r1") == decide.HealPlan(receive_from=0, send_to=())
    assert decide.heal_plan(quorum, "r3") == decide.HealPlan(receive_from=2, send_to=())


def test_a_participant_sends_to_the_replicas_it_heals() -> None:
    quorum = _quorum((5, 3, 5, 0))
    assert decide.heal_plan(quorum, "r0") == decide.HealPlan(receive_from=None, send_to=(1,))
    assert decide.heal_plan(quorum, "r2") == decide.HealPlan(receive_from=None, send_to=(3,))


def test_the_first_member_sends_its_first_state_to_every_other_under_init_sync() -> None:
    quorum = _quorum((0, 0, 0), init_sync=True)
    assert decide.heal_plan(quorum, "r0") == decide.HealPlan(receive_from=None, send_to=(1, 2))
    assert decide.heal_plan(quorum, "r2") == decide.HealPlan(receive_from=0, send_to=())


def test_nobody_heals_in_a_quorum_of_equals() -> None:
    quorum = _quorum((4, 4))
    assert (
        decide.heal_plan(quorum, "r0")
        == decide.heal_plan(quorum, "r1")
        == decide.HealPlan(None, ())
    )


# -- the watcher's verdicts -------------------------------------------------------------------


def test_an_allreduce_still_running_past_its_deadline_fails_the_step() -> None:
    error = decide.overdue_error(
        11.0,
        allreduce_deadline=10.0,
        allreduce_unfinished=True,
        vote_deadline=None,
        timeout=TIMEOUT,
    )
    assert isinstance(error, TimeoutError) and "allreduce" in str(error)


@pytest.mark.parametrize(("now", "unfinished"), [(9.0, True), (11.0, False)])
def test_allreduces_within_their_deadline_or_all_done_fail_nothing(
    now: float, unfinished: bool
) -> None:
    assert (
        decide.overdue_error(
            now,
            allreduce_deadline=10.0,
            allreduce_unfinished=unfinished,
            vote_deadline=None,
            timeout=TIMEOUT,
        )
        is None
    )


def test_a_vote_past_its_deadline_fails_the_step() -> None:
    error = decide.overdue_error(
        11.0,
        allreduce_deadline=None,
        allreduce_unfinished=False,
        vote_deadline=10.0,
        timeout=TIMEOUT,
    )
    assert isinstance(error, TimeoutError) and "commit decision" in str(error)
    assert (
        decide.overdue_error(
            9.0,
            allreduce_deadline=None,
            allreduce_unfinished=False,
            vote_deadline=10.0,
            timeout=TIMEOUT,
        )
        is None
    )


def test_members_lost_are_those_not_alive_but_never_this_replica() -> None:
    quorum = _quorum((4, 4, 4))
    assert decide.lost_members(quorum, {"r1"}, "r0") == ["r2"]
    assert decide.lost_members(quorum, {"r0", "r1", "r2", "r9"}, "r0") == []


def test_a_lost_member_fails_a_step_that_is_not_committed() -> None:
    for decision in (None, Verdict(committed=False)):
        error = decide.lost_member_error(["r2"], decision)
        assert isinstance(error, ReplicaError) and "['r2']" in str(error)


def test_a_member_that_left_after_the_commit_does_not_fail_the_step() -> None:
    assert decide.lost_member_error(["r2"], FULL) is None
    assert decide.lost_member_error([], None) is None


# -- replica groups ---------------------------------------------------------------------------


def test_group_rank_0_watches_every_other_rank_and_the_others_watch_rank_0() -> None:
    assert list(watched_group_ranks(0, 4)) == [1, 2, 3]
    assert list(watched_group_ranks(2, 4)) == [0]
    assert list(watched_group_ranks(0, 1)) == []


def test_a_broken_group_message_names_the_group_and_its_stale_ranks() -> None:
    message = decide.broken_group_message("g1", [2, 3])
    assert message.startswith("replica group g1: group ranks [2, 3] stopped beating")


def test_rank_i_of_each_replica_group_forms_a_group_of_its_own() -> None:
    base = "h:1/ns"
    assert decide.group_address(base, 4, group_rank=0, group_world_size=1) == "h:1/ns/pg/4"
    assert decide.group_address(base, 4, group_rank=1, group_world_size=2) == "h:1/ns/pg/4/1"


# -- recovery and its log -------------------------------------------------------------------


def test_the_membership_change_names_who_left_and_who_joined() -> None:
    assert decide.membership_change((), ("a", "b")) == ""
    assert decide.membership_change(("a", "b", "c"), ("a", "b")) == ", without c"
    assert decide.membership_change(("a", "b"), ("a", "b", "d")) == ", joined by d"
    assert decide.membership_change(("a", "c"), ("a", "d")) == ", without c, joined by d"
    assert decide.membership_change(("a",), ("a",)) == ""


def _failure(generation: int) -> decide.Failure:
    return decide.Failure(seen_at=1.0, step=15, members=("r0", "r1", "r3"), generation=generation)


def test_the_first_commit_of_a_later_step_ends_the_recovery() -> None:
    assert decide.recovered_failure(_failure(4), committed=True, generation=5)


def test_a_failure_after_every_vote_of_a_committed_step_waits_for_the_next_commit() -> None:
    assert not decide.recovered_failure(_failure(5), committed=True, generation=5)


def test_no_recovery_without_a_commit_or_a_failure() -> None:
    assert not decide.recovered_failure(_failure(4), committed=False, generation=5)
    assert not decide.recovered_failure(None, committed=True, generation=5)


def test_the_replicas_lost_since_a_failure_are_those_the_new_quorum_lacks() -> None:
    quorum = _quorum((15, 15))  # r0, r1
    assert decide.lost_since(_failure(4), quorum) == ["r3"]


def test_a_cause_is_the_first_line_without_gloos_source_location() -> None:
    error = RuntimeError("[/src/gloo/transport/tcp/pair.cc:537] Read error: reset\nmore lines")
    assert decide.failure_cause(error) == "RuntimeError: Read error: reset"


def test_a_long_cause_is_cut_to_a_bounded_length() -> None:
    cause = decide.failure_cause(ValueError("x" * 1000))
    assert len(cause) == decide.CAUSE_CHARS and cause.endswith("...")
    assert decide.failure_cause(KeyError()) == "KeyError: "


@pytest.mark.parametrize(("own", "others", "step"), [(7, [7], 7), (7, [0], 0), (3, [5, 4], 3)])
def test_a_group_asks_with_the_oldest_step_any_of_its_ranks_holds(
    own: int, others: list[int], step: int
) -> None:
    assert group_step(own, others) == step
