"""One attempt of this node's workers: environment, start, output relay, supervision.

:class:`LocalGroup` starts ``nproc`` workers for one rendezvous round, relays their
output with a rank prefix, and hands them to the supervisor, which stops all of them
when one fails and reads who failed first. The fork server (:class:`ForkServerClient`) is owned
by the agent and kept warm across attempts, so a restart pays no new ``import torch``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from dist_core.rank_files import RankFiles
from dist_core.supervisor import GroupOutcome, Supervisor, Worker
from dist_launch.agent.event_loop import EventLoop
from dist_launch.diagnostics.hang_report import HangReport
from dist_launch.diagnostics.stacks import without_launcher_frames
from dist_launch.in_worker.bootstrap import PARENT_PID_VARIABLE, RUN_DIR_VARIABLE
from dist_launch.output.line_relay import LineRelay
from dist_launch.output.log_layout import LogLayout, write_torch_error_file
from dist_launch.output.routing import STREAMS, Stream
from dist_launch.plan.hang_policy import HangPolicy
from dist_launch.plan.launch_plan import LaunchPlan
from dist_launch.rendezvous.progress_board import ProgressBoard
from dist_launch.rendezvous.protocol import Assignment
from dist_launch.watch.file_timer import FILE_VARIABLE, FileTimerWatch
from dist_launch.watch.hang_watch import HangWatch, node_name
from dist_launch.workers.environment import rank_environment, worker_environment
from dist_launch.workers.fork_server_client import ForkedWorker, ForkServerClient
from dist_launch.workers.subprocess_start import start_subprocess_worker
from dist_launch.workers.terminals import WindowSizeFollower, WorkerTerminals, worker_terminals

# After the workers ended, how long a grandchild holding their pipes may delay us.
DRAIN_SECONDS = 2.0


def _flush_partial_lines(relays: list[LineRelay], now: float) -> float | None:
    """Shows partial lines that waited long enough; returns when the next one is due."""
    due: list[float] = []
    for relay in relays:
        relay.flush_due(now)
        deadline = relay.next_deadline()
        if deadline is not None:
            due.append(deadline)
    return min(due, default=None)


def _pump_callback(
    loop: EventLoop, relay: LineRelay, on_output: Callable[[], None]
) -> Callable[[], None]:
    def pump() -> None:
        on_output()
        if not relay.pump():
            loop.unwatch(relay.fd)

    return pump


class LocalGroup:
    """This node's workers for one round.

    Args:
        plan: The launch plan.
        assignment: This node's place in the round.
        node_env: :func:`node_environment`.
        loop: The launcher's event loop (signals, the fork server's replies and the
            rendezvous watch are served by it too).
        fork_server: The warm fork server, or None to start fresh interpreters.
        on_supervisor: Called with the supervisor once it exists (signals reach it).
        layout: The run's log directory, when some stream goes to a file.
        timers: torch elastic's timer server, when the launcher serves one.
        longest_quiet: What ``--hang-timeout auto`` learned in earlier rounds.
        board: The job's progress board, when the nodes share one.

    Attributes:
        hang: The report of a hang found in the round, else None.
        watch: The round's hang watch (``auto`` reads what it learned from it).
    """

    def __init__(
        self,
        plan: LaunchPlan,
        assignment: Assignment,
        node_env: dict[str, str],
        loop: EventLoop,
        fork_server: ForkServerClient | None,
        on_supervisor: Callable[[Supervisor | None], None],
        layout: LogLayout | None,
        timers: FileTimerWatch | None = None,
        longest_quiet: float = 0.0,
        board: ProgressBoard | None = None,
    ) -> None:
        self.plan = plan
        self.assignment = assignment
        self.node_env = node_env
        self.loop = loop
        self.fork_server = fork_server
        self.on_supervisor = on_supervisor
        self.routing = plan.routing
        self.layout = layout
        self.run_dir = tempfile.mkdtemp(prefix="dist-launch-")
        self.files: dict[int, RankFiles] = {}
        # The short name, as torchrun's ${hostname} (r12i0n8, not its FQDN).
        self._hostname = socket.gethostname()
        policy = plan.hang_policy
        if plan.target.no_python and policy.mode == "auto":
            policy = HangPolicy("off")  # no bootstrap: no stack to watch (documented)
        self.watch = HangWatch(
            policy,
            self.run_dir,
            node_name(self._hostname, assignment.group_rank),
            timers,
            longest_quiet,
            board,
        )
        self.hang: HangReport | None = None

    def _open_logs(self, attempt: int) -> dict[tuple[int, str], BinaryIO]:
        """Each (local rank, stream) that goes to a file, opened in the attempt's directory."""
        logs: dict[tuple[int, str], BinaryIO] = {}
        layout = self.layout
        if layout is None:
            return logs
        layout.create_attempt(attempt, range(self.plan.nproc))
        for local_rank in range(self.plan.nproc):
            paths: tuple[tuple[Stream, Path], ...] = (
                ("stdout", layout.stdout(attempt, local_rank)),
                ("stderr", layout.stderr(attempt, local_rank)),
            )
            for stream, path in paths:
                if self.routing.route(local_rank, stream).file:
                    logs[(local_rank, stream)] = open(path, "wb")  # noqa: SIM115
        return logs

    def _write_error_files(self, attempt: int, outcome: GroupOutcome) -> None:
        """Torch's error.json for each failed rank with a Python error, as torchrun."""
        if self.layout is None:
            return
        for rank in outcome.ranks:
            record = rank.record
            if rank.status != "failed" or record is None:
                continue
            write_torch_error_file(
                self.layout.error_file(attempt, rank.local_rank),
                message=f"{record.exception}: {record.message}",
                traceback=record.traceback,
                timestamp=record.timestamp,
            )

    def _write_hang_files(self, attempt: int, hang: HangReport) -> None:
        """The hang report in the attempt's directory, and each rank's error.json."""
        if self.layout is None:
            return
        # The attempt's directories exist: _open_logs made them.
        (self.layout.attempt_dir(attempt) / "hang.txt").write_text(hang.format() + "\n")
        now = time.time()
        base = self.assignment.base_rank
        for local_rank in range(self.plan.nproc):
            stack = without_launcher_frames(hang.stacks.get(base + local_rank, ""))
            write_torch_error_file(
                self.layout.error_file(attempt, local_rank),
                message=f"HangError: {hang.reason}; {hang.summary}",
                traceback=stack,
                timestamp=now,
            )

    def _hang_report(self, outcome: GroupOutcome) -> HangReport | None:
        reason = self.watch.reason
        if reason is None:
            return None
        stacks = {rank.rank: rank.live_stack for rank in outcome.ranks if rank.live_stack}
        return HangReport(reason, self.watch.node, stacks)

    def run(self, attempt: int, timeout: float | None) -> GroupOutcome:
        """Starts the workers, waits for the outcome, cleans up; returns the outcome.

        Every worker started is killed and reaped when this returns or raises (the
        supervisor's context), a start that failed halfway included.

        Raises:
            OSError, RuntimeError: A worker could not be started.
        """
        plan, assignment = self.plan, self.assignment
        loop = self.loop
        logs = self._open_logs(attempt)
        relays: list[LineRelay] = []
        timers: list[int] = []
        env = worker_environment(plan, assignment, self.node_env)
        env[RUN_DIR_VARIABLE] = self.run_dir
        env[PARENT_PID_VARIABLE] = str(os.getpid())
        if self.watch.timers is not None:
            env[FILE_VARIABLE] = self.watch.timers.path
        try:
            with (
                WindowSizeFollower() as follower,
                Supervisor(
                    grace_period=plan.grace_period, timeout=timeout, selector=loop.selector
                ) as supervisor,
            ):
                started: list[tuple[Worker, int, int, WorkerTerminals]] = []
                for local_rank in range(plan.nproc):
                    terminals = self._terminals(local_rank)
                    worker, out_fd, err_fd = self._start(env, local_rank, terminals)
                    supervisor.add(worker, self.files[worker.rank])
                    started.append((worker, out_fd, err_fd, terminals))
                    relays.extend(
                        self._relays(worker.rank, local_rank, out_fd, err_fd, logs, terminals)
                    )
                if self.fork_server is not None:
                    forked = [w for w, *_ in started if isinstance(w, ForkedWorker)]
                    self.fork_server.wait_until_started(forked)
                for worker, out_fd, err_fd, terminals in started:
                    self.watch.started(worker.rank, worker.pid)
                    for fd, stream in zip((out_fd, err_fd), STREAMS, strict=True):
                        if terminals.of(stream) is not None:
                            follower.add(
                                fd, stream, self._prefix_width(worker.local_rank), worker.pid
                            )
                timers.append(loop.add_timer(lambda now: _flush_partial_lines(relays, now)))
                # A hang is stopped as a signal is: every rank's stack first, then SIGTERM.
                self.watch.on_hang = lambda reason: supervisor.interrupt(signal.SIGTERM)
                timers.append(loop.add_timer(self.watch.due))
                timers.append(loop.add_timer(lambda now: supervisor.advance()))
                self.on_supervisor(supervisor)
                loop.run_until(lambda: supervisor.finished)
                outcome = supervisor.outcome()
                for handle in timers:
                    loop.remove_timer(handle)
                self._drain(relays)
            self.hang = self._hang_report(outcome)
            if self.hang is not None:
                self._write_hang_files(attempt, self.hang)
            else:
                self._write_error_files(attempt, outcome)
            return outcome
        finally:
            for handle in timers:
                loop.remove_timer(handle)
            self.watch.close()
            self.on_supervisor(None)
            for relay in relays:
                loop.unwatch(relay.fd)
                relay.close()
            for log in logs.values():
                log.close()

    def _prefix_width(self, local_rank: int) -> int:
        """How many columns the rank prefix takes on the console."""
        rank = self.assignment.base_rank + local_rank
        prefix = self.routing.console_prefix(rank, local_rank, self.plan.role, self._hostname)
        return len(prefix.decode(errors="replace"))

    def _terminals(self, local_rank: int) -> WorkerTerminals:
        """Which of the worker's streams get a pseudo-terminal (shown ones, on a terminal)."""
        shown = {stream: self.routing.route(local_rank, stream).console for stream in STREAMS}
        return worker_terminals(shown, self._prefix_width(local_rank))

    def _start(
        self, env: dict[str, str], local_rank: int, terminals: WorkerTerminals
    ) -> tuple[Worker, int, int]:
        """Starts one worker; returns it and the read ends of its stdout and stderr."""
        plan, node = self.plan, self.assignment.group_rank
        rank = self.assignment.base_rank + local_rank
        rank_env = rank_environment(plan, env, rank, local_rank)
        if not plan.target.no_python:
            rank_env.update(self.watch.worker_variables(rank))
        self.files[rank] = RankFiles.for_rank(self.run_dir, rank)
        rank_env["TORCHELASTIC_ERROR_FILE"] = str(self.files[rank].torchelastic_error)
        if self.fork_server is not None:  # none is started for a --no-python target
            return self.fork_server.start(plan.target, rank_env, rank, local_rank, node, terminals)
        return start_subprocess_worker(
            plan.target, rank_env, rank, local_rank, node, terminals=terminals
        )

    def _relays(
        self,
        rank: int,
        local_rank: int,
        out_fd: int,
        err_fd: int,
        logs: dict[tuple[int, str], BinaryIO],
        terminals: WorkerTerminals,
    ) -> list[LineRelay]:
        """A relay per stream, registered on the selector, routed as the flags say."""
        prefix = self.routing.console_prefix(rank, local_rank, self.plan.role, self._hostname)
        relays = []
        streams: tuple[tuple[int, Stream, BinaryIO], ...] = (
            (out_fd, "stdout", sys.stdout.buffer),
            (err_fd, "stderr", sys.stderr.buffer),
        )
        for fd, stream, sink in streams:
            relay = LineRelay(
                fd,
                prefix,
                sink,
                logs.get((local_rank, stream)),
                console=self.routing.route(local_rank, stream).console,
                terminal=terminals.of(stream) is not None,
            )
            relays.append(relay)
            self.loop.watch(fd, _pump_callback(self.loop, relay, self.watch.output))
        return relays

    def _drain(self, relays: list[LineRelay]) -> None:
        """Passes on what the ended workers left in their pipes (bounded)."""
        self.loop.run_until(
            lambda: all(relay.closed for relay in relays), time.monotonic() + DRAIN_SECONDS
        )

    def cleanup(self) -> None:
        """Removes the attempt's scratch directory."""
        shutil.rmtree(self.run_dir, ignore_errors=True)
