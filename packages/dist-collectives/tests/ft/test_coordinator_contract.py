"""The replica coordinator's contract, held by both implementations.

Every test runs twice: on the store coordinator over one in-process ``HashStore``
(each replica's every role on it) and on the in-memory coordinator. Replicas are
threads; heartbeats are beaten by a thread per replica where a test needs them.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from dist_collectives.ft import ManagerConfigError, ReplicaError
from dist_collectives.ft.coordination.coordinator import (
    CoordinatorSettings,
    FailureReport,
    JoinRequest,
    ReplicaCoordinator,
)
from dist_collectives.ft.coordination.memory_coordinator import MemoryHub
from dist_collectives.ft.coordination.quorum import QuorumTimeoutError
from dist_collectives.ft.coordination.store_coordinator import StoreCoordinator

WAIT = 30.0


class Observer:
    """The Manager's side of the waits, as its StepState keeps it."""

    def __init__(self) -> None:
        self.broken: str | None = None
        self.arrival: str | None = None
        self.awaited: str | None = None
        self.vote_deadlines: list[float | None] = []

    def group_wait(self, *, arrival: str | None = None, awaited: str | None = None) -> str | None:
        self.arrival = arrival or self.arrival
        self.awaited = awaited or self.awaited
        return self.broken

    def vote_wait(self, deadline: float | None) -> None:
        self.vote_deadlines.append(deadline)


Factory = Callable[..., tuple[ReplicaCoordinator, Observer]]


@pytest.fixture(params=["store", "memory"])
def make(request: pytest.FixtureRequest) -> Iterator[Factory]:
    """Makes a joined coordinator of one replica (or rank) of a shared job."""
    store = dist.HashStore()
    hub = MemoryHub(tick=0.02)
    made: list[ReplicaCoordinator] = []

    def factory(
        replica_id: str,
        *,
        group_rank: int = 0,
        group_world_size: int = 1,
        min_replicas: int = 1,
        heartbeat_timeout: float = 60.0,
        join_timeout: float = 60.0,
        timeout: float = WAIT,
    ) -> tuple[ReplicaCoordinator, Observer]:
        settings = CoordinatorSettings(
            replica_id=replica_id,
            group_rank=group_rank,
            group_world_size=group_world_size,
            min_replicas=min_replicas,
            timeout=timedelta(seconds=timeout),
            heartbeat_timeout=timedelta(seconds=heartbeat_timeout),
            join_timeout=timedelta(seconds=join_timeout),
        )
        observer = Observer()
        coordinator: ReplicaCoordinator
        if request.param == "store":
            coordinator = StoreCoordinator(settings, lambda role: store, observer)  # type: ignore[arg-type,return-value]
        else:
            coordinator = hub.coordinator(settings, observer)
        coordinator.join()
        made.append(coordinator)
        return coordinator, observer

    yield factory
    for coordinator in made:
        coordinator.close()


def _together(*calls: Callable[[], object]) -> list[object]:
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result(timeout=WAIT) for future in futures]


def _deadline(seconds: float = WAIT) -> float:
    return time.monotonic() + seconds


def _until(done: Callable[[], bool], why: str, seconds: float = 5.0) -> None:
    """Polls ``done`` until it holds; fails with ``why`` after ``seconds``."""
    give_up = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < give_up, why
        time.sleep(0.02)


class Beating:
    """Beats the given coordinators every 20 ms until stopped (each replica's watcher)."""

    def __init__(self, *coordinators: ReplicaCoordinator) -> None:
        self._coordinators = list(coordinators)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def stop_beating(self, coordinator: ReplicaCoordinator) -> None:
        self._coordinators.remove(coordinator)

    def _loop(self) -> None:
        while not self._stop.wait(0.02):
            for coordinator in list(self._coordinators):
                coordinator.beat()

    def __enter__(self) -> Beating:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def test_replicas_that_ask_together_get_one_quorum_and_keep_its_id(make: Factory) -> None:
    (a, _), (b, _) = make("a", min_replicas=2), make("b", min_replicas=2)
    first = _together(
        lambda: a.quorum(JoinRequest(1, 0), _deadline()),
        lambda: b.quorum(JoinRequest(1, 0), _deadline()),
    )
    assert first[0] == first[1] and first[0].members == ("a", "b")  # type: ignore[attr-defined]
    quorum = first[0]
    again = _together(
        lambda: a.quorum(JoinRequest(2, 0, previous=quorum), _deadline()),  # type: ignore[arg-type]
        lambda: b.quorum(JoinRequest(2, 0, previous=quorum), _deadline()),  # type: ignore[arg-type]
    )
    assert again[0] == again[1]
    assert again[0].quorum_id == quorum.quorum_id  # type: ignore[attr-defined]
    assert again[0].round == quorum.round + 1  # type: ignore[attr-defined]


def test_too_few_replicas_time_out_naming_the_round(make: Factory) -> None:
    a, _ = make("a", min_replicas=2)
    with pytest.raises(QuorumTimeoutError, match="need at least 2"):
        a.quorum(JoinRequest(1, 0), _deadline(0.3))


def test_a_replica_that_stopped_beating_is_left_out_and_the_others_are_not(
    make: Factory,
) -> None:
    (a, _), (b, _), (c, _) = (make(name, heartbeat_timeout=0.4) for name in "abc")
    with Beating(a, b, c) as beating:
        quorum = _together(
            *(lambda r=r: r.quorum(JoinRequest(1, 0), _deadline()) for r in (a, b, c))
        )[0]
        assert quorum.members == ("a", "b", "c")  # type: ignore[attr-defined]
        assert a.alive_members(quorum) == {"a", "b", "c"}  # type: ignore[arg-type]
        time.sleep(0.6)  # longer than the heartbeat timeout: nobody is out yet (false alarm)
        assert a.alive_members(quorum) == {"a", "b", "c"}  # type: ignore[arg-type]
        beating.stop_beating(c)
        _until(lambda: a.alive_members(quorum) == {"a", "b"}, "c still counts as alive")  # type: ignore[arg-type]
        later = _together(
            lambda: a.quorum(JoinRequest(2, 1, previous=quorum), _deadline()),  # type: ignore[arg-type]
            lambda: b.quorum(JoinRequest(2, 1, previous=quorum), _deadline()),  # type: ignore[arg-type]
        )
    assert later[0] == later[1] and later[0].members == ("a", "b")  # type: ignore[attr-defined]
    assert later[0].quorum_id == quorum.quorum_id + 1  # type: ignore[attr-defined]


def test_every_vote_commits_and_keeps_the_quorum_for_the_next_step(make: Factory) -> None:
    (a, _), (b, _) = make("a", min_replicas=2), make("b", min_replicas=2)
    quorum = _together(*(lambda r=r: r.quorum(JoinRequest(1, 0), _deadline()) for r in (a, b)))[0]
    # 0: the watcher has not read the registry since the quorum formed.
    verdicts = _together(
        *(
            lambda r=r: r.vote(quorum, _deadline(), failure=None, registry_version=0)  # type: ignore[arg-type]
            for r in (a, b)
        )
    )
    assert all(v.committed and v.reuse_quorum for v in verdicts)  # type: ignore[attr-defined]
    assert a.decision(quorum).committed  # type: ignore[arg-type,union-attr]


def test_a_newcomer_makes_the_next_step_hold_a_round(make: Factory) -> None:
    a, _ = make("a")
    quorum = a.quorum(JoinRequest(1, 0), _deadline())
    make("late")  # announces itself after the quorum was decided
    verdict = a.vote(quorum, _deadline(), failure=None, registry_version=a.registry_version())
    assert verdict.committed and not verdict.reuse_quorum


def test_one_failure_fails_the_step_everywhere_with_its_reason(make: Factory) -> None:
    (a, _), (b, _) = make("a", min_replicas=2), make("b", min_replicas=2)
    quorum = _together(*(lambda r=r: r.quorum(JoinRequest(1, 0), _deadline()) for r in (a, b)))[0]
    failure = FailureReport.of("a", RuntimeError("boom"))
    verdicts = _together(
        lambda: a.vote(quorum, _deadline(), failure=failure, registry_version=0),  # type: ignore[arg-type]
        lambda: b.vote(quorum, _deadline(), failure=None, registry_version=0),  # type: ignore[arg-type]
    )
    assert not any(v.committed for v in verdicts)  # type: ignore[attr-defined]
    assert verdicts[1].failure == failure  # type: ignore[attr-defined]
    assert str(failure) == "a: RuntimeError: boom"
    assert b.reported(quorum) == failure  # type: ignore[arg-type]
    # A failure reported under a quorum id gives the next round a new id.
    later = _together(
        *(lambda r=r: r.quorum(JoinRequest(2, 0, previous=quorum), _deadline()) for r in (a, b))  # type: ignore[misc]
    )
    assert later[0].quorum_id == quorum.quorum_id + 1  # type: ignore[attr-defined]


def test_a_report_from_the_watcher_ends_a_waiting_vote(make: Factory) -> None:
    (a, _), (b, observer) = make("a", min_replicas=2), make("b", min_replicas=2)
    quorum = _together(*(lambda r=r: r.quorum(JoinRequest(1, 0), _deadline()) for r in (a, b)))[0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        vote = pool.submit(b.vote, quorum, _deadline(), failure=None, registry_version=0)
        assert b.reported(quorum) is None and b.decision(quorum) is None  # type: ignore[arg-type]
        a.report(quorum, FailureReport("a", "lost c"))  # type: ignore[arg-type]
        verdict = vote.result(timeout=WAIT)
    assert not verdict.committed and verdict.failure == FailureReport("a", "lost c")
    assert observer.vote_deadlines[-1] is None  # the vote told the Manager it stopped waiting


def test_a_vote_that_nobody_decides_times_out_and_reports_it(make: Factory) -> None:
    (a, _), (b, _) = make("a", min_replicas=2), make("b", min_replicas=2)
    quorum = _together(*(lambda r=r: r.quorum(JoinRequest(1, 0), _deadline()) for r in (a, b)))[0]
    verdict = b.vote(quorum, time.monotonic() - 5.0, failure=None, registry_version=0)  # type: ignore[arg-type]
    assert not verdict.committed and verdict.timed_out
    reported = a.reported(quorum)  # type: ignore[arg-type]
    assert reported is not None and "no commit decision" in reported.message


def test_group_rank_0_asks_with_the_oldest_step_and_answers_its_ranks(make: Factory) -> None:
    r0, _ = make("g", group_rank=0, group_world_size=2)
    r1, _ = make("g", group_rank=1, group_world_size=2)
    got = _together(
        lambda: r0.quorum(JoinRequest(1, 5), _deadline()),
        lambda: r1.quorum(JoinRequest(1, 3), _deadline()),
    )
    assert got[0] == got[1] and got[0].steps == (3,)  # type: ignore[attr-defined]


def test_a_superseded_request_ends_the_ranks_wait(make: Factory) -> None:
    r0, _ = make("g", group_rank=0, group_world_size=2)
    r1, _ = make("g", group_rank=1, group_world_size=2)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asked = pool.submit(r1.quorum, JoinRequest(1, 0), _deadline())
        r0.drop(1)
        with pytest.raises(ReplicaError, match="superseded"):
            asked.result(timeout=WAIT)


def test_a_broken_group_ends_its_ranks_waits(make: Factory) -> None:
    r0, zero = make("g", group_rank=0, group_world_size=2)
    r1, one = make("g", group_rank=1, group_world_size=2)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asked = pool.submit(r1.quorum, JoinRequest(1, 0), _deadline())
        _until(lambda: one.awaited is not None, "rank 1 never waited")
        r1.break_group("rank 0 stopped", arrival=one.arrival, awaited=one.awaited)
        with pytest.raises(ReplicaError, match="rank 0 stopped"):
            asked.result(timeout=WAIT)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asked = pool.submit(r0.quorum, JoinRequest(2, 0), _deadline())
        _until(lambda: zero.arrival is not None, "rank 0 never waited")
        zero.broken = "rank 1 stopped"
        r0.break_group("rank 1 stopped", arrival=zero.arrival, awaited=None)
        with pytest.raises(ReplicaError, match="rank 1 stopped"):
            asked.result(timeout=WAIT)


def test_a_rank_that_stopped_beating_is_stale_and_one_still_starting_is_not(
    make: Factory,
) -> None:
    r0, _ = make("g", group_rank=0, group_world_size=3, heartbeat_timeout=0.3)
    r1, _ = make("g", group_rank=1, group_world_size=3, heartbeat_timeout=0.3)
    # Rank 2 never starts: it is not stale. Rank 1 beats and then stops.
    assert r0.stale_ranks() == []
    with Beating(r0, r1) as beating:
        time.sleep(0.5)
        assert r0.stale_ranks() == []  # a rank that beats is not stale (false alarm)
        beating.stop_beating(r1)
        _until(lambda: r0.stale_ranks() == [1], "rank 1 never counted as stale")
    r1.leave()  # a rank that left zeroes its heartbeat: no longer stale
    assert r0.stale_ranks() == []


def test_a_group_of_another_size_is_refused(make: Factory) -> None:
    make("g", group_rank=0, group_world_size=2)
    with pytest.raises(ManagerConfigError, match="group_world_size=3"):
        make("h", group_rank=0, group_world_size=3)


def test_a_replica_that_left_is_not_alive(make: Factory) -> None:
    (a, _), (b, _) = make("a"), make("b")
    quorum = _together(*(lambda r=r: r.quorum(JoinRequest(1, 0), _deadline()) for r in (a, b)))[0]
    b.leave()
    assert a.alive_members(quorum) == {"a"}  # type: ignore[arg-type]
