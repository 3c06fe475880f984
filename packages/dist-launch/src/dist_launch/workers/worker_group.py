"""This node's workers for one round: scratch directory, log files, start, relays, supervisor.

:class:`WorkerGroup` starts ``nproc`` workers, relays their output with a rank prefix
(to the console and the ``--log-dir`` files), and hands them to dist-core's
:class:`~dist_core.supervisor.Supervisor`, which stops all of them when one fails and
reads who failed first. It is a context manager: leaving the block, whichever way,
kills and reaps every worker it started, closes the relays and log files and removes
the scratch directory. The launcher's event loop drives it (the supervisor's next step
is one of the loop's timers); what watches the workers (the hang watch) is the round's
(:mod:`dist_launch.agent.round`) and reaches the workers through :meth:`WorkerGroup.start`.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Protocol

from dist_core.rank_files import RankFiles
from dist_core.supervisor import GroupOutcome, Supervisor, Worker
from dist_launch.in_worker.bootstrap import PARENT_PID_VARIABLE, RUN_DIR_VARIABLE
from dist_launch.output.line_relay import LineRelay
from dist_launch.output.log_layout import LogLayout, write_torch_error_file
from dist_launch.output.routing import STREAMS, Stream
from dist_launch.output.scratch import ScratchDir
from dist_launch.plan.launch_plan import LaunchPlan
from dist_launch.rendezvous.protocol import Assignment
from dist_launch.workers.environment import rank_environment, worker_environment
from dist_launch.workers.fork_server_client import ForkedWorker, ForkServerClient
from dist_launch.workers.fork_server_client import Loop as ForkServerLoop
from dist_launch.workers.subprocess_start import start_subprocess_worker
from dist_launch.workers.terminals import WindowSizeFollower, WorkerTerminals, worker_terminals

# After the workers ended, how long a grandchild holding their pipes may delay us.
DRAIN_SECONDS = 2.0


class Loop(ForkServerLoop, Protocol):
    """What the group needs of the launcher's event loop (:mod:`dist_launch.agent.event_loop`)."""

    @property
    def selector(self) -> selectors.BaseSelector:
        """The loop's selector: the supervisor registers the workers' exit descriptors."""

    def add_timer(self, due: Callable[[float], float | None]) -> int:
        """Calls ``due(now)`` on every turn; returns a handle."""

    def remove_timer(self, handle: int) -> None:
        """Stops calling a timer."""


def _flush_partial_lines(relays: list[LineRelay], now: float) -> float | None:
    """Shows partial lines that waited long enough; returns when the next one is due."""
    due: list[float] = []
    for relay in relays:
        relay.flush_due(now)
        deadline = relay.next_deadline()
        if deadline is not None:
            due.append(deadline)
    return min(due, default=None)


class WorkerGroup:
    """This node's workers of one round, from start to cleanup.

    Args:
        plan: The launch plan.
        assignment: This node's place in the round.
        node_env: :func:`~dist_launch.workers.environment.node_environment`.
        loop: The launcher's event loop.
        fork_server: The warm fork server, or None to start fresh interpreters.
        layout: The run's log directory, when some stream goes to a file.
        attempt: The round's number in this run (the ``attempt_<n>`` directory).
        timeout: Seconds the workers may run (what is left of ``--timeout``), or None.

    Attributes:
        run_dir: The round's private scratch directory (rank files, progress files).
        supervisor: The workers' supervisor, once the block was entered.
    """

    def __init__(
        self,
        plan: LaunchPlan,
        assignment: Assignment,
        node_env: Mapping[str, str],
        loop: Loop,
        fork_server: ForkServerClient | None,
        layout: LogLayout | None,
        *,
        attempt: int,
        timeout: float | None,
    ) -> None:
        self.plan = plan
        self.assignment = assignment
        self.node_env = node_env
        self.loop = loop
        self.fork_server = fork_server
        self.layout = layout
        self.attempt = attempt
        self.timeout = timeout
        self.routing = plan.routing
        self._scratch = ScratchDir()
        self.run_dir = self._scratch.path
        self.files: dict[int, RankFiles] = {}
        # The short name, as torchrun's ${hostname} (r12i0n8, not its FQDN).
        self.hostname = socket.gethostname()
        self._relays: list[LineRelay] = []
        self._logs: dict[tuple[int, str], BinaryIO] = {}
        self._timers: list[int] = []
        self._stack = contextlib.ExitStack()
        self._follower = WindowSizeFollower()
        self.supervisor: Supervisor | None = None

    # -- the block ------------------------------------------------------------------

    def __enter__(self) -> WorkerGroup:
        stack = self._stack
        # Closed in the reverse order: the timers first, the workers, then what they wrote to.
        stack.callback(self._scratch.close)
        stack.callback(self._close_logs)
        stack.callback(self._close_relays)
        stack.enter_context(self._follower)
        self.supervisor = stack.enter_context(
            Supervisor(
                grace_period=self.plan.grace_period,
                timeout=self.timeout,
                selector=self.loop.selector,
            )
        )
        stack.callback(self._remove_timers)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool | None:
        return self._stack.__exit__(exc_type, exc, traceback)

    def _remove_timers(self) -> None:
        for handle in self._timers:
            self.loop.remove_timer(handle)
        self._timers.clear()

    def _close_relays(self) -> None:
        for relay in self._relays:
            self.loop.unwatch(relay.fd)
            relay.close()

    def _close_logs(self) -> None:
        for log in self._logs.values():
            log.close()

    # -- starting -------------------------------------------------------------------

    def start(
        self,
        *,
        node_variables: Mapping[str, str],
        rank_variables: Callable[[int], Mapping[str, str]],
        on_output: Callable[[], None],
    ) -> list[Worker]:
        """Starts every worker and waits until each has a pid; the loop then supervises them.

        Args:
            node_variables: More variables for every worker (a timer server's file).
            rank_variables: More variables for one worker, by global rank (its progress
                file); not given to a ``--no-python`` target.
            on_output: Called whenever a worker wrote output.

        Returns:
            The workers, in local rank order.

        Raises:
            OSError, RuntimeError: A worker could not be started (those started are
                stopped when the block ends).
        """
        supervisor = self.supervisor
        assert supervisor is not None, "start() is called inside the block"
        plan = self.plan
        self._open_logs()
        env = worker_environment(plan, self.assignment, dict(self.node_env))
        env.update(node_variables)
        env[RUN_DIR_VARIABLE] = self.run_dir
        env[PARENT_PID_VARIABLE] = str(os.getpid())
        started: list[tuple[Worker, int, int, WorkerTerminals]] = []
        for local_rank in range(plan.nproc):
            terminals = self._terminals(local_rank)
            rank = self.assignment.base_rank + local_rank
            rank_env = rank_environment(plan, env, rank, local_rank)
            if not plan.target.no_python:
                rank_env.update(rank_variables(rank))
            worker, out_fd, err_fd = self._start(rank_env, rank, local_rank, terminals)
            supervisor.add(worker, self.files[rank])
            started.append((worker, out_fd, err_fd, terminals))
            # Followed before the loop runs again: once it does, a worker that already
            # ended has its relay close these ends (seen: EBADF starting the next rank).
            for fd, stream in zip((out_fd, err_fd), STREAMS, strict=True):
                if terminals.of(stream) is not None:
                    width = self._prefix_width(local_rank)
                    self._follower.add(fd, stream, width, _pid_reader(worker))
            self._watch_output(rank, local_rank, out_fd, err_fd, terminals, on_output)
        if self.fork_server is not None:
            forked = [worker for worker, *_ in started if isinstance(worker, ForkedWorker)]
            self.fork_server.wait_until_started(forked)
        relays = self._relays
        self._timers.append(self.loop.add_timer(lambda now: _flush_partial_lines(relays, now)))
        self._timers.append(self.loop.add_timer(lambda now: supervisor.advance()))
        return [worker for worker, *_ in started]

    def _open_logs(self) -> None:
        """Each (local rank, stream) that goes to a file, opened in the attempt's directory."""
        layout = self.layout
        if layout is None:
            return
        layout.create_attempt(self.attempt, range(self.plan.nproc))
        for local_rank in range(self.plan.nproc):
            paths: tuple[tuple[Stream, Path], ...] = (
                ("stdout", layout.stdout(self.attempt, local_rank)),
                ("stderr", layout.stderr(self.attempt, local_rank)),
            )
            for stream, path in paths:
                if self.routing.route(local_rank, stream).file:
                    self._logs[(local_rank, stream)] = open(path, "wb")  # noqa: SIM115

    def _prefix_width(self, local_rank: int) -> int:
        """How many columns the rank prefix takes on the console."""
        rank = self.assignment.base_rank + local_rank
        prefix = self.routing.console_prefix(rank, local_rank, self.plan.role, self.hostname)
        return len(prefix.decode(errors="replace"))

    def _terminals(self, local_rank: int) -> WorkerTerminals:
        """Which of the worker's streams get a pseudo-terminal (shown ones, on a terminal)."""
        shown = {stream: self.routing.route(local_rank, stream).console for stream in STREAMS}
        return worker_terminals(shown, self._prefix_width(local_rank))

    def _start(
        self, rank_env: dict[str, str], rank: int, local_rank: int, terminals: WorkerTerminals
    ) -> tuple[Worker, int, int]:
        """Starts one worker; returns it and the read ends of its stdout and stderr."""
        plan, node = self.plan, self.assignment.group_rank
        self.files[rank] = RankFiles.for_rank(self.run_dir, rank)
        rank_env["TORCHELASTIC_ERROR_FILE"] = str(self.files[rank].torchelastic_error)
        if self.fork_server is not None:  # none is started for a --no-python target
            return self.fork_server.start(plan.target, rank_env, rank, local_rank, node, terminals)
        return start_subprocess_worker(
            plan.target, rank_env, rank, local_rank, node, terminals=terminals
        )

    def _watch_output(
        self,
        rank: int,
        local_rank: int,
        out_fd: int,
        err_fd: int,
        terminals: WorkerTerminals,
        on_output: Callable[[], None],
    ) -> None:
        """A relay per stream, served by the loop, routed as the flags say."""
        prefix = self.routing.console_prefix(rank, local_rank, self.plan.role, self.hostname)
        streams: tuple[tuple[int, Stream, BinaryIO], ...] = (
            (out_fd, "stdout", sys.stdout.buffer),
            (err_fd, "stderr", sys.stderr.buffer),
        )
        for fd, stream, sink in streams:
            relay = LineRelay(
                fd,
                prefix,
                sink,
                self._logs.get((local_rank, stream)),
                console=self.routing.route(local_rank, stream).console,
                terminal=terminals.of(stream) is not None,
            )
            self._relays.append(relay)
            self.loop.watch(fd, self._pump(relay, on_output))

    def _pump(self, relay: LineRelay, on_output: Callable[[], None]) -> Callable[[], None]:
        def pump() -> None:
            on_output()
            if not relay.pump():
                self.loop.unwatch(relay.fd)

        return pump

    # -- running --------------------------------------------------------------------

    @property
    def ended(self) -> bool:
        """True once every worker ended (the supervisor's outcome is ready)."""
        return self.supervisor is not None and self.supervisor.finished

    def interrupt(self, signum: int, *, take_stacks: bool = True, delivered: bool = False) -> None:
        """Stops every worker with ``signum`` (stacks first, unless taken already).

        With ``delivered``, the signal reached every worker already: none is sent again.
        """
        if self.supervisor is not None:
            self.supervisor.interrupt(signum, take_stacks=take_stacks, delivered=delivered)

    def notify(self, signum: int) -> list[int]:
        """Passes ``signum`` on to every running worker, stopping nothing; their ranks."""
        return [] if self.supervisor is None else self.supervisor.notify(signum)

    def take_stacks(self) -> dict[int, str]:
        """Every running worker's Python stack, stopping nothing (bounded)."""
        if self.supervisor is None:
            return {}
        self.supervisor.dump_stacks()
        return {o.rank: o.live_stack for o in self.supervisor.outcomes if o.live_stack}

    def resize(self) -> None:
        """The launcher's terminal was resized: so are the workers' pseudo-terminals."""
        self._follower.resize()

    def finish(self) -> GroupOutcome:
        """After the workers ended: passes on what they left in their pipes (bounded).

        Returns:
            The supervisor's outcome.
        """
        supervisor = self.supervisor
        assert supervisor is not None and supervisor.finished
        self._remove_timers()
        relays = self._relays
        self.loop.run_until(
            lambda: all(relay.closed for relay in relays), time.monotonic() + DRAIN_SECONDS
        )
        return supervisor.outcome()

    def write_error_files(self, outcome: GroupOutcome) -> None:
        """Torch's error.json for each failed rank with a Python error, as torchrun."""
        if self.layout is None:
            return
        for rank in outcome.ranks:
            record = rank.record
            if rank.status != "failed" or record is None:
                continue
            write_torch_error_file(
                self.layout.error_file(self.attempt, rank.local_rank),
                message=f"{record.exception}: {record.message}",
                traceback=record.traceback,
                timestamp=record.timestamp,
            )


def _pid_reader(worker: Worker) -> Callable[[], int | None]:
    """Reads ``worker``'s pid when called (a forked worker's arrives after its start)."""
    return lambda: worker.pid
