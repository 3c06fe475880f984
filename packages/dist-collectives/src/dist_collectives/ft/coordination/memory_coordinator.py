"""The replica protocol for replicas that are threads of one process (fast tests).

A :class:`MemoryHub` holds what a job's store would: the rounds, the heartbeats (as the
hub's monotonic time of each beat: one process, one clock), the votes, verdicts and
reported failures, and the answers of replica groups' rank 0. Each replica (or rank)
gets its own :class:`MemoryCoordinator` from the hub. The rules are the store
coordinator's (:mod:`dist_collectives.ft.coordination.quorum` decides), and both are
held to the same contract tests; only the carrying out differs: one condition
variable instead of keys, ``compare_set`` and waits on a server.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from dist_collectives.ft.coordination.coordinator import (
    CoordinatorSettings,
    FailureReport,
    JoinRequest,
    StepWatch,
    Verdict,
    WaitObserver,
    proposed_verdict,
)
from dist_collectives.ft.coordination.quorum import (
    ROUND_TICK_SECONDS,
    Quorum,
    QuorumTimeoutError,
    decide_quorum,
    group_step,
    kept_a_failed_quorum,
    round_is_due,
    watched_group_ranks,
)
from dist_collectives.ft.errors import ManagerConfigError, ReplicaError

# As the store coordinator's vote: its own wait ends this long after the deadline.
_VOTE_WAIT_GRACE_SECONDS = 5.0


@dataclasses.dataclass
class _Group:
    """What the ranks of one replica group trade for one request."""

    steps: dict[int, int] = dataclasses.field(default_factory=dict)
    arrived: bool = False
    broken: str | None = None
    answer: Quorum | str | None = None


class MemoryHub:
    """The state replicas share, behind one condition (see the module doc).

    Args:
        tick: How often a waiting replica checks what closes a round on a timer.
    """

    def __init__(self, *, tick: float = ROUND_TICK_SECONDS) -> None:
        self.tick = tick
        self.cond = threading.Condition()
        self.round = 0
        self.members: dict[int, dict[str, int]] = {}
        self.decisions: dict[int, Quorum] = {}
        self.registry: set[str] = set()
        self.beats: dict[str, float] = {}
        self.left: set[str] = set()
        self.rank_beats: dict[tuple[str, int], float | None] = {}
        self.registry_version = 0
        self.version_changed_at = time.monotonic()
        self.votes: dict[tuple[int, int], int] = {}
        self.verdicts: dict[tuple[int, int], Verdict] = {}
        self.errors: dict[int, FailureReport] = {}
        self.group_world_size: int | None = None
        self.incarnations: dict[tuple[str, int], int] = {}
        self.groups: dict[tuple[str, int], _Group] = {}

    def coordinator(
        self, settings: CoordinatorSettings, observer: WaitObserver
    ) -> MemoryCoordinator:
        """The coordinator of one replica (or one rank of a replica group)."""
        return MemoryCoordinator(self, settings, observer)

    # Callers hold ``cond``.

    def bump_version(self) -> None:
        """Somebody announced itself or joined a round."""
        self.registry_version += 1
        self.version_changed_at = time.monotonic()

    def alive(self, replica_id: str, timeout: float, now: float) -> bool:
        """Whether ``replica_id`` beat within ``timeout`` and did not leave."""
        beat = self.beats.get(replica_id)
        return replica_id not in self.left and beat is not None and now - beat < timeout

    def wait_until(self, ready: Callable[[], bool], deadline: float) -> bool:
        """Waits on ``cond`` (held) until ``ready()`` or ``deadline``; whether it is ready."""
        while not ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self.cond.wait(min(remaining, self.tick))
        return True


class MemoryCoordinator:
    """One replica's (or rank's) coordinator on a :class:`MemoryHub`."""

    def __init__(
        self, hub: MemoryHub, settings: CoordinatorSettings, observer: WaitObserver
    ) -> None:
        self._hub = hub
        self._settings = settings
        self._observer = observer
        self._incarnation = 0

    @property
    def group_name(self) -> str:
        """This replica group in this incarnation."""
        return f"{self._settings.replica_id}/{self._incarnation}"

    def join(self) -> None:
        """Checks the group's size, counts this rank's start, beats, announces (rank 0)."""
        s, hub = self._settings, self._hub
        with hub.cond:
            if s.group_world_size > 1:
                if hub.group_world_size is None:
                    hub.group_world_size = s.group_world_size
                if hub.group_world_size != s.group_world_size:
                    raise ManagerConfigError(
                        f"replica {s.replica_id}: group_world_size={s.group_world_size}, "
                        f"but the job's replica groups have {hub.group_world_size} ranks"
                    )
                key = (s.replica_id, s.group_rank)
                self._incarnation = hub.incarnations.get(key, 0) + 1
                hub.incarnations[key] = self._incarnation
            if s.group_rank == 0:
                hub.left.discard(s.replica_id)
                hub.registry.add(s.replica_id)
                hub.bump_version()
            self._beat_locked()
            hub.cond.notify_all()

    # -- the quorum worker's ------------------------------------------------------------

    def quorum(self, request: JoinRequest, deadline: float) -> Quorum:
        """The next step's quorum; group rank 0 asks for its group and answers its ranks."""
        s, hub = self._settings, self._hub
        if s.group_world_size == 1:
            return self._round(request, request.step, deadline)
        token = f"{self.group_name}/{request.number}"
        group_deadline = time.monotonic() + s.timeout.total_seconds()
        with hub.cond:
            group = hub.groups.setdefault((self.group_name, request.number), _Group())
            if s.group_rank > 0:
                group.steps[s.group_rank] = request.step
                group.arrived = len(group.steps) == s.group_world_size - 1
                hub.cond.notify_all()
        if s.group_rank > 0:
            broken = self._observer.group_wait(awaited=token)
            if broken is not None:
                raise ReplicaError(broken)
            with hub.cond:
                if not hub.wait_until(lambda: group.answer is not None, group_deadline):
                    raise QuorumTimeoutError(f"replica {s.replica_id}: no answer from rank 0")
                answer = group.answer
            if isinstance(answer, Quorum):
                return answer
            raise ReplicaError(f"replica {s.replica_id}: no quorum for the group: {answer}")
        try:
            if self._observer.group_wait(arrival=token) is None:
                with hub.cond:
                    ready = hub.wait_until(
                        lambda: group.arrived or group.broken is not None, group_deadline
                    )
                if not ready:
                    raise QuorumTimeoutError(
                        f"replica {s.replica_id}: the group's ranks did not ask"
                    )
            broken = self._observer.group_wait()
            if broken is not None:
                raise ReplicaError(broken)
            quorum = self._round(
                request, group_step(request.step, list(group.steps.values())), deadline
            )
        except Exception as error:
            with hub.cond:
                group.answer = f"{type(error).__name__}: {error}"
                hub.cond.notify_all()
            raise
        with hub.cond:
            group.answer = quorum
            hub.cond.notify_all()
        return quorum

    def _round(self, request: JoinRequest, step: int, deadline: float) -> Quorum:
        """A round's decision; one more round when it kept the id of a failed step."""
        quorum = self._compute(step, request.previous, deadline)
        if kept_a_failed_quorum(quorum, request.failed_quorum_id):
            reason = f"quorum {quorum.quorum_id} kept the id of a configuration whose step failed"
            with self._hub.cond:
                self._hub.errors[quorum.quorum_id] = FailureReport(
                    self._settings.replica_id, reason
                )
            quorum = self._compute(step, quorum, deadline)
        return quorum

    def _compute(self, step: int, previous: Quorum | None, deadline: float) -> Quorum:
        s, hub = self._settings, self._hub
        timeout = s.heartbeat_timeout.total_seconds()
        with hub.cond:
            round_ = hub.round
            while True:
                hub.members.setdefault(round_, {})[s.replica_id] = step
                hub.bump_version()
                hub.cond.notify_all()
                joined = time.monotonic()
                while round_ not in hub.decisions:
                    now = time.monotonic()
                    members = hub.members[round_]
                    alive = {r for r in hub.registry if hub.alive(r, timeout, now)}
                    due = round_is_due(
                        members=members,
                        alive=alive,
                        min_replicas=s.min_replicas,
                        waited=now - joined,
                        join_timeout=s.join_timeout.total_seconds(),
                        settled_for=now - hub.version_changed_at,
                        window=s.first_quorum_window.total_seconds() if round_ == 0 else 0.0,
                    )
                    if due:
                        last = hub.decisions.get(round_ - 1)
                        hub.decisions[round_] = decide_quorum(
                            round_,
                            dict(members),
                            last,
                            previous_failed=last is not None and last.quorum_id in hub.errors,
                            registry_version=hub.registry_version,
                            init_sync=s.init_sync,
                        )
                        hub.round = max(hub.round, round_ + 1)
                        hub.cond.notify_all()
                        break
                    if now > deadline:
                        raise QuorumTimeoutError(
                            f"replica {s.replica_id!r}: no quorum: round {round_} has "
                            f"{sorted(members)} (need at least {s.min_replicas}), "
                            f"alive: {sorted(alive)}"
                        )
                    hub.cond.wait(min(hub.tick, max(deadline - now, 0.001)))
                quorum = hub.decisions[round_]
                if s.replica_id in quorum.members:
                    return quorum
                round_ = max(round_ + 1, hub.round)

    def drop(self, number: int) -> None:
        """Request ``number`` was superseded: rank 0 tells its group's ranks."""
        if self._settings.group_world_size == 1 or self._settings.group_rank != 0:
            return
        with self._hub.cond:
            group = self._hub.groups.setdefault((self.group_name, number), _Group())
            if group.answer is None:
                group.answer = "superseded"
            self._hub.cond.notify_all()

    # -- the training thread's ----------------------------------------------------------

    def vote(
        self,
        quorum: Quorum,
        deadline: float,
        *,
        failure: FailureReport | None,
        registry_version: int,
    ) -> Verdict:
        """Votes, and reads the verdict the last voter (or a failure) reached."""
        hub, key = self._hub, (quorum.quorum_id, quorum.max_step)
        with hub.cond:
            if failure is None:
                hub.votes[key] = hub.votes.get(key, 0) + 1
                proposal = proposed_verdict(
                    hub.votes[key],
                    quorum,
                    group_world_size=self._settings.group_world_size,
                    registry_version=registry_version,
                )
                if proposal is not None:
                    hub.verdicts.setdefault(key, proposal)
            else:
                self._publish_locked(quorum, failure)
            hub.cond.notify_all()
            decided = key in hub.verdicts
        timed_out = False
        if not decided:
            self._observer.vote_wait(deadline)
            try:
                with hub.cond:
                    grace = deadline + _VOTE_WAIT_GRACE_SECONDS
                    if not hub.wait_until(lambda: key in hub.verdicts, grace):
                        timed_out = True
                        reason = f"no commit decision within {self._settings.timeout}"
                        failed = FailureReport.of(self._settings.replica_id, TimeoutError(reason))
                        self._publish_locked(quorum, failed)
            finally:
                self._observer.vote_wait(None)
        with hub.cond:
            verdict = hub.verdicts[key]
            if verdict.committed:
                return verdict
            return Verdict(
                committed=False, failure=hub.errors.get(quorum.quorum_id), timed_out=timed_out
            )

    def leave(self) -> None:
        """Rank 0 marks the replica as gone; another rank zeroes its heartbeat."""
        s, hub = self._settings, self._hub
        with hub.cond:
            if s.group_rank == 0:
                hub.left.add(s.replica_id)
            else:
                hub.rank_beats[(self.group_name, s.group_rank)] = None
            hub.cond.notify_all()

    # -- the watcher's -----------------------------------------------------------------

    def _publish_locked(self, quorum: Quorum, failure: FailureReport) -> None:
        self._hub.errors[quorum.quorum_id] = failure
        self._hub.verdicts.setdefault((quorum.quorum_id, quorum.max_step), Verdict(False))
        self._hub.cond.notify_all()

    def report(self, quorum: Quorum, failure: FailureReport) -> None:
        """Fails ``quorum``'s step for every replica."""
        with self._hub.cond:
            self._publish_locked(quorum, failure)

    def reported(self, quorum: Quorum) -> FailureReport | None:
        """The failure a replica reported for ``quorum``'s step, if any."""
        with self._hub.cond:
            return self._hub.errors.get(quorum.quorum_id)

    def decision(self, quorum: Quorum) -> Verdict | None:
        """``quorum``'s step's verdict, if reached."""
        with self._hub.cond:
            return self._hub.verdicts.get((quorum.quorum_id, quorum.max_step))

    def _beat_locked(self) -> None:
        s, now = self._settings, time.monotonic()
        if s.group_world_size > 1:
            self._hub.rank_beats[(self.group_name, s.group_rank)] = now
        if s.group_rank == 0:
            self._hub.beats[s.replica_id] = now

    def beat(self) -> None:
        """Beats this rank's heartbeat; group rank 0 also the replica's."""
        with self._hub.cond:
            self._beat_locked()

    def registry_version(self) -> int:
        """The registry version now."""
        with self._hub.cond:
            return self._hub.registry_version

    def stale_ranks(self) -> list[int]:
        """The watched ranks of this group whose last beat is older than the timeout.

        A rank that never beat (or zeroed its heartbeat when it left) is not stale.
        """
        s, hub, now = self._settings, self._hub, time.monotonic()
        timeout = s.heartbeat_timeout.total_seconds()
        with hub.cond:
            beats = {
                rank: hub.rank_beats.get((self.group_name, rank))
                for rank in watched_group_ranks(s.group_rank, s.group_world_size)
            }
        return [rank for rank, beat in beats.items() if beat is not None and now - beat >= timeout]

    def alive_members(self, quorum: Quorum) -> set[str]:
        """The members of ``quorum`` that beat within the heartbeat timeout and did not leave."""
        timeout, now = self._settings.heartbeat_timeout.total_seconds(), time.monotonic()
        with self._hub.cond:
            return {m for m in quorum.members if self._hub.alive(m, timeout, now)}

    def watch(self, quorum: Quorum) -> StepWatch:
        """The failure reported, the members alive and the registry version, read at once."""
        timeout, now = self._settings.heartbeat_timeout.total_seconds(), time.monotonic()
        with self._hub.cond:
            return StepWatch(
                failure=self._hub.errors.get(quorum.quorum_id),
                alive=frozenset(m for m in quorum.members if self._hub.alive(m, timeout, now)),
                registry_version=self._hub.registry_version,
            )

    def break_group(self, message: str, *, arrival: str | None, awaited: str | None) -> None:
        """Rank 0 leaves and ends its wait for its ranks; another rank ends its wait for rank 0."""
        hub = self._hub
        with hub.cond:
            if self._settings.group_rank == 0:
                hub.left.add(self._settings.replica_id)
                for (name, _), group in hub.groups.items():
                    if name == self.group_name and arrival is not None and not group.arrived:
                        group.broken = message
            elif awaited is not None:
                for (name, _), group in hub.groups.items():
                    if name == self.group_name and group.answer is None:
                        group.answer = message
            hub.cond.notify_all()

    def close(self) -> None:
        """Nothing to release: the hub is the test's."""
