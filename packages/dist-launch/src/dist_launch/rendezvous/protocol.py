"""How this node learns its place in the job: the one interface the agent works through.

A :class:`Rendezvous` forms each round of the job (:meth:`~Rendezvous.next_round`),
counts failed rounds against ``--max-restarts``, watches for a reason to re-form the
round while the workers run, and tells the other nodes when this one closes the job.
Three implementations, chosen by :func:`dist_launch.rendezvous.factory.open_rendezvous`:

- :class:`~dist_launch.rendezvous.static.StaticRendezvous` (``--rdzv-backend static``):
  every node is told its rank; restarts are counted per node, nothing is shared.
- :class:`~dist_launch.rendezvous.c10d.C10dRendezvous` (``--rdzv-backend c10d``):
  torch elastic's own c10d rendezvous, with a job-wide restart budget on its store.
- :class:`~dist_launch.rendezvous.etcd.EtcdRendezvous` (``--rdzv-backend etcd``): the
  same, its state and store in etcd, so that no node's loss ends the job.

This module holds the interface and the values that cross it; it imports neither
implementation (as torch elastic's ``RendezvousHandler`` knows none of its backends).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from dist_core.supervisor import GroupOutcome
from dist_launch.diagnostics.failure_report import one_line_cause
from dist_launch.rendezvous.job_board import JobBoard


@dataclass(frozen=True)
class Assignment:
    """This node's place in one round of the job."""

    group_rank: int
    group_world_size: int
    base_rank: int  # the global rank of local rank 0
    world_size: int
    master_addr: str
    master_port: int
    restart_count: int  # failed rounds so far (this node's or job-wide, see RestartScope)


@dataclass(frozen=True)
class FailureRecord:
    """One node's first failure of a round, as shared with the other nodes."""

    node: str
    group_rank: int
    rank: int
    timestamp: float
    summary: str
    # True when this node's ranks only lost, or wait on, a peer elsewhere: its record is
    # an effect, and another node's record (if one comes) names the cause.
    consequence: bool = False
    # The class of the failure (diagnostics.failure_class's FailureKind: "error",
    # "deterministic", "infrastructure"); "" when it has none (a hang, a cut). Every
    # node of the job exits with the class of the round's first failure.
    kind: str = ""

    def describe(self) -> str:
        """``rank 5 on node 1 (host-b): ValueError: ...``."""
        return f"rank {self.rank} on node {self.group_rank} ({self.node}): {self.summary}"

    @classmethod
    def of_round(cls, outcome: GroupOutcome, group_rank: int) -> FailureRecord:
        """This node's record of a failed round: its root cause, or the round's status."""
        root = outcome.root_cause
        failed = [rank for rank in outcome.ranks if rank.status == "failed"]
        return cls(
            node=socket.gethostname(),
            group_rank=group_rank,
            rank=root.rank if root is not None else -1,
            timestamp=root.failure_time if root is not None else time.time(),
            summary=one_line_cause(outcome),
            consequence=bool(failed) and all(rank.is_peer_failure for rank in failed),
        )

    @property
    def precedence(self) -> tuple[bool, float, int]:
        """Sort key of a round's records: causes before consequences, then earliest."""
        return (self.consequence, self.timestamp, self.rank)


# Whose budget ``--max-restarts`` is: this node's (torchrun's static meaning) or the
# whole job's (c10d: a failure is counted once, on whichever node reports it first).
RestartScope = Literal["node", "job"]


@dataclass(frozen=True)
class FailureCount:
    """A failed round, as the rendezvous counted it against ``--max-restarts``."""

    restarts: int  # failed rounds counted so far, this one included
    scope: RestartScope
    first_failure: str  # the round's earliest failure, described for the log
    first_kind: str = ""  # that failure's class (FailureRecord.kind), "" when unknown


ChangeKind = Literal["closed", "unreachable", "membership"]


@dataclass(frozen=True)
class RoundChange:
    """Why the current round must end although no worker failed.

    ``closed``: a node closed the job; ``unreachable``: the rendezvous store stopped
    answering; ``membership``: nodes are waiting to join or were lost, and the job
    re-forms (no failure, no restart counted).
    """

    kind: ChangeKind
    detail: str = ""

    def __str__(self) -> str:
        if self.kind == "membership":
            return self.detail
        return f"{self.kind}: {self.detail}" if self.detail else self.kind


class RoundWatch(Protocol):
    """A watch over the current round, started by :meth:`Rendezvous.watch`."""

    def stop(self) -> None:
        """Stops watching (bounded); calling it again does nothing."""


class NoWatch:
    """The watch of a rendezvous whose rounds never change on their own."""

    def stop(self) -> None:
        """Nothing to stop."""


class RendezvousUsageError(Exception):
    """The plan cannot run as given (a master port already taken); exit status 2."""


class Rendezvous(Protocol):
    """What the agent needs from a rendezvous, whichever backend forms the rounds."""

    def next_round(self) -> Assignment:
        """Joins the next round; returns this node's place in it.

        May block (waiting for other nodes); the agent calls it on a thread.

        Raises:
            Exception: The round could not be formed (the job was closed, too few
                nodes joined in time, the store is gone); :meth:`closing_reason`
                says whether a node closed the job.
        """

    def watch(self, interval: float, on_change: Callable[[RoundChange], None]) -> RoundWatch:
        """Calls ``on_change`` once, from a thread, if the current round must end."""

    def count_failure(self, record: FailureRecord) -> FailureCount:
        """Counts this node's failed round against the restart budget.

        Raises:
            Exception: The count could not be shared (the store is unreachable).
        """

    def membership_changing(self) -> bool:
        """True when nodes wait to join or were lost: peers vanish without a failure."""

    def replace_master_port(self) -> tuple[int, int] | None:
        """After the master port was found taken: ``(old, new)``, or None if fixed."""

    def close_job(self, why: str) -> None:
        """Stops the job on every node, saying ``why``; never raises."""

    def can_leave(self) -> bool:
        """Whether this node may leave the job while the others go on without it.

        True on an elastic rendezvous (``--nnodes MIN:MAX``) whose current round keeps
        at least ``MIN`` nodes without this one; a stopped node then leaves
        (:meth:`leave`) instead of closing the job.
        """

    def leave(self, why: str) -> None:
        """Leaves the job for good (preempted), saying ``why``; never raises.

        The others re-form without this node, and nothing is counted against the
        restart budget. :meth:`close` then releases what is left without closing the
        job.
        """

    def closing_reason(self) -> str | None:
        """What the node that closed the job said, if one did."""

    def job_board(self, period: float) -> JobBoard | None:
        """This round's job board (progress, a hang's alarm, reports), every ``period`` s.

        None when the nodes share no store (static rendezvous) or the round has one
        node: the hang watch then judges this node's ranks alone, and a hang's verdict
        covers this node's ranks.
        """

    def exit_barrier(self) -> None:
        """After success, waits (bounded) until every node of the round finished."""

    def close(self) -> None:
        """Releases what the rendezvous holds (ports, heartbeats); idempotent."""
