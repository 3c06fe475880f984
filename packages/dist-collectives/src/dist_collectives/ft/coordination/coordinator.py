"""The one object a Manager speaks to about other replicas, and the records it trades.

A :class:`~dist_collectives.ft.Manager`'s executor keeps no protocol of its own: it asks
its :class:`ReplicaCoordinator` for a quorum, votes through it, beats through it and
reports failures to it, as torchft's Manager asks its client. Two implementations keep
the same contract (``tests/ft/test_coordinator_contract.py``):

- :class:`~dist_collectives.ft.coordination.store_coordinator.StoreCoordinator`: the
  job's key-value store, one module that owns every key and value codec;
- :class:`~dist_collectives.ft.coordination.memory_coordinator.MemoryCoordinator`:
  replicas that are threads of one process (fast tests).

Each method is called by one of the Manager's threads, and an implementation may give
each thread its own connection: :meth:`~ReplicaCoordinator.quorum` and
:meth:`~ReplicaCoordinator.drop` by the quorum worker;
:meth:`~ReplicaCoordinator.vote` and :meth:`~ReplicaCoordinator.leave` by the training
thread; the others by the watcher.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Protocol

from dist_collectives.ft.coordination.quorum import Quorum

# The longest failure message kept: a traceback does not travel to every replica.
MESSAGE_CHARS = 1000


@dataclasses.dataclass(frozen=True)
class JoinRequest:
    """A replica (or one rank of a replica group) asks for the next step's quorum.

    Attributes:
        number: This rank's count of requests: the ranks of a group count alike, and
            the group's decision for request ``number`` is kept apart from the others.
        step: The last step this rank committed.
        previous: The last decision this replica saw (saves reading it again).
        failed_quorum_id: The last quorum a step of this replica failed in: a decision
            that keeps its id is reported and a new round held, so that the failed
            group is never used again.
    """

    number: int
    step: int
    previous: Quorum | None = None
    failed_quorum_id: int | None = None


@dataclasses.dataclass(frozen=True)
class FailureReport:
    """Why a step failed, as one replica tells the others."""

    replica_id: str
    message: str

    @classmethod
    def of(cls, replica_id: str, error: BaseException) -> FailureReport:
        """The report of ``error`` on ``replica_id`` (its type and message, bounded)."""
        return cls(replica_id, f"{type(error).__name__}: {error}"[:MESSAGE_CHARS])

    def __str__(self) -> str:
        return f"{self.replica_id}: {self.message}"


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A step's commit decision, as every replica of its quorum reads it.

    Attributes:
        committed: Every rank of every member voted for the step; nobody failed it.
        reuse_quorum: The next step takes the same quorum one step on, without a round
            (nobody announced itself or asked to join since the quorum was decided).
        failure: When not committed: the failure a replica reported, if any was read.
        timed_out: When not committed: no decision came within the deadline (this
            replica then reported that as the step's failure).
    """

    committed: bool
    reuse_quorum: bool = False
    failure: FailureReport | None = None
    timed_out: bool = False


@dataclasses.dataclass(frozen=True)
class StepWatch:
    """What a step's watcher learns in one look (one store call for most replicas).

    Attributes:
        failure: The failure a replica reported for the step's quorum, if any.
        alive: The quorum's members alive now, as this rank sees them.
        registry_version: The registry version now (see
            :meth:`ReplicaCoordinator.registry_version`).
    """

    failure: FailureReport | None
    alive: frozenset[str]
    registry_version: int


def proposed_verdict(
    votes: int, quorum: Quorum, *, group_world_size: int, registry_version: int
) -> Verdict | None:
    """What the voter that cast vote number ``votes`` proposes as the step's verdict.

    Only the last voter proposes (every rank of every member group votes once): it
    proposes to reuse the quorum when no replica announced itself or asked to join a
    round since the quorum was decided, as far as ``registry_version`` (the registry
    version its watcher last read) tells; else a commit after which the next step
    holds a round.

    Returns:
        The proposal, or None when other voters are still to come.
    """
    if votes < len(quorum.members) * group_world_size:
        return None
    return Verdict(committed=True, reuse_quorum=registry_version <= quorum.registry_version)


@dataclasses.dataclass(frozen=True)
class CoordinatorSettings:
    """What a coordinator needs to know of its replica and of the protocol's times."""

    replica_id: str
    group_rank: int
    group_world_size: int
    min_replicas: int
    timeout: timedelta
    heartbeat_timeout: timedelta
    join_timeout: timedelta
    first_quorum_window: timedelta = timedelta(0)
    init_sync: bool = False


class WaitObserver(Protocol):
    """The Manager's side of the coordinator's blocking waits.

    The watcher ends a replica group's waits when the group breaks
    (:meth:`ReplicaCoordinator.break_group`) and the step's vote when its deadline
    passes; it learns what to end here. The tokens are opaque to the Manager.
    """

    def group_wait(self, *, arrival: str | None = None, awaited: str | None = None) -> str | None:
        """Records the group wait about to start; why the group broke, if it did."""

    def vote_wait(self, deadline: float | None) -> None:
        """The vote waits for the decision until ``deadline`` (None: it no longer waits)."""


class ReplicaCoordinator(Protocol):
    """The replica protocol of one rank of one replica (see the module doc).

    Blocking calls end by their deadline (a monotonic time) or the coordinator's
    timeout; an implementation raises
    :class:`~dist_collectives.ft.coordination.quorum.QuorumTimeoutError` when no quorum
    formed in time and :class:`~dist_collectives.ft.errors.ReplicaError` when the
    group's rank 0 could not get one for the group.
    """

    @property
    def group_name(self) -> str:
        """This replica group in this incarnation (a restarted group counts afresh)."""

    def join(self) -> None:
        """Checks the group's size against the job's, beats once, announces the replica.

        Raises:
            ManagerConfigError: This group's size differs from the job's groups'.
        """

    def quorum(self, request: JoinRequest, deadline: float) -> Quorum:
        """The quorum of the next step; in a replica group, rank 0 gets it for all ranks."""

    def drop(self, number: int) -> None:
        """Request ``number`` was superseded: the group's other ranks stop waiting for it."""

    def vote(
        self,
        quorum: Quorum,
        deadline: float,
        *,
        failure: FailureReport | None,
        registry_version: int,
    ) -> Verdict:
        """Votes for ``quorum``'s step (against it with ``failure``) and reads the verdict.

        Args:
            quorum: The step's quorum.
            deadline: When the wait for the verdict ends.
            failure: Why this replica's step failed; None votes for the commit.
            registry_version: The registry version the watcher last read.
        """

    def report(self, quorum: Quorum, failure: FailureReport) -> None:
        """Fails ``quorum``'s step for every replica, with ``failure`` as its reason."""

    def reported(self, quorum: Quorum) -> FailureReport | None:
        """The failure a replica reported for ``quorum``'s step, if any."""

    def decision(self, quorum: Quorum) -> Verdict | None:
        """``quorum``'s step's verdict, if it was decided."""

    def beat(self) -> None:
        """Advances this rank's heartbeat (group rank 0: the replica's too)."""

    def registry_version(self) -> int:
        """Counts replicas announced and requests to join rounds (the vote compares it)."""

    def stale_ranks(self) -> list[int]:
        """The ranks of this replica group it watches that stopped beating.

        Rank 0 watches every other rank; the others watch rank 0.
        """

    def alive_members(self, quorum: Quorum) -> set[str]:
        """The members of ``quorum`` alive now, as this rank sees them."""

    def watch(self, quorum: Quorum) -> StepWatch:
        """One look at ``quorum``'s step: a failure reported, who is alive, the registry.

        What :meth:`reported`, :meth:`alive_members` and :meth:`registry_version` answer,
        read together: the watcher's look at a step in flight, which every replica
        takes every few ticks, costs the store a constant number of calls.
        """

    def break_group(self, message: str, *, arrival: str | None, awaited: str | None) -> None:
        """This group broke for good: ends its ranks' waits; rank 0 leaves the quorum."""

    def leave(self) -> None:
        """Leaves for good (rank 0: the replica; another rank: its own heartbeat)."""

    def close(self) -> None:
        """Releases the connections; no call may follow."""
