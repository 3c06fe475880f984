"""The Manager's shared state: each transition its threads make, without threads or a store."""

from __future__ import annotations

from dist_collectives.ft.dummy import ProcessGroupDummy
from dist_collectives.ft.generation import Generation
from dist_collectives.ft.manager_futures import BufferPool, WrappedFutures
from dist_collectives.ft.manager_state import StepState
from dist_collectives.ft.quorum import Quorum


def _quorum(step: int = 4, quorum_id: int = 1) -> Quorum:
    return Quorum(round=0, quorum_id=quorum_id, members=("a", "b"), steps=(step, step))


def _generation(number: int) -> Generation:
    return Generation(
        number,
        ProcessGroupDummy(0, 1),
        BufferPool(),
        on_error=lambda error: None,
        swallowed_error=lambda: None,
        copy_wait=1.0,
    )


def _started(state: StepState, quorum: Quorum | None = None) -> int:
    generation, _ = state.begin_step(reuse=False, open_generation=_generation)
    if quorum is not None:
        assert state.adopt_quorum(quorum, generation)
    return generation


def test_the_first_error_of_a_step_wins_and_hands_over_its_generation() -> None:
    state = StepState()
    generation = _started(state, _quorum())
    current = state.current()
    assert current is not None and current.number == generation
    failed = state.fail(RuntimeError("first"), generation)
    assert failed is not None and failed.generation is current and failed.step == 4
    assert state.failed_quorum_id == 1, "the group of a failed step is never used again"
    assert state.fail(RuntimeError("second"), None) is None
    assert str(state.error) == "first" and state.error_wall_time is not None


def test_a_late_failure_of_an_earlier_step_is_dropped() -> None:
    state = StepState()
    old = _started(state)
    _started(state)
    assert state.fail(RuntimeError("late"), old) is None
    assert state.error is None


def test_a_new_step_forgets_the_last_ones_error_quorum_and_generation() -> None:
    state = StepState()
    generation = _started(state, _quorum())
    old = state.current()
    state.fail(RuntimeError("x"), generation)
    assert _started(state) == generation + 1
    current = state.current()
    assert state.error is None and state.quorum is None
    assert current is not None and current is not old and current.futures() == ()


def test_failures_wait_for_the_watcher_to_publish_them_once() -> None:
    state = StepState()
    state.to_publish(_quorum(), "replica a: RuntimeError: x")
    assert state.take_unpublished() == [(_quorum(), "replica a: RuntimeError: x")]
    assert state.take_unpublished() == []


def test_a_quorum_decided_for_an_earlier_step_is_kept_only_as_the_last_one() -> None:
    state = StepState()
    old = _started(state)
    _started(state)
    quorum = _quorum()
    assert not state.adopt_quorum(quorum, old)
    assert state.quorum is None and state.last_quorum == quorum


def test_a_step_reuses_the_last_quorum_one_step_on_when_the_commit_allowed_it() -> None:
    state = StepState()
    _started(state, _quorum(step=4))
    _, reused = state.begin_step(reuse=True)
    assert reused is not None and reused.steps == (5, 5)
    assert state.quorum == reused == state.last_quorum


def test_a_commit_moves_the_step_on_and_forgets_an_error_seen_after_the_votes() -> None:
    state = StepState()
    generation = _started(state, _quorum(step=4))
    state.fail(RuntimeError("after the votes"), generation)
    assert state.end_step(_quorum(step=4), committed=True, healed_step=None) is None
    assert state.step == 5 and state.error is None
    # The failure is the next commit's recovery.
    _started(state, _quorum(step=5))
    recovered = state.end_step(_quorum(step=5), committed=True, healed_step=None)
    assert recovered is not None and recovered.step == 4


def test_a_discarded_step_keeps_the_step_and_the_error() -> None:
    state = StepState()
    generation = _started(state, _quorum(step=4))
    state.fail(RuntimeError("x"), generation)
    assert state.end_step(_quorum(step=4), committed=False, healed_step=None) is None
    assert state.step == 0 and state.error is not None


def test_a_healed_replica_takes_its_sources_step() -> None:
    state = StepState()
    generation = _started(state, _quorum(step=7))
    state.received({"w": 1}, 7, generation)
    assert state.healed() == ({"w": 1}, 7)
    state.end_step(_quorum(step=7), committed=False, healed_step=7)
    assert state.step == 7


def test_a_state_received_for_an_earlier_step_is_dropped() -> None:
    state = StepState()
    old = _started(state)
    _started(state)
    state.received({"w": 1}, 7, old)
    assert state.healed() is None and state.take_healed() is None


def test_a_group_breaks_once_and_ends_the_wait_it_was_blocked_on() -> None:
    state = StepState()
    generation = _started(state)
    assert state.wait_for_group(arrival_key="group/g/1/arrived") is None
    waits = state.break_group("ranks [1] stopped")
    assert waits is not None and waits.arrival_key == "group/g/1/arrived"
    assert waits.step_active and waits.generation == generation
    assert state.break_group("again") is None
    assert state.wait_for_group(awaited_key="k") == "ranks [1] stopped"


def test_the_watcher_watches_only_a_step_in_flight_with_a_quorum_and_no_error() -> None:
    state = StepState()
    generation = _started(state)
    assert state.watched_step() is None  # no quorum yet
    state.adopt_quorum(_quorum(), generation)
    state.set_deadlines(allreduce=12.0, vote=None)
    watched = state.watched_step()
    assert watched is not None and watched.allreduce_deadline == 12.0
    state.fail(RuntimeError("x"), generation)
    assert state.watched_step() is None


def test_the_registry_version_only_moves_forward() -> None:
    state = StepState()
    state.saw_registry_version(5)
    state.saw_registry_version(3)
    assert state.registry_version == 5


def test_a_wrapped_future_past_its_deadline_is_failed_once_and_a_done_one_never() -> None:
    futures = WrappedFutures()
    errors: list[str] = []
    futures.register(-1.0, lambda e: errors.append("overdue"))
    done = futures.register(-1.0, lambda e: errors.append("done"))
    futures.register(60.0, lambda e: errors.append("in time"))
    futures.forget(done)
    futures.expire()
    futures.expire()
    assert errors == ["overdue"]
