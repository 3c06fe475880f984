"""The state a Manager's threads share, behind one lock.

A Manager runs on four kinds of thread:

- the *training* thread, which calls the public API (``start_quorum``, ``allreduce``,
  ``should_commit``, ...);
- the *quorum worker*, one long-lived thread: it forms the quorums, configures the
  group and heals;
- the *watcher*, which beats the heartbeats and fails a step that another replica
  failed, that lost a member or that ran past its deadline;
- *callback* threads: a group's completion of an allreduce, a wrapped future's.

Every field of :class:`StepState` is read and written only with its lock held, by
the methods below, each one short and free of I/O. What only one thread touches is
not here: the executor keeps it and says which thread owns it. The step's operations
are its :class:`~dist_collectives.ft.replica.generation.Generation`'s, behind that object's
own condition; this lock is never held while that one is taken.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from dist_collectives.ft.coordination.quorum import Quorum
from dist_collectives.ft.replica.generation import Generation
from dist_collectives.ft.replica.manager_decisions import Failure, recovered_failure, reused_quorum


@dataclasses.dataclass(frozen=True)
class FailedStep:
    """What a failure that was recorded first in its step hands on to whoever recorded it."""

    quorum: Quorum | None
    step: int
    generation: Generation | None  # to fail, outside the state's lock


@dataclasses.dataclass(frozen=True)
class WatchedStep:
    """What the watcher checks of a step in flight that has not failed yet."""

    quorum: Quorum
    generation: int
    operations: Generation | None
    allreduce_deadline: float | None
    vote_deadline: float | None


@dataclasses.dataclass(frozen=True)
class GroupWaits:
    """The store keys the ranks of a replica group are blocked on, and the step in flight."""

    arrival_key: str | None  # group rank 0 waits for its ranks to ask for a quorum
    awaited_key: str | None  # another rank waits for rank 0's quorum decision
    step_active: bool
    generation: int


class StepState:
    """The fields a Manager's threads share, each guarded by one lock (see the module doc).

    Fields:
        generation: Counts ``start_quorum`` calls: a late result of an earlier step
            (a quorum, a failure) carries its generation and is dropped.
        step: The number of committed steps (a healed replica takes its source's).
        quorum: This step's quorum, once decided.
        last_quorum: The newest quorum decided, for the next round and for reuse.
        configured_quorum_id, configured_members: The quorum the group was last
            configured for.
        healed: The state received from a peer in this step, with its step.
        current: This step's :class:`Generation`: its operations.
        allreduce_deadline, vote_deadline: When the commit's waits must end (None
            while it does not wait); the watcher fails the step past them.
        error, error_wall_time: This step's error and when it was recorded (wall clock).
        failure: The first failure since the last commit, for the recovery log.
        step_active: Between ``start_quorum`` and the end of ``should_commit``.
        group_broken: Why this replica group left the quorum for good, once it has.
        arrival_key, awaited_key: The group keys the quorum worker is blocked on.
        registry_version: The registry version as the watcher last read it.
        unpublished: Failures recorded but not yet written to the store; the watcher
            writes them (no thread that completes an operation makes store calls).
        failed_quorum_id: The last quorum a step failed in: its group is never used
            again.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = 0
        self._step = 0
        self._quorum: Quorum | None = None
        self._last_quorum: Quorum | None = None
        self._configured_quorum_id: int | None = None
        self._configured_members: tuple[str, ...] = ()
        self._healed: tuple[Any, int] | None = None
        self._current: Generation | None = None
        self._allreduce_deadline: float | None = None
        self._vote_deadline: float | None = None
        self._error: Exception | None = None
        self._error_wall_time: float | None = None
        self._failure: Failure | None = None
        self._step_active = False
        self._group_broken: str | None = None
        self._arrival_key: str | None = None
        self._awaited_key: str | None = None
        self._registry_version = 0
        self._unpublished: list[tuple[Quorum, str]] = []
        self._failed_quorum_id: int | None = None

    # -- reads ------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """The generation of the current step."""
        with self._lock:
            return self._generation

    @property
    def step(self) -> int:
        """The number of steps committed so far."""
        with self._lock:
            return self._step

    @property
    def quorum(self) -> Quorum | None:
        """This step's quorum, if decided yet."""
        with self._lock:
            return self._quorum

    @property
    def last_quorum(self) -> Quorum | None:
        """The newest quorum decided."""
        with self._lock:
            return self._last_quorum

    @property
    def error(self) -> Exception | None:
        """This step's error, if any."""
        with self._lock:
            return self._error

    @property
    def error_wall_time(self) -> float | None:
        """When this step's error was recorded (``time.time()``), if it failed."""
        with self._lock:
            return self._error_wall_time

    @property
    def group_broken(self) -> str | None:
        """Why this replica group left the quorum for good, once it has."""
        with self._lock:
            return self._group_broken

    @property
    def registry_version(self) -> int:
        """The registry version as the watcher last read it."""
        with self._lock:
            return self._registry_version

    @property
    def failed_quorum_id(self) -> int | None:
        """The id of the last quorum a step of this replica failed in, if any."""
        with self._lock:
            return self._failed_quorum_id

    @property
    def configured(self) -> tuple[int | None, tuple[str, ...]]:
        """The id and the members of the quorum the group was last configured for."""
        with self._lock:
            return self._configured_quorum_id, self._configured_members

    def current(self) -> Generation | None:
        """This step's :class:`Generation` (None before the first step)."""
        with self._lock:
            return self._current

    def healed(self) -> tuple[Any, int] | None:
        """The state received in this step and its step, while no error failed the step."""
        with self._lock:
            return self._healed if self._error is None else None

    # -- the training thread's transitions ----------------------------------------------

    def begin_step(
        self, *, reuse: bool, open_generation: Callable[[int], Generation] | None = None
    ) -> tuple[int, Quorum | None]:
        """Starts a step: a new generation, no error, no quorum, no allreduce yet.

        Args:
            reuse: The last step's commit said the next step may reuse its quorum.
            open_generation: Makes the step's :class:`Generation` from its number
                (no I/O: it runs under the lock).

        Returns:
            The step's generation, and its quorum when it reuses the last one (else a
            quorum worker decides it).
        """
        with self._lock:
            self._generation += 1
            self._error = None
            self._error_wall_time = None
            self._quorum = None
            self._healed = None
            self._current = open_generation(self._generation) if open_generation else None
            self._step_active = True
            quorum = reused_quorum(
                self._last_quorum, reuse=reuse, group_broken=self._group_broken is not None
            )
            if quorum is not None:
                self._last_quorum = self._quorum = quorum
            return self._generation, quorum

    def take_healed(self) -> tuple[Any, int] | None:
        """The state received in this step and its step, handed over once."""
        with self._lock:
            healed, self._healed = self._healed, None
            return healed

    def set_deadlines(self, *, allreduce: float | None, vote: float | None) -> None:
        """Sets when the commit's waits (for the allreduces, for the vote) must end."""
        with self._lock:
            self._allreduce_deadline = allreduce
            self._vote_deadline = vote

    def end_step(
        self, quorum: Quorum | None, *, committed: bool, healed_step: int | None
    ) -> Failure | None:
        """Ends the step; the failure it recovered from, when this commit ends a recovery.

        Every replica voted before any error was seen when the step committed: what
        failed since (a peer that left or died after voting) belongs to the next step,
        whose quorum will not include it, so the error is forgotten.
        """
        with self._lock:
            self._step_active = False
            recovered = None
            if committed:
                self._error = None
                self._error_wall_time = None
                if recovered_failure(
                    self._failure, committed=committed, generation=self._generation
                ):
                    recovered, self._failure = self._failure, None
            if healed_step is not None:
                self._step = healed_step
            if committed and quorum is not None:
                self._step = quorum.max_step + 1
            return recovered

    # -- the quorum worker's transitions ------------------------------------------------

    def adopt_quorum(self, quorum: Quorum, generation: int) -> bool:
        """Records a decided quorum; whether it is still the current step's."""
        with self._lock:
            self._last_quorum = quorum
            if generation != self._generation:
                return False
            self._quorum = quorum
            return True

    def configured_for(self, quorum: Quorum) -> None:
        """The group is configured for ``quorum`` now."""
        with self._lock:
            self._configured_quorum_id = quorum.quorum_id
            self._configured_members = quorum.members

    def received(self, state: Any, step: int, generation: int) -> None:
        """Keeps the state received from a peer in the step of ``generation``."""
        with self._lock:
            if generation == self._generation:
                self._healed = (state, step)

    def wait_for_group(
        self, *, arrival_key: str | None = None, awaited_key: str | None = None
    ) -> str | None:
        """Records the group key the quorum worker blocks on next; why the group broke, if so.

        The watcher ends that wait (:meth:`break_group`) when the group breaks; a group
        that broke before the key was recorded is answered here instead.
        """
        with self._lock:
            if arrival_key is not None:
                self._arrival_key = arrival_key
            if awaited_key is not None:
                self._awaited_key = awaited_key
            return self._group_broken

    def group_wait(self, *, arrival: str | None = None, awaited: str | None = None) -> str | None:
        """As :meth:`wait_for_group`: the coordinator's ``WaitObserver`` side."""
        return self.wait_for_group(arrival_key=arrival, awaited_key=awaited)

    def vote_wait(self, deadline: float | None) -> None:
        """The vote waits for its verdict until ``deadline`` (None: no longer)."""
        self.set_deadlines(allreduce=None, vote=deadline)

    # -- the watcher's transitions ------------------------------------------------------

    def saw_registry_version(self, version: int) -> None:
        """The watcher read the registry version ``version``."""
        with self._lock:
            self._registry_version = max(self._registry_version, version)

    def break_group(self, message: str) -> GroupWaits | None:
        """Marks this replica group as broken for good; None if it already was.

        Returns:
            The group keys to end the waits on, and whether a step is in flight.
        """
        with self._lock:
            if self._group_broken is not None:
                return None
            self._group_broken = message
            return GroupWaits(
                self._arrival_key, self._awaited_key, self._step_active, self._generation
            )

    def watched_step(self) -> WatchedStep | None:
        """The step in flight for the watcher to check, or None when there is nothing to watch."""
        with self._lock:
            if self._quorum is None or not self._step_active or self._error is not None:
                return None
            return WatchedStep(
                self._quorum,
                self._generation,
                self._current,
                self._allreduce_deadline,
                self._vote_deadline,
            )

    # -- any thread -------------------------------------------------------------------

    def fail(self, error: Exception, generation: int | None) -> FailedStep | None:
        """Records ``error`` as this step's, unless the step failed already.

        Args:
            error: The error.
            generation: The step it happened in; a late failure of an earlier step is
                dropped. None: the current step.

        Returns:
            The failed step, to fail its generation and to publish the error; None
            when the error was dropped.
        """
        with self._lock:
            if generation is not None and generation != self._generation:
                return None  # a late failure of an earlier step's group
            if self._error is not None:
                return None
            self._error = error
            self._error_wall_time = time.time()
            quorum = self._quorum
            if quorum is not None:
                self._failed_quorum_id = quorum.quorum_id
            step = quorum.max_step if quorum is not None else self._step
            if self._failure is None:
                self._failure = Failure(
                    seen_at=time.monotonic(),
                    step=step,
                    members=quorum.members if quorum is not None else (),
                    generation=self._generation,
                )
            return FailedStep(quorum, step, self._current)

    def to_publish(self, quorum: Quorum, message: str) -> None:
        """Queues a failure of ``quorum``'s step for the watcher to write to the store."""
        with self._lock:
            self._unpublished.append((quorum, message))

    def take_unpublished(self) -> list[tuple[Quorum, str]]:
        """The failures queued for the store since the last call (the watcher's)."""
        with self._lock:
            unpublished, self._unpublished = self._unpublished, []
            return unpublished
