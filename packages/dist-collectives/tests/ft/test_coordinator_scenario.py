"""A whole job's replica protocol in one process: a replica dies, the others go on, it rejoins.

Replicas are threads on the in-memory coordinator, each with a watcher thread that
beats and reports a lost member, as a Manager's does; training is only counting steps,
and healing takes the newest step. The same scenario with real processes and a real
store is ``test_manager_faults.py``; this one takes a second.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta

from dist_collectives.ft.coordination.coordinator import (
    CoordinatorSettings,
    FailureReport,
    JoinRequest,
)
from dist_collectives.ft.coordination.memory_coordinator import MemoryCoordinator, MemoryHub
from dist_collectives.ft.coordination.quorum import Quorum

HEARTBEAT_TIMEOUT = 0.3
WAIT = 20.0
STOP_AT = 12
GATE_AT = 6


class _NoWaits:
    def group_wait(self, *, arrival: str | None = None, awaited: str | None = None) -> str | None:
        return None

    def vote_wait(self, deadline: float | None) -> None:
        pass


@dataclasses.dataclass
class Replica:
    """One replica: a training thread and its watcher."""

    hub: MemoryHub
    name: str
    die_at: int | None = None
    gate: threading.Event | None = None  # waited for before voting for step GATE_AT
    step: int = 0
    quorums: list[Quorum] = dataclasses.field(default_factory=list)
    healed_from: int | None = None
    error: BaseException | None = None

    def __post_init__(self) -> None:
        settings = CoordinatorSettings(
            replica_id=self.name,
            group_rank=0,
            group_world_size=1,
            min_replicas=2,
            timeout=timedelta(seconds=WAIT),
            heartbeat_timeout=timedelta(seconds=HEARTBEAT_TIMEOUT),
            join_timeout=timedelta(seconds=WAIT),
        )
        self.coordinator: MemoryCoordinator = self.hub.coordinator(settings, _NoWaits())
        self._current: Quorum | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._train, name=self.name, daemon=True)
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> None:
        """Starts the threads (call ``coordinator.join()`` first)."""
        self._watcher.start()
        self.thread.start()

    def _watch(self) -> None:
        """Beats, and fails the step in flight when a member of its quorum stopped beating."""
        while not self._stop.wait(0.02):
            self.coordinator.beat()
            quorum = self._current
            if quorum is None:
                continue
            lost = set(quorum.members) - self.coordinator.alive_members(quorum) - {self.name}
            if lost and self.coordinator.decision(quorum) is None:
                failure = FailureReport(self.name, f"lost {sorted(lost)}")
                self.coordinator.report(quorum, failure)

    def _train(self) -> None:
        try:
            self._steps()
        except BaseException as error:
            self.error = error
        finally:
            self._stop.set()

    def _steps(self) -> None:
        reuse: Quorum | None = None
        previous: Quorum | None = None
        number = 0
        while self.step < STOP_AT:
            if reuse is not None:
                quorum = reuse
            else:
                number += 1
                deadline = time.monotonic() + WAIT
                quorum = self.coordinator.quorum(JoinRequest(number, self.step, previous), deadline)
                previous = quorum
                self.quorums.append(quorum)
            if quorum.is_behind(self.name):
                self.healed_from, self.step = self.step, quorum.max_step
            if self.die_at is not None and self.step >= self.die_at:
                return  # dies silently: no vote, no more heartbeats
            if self.gate is not None and self.step == GATE_AT:
                self.gate.wait(WAIT)
            self._current = quorum
            verdict = self.coordinator.vote(
                quorum,
                time.monotonic() + WAIT,
                failure=None,
                registry_version=self.coordinator.registry_version(),
            )
            self._current = None
            reuse = quorum.next_step() if verdict.committed and verdict.reuse_quorum else None
            if verdict.committed:
                self.step += 1


def test_a_replica_dies_the_others_go_on_and_it_rejoins_by_healing() -> None:
    hub = MemoryHub(tick=0.02)
    gate = threading.Event()  # the survivors wait at step 6 until c restarted
    a, b = Replica(hub, "a", gate=gate), Replica(hub, "b", gate=gate)
    c = Replica(hub, "c", die_at=3)
    for replica in (a, b, c):  # all announced before any asks for the first quorum
        replica.coordinator.join()
    for replica in (a, b, c):
        replica.start()
    c.thread.join(timeout=WAIT)
    assert not c.thread.is_alive() and c.error is None and c.step == 3
    started = time.monotonic()
    while min(a.step, b.step) < GATE_AT:  # the survivors commit steps without c
        assert time.monotonic() - started < WAIT, f"stuck at {a.step}, {b.step}: {a.error}"
        time.sleep(0.01)
    recovered_in = time.monotonic() - started
    back = Replica(hub, "c")  # c restarts with nothing committed
    back.coordinator.join()
    back.start()
    gate.set()
    for replica in (a, b, back):
        replica.thread.join(timeout=WAIT)
        assert not replica.thread.is_alive() and replica.error is None, replica.error
    assert a.step == b.step == back.step == STOP_AT
    without_c = [q for q in a.quorums if q.members == ("a", "b")]
    assert without_c, "the survivors never formed a quorum without c"
    first = a.quorums[0]
    assert first.members == ("a", "b", "c")
    assert without_c[0].quorum_id > first.quorum_id  # a new group for the new members
    rejoined = back.quorums[0]
    assert rejoined.members == ("a", "b", "c") and rejoined.is_behind("c")
    assert rejoined.quorum_id > without_c[0].quorum_id
    assert back.healed_from == 0
    print(f"survivors at step 6 {recovered_in:.2f} s after c died")
