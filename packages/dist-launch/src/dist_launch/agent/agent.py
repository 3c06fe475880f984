"""The agent: rendezvous, one local worker group per round, restarts within a budget.

One agent runs per node (one ``dist-launch`` process). Each round it joins the
rendezvous (:mod:`dist_launch.rendezvous.protocol`), runs this node's workers
(:class:`~dist_launch.agent.local_group.LocalGroup`) until they end, and then:

- all succeeded: waits for the other nodes (c10d: the exit barrier) and exits 0;
- one failed: with c10d the failure is shared with every node and counted once for the
  job; within ``--max-restarts`` every node stops its workers and rejoins (the others
  see this node waiting in the rendezvous); past it the job is closed on every node and
  each prints the report, the node and rank that failed first named;
- nodes wait to join (a late node under ``--nnodes MIN:MAX``, or a restarted one): the
  workers are stopped and the round re-formed; this is not a failure and costs no
  restart;
- no rank made progress for ``--hang-timeout`` (or a torch elastic timer expired; its
  server runs when ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` is in the environment):
  every rank's stack is taken and grouped, the ranks elsewhere named
  (:mod:`dist_launch.diagnostics.hang_report`), and the hang counts against ``--max-restarts`` as
  a failure does; past the budget the run ends ``hung``;
- a handled signal (``--signals-to-handle``) stops the workers with that signal and
  closes the rendezvous; ``SIGQUIT`` prints every rank's stack and stops nothing.

The agent works through the :class:`~dist_launch.rendezvous.protocol.Rendezvous` interface
alone: which backend forms the rounds is decided once, by
:func:`~dist_launch.rendezvous.factory.open_rendezvous`. Whatever ends the run becomes
a :class:`~dist_launch.agent.run_outcome.RunOutcome`, printed and turned into the exit
status in one place (:func:`~dist_launch.agent.run_outcome.report_run_outcome`).

The fork server is started once and kept warm across rounds, so a restart pays for the
script's own start-up but not for a new ``import torch``.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sys
import time
from dataclasses import replace
from functools import partial
from typing import Any

from dist_core.supervisor import GroupOutcome, Supervisor
from dist_launch.agent.event_loop import EventLoop, Pending
from dist_launch.agent.local_group import LocalGroup
from dist_launch.agent.run_outcome import HANG_EXIT_STATUS, RunOutcome, report_run_outcome
from dist_launch.agent.signal_inbox import DUMP_SIGNAL, SignalInbox
from dist_launch.diagnostics.hang_report import HangReport
from dist_launch.output.log_layout import LogLayout
from dist_launch.plan.launch_plan import LaunchPlan, describe_sources
from dist_launch.rendezvous.factory import open_rendezvous
from dist_launch.rendezvous.protocol import (
    Assignment,
    FailureRecord,
    Rendezvous,
    RendezvousUsageError,
    RoundChange,
)
from dist_launch.watch.file_timer import FileTimerWatch, file_timer_requested
from dist_launch.workers.environment import node_environment
from dist_launch.workers.fork_server_client import ForkServerClient, start_fork_server

logger = logging.getLogger(__name__)

PROG = "dist-launch"
# How many times an automatically chosen master port that turned out taken is replaced.
PORT_RETRIES = 3
_ADDRESS_IN_USE = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)
# The restart line, by whose budget --max-restarts is (see RestartScope).
_RESTARTING = {
    "node": "restarting the local worker group (restart %d of %d) after: %s",
    "job": "restarting the job (restart %d of %d, job-wide) after: %s",
}


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _address_in_use(outcome: GroupOutcome) -> bool:
    """True when the root cause's traceback says its master port was taken."""
    root = outcome.root_cause
    return (
        root is not None
        and root.record is not None
        and _ADDRESS_IN_USE.search(root.record.traceback) is not None
    )


class Agent:
    """Runs a :class:`LaunchPlan` on this node; see the module docstring."""

    def __init__(
        self,
        plan: LaunchPlan,
        *,
        loop: EventLoop | None = None,
        fork_server: ForkServerClient | None = None,
    ) -> None:
        self.plan = plan
        # The one loop of the launcher: the CLI makes it first, for the fork server.
        self.loop = loop if loop is not None else EventLoop()
        # Started by the caller before it imported this module, when it could: the fork
        # server's import of torch is the longest step of a start.
        self._fork_server = fork_server
        self._rdzv: Rendezvous | None = None
        self.inbox: SignalInbox | None = None
        self._supervisor: Supervisor | None = None
        self._interrupted: int | None = None  # the first stopping signal received
        self._change: RoundChange | None = None  # why the rendezvous asked for a new round
        self._timers: FileTimerWatch | None = None  # torch elastic's timer server
        self._longest_quiet = 0.0  # what --hang-timeout auto learned, over every round

    # -- events ---------------------------------------------------------------------

    def _received(self) -> int | None:
        """The first stopping signal received (set by the signal callback)."""
        return self._interrupted

    def _rendezvous_change(self) -> RoundChange | None:
        """Why the rendezvous asked for a new round (set by the watcher thread)."""
        return self._change

    def _set_supervisor(self, supervisor: Supervisor | None) -> None:
        self._supervisor = supervisor
        if supervisor is not None and self._interrupted is not None:
            supervisor.interrupt(self._interrupted)

    def _on_signal(self) -> None:
        assert self.inbox is not None
        for signum in self.inbox.take():
            if signum == DUMP_SIGNAL:
                self._dump_stacks()
                continue
            if self._interrupted is None:
                self._interrupted = signum
            if self._supervisor is not None:
                self._supervisor.interrupt(signum)

    def _dump_stacks(self) -> None:
        supervisor = self._supervisor
        if supervisor is None:
            _say("SIGQUIT: no workers are running")
            return
        from dist_launch.diagnostics.stacks import format_stack_dump  # noqa: PLC0415

        supervisor.dump_stacks()
        print(
            format_stack_dump(supervisor.outcomes, "SIGQUIT; nothing stopped"),
            file=sys.stderr,
            flush=True,
        )

    def _on_change(self, why: RoundChange) -> None:
        """On the loop (posted by the watch's thread): the round must end."""
        self._change = why
        if self._supervisor is not None:
            self._supervisor.interrupt(signal.SIGTERM)

    # -- the run --------------------------------------------------------------------

    def _wait_for(self, pending: Pending[Any]) -> bool:
        """Serves signals until ``pending`` is done; False when interrupted first."""
        self.loop.run_until(lambda: pending.done or self._interrupted is not None)
        return pending.done

    def run(self) -> int:
        """Runs the job, reports how it ended; returns the exit status."""
        plan = self.plan
        logger.info("%s", describe_sources(plan))
        self.inbox = SignalInbox((*plan.signals_to_handle, DUMP_SIGNAL))
        self.loop.watch(self.inbox.read_fd, self._on_signal)
        node_env = node_environment(plan, os.environ)
        self.layout: LogLayout | None = None
        if plan.routing.needs_files(range(plan.nproc)):
            self.layout = LogLayout.create(plan.log_dir, plan.run_id)
            logger.info("logs of this run: %s", self.layout.run_dir)
        try:
            # Reported before the cleanup below, which may wait for a silent store.
            return report_run_outcome(self._run(node_env), PROG)
        finally:
            if self._timers is not None:
                self._timers.close()
            if self._fork_server is not None:
                self._fork_server.close()
            if self._rdzv is not None:
                self._rdzv.close()
            self.loop.unwatch(self.inbox.read_fd)
            self.inbox.close()
            self.loop.close()

    def _run(self, node_env: dict[str, str]) -> RunOutcome:
        plan = self.plan
        # Connecting may wait for the endpoint's node (torch's read_timeout): on a
        # thread, so that Ctrl-C is served meanwhile.
        connecting = self.loop.call_in_thread(lambda: open_rendezvous(plan), "rendezvous-connect")
        if not self._wait_for(connecting):
            return self._interrupted_outcome(None)
        error = connecting.error
        if isinstance(error, RendezvousUsageError):
            return RunOutcome("usage", message=str(error))
        if error is not None:
            return RunOutcome("rendezvous_failed", message=f"error: {error}")
        rdzv: Rendezvous = connecting.result
        self._rdzv = rdzv
        if file_timer_requested(os.environ):
            try:
                self._timers = FileTimerWatch(plan.run_id)
            except (ImportError, OSError) as error:
                return RunOutcome(
                    "start_failed",
                    message=f"error: TORCHELASTIC_ENABLE_FILE_TIMER=1, but torch's "
                    f"FileTimerServer could not be started: {error}",
                )
        if self._fork_server is None:
            self._fork_server = start_fork_server(plan, self.loop)
        return self._rounds(rdzv, node_env, self._fork_server)

    def _interrupted_outcome(
        self, rdzv: Rendezvous | None, group: GroupOutcome | None = None
    ) -> RunOutcome:
        signum = self._interrupted
        assert signum is not None
        if rdzv is not None:
            name = signal.Signals(signum).name
            rdzv.close_job(f"node {socket.gethostname()} was interrupted by {name}")
        return RunOutcome("interrupted", group, signum=signum)

    def _join(self, rdzv: Rendezvous) -> Assignment | RunOutcome:
        """The next round's assignment, or how the run ended."""
        joining = self.loop.call_in_thread(rdzv.next_round, "rendezvous-join")
        if not self._wait_for(joining):
            return self._interrupted_outcome(rdzv)
        error = joining.error
        if error is not None:
            reason = rdzv.closing_reason()
            if reason is not None:
                return RunOutcome("closed", message=f"the job was closed: {reason}")
            plan = self.plan
            return RunOutcome(
                "rendezvous_failed",
                message=f"error: rendezvous {plan.rdzv_id!r} at {plan.rdzv_endpoint} failed: "
                f"{type(error).__name__}: {error}",
            )
        assignment: Assignment = joining.result
        return assignment

    def _rounds(
        self, rdzv: Rendezvous, node_env: dict[str, str], fork_server: ForkServerClient | None
    ) -> RunOutcome:
        plan = self.plan
        deadline = None if plan.timeout is None else time.monotonic() + plan.timeout
        port_retries = 0
        attempt = 0
        while True:
            if self._received() is not None:
                return self._interrupted_outcome(rdzv)
            joined = self._join(rdzv)
            if isinstance(joined, RunOutcome):
                return joined
            assignment = joined
            self._change = None
            watch = rdzv.watch(
                plan.monitor_interval, lambda why: self.loop.post(partial(self._on_change, why))
            )
            board = (
                rdzv.progress_board(plan.hang_policy.look_period)
                if plan.hang_policy.enabled
                else None
            )
            group = LocalGroup(
                plan,
                assignment,
                node_env,
                self.loop,
                fork_server,
                self._set_supervisor,
                self.layout,
                self._timers,
                self._longest_quiet,
                board,
            )
            remaining = None if deadline is None else max(0.01, deadline - time.monotonic())
            try:
                outcome = group.run(attempt, remaining)
            except (OSError, RuntimeError) as error:
                return RunOutcome(
                    "start_failed", message=f"error: could not start the workers: {error}"
                )
            finally:
                watch.stop()
                self.loop.run_posted()  # a change the watch saw before it stopped
                if board is not None:
                    board.stop()
                group.cleanup()
                self._longest_quiet = group.watch.quiet.longest_quiet
            attempt += 1
            if outcome.status == "succeeded":
                rdzv.exit_barrier()
                return RunOutcome("succeeded", outcome)
            if self._received() is not None:
                return self._interrupted_outcome(rdzv, outcome)
            if group.hang is not None:
                ended = self._after_hang(rdzv, assignment, outcome, group.hang)
                if ended is not None:
                    return ended
                continue
            change = self._rendezvous_change()
            if change is not None and outcome.status == "interrupted":
                if change.kind == "closed":
                    reason = rdzv.closing_reason() or "no reason given"
                    return RunOutcome(
                        "closed", message=f"the job was closed by another node: {reason}"
                    )
                if change.kind == "unreachable":
                    return RunOutcome(
                        "rendezvous_failed", message=f"error: {change}; this node stops"
                    )
                logger.info("%s: stopping this node's workers to re-form the job", change)
                continue
            if outcome.status == "timed_out":
                outcome.timeout = plan.timeout  # the job's, not this round's remainder
                rdzv.close_job(f"node {assignment.group_rank} timed out (--timeout)")
                return RunOutcome("timed_out", outcome)
            if port_retries < PORT_RETRIES and _address_in_use(outcome):
                replaced = rdzv.replace_master_port()
                if replaced is not None:
                    port_retries += 1
                    logger.warning("master port %d was taken meanwhile; retrying on %d", *replaced)
                    continue
            ended = self._after_failure(rdzv, assignment, outcome)
            if ended is not None:
                return ended

    def _after_failure(
        self, rdzv: Rendezvous, assignment: Assignment, outcome: GroupOutcome
    ) -> RunOutcome | None:
        """Counts the failure against the budget; None to restart, else how the run ended."""
        record = FailureRecord.of_round(outcome, assignment.group_rank)
        if record.consequence and rdzv.membership_changing():
            # Peers went away because the job is re-forming (a node restarted or
            # left); the node that failed first counts the failure, if it was one.
            logger.info(
                "this node's ranks lost their peers while the job re-forms; "
                "rejoining (not counted as a restart)"
            )
            return None
        return self._count(rdzv, record, RunOutcome("failed", outcome))

    def _after_hang(
        self, rdzv: Rendezvous, assignment: Assignment, outcome: GroupOutcome, hang: HangReport
    ) -> RunOutcome | None:
        """Counts a hang as a failure; None to restart (after its report), else the end."""
        # The odd rank out, else this node's first rank: the record names a rank.
        odd = hang.odd_rank
        if odd is None:
            odd = min(hang.stacks, default=assignment.base_rank)
        record = FailureRecord(
            node=socket.gethostname(),
            group_rank=assignment.group_rank,
            rank=odd,
            timestamp=time.time(),
            summary=f"hang: {hang.summary}",
            # Every rank here waits in the same place: the rank they wait for, if any
            # node can name it, is another node's.
            consequence=hang.odd_rank is None,
        )
        print(hang.format(PROG), file=sys.stderr, flush=True)
        final = RunOutcome(
            "hung",
            outcome,
            message=f"the group hung and no restart is left (--max-restarts "
            f"{self.plan.max_restarts}): exit status {HANG_EXIT_STATUS}",
        )
        return self._count(rdzv, record, final)

    def _count(
        self, rdzv: Rendezvous, record: FailureRecord, final: RunOutcome
    ) -> RunOutcome | None:
        """Counts ``record`` against the budget; None to restart, else ``final``."""
        plan = self.plan
        try:
            count = rdzv.count_failure(record)
        except Exception as error:
            return replace(
                final, message=f"the rendezvous store is unreachable ({error}); cannot restart"
            )
        if count.restarts <= plan.max_restarts:
            logger.warning(
                _RESTARTING[count.scope], count.restarts, plan.max_restarts, count.first_failure
            )
            return None
        if count.scope == "node":
            return final
        why = (
            f"restart budget spent ({plan.max_restarts} job-wide); "
            f"first failure: {count.first_failure}"
        )
        rdzv.close_job(why)
        return replace(final, message=why)
