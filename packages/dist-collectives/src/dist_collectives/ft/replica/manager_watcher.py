"""The Manager's watcher thread: heartbeats, the replica group's liveness, the step in flight.

Every ``heartbeat_interval`` it expires overdue wrapped futures and fails the step in
flight when a wait of the step ran past its deadline (no store call). Its store calls
follow a :class:`WatchSchedule`: every ``beat_interval`` (a quarter of the heartbeat
timeout, or every tick if that is longer) it beats this rank's heartbeat (group rank 0
also the replica's); every ``_LOOK_TICKS`` ticks, while a step is in flight, it takes
one look at the step through the coordinator's ``watch`` (a failure another replica
reported, who of the quorum is alive and the registry version, in one store call for
every replica but the quorum's first) and reads its replica group's heartbeats; with
no step in flight it reads the registry version every second. Each replica thus
costs the store a few calls per heartbeat interval whatever the number of replicas,
and the store's load grows as the number of replicas (``benchmarks/ft.py --only
scale``).

It also writes the failures the other threads queued in the state to the store, at
once when woken (:meth:`Watcher.wake`): the threads that complete operations (a
group's callbacks) make no store calls.

It speaks to the other replicas only through the Manager's coordinator (the watcher's
methods of :class:`~dist_collectives.ft.coordination.coordinator.ReplicaCoordinator`).
It reads and writes the step only through
:class:`~dist_collectives.ft.replica.manager_state.StepState`, and fails it through the
executor's ``fail``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from dist_collectives.ft.coordination.coordinator import FailureReport, ReplicaCoordinator
from dist_collectives.ft.errors import ReplicaError
from dist_collectives.ft.replica.manager_config import ManagerConfig
from dist_collectives.ft.replica.manager_decisions import (
    broken_group_message,
    lost_member_error,
    lost_members,
    overdue_error,
)
from dist_collectives.ft.replica.manager_futures import WrappedFutures
from dist_collectives.ft.replica.manager_state import StepState

# A look at the step in flight (and at the group's heartbeats) every this many ticks.
_LOOK_TICKS = 2
# With no step in flight, the registry version (newcomers) is read this often (a step's
# look reads it with every look).
_REGISTRY_READ_SECONDS = 1.0


@dataclasses.dataclass(frozen=True)
class TickDuties:
    """The store calls of one tick of the watcher.

    Attributes:
        beat: Beat this rank's heartbeat.
        look: Look at the step in flight and at the group's heartbeats.
        registry: Read the registry version (unless a look just read it).
    """

    beat: bool
    look: bool
    registry: bool


@dataclasses.dataclass(frozen=True)
class WatchSchedule:
    """Which ticks of the watcher make which store calls (see the module doc)."""

    beat_ticks: int
    registry_ticks: int
    look_ticks: int = _LOOK_TICKS

    @classmethod
    def of(cls, config: ManagerConfig) -> WatchSchedule:
        """The schedule of a Manager's watcher."""
        interval = config.heartbeat_interval.total_seconds()
        beat_ticks = max(1, int(config.beat_interval.total_seconds() / interval + 1e-9))
        registry_ticks = max(_LOOK_TICKS, int(_REGISTRY_READ_SECONDS / interval + 1e-9))
        return cls(beat_ticks=beat_ticks, registry_ticks=registry_ticks)

    def duties(self, tick: int) -> TickDuties:
        """The store calls of tick number ``tick`` (counted from 1)."""
        return TickDuties(
            beat=tick % self.beat_ticks == 0,
            look=tick % self.look_ticks == 0,
            registry=tick % self.registry_ticks == 0,
        )


class Watcher:
    """The watcher thread of one Manager (see the module doc).

    Args:
        config: The Manager's settings.
        state: The state the Manager's threads share.
        coordinator: The Manager's coordinator (its watcher's methods are this thread's).
        wrapped: The futures of ``wrap_future`` to expire.
        fail: Fails the step of a generation (the executor's ``fail``).
        log: Where the Manager's log lines go.
    """

    def __init__(
        self,
        config: ManagerConfig,
        state: StepState,
        coordinator: ReplicaCoordinator,
        wrapped: WrappedFutures,
        *,
        fail: Callable[[Exception, int | None], None],
        log: logging.Logger,
    ) -> None:
        self._config = config
        self._state = state
        self._coordinator = coordinator
        self._wrapped = wrapped
        self._fail = fail
        self._log = log
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._failing = False  # the watcher thread's own: whether its last store call failed
        self._thread = threading.Thread(
            target=self._loop, name=f"ft-monitor-{config.replica_id}", daemon=True
        )

    def start(self) -> None:
        """Starts the thread (the coordinator's ``join`` beat once and announced the replica)."""
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread and waits a little for it to end."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def wake(self) -> None:
        """Has the thread write the failures queued in the state now, not at its next tick."""
        self._wake.set()

    def _publish(self) -> None:
        """Writes each queued failure to the store, for every other replica.

        What could not be written is queued again, for the next tick.
        """
        queued = self._state.take_unpublished()
        for index, (quorum, message) in enumerate(queued):
            try:
                self._coordinator.report(quorum, FailureReport(self._config.replica_id, message))
            except Exception:
                for later in queued[index:]:
                    self._state.to_publish(*later)
                raise

    def _loop(self) -> None:
        interval = self._config.heartbeat_interval.total_seconds()
        schedule = WatchSchedule.of(self._config)
        ticks = 0
        next_tick = time.monotonic() + interval
        while not self._stop.is_set():
            self._wake.wait(max(next_tick - time.monotonic(), 0.0))
            self._wake.clear()
            if self._stop.is_set():
                break
            due = time.monotonic() >= next_tick
            try:
                self._publish()
                if due:
                    next_tick = time.monotonic() + interval
                    ticks += 1
                    self._tick(schedule.duties(ticks))
            except Exception as error:
                next_tick = max(next_tick, time.monotonic() + interval)
                self._store_failed(error)
            else:
                self._store_answered()

    def _tick(self, duties: TickDuties) -> None:
        self._wrapped.expire()
        self._beat(check_group=duties.look, beat=duties.beat)
        looked = self._watch_step(look=duties.look)
        if duties.registry and not looked:
            self._state.saw_registry_version(self._coordinator.registry_version())

    def _store_failed(self, error: Exception) -> None:
        """Logs the first failed store call of an outage; the others until it ends at debug."""
        if self._stop.is_set():
            return
        if self._failing:
            self._log.debug("ft monitor: store call failed again: %s", error)
            return
        self._failing = True
        self._log.warning("ft monitor: store call failed: %s", error, exc_info=True)

    def _store_answered(self) -> None:
        if self._failing:
            self._failing = False
            self._log.warning("ft monitor: the store answers again")

    def _beat(self, *, check_group: bool, beat: bool) -> None:
        """Beats this rank's heartbeat when ``beat``; rank 0 beats the group's while it is whole.

        In a replica group, rank 0 watches every rank and the others watch rank 0. When a
        watched rank stops beating, the group is broken for good (it rejoins only by
        restarting whole): this rank stops beating, fails the step and ends its own wait
        for the group (rank 0's for its ranks, another rank's for rank 0's decision);
        rank 0 also marks the group as left, so that the other groups leave it out at once.
        """
        config = self._config
        if config.grouped and check_group and self._state.group_broken is None:
            stale = self._coordinator.stale_ranks()
            if stale:
                self._break_group(stale)
        if beat and self._state.group_broken is None:
            self._coordinator.beat()

    def _break_group(self, stale: list[int]) -> None:
        message = broken_group_message(self._config.replica_id, stale)
        waits = self._state.break_group(message)
        if waits is None:
            return
        self._coordinator.break_group(message, arrival=waits.arrival_key, awaited=waits.awaited_key)
        self._log.warning("%s", message)
        if waits.step_active:
            self._fail(ReplicaError(message), waits.generation)

    def _watch_step(self, *, look: bool) -> bool:
        """Fails the step in flight when overdue, reported or a member is lost.

        Returns whether it looked at the step (which read the registry version too).
        """
        watched = self._state.watched_step()
        if watched is None:
            return False
        quorum, generation = watched.quorum, watched.generation
        overdue = overdue_error(
            time.monotonic(),
            allreduce_deadline=watched.allreduce_deadline,
            allreduce_unfinished=watched.operations is not None and watched.operations.unfinished(),
            vote_deadline=watched.vote_deadline,
            timeout=self._config.timeout,
        )
        if overdue is not None:
            self._fail(overdue, generation)
            return False
        if not look:
            return False
        seen = self._coordinator.watch(quorum)
        self._state.saw_registry_version(seen.registry_version)
        if seen.failure is not None:
            self._fail(ReplicaError(f"reported by replica {seen.failure}"), generation)
            return True
        lost = lost_members(quorum, set(seen.alive), self._config.replica_id)
        if not lost:
            return True
        error = lost_member_error(lost, self._coordinator.decision(quorum))
        if error is not None:
            self._fail(error, generation)
        return True
