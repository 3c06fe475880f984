"""What the agent does after a round: the decision, apart from carrying it out.

:func:`decide_next` reads a round's :class:`~dist_launch.agent.round.RoundResult` and
returns one action; the agent (:mod:`dist_launch.agent.agent`) carries it out, which is
where the rendezvous is called. An action that needs the rendezvous's answer to go on
(:class:`CountFailure`, :class:`ReplacePort`) says what comes next for each answer:
:func:`decide_after_count` decides after a count. Pure: the tests feed results and
read actions, one row each (as torch elastic's dynamic rendezvous decides its next
action apart from the loop that runs it).

The rows, in order:

=============================================  =========================================
the round ended ...                            action
=============================================  =========================================
with every rank succeeded                      :class:`ExitBarrier`, then the run succeeds
after the launcher got a stopping signal       :class:`End` ``interrupted``: this node leaves
                                               an elastic job that keeps its minimum
                                               without it, else the job is closed
without starting its workers                   :class:`End` ``start_failed``
hung (``--hang-timeout``, a torch elastic       :class:`CountFailure`, then ``hung``
timer)
because a node closed the job                  :class:`JobClosed`
because the store stopped answering            :class:`End` ``rendezvous_failed``
because nodes join or left                     :class:`Rejoin` (no restart spent)
at ``--timeout``                               :class:`End` ``timed_out``, the job closed
failed on a master port taken meanwhile        :class:`ReplacePort` (at most PORT_RETRIES)
failed deterministically (an error before the  :class:`End` ``failed`` (no restart spent),
process group existed, or the same error at    the job closed
the same place as the last time)
failed, only losing peers while the job        :class:`Rejoin` (no restart spent)
re-forms
failed                                         :class:`CountFailure`, then ``failed``
=============================================  =========================================

After a count (:func:`decide_after_count`): within ``--max-restarts`` :class:`Restart`;
past it :class:`End` (with c10d the job is closed on every node, saying why); a count
that could not be shared ends the run, the store named.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, cast, get_args

from dist_launch.agent.run_outcome import RunOutcome
from dist_launch.diagnostics.failure_class import FailureKind
from dist_launch.exit_codes import ExitCode
from dist_launch.rendezvous.protocol import FailureCount, FailureRecord

if TYPE_CHECKING:
    from dist_launch.agent.round import RoundResult

# How many times an automatically chosen master port that turned out taken is replaced.
PORT_RETRIES = 3
# The restart line, by whose budget --max-restarts is (see RestartScope).
_RESTARTING = {
    "node": "restarting the local worker group (restart {} of {}) after: {}",
    "job": "restarting the job (restart {} of {}, job-wide) after: {}",
}


@dataclass(frozen=True)
class End:
    """The run ends with ``outcome``.

    With ``close_job``, every node is told why first; with ``leave``, this node leaves
    the job and the others go on without it (a preempted node of an elastic job).
    """

    outcome: RunOutcome
    close_job: str | None = None
    leave: str | None = None


@dataclass(frozen=True)
class JobClosed:
    """Another node closed the job: the run ends ``closed``, with that node's reason."""


@dataclass(frozen=True)
class ExitBarrier:
    """Every rank here succeeded: wait for the other nodes (c10d), then end with ``outcome``."""

    outcome: RunOutcome


@dataclass(frozen=True)
class Rejoin:
    """Join the next round; nothing is counted. ``reason`` goes to the launcher's log."""

    reason: str


@dataclass(frozen=True)
class Restart:
    """A failure was counted within the budget: join the next round, logging ``message``."""

    message: str


@dataclass(frozen=True)
class CountFailure:
    """Count ``record`` against the budget; :func:`decide_after_count` takes the answer.

    ``final`` is how the run ends once the budget is spent.
    """

    record: FailureRecord
    final: RunOutcome


@dataclass(frozen=True)
class ReplacePort:
    """Ask the rendezvous for another master port and rejoin; ``otherwise`` if it has none."""

    otherwise: CountFailure


Action = End | JobClosed | ExitBarrier | Rejoin | Restart | CountFailure | ReplacePort


def needs_membership(result: RoundResult) -> bool:
    """Whether :func:`decide_next` reads ``membership_changing`` for ``result``.

    Only a failed round whose ranks merely lost their peers does: the agent asks the
    store then and only then.
    """
    return result.ending == "failed" and result.record is not None and result.record.consequence


def decide_next(
    result: RoundResult,
    *,
    interrupted: int | None,
    port_retries: int,
    membership_changing: bool,
    node_rank: int,
    host: str,
    max_restarts: int,
    can_leave: bool = False,
) -> Action:
    """The agent's next action after a round (the rows in the module docstring).

    Args:
        result: How the round ended.
        interrupted: The first stopping signal the launcher received, if any.
        port_retries: Master ports replaced so far in this run.
        membership_changing: Whether nodes wait to join or were lost (read only when
            :func:`needs_membership` says so; False otherwise).
        node_rank: This node's rank in the round.
        host: This node's host name.
        max_restarts: ``--max-restarts``.
        can_leave: Whether the job goes on without this node (an elastic rendezvous
            whose round keeps its minimum without it).
    """
    group = result.group
    if result.ending == "succeeded":
        return ExitBarrier(RunOutcome("succeeded", group))
    if interrupted is not None:
        why = f"node {host} was interrupted by {signal.Signals(interrupted).name}"
        outcome = RunOutcome("interrupted", group, signum=interrupted)
        if can_leave:
            # A preempted node of an elastic job: the others re-form without it.
            return End(outcome, leave=f"{why}; the other nodes go on without it")
        return End(outcome, close_job=why)
    if result.ending == "start_failed":
        return End(RunOutcome("start_failed", message=result.message))
    if result.ending == "hung":
        assert result.record is not None
        final = RunOutcome(
            "hung",
            group,
            message=f"the group hung and no restart is left (--max-restarts "
            f"{max_restarts}): exit status {int(ExitCode.HUNG)}",
        )
        return CountFailure(result.record, final)
    if result.ending == "changed":
        assert result.change is not None
        if result.change.kind == "closed":
            return JobClosed()
        if result.change.kind == "unreachable":
            return End(
                RunOutcome("rendezvous_failed", message=f"error: {result.change}; this node stops")
            )
        return Rejoin(f"{result.change}: stopping this node's workers to re-form the job")
    if result.ending == "timed_out":
        return End(
            RunOutcome("timed_out", group), close_job=f"node {node_rank} timed out (--timeout)"
        )
    if result.ending == "interrupted":
        # A signal forwarded to the workers that the launcher did not count as stopping.
        signum = group.signum if group is not None else None
        return End(RunOutcome("interrupted", group, signum=signum or signal.SIGTERM))
    assert result.record is not None
    failure = result.failure
    kind = None if failure is None else failure.kind
    count = CountFailure(result.record, RunOutcome("failed", group, failure=kind))
    if result.address_in_use and port_retries < PORT_RETRIES:
        return ReplacePort(otherwise=count)
    if failure is not None and failure.kind == "deterministic":
        # Named by rank and node: the other nodes print this as the job's closing reason.
        record = result.record
        why = (
            f"not restarting: rank {record.rank} on node {record.group_rank} ({record.node}): "
            f"{failure.why} (a restart would fail the same way)"
        )
        return End(RunOutcome("failed", group, message=why, failure=kind), close_job=why)
    if result.record.consequence and membership_changing:
        # Peers went away because the job is re-forming (a node restarted or left);
        # the node that failed first counts the failure, if it was one.
        return Rejoin(
            "this node's ranks lost their peers while the job re-forms; "
            "rejoining (not counted as a restart)"
        )
    return count


def decide_after_count(
    count: FailureCount | Exception, final: RunOutcome, max_restarts: int
) -> Restart | End:
    """After a failure was counted (or could not be): restart, or end with ``final``."""
    if isinstance(count, Exception):
        return End(
            replace(final, message=f"the rendezvous store is unreachable ({count}); cannot restart")
        )
    if count.restarts <= max_restarts:
        return Restart(
            _RESTARTING[count.scope].format(count.restarts, max_restarts, count.first_failure)
        )
    if count.scope == "node":
        return End(final)
    why = f"restart budget spent ({max_restarts} job-wide); first failure: {count.first_failure}"
    return End(replace(final, message=why, failure=_job_kind(count, final)), close_job=why)


def _job_kind(count: FailureCount, final: RunOutcome) -> FailureKind | None:
    """The class this node exits with: the job's first failure's, where it has one.

    A node whose ranks only lost their peers would exit 137 (infrastructure) while the
    node of the cause, a ValueError, exits 1: a scheduler told to requeue on 137 would
    rerun a job that fails the same way. The first failure's class decides for all.
    """
    kind = count.first_kind
    if final.status == "failed" and kind in get_args(FailureKind):
        return cast(FailureKind, kind)
    return final.failure
