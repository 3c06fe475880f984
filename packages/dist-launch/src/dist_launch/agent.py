"""The agent: rendezvous, one local worker group per round, restarts within a budget.

One agent runs per node (one ``dist-launch`` process). Each round it joins the
rendezvous (:mod:`dist_launch.rendezvous`), runs this node's workers
(:class:`~dist_launch.local_group.LocalGroup`) until they end, and then:

- all succeeded: waits for the other nodes (c10d: the exit barrier) and exits 0;
- one failed: with c10d the failure is shared with every node and counted once for the
  job; within ``--max-restarts`` every node stops its workers and rejoins (the others
  see this node waiting in the rendezvous); past it the job is closed on every node and
  each prints the report, the node and rank that failed first named;
- nodes wait to join (a late node under ``--nnodes MIN:MAX``, or a restarted one): the
  workers are stopped and the round re-formed; this is not a failure and costs no
  restart;
- a handled signal (``--signals-to-handle``) stops the workers with that signal and
  closes the rendezvous; ``SIGQUIT`` prints every rank's stack and stops nothing.

The fork server is started once and kept warm across rounds, so a restart pays for the
script's own start-up but not for a new ``import torch``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from dist_core.ports import port_is_free
from dist_core.supervisor import GroupOutcome, Supervisor
from dist_launch.local_group import LocalGroup
from dist_launch.log_layout import LogLayout
from dist_launch.plan import LaunchPlan, describe_sources
from dist_launch.rendezvous import (
    Assignment,
    ElasticRendezvous,
    FailureRecord,
    StaticRendezvous,
)
from dist_launch.report import describe_returncode, format_report, group_exit_status
from dist_launch.signals import DUMP_SIGNAL, SignalInbox
from dist_launch.worker_env import node_environment
from dist_launch.zygote import Zygote, start_fork_server

logger = logging.getLogger(__name__)

PROG = "dist-launch"
USAGE_EXIT_STATUS = 2
# How many times an automatically chosen master port that turned out taken is replaced.
PORT_RETRIES = 3
_ADDRESS_IN_USE = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def one_line_cause(outcome: GroupOutcome) -> str:
    """``rank 3 failed with exit code 1 (ValueError: ...)``."""
    root = outcome.root_cause
    if root is None:
        return outcome.status
    what = f"rank {root.rank} failed with {describe_returncode(root.returncode)}"
    if root.record is not None:
        what += f" ({root.record.summary})"
    return what


class _Background:
    """Runs ``call`` on a thread; a pipe registered on the selector says when it is done."""

    def __init__(self, selector: selectors.BaseSelector, call: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = False
        self._read, self._write = os.pipe()
        self._selector = selector
        selector.register(self._read, selectors.EVENT_READ, self._finish)
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self.result = call()
        except BaseException as error:
            self.error = error
        with contextlib.suppress(OSError):
            os.write(self._write, b"x")

    def _finish(self) -> None:
        self.done = True
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._read)
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


class _RendezvousWatcher:
    """Polls the c10d rendezvous while workers run: waiting nodes, a closed job."""

    def __init__(
        self,
        rdzv: ElasticRendezvous,
        interval: float,
        on_change: Callable[[str], None],
        lost_after: float,
    ) -> None:
        self._rdzv = rdzv
        self._interval = interval
        # torch's keep-alive may drop a node whose first heartbeat after a round formed
        # is late; a node gone for good stays gone for a whole heartbeat interval.
        self._lost_after = lost_after
        self._lost_since: float | None = None
        self._on_change = on_change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                if self._rdzv.is_closed():
                    self._on_change("closed")
                    return
                waiting = self._rdzv.nodes_waiting()
                lost = self._rdzv.lost_nodes()
            except Exception as error:  # torch's store errors vary
                # Each store operation already waited torch's read_timeout: the store's
                # node is gone, or this node's network is.
                self._on_change(f"unreachable: the rendezvous store does not answer ({error})")
                return
            if waiting > 0:
                self._on_change(f"{waiting} node(s) waiting to join")
                return
            if lost == 0:
                self._lost_since = None
                continue
            now = time.monotonic()
            if self._lost_since is None:
                self._lost_since = now
            if now - self._lost_since >= self._lost_after:
                self._on_change(f"{lost} node(s) stopped sending heartbeats")
                return

    def stop(self) -> None:
        """Stops polling (bounded: one interval at most)."""
        self._stop.set()
        self._thread.join(self._interval + 5.0)


class Agent:
    """Runs a :class:`LaunchPlan` on this node; see the module docstring."""

    def __init__(
        self,
        plan: LaunchPlan,
        *,
        selector: selectors.BaseSelector | None = None,
        zygote: Zygote | None = None,
    ) -> None:
        self.plan = plan
        self.selector = selector if selector is not None else selectors.DefaultSelector()
        # Started by the caller before it imported this module, when it could: the fork
        # server's import of torch is the longest step of a start.
        self._early_zygote = zygote
        self.inbox: SignalInbox | None = None
        self._supervisor: Supervisor | None = None
        self._interrupted: int | None = None  # the first stopping signal received
        self._change: str | None = None  # why the rendezvous asked for a new round
        self._change_read, self._change_write = os.pipe()
        os.set_blocking(self._change_read, False)

    # -- events ---------------------------------------------------------------------

    def _received(self) -> int | None:
        """The first stopping signal received (set by the signal callback)."""
        return self._interrupted

    def _rendezvous_change(self) -> str | None:
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
        from dist_launch.report import format_stack_dump  # noqa: PLC0415

        supervisor.dump_stacks()
        print(
            format_stack_dump(supervisor.outcomes, "SIGQUIT; nothing stopped"),
            file=sys.stderr,
            flush=True,
        )

    def _on_change(self, why: str) -> None:
        """From the watcher thread: wake the main loop through a pipe."""
        self._change = why
        with contextlib.suppress(OSError):
            os.write(self._change_write, b"x")

    def _on_change_readable(self) -> None:
        with contextlib.suppress(OSError):
            os.read(self._change_read, 4096)
        if self._supervisor is not None and self._change is not None:
            self._supervisor.interrupt(signal.SIGTERM)

    # -- the run --------------------------------------------------------------------

    def _wait_for(self, background: _Background) -> bool:
        """Serves signals until ``background`` finished; False when interrupted first."""
        while not background.done:
            if self._interrupted is not None:
                return False
            for key, _ in self.selector.select(None):
                if callable(key.data):
                    key.data()
        return True

    def run(self) -> int:
        """Runs the job; returns the exit status."""
        plan = self.plan
        logger.info("%s", describe_sources(plan))
        self.inbox = SignalInbox((*plan.signals_to_handle, DUMP_SIGNAL))
        self.selector.register(self.inbox.read_fd, selectors.EVENT_READ, self._on_signal)
        self.selector.register(self._change_read, selectors.EVENT_READ, self._on_change_readable)
        node_env = node_environment(plan, os.environ)
        self.layout: LogLayout | None = None
        if plan.routing.needs_files(range(plan.nproc)):
            self.layout = LogLayout.create(plan.log_dir, plan.run_id)
            logger.info("logs of this run: %s", self.layout.run_dir)
        zygote: Zygote | None = self._early_zygote
        rdzv: StaticRendezvous | ElasticRendezvous | None = None
        try:
            if plan.elastic:
                # Connecting may wait for the endpoint's node (torch's read_timeout):
                # on a thread, so that Ctrl-C is served meanwhile.
                connecting = _Background(self.selector, lambda: ElasticRendezvous(plan))
                if not self._wait_for(connecting):
                    assert self._interrupted is not None
                    _say(f"interrupted by {signal.Signals(self._interrupted).name}")
                    return 128 + self._interrupted
                if connecting.error is not None:
                    _say(
                        f"error: cannot reach the rendezvous at {plan.rdzv_endpoint}: "
                        f"{connecting.error}"
                    )
                    return 1
                rdzv = connecting.result
            else:
                rdzv = StaticRendezvous(plan)
                if plan.node_rank == 0 and not port_is_free(rdzv.port):
                    explicit = plan.master_port is not None
                    how = "--master-port" if explicit else "the default master port"
                    _say(
                        f"{how} {rdzv.port} is already in use on this host; choose a free "
                        "port or leave --master-port out to get one"
                    )
                    return USAGE_EXIT_STATUS
            if zygote is None:
                zygote = start_fork_server(plan, self.selector)
            return self._rounds(rdzv, node_env, zygote)
        finally:
            if zygote is not None:
                zygote.close()
            if rdzv is not None:
                rdzv.close()
            self.inbox.close()
            self.selector.close()
            for fd in (self._change_read, self._change_write):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _interrupted_status(self, rdzv: StaticRendezvous | ElasticRendezvous) -> int:
        assert self._interrupted is not None
        name = signal.Signals(self._interrupted).name
        if isinstance(rdzv, ElasticRendezvous):
            rdzv.close_job(f"node {socket.gethostname()} was interrupted by {name}")
        _say(f"interrupted by {name}")
        return 128 + self._interrupted

    def _join(self, rdzv: StaticRendezvous | ElasticRendezvous, restarts: int) -> Assignment | int:
        """The next round's assignment, or an exit status."""
        if isinstance(rdzv, StaticRendezvous):
            return rdzv.next_round(restarts)
        joining = _Background(self.selector, lambda: rdzv.next_round(restarts))
        if not self._wait_for(joining):
            return self._interrupted_status(rdzv)
        if joining.error is not None:
            error = joining.error
            reason = rdzv.closing_reason()
            if reason is not None:
                _say(f"the job was closed: {reason}")
            else:
                _say(
                    f"error: rendezvous {plan_id(rdzv)} at {rdzv.plan.rdzv_endpoint} failed: "
                    f"{type(error).__name__}: {error}"
                )
            return 1
        assignment: Assignment = joining.result
        return assignment

    def _rounds(
        self,
        rdzv: StaticRendezvous | ElasticRendezvous,
        node_env: dict[str, str],
        zygote: Zygote | None,
    ) -> int:
        plan = self.plan
        deadline = None if plan.timeout is None else time.monotonic() + plan.timeout
        restarts = 0  # static: this node's; c10d: read from the job's store each round
        port_retries = 0
        attempt = 0
        while True:
            if self._interrupted is not None:
                return self._interrupted_status(rdzv)
            joined = self._join(rdzv, restarts)
            if isinstance(joined, int):
                return joined
            assignment = joined
            if isinstance(rdzv, ElasticRendezvous):
                restarts = assignment.restart_count
                logger.info(
                    "round %d: node %d of %d, ranks %d-%d of %d, master %s:%d, restarts %d of %d",
                    attempt,
                    assignment.group_rank,
                    assignment.group_world_size,
                    assignment.base_rank,
                    assignment.base_rank + plan.nproc - 1,
                    assignment.world_size,
                    assignment.master_addr,
                    assignment.master_port,
                    restarts,
                    plan.max_restarts,
                )
            self._change = None
            watcher = (
                _RendezvousWatcher(
                    rdzv, plan.monitor_interval, self._on_change, rdzv.keep_alive_interval
                )
                if isinstance(rdzv, ElasticRendezvous)
                else None
            )
            group = LocalGroup(
                plan,
                assignment,
                node_env,
                self.selector,
                zygote,
                self._set_supervisor,
                self.layout,
            )
            remaining = None if deadline is None else max(0.01, deadline - time.monotonic())
            try:
                outcome = group.run(attempt, remaining)
            except (OSError, RuntimeError) as error:
                _say(f"error: could not start the workers: {error}")
                return 1
            finally:
                if watcher is not None:
                    watcher.stop()
                group.cleanup()
            attempt += 1
            if outcome.status == "succeeded":
                if isinstance(rdzv, ElasticRendezvous):
                    rdzv.exit_barrier()
                return 0
            if self._received() is not None:
                print(format_report(outcome, PROG), file=sys.stderr, flush=True)
                return self._interrupted_status(rdzv)
            change = self._rendezvous_change()
            if change is not None and outcome.status == "interrupted":
                if change == "closed":
                    reason = isinstance(rdzv, ElasticRendezvous) and rdzv.closing_reason()
                    _say(f"the job was closed by another node: {reason or 'no reason given'}")
                    return 1
                if change.startswith("unreachable"):
                    _say(f"error: {change}; this node stops")
                    return 1
                logger.info("%s: stopping this node's workers to re-form the job", change)
                continue
            if outcome.status == "timed_out":
                outcome.timeout = plan.timeout  # the job's, not this round's remainder
                print(format_report(outcome, PROG), file=sys.stderr, flush=True)
                if isinstance(rdzv, ElasticRendezvous):
                    rdzv.close_job(f"node {assignment.group_rank} timed out (--timeout)")
                return group_exit_status(outcome)
            root = outcome.root_cause
            if (
                isinstance(rdzv, StaticRendezvous)
                and rdzv.auto_port
                and plan.nnodes == 1
                and port_retries < PORT_RETRIES
                and root is not None
                and root.record is not None
                and _ADDRESS_IN_USE.search(root.record.traceback)
            ):
                port_retries += 1
                old, new = rdzv.replace_port()
                logger.warning("master port %d was taken meanwhile; retrying on %d", old, new)
                continue
            if isinstance(rdzv, ElasticRendezvous):
                status = self._after_elastic_failure(rdzv, assignment, outcome)
                if status is None:
                    continue
                return status
            if restarts < plan.max_restarts:
                restarts += 1
                logger.warning(
                    "restarting the local worker group (restart %d of %d) after: %s",
                    restarts,
                    plan.max_restarts,
                    one_line_cause(outcome),
                )
                continue
            print(format_report(outcome, PROG), file=sys.stderr, flush=True)
            return group_exit_status(outcome)

    def _after_elastic_failure(
        self, rdzv: ElasticRendezvous, assignment: Assignment, outcome: GroupOutcome
    ) -> int | None:
        """Shares the failure; None to restart, else the exit status (budget spent)."""
        plan = self.plan
        failed = [rank for rank in outcome.ranks if rank.status == "failed"]
        if failed and all(rank.is_peer_failure for rank in failed):
            try:
                reforming = rdzv.nodes_waiting() > 0 or rdzv.lost_nodes() > 0
            except Exception:
                reforming = False
            if reforming:
                # Peers went away because the job is re-forming (a node restarted or
                # left); the node that failed first counts the failure, if it was one.
                logger.info(
                    "this node's ranks lost their peers while the job re-forms; "
                    "rejoining (not counted as a restart)"
                )
                return None
        root = outcome.root_cause
        record = FailureRecord(
            node=socket.gethostname(),
            group_rank=assignment.group_rank,
            rank=root.rank if root is not None else -1,
            timestamp=root.failure_time if root is not None else time.time(),
            summary=(one_line_cause(outcome) if root is not None else outcome.status),
        )
        try:
            total = rdzv.report_failure(record)
        except Exception as error:
            print(format_report(outcome, PROG), file=sys.stderr, flush=True)
            _say(f"the rendezvous store is unreachable ({error}); cannot restart")
            return group_exit_status(outcome)
        first = rdzv.failures()
        first_text = first[0].describe() if first else record.describe()
        if total <= plan.max_restarts:
            logger.warning(
                "restarting the job (restart %d of %d, job-wide) after: %s",
                total,
                plan.max_restarts,
                first_text,
            )
            return None
        print(format_report(outcome, PROG), file=sys.stderr, flush=True)
        why = f"restart budget spent ({plan.max_restarts} job-wide); first failure: {first_text}"
        _say(why)
        rdzv.close_job(why)
        return group_exit_status(outcome)


def plan_id(rdzv: ElasticRendezvous) -> str:
    """The rendezvous id, quoted for messages."""
    return repr(rdzv.plan.rdzv_id)
