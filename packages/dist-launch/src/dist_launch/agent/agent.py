"""The agent: rendezvous, one :class:`~dist_launch.agent.round.Round` at a time, restarts.

One agent runs per node (one ``dist-launch`` process). It joins the rendezvous
(:mod:`dist_launch.rendezvous.protocol`), runs one round of this node's workers
(:class:`~dist_launch.agent.round.Round`, which returns one
:class:`~dist_launch.agent.round.RoundResult`), asks the pure
:func:`~dist_launch.agent.next_step.decide_next` what comes next, and carries it out:

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
  closes the rendezvous: sent to each worker once, or not at all when it reached
  every process of the job already (a scheduler's stop, seen by the
  :class:`~dist_launch.workers.signal_witness.SignalWitness`), then the grace period
  for checkpoints; ``--signals-to-forward`` signals are passed on to every worker the
  same way, stopping nothing; ``SIGQUIT`` prints every rank's stack and stops nothing;
  ``SIGWINCH`` resizes the workers' terminals.

The agent works through the :class:`~dist_launch.rendezvous.protocol.Rendezvous` interface
alone: which backend forms the rounds is decided once, by
:func:`~dist_launch.rendezvous.factory.open_rendezvous`. Whatever ends the run becomes
a :class:`~dist_launch.agent.run_outcome.RunOutcome`, printed and turned into the exit
status in one place (:func:`~dist_launch.agent.run_outcome.report_run_outcome`). Every
wait is served by the launcher's one :class:`~dist_launch.agent.event_loop.EventLoop`.

The fork server is started once and kept warm across rounds, so a restart pays for the
script's own start-up but not for a new ``import torch``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from dist_launch.agent.event_loop import EventLoop, Pending
from dist_launch.agent.next_step import (
    Action,
    CountFailure,
    End,
    ExitBarrier,
    JobClosed,
    Rejoin,
    ReplacePort,
    Restart,
    decide_after_count,
    decide_next,
    needs_membership,
)
from dist_launch.agent.round import Round, RoundContext
from dist_launch.agent.run_outcome import RunOutcome, error_file_fields, report_run_outcome
from dist_launch.agent.signal_inbox import DUMP_SIGNAL, SignalInbox
from dist_launch.diagnostics.failure_class import Fingerprint
from dist_launch.exit_codes import ExitCode
from dist_launch.output.log_layout import LogLayout, write_torch_error_file
from dist_launch.output.scratch import sweep_dead_scratch_dirs
from dist_launch.plan.kill_wait import read_kill_wait
from dist_launch.plan.launch_plan import LaunchPlan, UsageError, describe_sources
from dist_launch.plan.run_identity import node_log_folder
from dist_launch.plan.timeout_budget import TimeoutBudget, pg_timeout, timeout_budget
from dist_launch.rendezvous.factory import open_rendezvous
from dist_launch.rendezvous.protocol import Assignment, Rendezvous, RendezvousUsageError
from dist_launch.watch.cut_watch import fencing_bound
from dist_launch.watch.file_timer import FileTimerWatch, file_timer_requested
from dist_launch.workers.environment import node_environment
from dist_launch.workers.fork_server_client import ForkServerClient, start_fork_server
from dist_launch.workers.signal_witness import SignalWitness

logger = logging.getLogger(__name__)

PROG = "dist-launch"
# The launcher's terminal was resized: the workers' pseudo-terminals follow.
RESIZE_SIGNAL = signal.SIGWINCH


# How long a node whose ranks only lost their peers waits for the rendezvous to show
# a node leaving (or lost) before it counts the round as failed.
MEMBERSHIP_SETTLE_SECONDS = 1.0


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


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
        self._round: Round | None = None  # the round in progress
        self._interrupted: int | None = None  # the first stopping signal received
        self._timers: FileTimerWatch | None = None  # torch elastic's timer server
        self._witness: SignalWitness | None = None  # which signals reached the workers
        self._leaving: Pending[None] | None = None  # this node leaving an elastic job
        self.layout: LogLayout | None = None
        # torchrun's parent-facing error file: where this launcher reports its own end.
        self._error_file = os.environ.get("TORCHELASTIC_ERROR_FILE") or None
        self._budget: TimeoutBudget | None = None  # the run's clocks, once read

    # -- signals ----------------------------------------------------------------------

    def _on_signal(self) -> None:
        assert self.inbox is not None
        for signum in self.inbox.take():
            if signum == DUMP_SIGNAL:
                self._dump_stacks()
            elif signum == RESIZE_SIGNAL:
                if self._round is not None:
                    self._round.resize()
            elif signum in self.plan.signals_to_forward:
                self._forward(signum)
            else:
                delivered = self._reached_the_workers(signum)
                if self._interrupted is None:
                    self._interrupted = signum
                    self._leave_early(signum)
                if self._round is not None:
                    self._round.interrupt(signum, delivered=delivered)

    def _reached_the_workers(self, signum: int) -> bool:
        """Whether ``signum`` was sent to every process of the job, the workers included.

        The witness, placed as a worker is, says so (waiting a moment for its copy).
        """
        if self._witness is None or not self._witness.saw(signum):
            return False
        logger.info(
            "%s reached every process of the job, the workers too: not sent again",
            signal.Signals(signum).name,
        )
        return True

    def _forward(self, signum: int) -> None:
        """A --signals-to-forward signal: every worker gets it once; nothing stops."""
        if self._reached_the_workers(signum):
            return
        name = signal.Signals(signum).name
        ranks = [] if self._round is None else self._round.notify(signum)
        if ranks:
            logger.info("passed %s on to rank(s) %s", name, ranks)
        else:
            logger.info("%s: no workers are running; not passed on", name)

    def _leave_early(self, signum: int) -> None:
        """A stopped node of an elastic job leaves at once, before its workers end.

        Its workers' peers on the other nodes fail as soon as the workers exit; when
        the others' launchers look, the rendezvous already shows this node gone, so
        they re-form without it and count no failure (a preemption of one node).
        """
        rdzv = self._rdzv
        if rdzv is None or self._round is None or not rdzv.can_leave():
            return
        why = f"node {socket.gethostname()} was interrupted by {signal.Signals(signum).name}"
        self._start_leaving(rdzv, f"{why}; the other nodes go on without it")

    def _start_leaving(self, rdzv: Rendezvous, why: str) -> None:
        if self._leaving is None:
            self._leaving = self.loop.call_in_thread(lambda: rdzv.leave(why), "rendezvous-leave")

    def _finish_leaving(self) -> None:
        """Waits for the leave (bounded: it is bounded itself) to be written."""
        leaving = self._leaving
        if leaving is not None:
            self.loop.run_until(lambda: leaving.done)

    def _received(self) -> int | None:
        """The first stopping signal received (set by the signal callback, on the loop)."""
        return self._interrupted

    def _dump_stacks(self) -> None:
        text = None if self._round is None else self._round.dump_stacks()
        if text is None:
            _say("SIGQUIT: no workers are running")
        else:
            print(text, file=sys.stderr, flush=True)

    def _wait_for(self, pending: Pending[Any]) -> bool:
        """Serves signals until ``pending`` is done; False when interrupted first."""
        self.loop.run_until(lambda: pending.done or self._interrupted is not None)
        return pending.done

    # -- the run ----------------------------------------------------------------------

    def run(self) -> int:
        """Runs the job, reports how it ended; returns the exit status."""
        plan = self.plan
        logger.info("%s", describe_sources(plan))
        handled = (*plan.signals_to_handle, *plan.signals_to_forward, DUMP_SIGNAL)
        self.inbox = SignalInbox((*handled, RESIZE_SIGNAL))
        self.loop.watch(self.inbox.read_fd, self._on_signal)
        self._witness = SignalWitness(handled)
        sweep_dead_scratch_dirs()
        node_env = node_environment(plan, os.environ)
        if plan.routing.needs_files(range(plan.nproc)):
            folder = node_log_folder(
                several_nodes=plan.max_nodes > 1,
                elastic=plan.elastic,
                node_rank=plan.node_rank,
                host=socket.gethostname(),
            )
            self.layout = LogLayout.create(plan.log_dir, plan.run_id, folder)
            logger.info("logs of this run: %s", self.layout.launcher_dir)
        try:
            # Reported before the cleanup below, which may wait for a silent store.
            outcome = self._run(node_env)
            code = report_run_outcome(outcome, PROG)
            self._write_error_files(outcome, code)
            return code
        finally:
            if self._witness is not None:
                self._witness.close()
            if self._timers is not None:
                self._timers.close()
            if self._fork_server is not None:
                self._fork_server.close()
            if self._rdzv is not None:
                self._rdzv.close()
            self.loop.unwatch(self.inbox.read_fd)
            self.inbox.close()
            self.loop.close()

    def _write_error_files(self, outcome: RunOutcome, code: ExitCode) -> None:
        """The run's error.json (in torch's format, with the exit code and its class).

        Written for every ending but success: in ``--log-dir``'s run directory, and to
        ``TORCHELASTIC_ERROR_FILE`` when the launcher's own environment names one.
        """
        if code == ExitCode.SUCCESS:
            return
        paths = [] if self.layout is None else [self.layout.launcher_dir / "error.json"]
        if self._error_file is not None:
            paths.append(Path(self._error_file))
        message, traceback, timestamp = error_file_fields(outcome)
        extra: dict[str, object] = {"exit_code": int(code), "exit_class": code.name}
        if self._budget is not None:
            extra["timeouts"] = self._budget.as_json()
        for path in paths:
            try:
                write_torch_error_file(
                    path, message=message, traceback=traceback, timestamp=timestamp, extra=extra
                )
            except OSError as error:
                logger.warning("could not write %s: %s", path, error)

    def _check_timeouts(self) -> RunOutcome | None:
        """Reads the timeout budget, says what is wrong, and takes its grace period.

        Reads ``DIST_LAUNCH_KILL_WAIT``, ``DIST_LAUNCH_PG_TIMEOUT`` and the variables
        of :func:`~dist_launch.plan.kill_wait.read_kill_wait` and
        :func:`~dist_launch.plan.timeout_budget.pg_timeout`.

        Returns:
            A usage outcome when an inversion guarantees a bad ending; else None.
        """
        try:
            budget = timeout_budget(
                self.plan,
                pg_timeout(os.environ),
                read_kill_wait(os.environ),
                fencing_bound(self.plan),
            )
        except UsageError as error:
            return RunOutcome("usage", message=f"error: {error}")
        self._budget = budget
        if self.plan.verbose:
            for line in budget.lines():
                logger.info("%s", line)
        for warning in budget.problems.warnings:
            logger.warning("%s", warning)
        if budget.problems.errors:
            return RunOutcome(
                "usage", message="\n".join(f"error: {e}" for e in budget.problems.errors)
            )
        if budget.grace_period != self.plan.grace_period:
            logger.info(
                "grace period %g s: the scheduler's SIGKILL comes %g s after its SIGTERM",
                budget.grace_period,
                next(w.seconds for w in budget.waits if w.key == "kill_wait"),
            )
            self.plan = replace(self.plan, grace_period=budget.grace_period)
        return None

    def _run(self, node_env: dict[str, str]) -> RunOutcome:
        refused = self._check_timeouts()
        if refused is not None:
            return refused
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
        rdzv = connecting.result
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
        if self._witness is not None and not self._witness.wait_ready():
            logger.warning(
                "the signal witness did not start: every stop signal will be passed on "
                "to the workers, also one a scheduler sent them already"
            )
            self._witness.close()
            self._witness = None
        context = RoundContext(
            node_env,
            self._fork_server,
            self.layout,
            self._timers,
            deadline=None if plan.timeout is None else time.monotonic() + plan.timeout,
        )
        return self._rounds(rdzv, context)

    def _interrupted_outcome(self, rdzv: Rendezvous | None) -> RunOutcome:
        signum = self._interrupted
        assert signum is not None
        if rdzv is not None:
            why = f"node {socket.gethostname()} was interrupted by {signal.Signals(signum).name}"
            if rdzv.can_leave():
                self._start_leaving(rdzv, f"{why}; the other nodes go on without it")
                self._finish_leaving()
            else:
                rdzv.close_job(why)
        return RunOutcome("interrupted", signum=signum)

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

    def _rounds(self, rdzv: Rendezvous, context: RoundContext) -> RunOutcome:
        """Joins and runs rounds until one's next step ends the run."""
        plan = self.plan
        port_retries = 0
        attempt = 0
        learned_quiet = 0.0
        previous_failure: Fingerprint | None = None
        while True:
            if self._interrupted is not None:
                return self._interrupted_outcome(rdzv)
            joined = self._join(rdzv)
            if isinstance(joined, RunOutcome):
                return joined
            self._round = Round(
                plan,
                joined,
                rdzv,
                context,
                self.loop,
                attempt=attempt,
                learned_quiet=learned_quiet,
                previous_failure=previous_failure,
            )
            received = self._received()
            if received is not None:  # with the join's end, in the same turn of the loop
                self._round.interrupt(received)
            try:
                result = self._round.run()
            finally:
                self._round = None
            attempt += 1
            learned_quiet = result.learned_quiet
            if result.failure is not None:
                previous_failure = result.failure.fingerprint
            action = decide_next(
                result,
                interrupted=self._received(),
                port_retries=port_retries,
                membership_changing=needs_membership(result) and self._membership_changes(rdzv),
                node_rank=joined.group_rank,
                host=socket.gethostname(),
                max_restarts=plan.max_restarts,
                can_leave=rdzv.can_leave(),
            )
            if isinstance(action, ReplacePort):
                replaced = rdzv.replace_master_port()
                if replaced is not None:
                    port_retries += 1
                    logger.warning("master port %d was taken meanwhile; retrying on %d", *replaced)
                    continue
                action = action.otherwise
            ended = self.carry_out(action, rdzv)
            if ended is not None:
                return ended

    def _membership_changes(self, rdzv: Rendezvous) -> bool:
        """Whether nodes join, left or were lost, waiting a moment for a leaving node.

        This node's ranks only lost their peers; a preempted node says it leaves as its
        stop signal arrives, but its workers may end (and break this node's
        collectives) a moment before its word is in the store. Signals are served
        meanwhile. No node leaves a round that cannot shrink (a static job, ``--nnodes N``,
        or a round at its minimum: :meth:`Rendezvous.can_leave` is the same for every
        node of a round): the store is read once, with no wait.
        """
        if not rdzv.can_leave():
            return rdzv.membership_changing()
        deadline = time.monotonic() + MEMBERSHIP_SETTLE_SECONDS
        while not rdzv.membership_changing():
            if time.monotonic() >= deadline or self._interrupted is not None:
                return False
            self.loop.run_until(lambda: False, min(deadline, time.monotonic() + 0.1))
        return True

    def carry_out(self, action: Action, rdzv: Rendezvous) -> RunOutcome | None:
        """Does what ``action`` says; returns how the run ended, or None for the next round."""
        if isinstance(action, CountFailure):
            try:
                count: Any = rdzv.count_failure(action.record)
            except Exception as error:
                count = error
            action = decide_after_count(count, action.final, self.plan.max_restarts)
        if isinstance(action, End):
            if action.close_job is not None:
                rdzv.close_job(action.close_job)
            if action.leave is not None:
                self._start_leaving(rdzv, action.leave)
                self._finish_leaving()
            return action.outcome
        if isinstance(action, ExitBarrier):
            rdzv.exit_barrier()
            return action.outcome
        if isinstance(action, JobClosed):
            reason = rdzv.closing_reason() or "no reason given"
            return RunOutcome("closed", message=f"the job was closed by another node: {reason}")
        if isinstance(action, Restart):
            logger.warning("%s", action.message)
            return None
        if isinstance(action, Rejoin):
            logger.info("%s", action.reason)
            return None
        raise AssertionError(f"unexpected action {action!r}")  # ReplacePort: _rounds' own
