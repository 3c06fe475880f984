"""Own a group of worker processes from start to cleanup; when one fails, stop the rest.

One :class:`Supervisor` serves every runner of the dist-* packages: dist-launch's CLI
(:class:`PopenWorker` and fork-server workers), its library launcher and
:func:`dist_core.testing.run_ranks` (``multiprocessing`` workers: :class:`ProcessWorker`).
It only needs, for each worker, a pid, a way to learn its exit status, and
optionally a file descriptor that becomes readable when it exits.
The caller may register more file descriptors on the supervisor's selector (output
pipes, a signal wake-up pipe) with a callback each. Standard library only.

It is a context manager that owns the workers' cleanup::

    with Supervisor(grace_period=5.0) as supervisor:
        for rank in range(n):
            supervisor.add(start_worker(rank), RankFiles.for_rank(run_dir, rank))
        outcome = supervisor.run()

Whatever ends the block (a return, an exception, a worker that failed to start, a
KeyboardInterrupt), every worker still alive is killed (its whole process group
where it leads one) and reaped, and the descriptors the supervisor registered are
unregistered. A KeyboardInterrupt is first handled as a SIGINT the caller received
(:meth:`Supervisor.interrupt`): forwarded, with the grace period to end.

What happens when a rank fails (exits non-zero):

1. The other ranks may end on their own for ``report_window`` seconds (0 for the
   launchers; :func:`~dist_core.testing.run_ranks` lets peers report what they saw).
2. Every live rank is asked for its Python stack (faulthandler on
   :data:`~dist_core.rank_files.STACK_DUMP_SIGNAL`), so the report shows where each
   one was, even in C code or a collective.
3. Every live rank gets SIGTERM, sent to its process alone (a rank stops what it
   started itself); those alive after the grace period get SIGKILL, sent to their
   whole process group. The supervisor never waits for a collective's own timeout.
4. The root cause is the failed rank with the earliest failure time *recorded by the
   workers* (see :mod:`dist_core.rank_files`), preferring failures that are not merely
   a peer vanishing (:func:`dist_core.proc.is_peer_failure`).

A signal the caller forwards with :meth:`Supervisor.interrupt` (SIGINT, SIGTERM) goes
the same way: stacks first, so that a Ctrl-C on a hung job can say where every rank
was, then the signal itself instead of SIGTERM, or nothing when the signal reached
every rank already (a scheduler's stop: each rank's handler gets the whole grace
period, uncut by a second copy). :meth:`Supervisor.request_stacks` asks for the stacks
without stopping anything (a launcher's SIGQUIT), :meth:`Supervisor.notify` passes a
signal on without stopping anything. When the supervisor closes, what is left of each
rank's process group is killed.

:meth:`Supervisor.run` waits on the supervisor's selector. A caller whose own event
loop owns the selector drives the supervisor instead: :meth:`Supervisor.advance` is one
turn of :meth:`~Supervisor.run`'s loop that never waits, and says by when it needs the
next one; :attr:`~Supervisor.finished` and :meth:`~Supervisor.outcome` say how it ended.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import TracebackType
from typing import Literal, Protocol

from dist_core.proc import is_peer_failure
from dist_core.rank_files import (
    STACK_DUMP_SIGNAL,
    ErrorRecord,
    RankFiles,
    read_error_record,
    read_torchelastic_error,
)

logger = logging.getLogger(__name__)

# How long live ranks get to write their stacks before they are stopped.
STACK_DUMP_SECONDS = 1.0
# After SIGKILL, how long to wait for the kernel to reap; past it the report says so.
KILL_WAIT_SECONDS = 10.0
# How often workers without an exit descriptor are polled.
_POLL_SECONDS = 0.05
# Signals a scheduler sends every process of a job to stop it. A rank that died of one
# before the caller's own copy arrived was stopped from outside, not failed: the
# reaction to it waits this long for that copy (see Supervisor.interrupt).
OUTSIDE_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SIGNAL_RACE_SECONDS = 0.2

RankStatus = Literal["running", "succeeded", "failed", "stopped"]
GroupStatus = Literal["succeeded", "failed", "timed_out", "interrupted"]


class Worker(Protocol):
    """One worker process as the supervisor sees it."""

    rank: int
    local_rank: int
    node_rank: int
    # True when the worker leads its own process group: stop signals then reach its
    # children too (data-loader workers, tools it started).
    own_process_group: bool

    @property
    def pid(self) -> int | None:
        """The process id (None when it never started)."""

    def returncode(self) -> int | None:
        """None while running; the exit status, or ``-N`` when killed by signal N."""

    def exit_fd(self) -> int | None:
        """A descriptor readable once the process exited; None if none exists."""

    def close(self) -> None:
        """Reaps the ended process (bounded) and releases what the object holds.

        Called once by the supervisor when it closes, after the process ended or was
        killed.
        """


class ProcessWorker:
    """A ``multiprocessing`` process as a :class:`Worker`.

    It shares the caller's process group, so stop signals reach the process alone.

    Args:
        process: The started process.
        rank: Its global rank.
        local_rank: Its rank on this node (default: ``rank``).
        node_rank: Its node's rank.
    """

    own_process_group = False

    def __init__(
        self, process: BaseProcess, rank: int, local_rank: int | None = None, node_rank: int = 0
    ) -> None:
        self.process = process
        self.rank = rank
        self.local_rank = rank if local_rank is None else local_rank
        self.node_rank = node_rank

    @property
    def pid(self) -> int | None:
        """The process id (None before it started)."""
        return self.process.pid

    def returncode(self) -> int | None:
        """None while running; the exit status, or -N after signal N."""
        return self.process.exitcode

    def exit_fd(self) -> int | None:
        """The process's sentinel, readable once it exited."""
        return self.process.sentinel

    def close(self) -> None:
        """Releases the process's sentinel once it ended (reading its exit code reaps it)."""
        if self.process.exitcode is not None:
            self.process.close()
        # else it survived SIGKILL: leave the object to the garbage collector.


class PopenWorker:
    """A ``subprocess.Popen`` child as a :class:`Worker`; its exit is seen through a pidfd.

    Start it in a process group of its own (``process_group=0``): stop signals then
    reach everything it started.

    Args:
        popen: The started process.
        rank: Its global rank.
        local_rank: Its rank on this node.
        node_rank: Its node's rank.
    """

    own_process_group = True

    def __init__(
        self, popen: subprocess.Popen[bytes], rank: int, local_rank: int, node_rank: int
    ) -> None:
        self.popen = popen
        self.rank = rank
        self.local_rank = local_rank
        self.node_rank = node_rank
        self._pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):  # pidfds need Linux 5.3
            self._pidfd = os.pidfd_open(popen.pid)

    @property
    def pid(self) -> int | None:
        """The process id."""
        return self.popen.pid

    def returncode(self) -> int | None:
        """None while running; the exit status, or -N after signal N."""
        return self.popen.poll()

    def exit_fd(self) -> int | None:
        """A descriptor readable once the process exited, if there is one."""
        return self._pidfd

    def close(self) -> None:
        """Reaps the process (bounded) and releases the pidfd."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5.0)
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None


@dataclass
class RankOutcome:
    """What became of one rank."""

    rank: int
    local_rank: int
    node_rank: int
    status: RankStatus = "running"
    returncode: int | None = None
    ended_at: float | None = None  # wall clock when the supervisor saw it end
    stop_signal: int | None = None  # the signal the supervisor sent to stop it
    stopped_at: float | None = None  # wall clock when it was sent
    record: ErrorRecord | None = None
    crash_stack: str = ""  # faulthandler's output at a fatal signal
    crash_time: float | None = None
    live_stack: str = ""  # the stack the rank dumped before it was stopped

    @property
    def failure_time(self) -> float:
        """When the rank failed, by the worker's clock where it recorded one."""
        if self.record is not None:
            return self.record.timestamp
        if self.crash_time is not None:
            return self.crash_time
        return self.ended_at if self.ended_at is not None else float("inf")

    @property
    def is_peer_failure(self) -> bool:
        """True when its error only says that a peer vanished."""
        return self.record is not None and is_peer_failure(self.record.traceback)


@dataclass
class GroupOutcome:
    """What became of the whole group."""

    status: GroupStatus
    ranks: list[RankOutcome]
    signum: int | None = None  # for "interrupted"
    timeout: float | None = None  # for "timed_out"
    unkillable: list[int] = field(default_factory=list)

    @property
    def root_cause(self) -> RankOutcome | None:
        """The rank whose failure came first (see the module docstring)."""
        return pick_root_cause(self.ranks)


def catches_signal(proc_status: str, signum: int) -> bool:
    """Whether a process handles ``signum``, from its ``/proc/PID/status`` text (``SigCgt``)."""
    for line in proc_status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def pick_root_cause(ranks: Sequence[RankOutcome]) -> RankOutcome | None:
    """The failed rank that failed first, preferring failures not caused by a peer."""
    failed = [rank for rank in ranks if rank.status == "failed"]
    primary = [rank for rank in failed if not rank.is_peer_failure]
    candidates = primary or failed
    if not candidates:
        return None
    return min(candidates, key=lambda rank: (rank.failure_time, rank.rank))


class Supervisor:
    """Owns a group of workers: watches them, stops them all when one fails, cleans up.

    Use it as a context manager (see the module docstring); :meth:`close` is what
    leaving the block calls.

    Args:
        workers: Workers already started, if any; more come with :meth:`add`.
        files: Each worker's files, by global rank (:meth:`add` may name them instead).
        grace_period: Seconds between SIGTERM (or a forwarded signal) and SIGKILL.
        timeout: Seconds the whole group may run, counted from the first :meth:`run`;
            None for no limit.
        report_window: Seconds after the first failure during which the other ranks
            may still end on their own (and record why) before they are stopped.
        selector: A selector the caller also registers its own descriptors on; the
            ``data`` of each such key is a callable run when it is ready. The caller
            keeps it open until the supervisor closed (exit statuses may arrive
            through it) and closes it; a selector the supervisor made itself is
            closed with it.
    """

    def __init__(
        self,
        workers: Sequence[Worker] = (),
        files: Mapping[int, RankFiles] | None = None,
        *,
        grace_period: float,
        timeout: float | None = None,
        report_window: float = 0.0,
        selector: selectors.BaseSelector | None = None,
    ) -> None:
        self.files: dict[int, RankFiles] = dict(files or {})
        self.grace_period = grace_period
        self.timeout = timeout
        self.report_window = report_window
        self._owns_selector = selector is None
        self.selector = selector if selector is not None else selectors.DefaultSelector()
        self.workers: list[Worker] = []
        self.outcomes: list[RankOutcome] = []
        # (signum, take stacks first, delivered already)
        self._signals: list[tuple[int, bool, bool]] = []
        self._exit_fds: dict[int, int] = {}
        self._timers: list[Callable[[float], float | None]] = []
        self._closed = False
        # The run's state lives here, not in run(), so that run() may be called again
        # (after a KeyboardInterrupt) and goes on where it stopped.
        self._status: GroupStatus | None = None
        self._signum: int | None = None
        self._deadline: float | None = None
        self._stop_at: float | None = None
        # Until when a group whose ranks all died of an outside stop signal waits for
        # the caller's copy before it counts as failed.
        self._race_until: float | None = None
        self._kill_at: float | None = None
        self._give_up_at: float | None = None
        self._outcome: GroupOutcome | None = None
        for worker in workers:
            self.add(worker)

    # -- owning ---------------------------------------------------------------------

    def add_timer(self, due: Callable[[float], float | None]) -> None:
        """Calls ``due(now)`` on every turn of :meth:`run`'s loop.

        ``due`` does what is due at ``now`` (monotonic) and returns when it next needs
        a call, or None; the loop wakes up by then (an output relay's partial line).
        """
        self._timers.append(due)

    def add(self, worker: Worker, files: RankFiles | None = None) -> None:
        """Takes a started worker into the group; from now on the supervisor cleans it up.

        Add each worker as soon as it started, so that a later start that fails does
        not leave it behind. Workers are added before :meth:`run`.

        Args:
            worker: The started worker.
            files: Its files; by default those given at construction for its rank.

        Raises:
            KeyError: No files were given for the worker's rank.
            RuntimeError: The supervisor is closed.
        """
        if self._closed:
            raise RuntimeError(f"cannot add rank {worker.rank}: the supervisor is closed")
        if files is not None:
            self.files[worker.rank] = files
        elif worker.rank not in self.files:
            raise KeyError(f"no RankFiles for rank {worker.rank}: pass them to add()")
        index = len(self.workers)
        self.workers.append(worker)
        self.outcomes.append(RankOutcome(worker.rank, worker.local_rank, worker.node_rank))
        fd = worker.exit_fd()
        if fd is not None:
            self.selector.register(fd, selectors.EVENT_READ, None)
            self._exit_fds[index] = fd

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if isinstance(exc, KeyboardInterrupt) and not self._closed:
                # As if the caller had received SIGINT: stacks, SIGINT, grace, SIGKILL.
                self._poll()
                if self._live():
                    self.interrupt(signal.SIGINT)
                    self.run()
        finally:
            self.close()

    def close(self) -> None:
        """Kills every worker still alive and reaps it; unregisters what it registered.

        Idempotent. Workers that lead a process group are killed with their group.
        """
        if self._closed:
            return
        self._closed = True
        try:
            self._poll()
            live = self._live()
            if live:
                logger.debug("closing: SIGKILL to %d live rank(s)", len(live))
                self._stop(signal.SIGKILL)
                give_up_at = time.monotonic() + KILL_WAIT_SECONDS
                while self._live() and time.monotonic() < give_up_at:
                    self._wait_quietly(min(give_up_at, time.monotonic() + _POLL_SECONDS))
                    self._poll()
                survivors = [self.workers[i].rank for i in self._live()]
                if survivors:
                    logger.warning("rank(s) %s survived SIGKILL (stuck in the kernel?)", survivors)
            self._sweep_process_groups()
        finally:
            for fd in self._exit_fds.values():
                with contextlib.suppress(KeyError, ValueError, OSError):
                    self.selector.unregister(fd)
            self._exit_fds.clear()
            for worker in self.workers:
                try:
                    worker.close()
                except (OSError, ValueError):
                    logger.debug("closing rank %d failed", worker.rank, exc_info=True)
            if self._owns_selector:
                self.selector.close()

    def interrupt(self, signum: int, *, take_stacks: bool = True, delivered: bool = False) -> None:
        """Records a stop signal the caller received; :meth:`run` passes it on.

        Before passing it on, :meth:`run` asks every live rank for its stack (each
        outcome's ``live_stack``), unless ``take_stacks`` is False (a caller that took
        them already, e.g. with :meth:`dump_stacks`). Each rank then gets the signal,
        sent to the rank's process alone (what it started is its own to stop), and the
        grace period starts; at its end what is left of each rank's process group gets
        SIGKILL. With ``delivered``, the sender already signalled every rank (a
        scheduler that signals every process of the job): nothing is sent again, so a
        rank's handler is not cut short by a second copy; only the grace period starts.

        A rank that died of this very signal just before (the scheduler's copy reached
        it first) counts as stopped, not failed. A later SIGINT (a person pressing
        Ctrl-C again) ends the grace period at once; a later SIGTERM or SIGHUP (SLURM
        sends SIGTERM twice at a time limit) changes nothing.
        """
        self._signals.append((signum, take_stacks, delivered))

    def notify(self, signum: int) -> list[int]:
        """Sends ``signum`` to every live rank's process, stopping nothing.

        For a signal the caller passes on as a notification (SLURM's
        ``--signal=USR1@90``): no outcome changes and no grace period starts.

        Returns:
            The ranks it was sent to.
        """
        live = self._live()
        self._signal(live, signum)
        return [self.workers[index].rank for index in live]

    # -- observing ------------------------------------------------------------------

    def _poll(self) -> None:
        for index, worker in enumerate(self.workers):
            outcome = self.outcomes[index]
            if outcome.status != "running":
                continue
            code = worker.returncode()
            if code is None:
                continue
            outcome.returncode = code
            outcome.ended_at = time.time()
            if code == 0:
                outcome.status = "succeeded"
            elif outcome.stop_signal is not None:
                outcome.status = "stopped"
            else:
                outcome.status = "failed"
            fd = self._exit_fds.pop(index, None)
            if fd is not None:
                with contextlib.suppress(KeyError, ValueError):
                    self.selector.unregister(fd)

    def _live(self) -> list[int]:
        return [i for i, outcome in enumerate(self.outcomes) if outcome.status == "running"]

    def _wait(self, until: float | None) -> None:
        """Sleeps until a descriptor is ready or ``until`` (monotonic); runs callbacks."""
        delay = None if until is None else max(0.0, until - time.monotonic())
        for key, _ in self.selector.select(delay):
            if callable(key.data):
                key.data()

    def _wait_quietly(self, until: float) -> None:
        """:meth:`_wait` for cleanup.

        A selector the caller owns is the caller's loop's (and may be closed already):
        cleanup runs none of its callbacks, it sleeps and polls instead.
        """
        if not self._owns_selector:
            time.sleep(max(0.0, until - time.monotonic()))
            return
        try:
            self._wait(until)
        except (OSError, ValueError, RuntimeError):
            time.sleep(max(0.0, until - time.monotonic()))

    # -- acting ---------------------------------------------------------------------

    def _signal(self, indices: Sequence[int], signum: int, *, group: bool = False) -> None:
        for index in indices:
            worker = self.workers[index]
            pid = worker.pid
            if pid is None or self.outcomes[index].status != "running":
                continue
            if group and worker.own_process_group:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signum)
                    continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    def _stop(self, signum: int, *, send: bool = True) -> None:
        """Stops every live rank with ``signum``.

        SIGKILL goes to each rank's whole process group, any other signal to its process
        alone (the rank stops what it started itself); with ``send`` False, it is only
        recorded that the rank was told (the signal reached it already).
        """
        live = self._live()
        for index in live:
            if self.outcomes[index].stop_signal is None:
                self.outcomes[index].stop_signal = signum
                self.outcomes[index].stopped_at = time.time()
        if send:
            self._signal(live, signum, group=signum == signal.SIGKILL)

    def _sweep_process_groups(self) -> None:
        """SIGKILL to the process group of every rank that led one, ended or not.

        What a rank started and left behind (a data loader's workers, a tool) dies with
        it. A group outlives its leader while it has members, and Linux hands out no
        pid still used as a group id, so the signal reaches only the rank's own.
        """
        for worker in self.workers:
            pid = worker.pid
            if worker.own_process_group and pid is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)

    def request_stacks(self) -> dict[int, str]:
        """Asks every live rank for its Python stack, without stopping anything.

        Only ranks whose handler is armed (their stack file exists) are asked; the wait
        for their answers is bounded by :data:`STACK_DUMP_SECONDS`. Nothing about the
        ranks' outcomes changes.

        Returns:
            Each asked rank's stack, by global rank (``(no stack received)`` for one
            that did not answer in time).
        """
        targets: dict[int, int] = {}
        for index in self._live():
            path = self.files[self.workers[index].rank].stack
            with contextlib.suppress(OSError):
                targets[index] = path.stat().st_size  # exists once the handler is armed
        self._signal(list(targets), STACK_DUMP_SIGNAL)
        pending = dict(targets)
        last_size: dict[int, int] = {}
        deadline = time.monotonic() + STACK_DUMP_SECONDS
        # faulthandler writes from its signal handler, line by line, and tells nobody
        # when it is done: a dump is complete once the file grew and stopped growing.
        while pending and time.monotonic() < deadline:
            time.sleep(0.02)
            for index, before in list(pending.items()):
                path = self.files[self.workers[index].rank].stack
                try:
                    size = path.stat().st_size
                except OSError:
                    del pending[index]
                    continue
                if size > before and last_size.get(index) == size:
                    del pending[index]
                last_size[index] = size
        stacks: dict[int, str] = {}
        for index, before in targets.items():
            rank = self.workers[index].rank
            text = ""
            with contextlib.suppress(OSError), self.files[rank].stack.open("rb") as handle:
                handle.seek(before)
                text = handle.read().decode(errors="replace").strip()
            stacks[rank] = text or "(no stack received)"
        return stacks

    def dump_stacks(self) -> None:
        """:meth:`request_stacks`, kept in each asked rank's outcome (``live_stack``)."""
        stacks = self.request_stacks()
        for outcome in self.outcomes:
            if outcome.rank in stacks and outcome.status == "running":
                outcome.live_stack = stacks[outcome.rank]

    # -- the loop -------------------------------------------------------------------

    def _take_signals(self) -> None:
        received = self._signals[:]
        self._signals.clear()
        for signum, take_stacks, delivered in received:
            if self._status == "interrupted":
                self._again(signum)
                continue
            self._adopt_outside_stops(signum)
            if take_stacks and self._kill_at is None and self._live():
                self.dump_stacks()  # not yet stopping: say where each rank was
                self._poll()
            self._status, self._signum = "interrupted", signum
            name = signal.Signals(signum).name
            if delivered:
                logger.debug("%s reached %d rank(s) already", name, len(self._live()))
            else:
                logger.debug("forwarding %s to %d rank(s)", name, len(self._live()))
            self._stop(signum, send=not delivered)
            self._kill_at = time.monotonic() + self.grace_period
            self._say_who_catches(signum)

    def _again(self, signum: int) -> None:
        """A stop signal after the first: a second Ctrl-C ends the grace period."""
        name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            logger.info("%s again: not waiting for the rest of the grace period", name)
            self._kill_at = time.monotonic()
        else:
            logger.info("%s again: still within the grace period", name)

    def _adopt_outside_stops(self, signum: int) -> None:
        """Ranks that just died of ``signum`` without being told were stopped, not failed.

        The scheduler signalled them and the caller; their copy arrived first.
        """
        if signum not in OUTSIDE_STOP_SIGNALS:
            return
        for outcome in self.outcomes:
            if (
                outcome.status == "failed"
                and outcome.stop_signal is None
                and outcome.returncode == -signum
            ):
                outcome.status = "stopped"
                outcome.stop_signal = signum
                outcome.stopped_at = outcome.ended_at
        if self._status == "failed" and not any(o.status == "failed" for o in self.outcomes):
            self._status, self._stop_at, self._race_until = None, None, None

    def _say_who_catches(self, signum: int) -> None:
        """Logs which live ranks handle ``signum`` (they get the grace period to end)."""
        catching = []
        for index in self._live():
            pid = self.workers[index].pid
            with contextlib.suppress(OSError):
                if pid is not None and catches_signal(
                    Path(f"/proc/{pid}/status").read_text(), signum
                ):
                    catching.append(self.workers[index].rank)
        if catching:
            logger.info(
                "rank(s) %s catch %s: waiting up to %g s for them to end",
                catching,
                signal.Signals(signum).name,
                self.grace_period,
            )

    @property
    def finished(self) -> bool:
        """True once every rank ended (or outlived SIGKILL's wait): :meth:`outcome` is ready."""
        return self._outcome is not None

    def outcome(self) -> GroupOutcome:
        """The group's outcome, with each rank's record and stacks read.

        Raises:
            RuntimeError: The group has not finished (see :attr:`finished`).
        """
        if self._outcome is None:
            raise RuntimeError("the group has not finished: call advance() or run() first")
        return self._outcome

    def run(self) -> GroupOutcome:
        """Waits until every rank ended, stopping them all after a failure.

        May be called again after it was interrupted (KeyboardInterrupt): it goes on
        where it stopped.

        Returns:
            The group's outcome, with each rank's record and stacks read.
        """
        while not self.finished:
            wake_at = self.advance()
            if not self.finished:
                self._wait(wake_at)
        return self.outcome()

    def advance(self, now: float | None = None) -> float | None:
        """One turn of :meth:`run`'s loop, without waiting.

        Reads which ranks ended, forwards the signals :meth:`interrupt` recorded,
        stops the group after a failure or at the timeout, sends SIGKILL once the
        grace period is over, and runs the :meth:`add_timer` timers. A caller whose
        loop owns the selector calls it whenever the loop wakes (a worker's exit
        descriptor is registered on the selector with no callback: it only wakes the
        loop) and by the time it returns. Workers are all added before the first call.

        Args:
            now: The monotonic time; by default read here.

        Returns:
            The monotonic time by which it needs its next call, or None when only a
            ready descriptor needs one (or the group has finished: :attr:`finished`).
        """
        if self._outcome is not None:
            return None
        if self._deadline is None and self.timeout is not None:
            self._deadline = time.monotonic() + self.timeout
        deadline = self._deadline
        # Signals first: a rank that dies of the signal meanwhile counts as stopped.
        self._take_signals()
        self._poll()
        now = time.monotonic() if now is None else now
        failed = [o for o in self.outcomes if o.status == "failed"]
        if self._status is None and failed:
            self._status = "failed"
            window = self.report_window
            if all(
                o.returncode is not None and -o.returncode in OUTSIDE_STOP_SIGNALS for o in failed
            ):
                # Perhaps the scheduler's signal, whose copy to the caller is on its way.
                window = max(window, SIGNAL_RACE_SECONDS)
                self._race_until = now + SIGNAL_RACE_SECONDS
            self._stop_at = now + window
        if self._status is None and deadline is not None and now >= deadline:
            self._status = "timed_out"
            self._stop_at = now
        if (
            self._kill_at is None
            and self._stop_at is not None
            and (now >= self._stop_at or (deadline is not None and now >= deadline))
            and self._live()
        ):
            self.dump_stacks()
            self._poll()
            self._stop(signal.SIGTERM)
            self._kill_at = time.monotonic() + self.grace_period
        live = self._live()
        if not live:
            race = self._race_until
            if self._status == "failed" and self._kill_at is None and race and now < race:
                # Every rank died of a stop signal, fast: the copy may still be on its way.
                return race
            self._finish()
            return None
        now = time.monotonic()
        if self._kill_at is not None and now >= self._kill_at and self._give_up_at is None:
            logger.info("grace period over: SIGKILL to %d rank(s)", len(live))
            self._stop(signal.SIGKILL)
            self._give_up_at = now + KILL_WAIT_SECONDS
        if self._give_up_at is not None and now >= self._give_up_at:
            self._finish()
            return None
        wake_points = [
            t
            for t in (
                deadline if self._status is None else None,
                self._stop_at if self._kill_at is None else None,
                self._kill_at,
                self._give_up_at,
            )
            if t is not None and t > now
        ]
        for due in self._timers:
            when = due(now)
            if when is not None:
                wake_points.append(max(when, now))
        # The exit of a worker without a descriptor is not watched: poll it now and then.
        if len(self._exit_fds) < len(live):
            wake_points.append(now + _POLL_SECONDS)
        return min(wake_points) if wake_points else None

    def _finish(self) -> None:
        self._outcome = GroupOutcome(
            status=self._status or "succeeded",
            ranks=self.outcomes,
            signum=self._signum,
            timeout=self.timeout,
            unkillable=[self.workers[i].rank for i in self._live()],
        )
        self._read_records()

    def _read_records(self) -> None:
        for outcome in self.outcomes:
            files = self.files[outcome.rank]
            outcome.record = read_error_record(files.error) or read_torchelastic_error(
                files.torchelastic_error, outcome.rank
            )
            with contextlib.suppress(OSError):
                text = files.fatal.read_text(errors="replace").strip()
                if text:
                    outcome.crash_stack = text
                    outcome.crash_time = files.fatal.stat().st_mtime
            # A rank that failed on its own just before it was told to stop counts as
            # failed: its record predates the stop signal.
            if (
                outcome.status == "stopped"
                and outcome.record is not None
                and outcome.stopped_at is not None
                and outcome.record.timestamp < outcome.stopped_at
            ):
                outcome.status = "failed"
