"""Watch a group of workers; when one fails, stop the others and say who failed first.

The :class:`Supervisor` is shared by the library (``multiprocessing`` workers) and the
CLI (subprocess and fork-server workers): it only needs, for each worker, a pid, a
way to learn its exit status, and optionally a file descriptor that becomes readable
when it exits. The caller may register more file descriptors on the supervisor's
selector (output pipes, a signal wake-up pipe) with a callback each.

What happens when a rank fails (exits non-zero):

1. Every live rank is asked for its Python stack (faulthandler on
   :data:`~dist_launch.records.STACK_DUMP_SIGNAL`), so the report shows where each
   one was, even in C code or a collective.
2. Every live rank gets SIGTERM; those alive after the grace period get SIGKILL. The
   launcher never waits for a collective's own timeout.
3. The root cause is the failed rank with the earliest failure time *recorded by the
   workers* (see :mod:`dist_launch.records`), preferring failures that are not merely
   a peer vanishing (:func:`dist_core.proc.is_peer_failure`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from dist_core.proc import is_peer_failure
from dist_launch.records import (
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


@dataclass
class RankOutcome:
    """What became of one rank."""

    rank: int
    local_rank: int
    node_rank: int
    status: RankStatus = "running"
    returncode: int | None = None
    ended_at: float | None = None  # wall clock when the launcher saw it end
    stop_signal: int | None = None  # the signal the launcher sent to stop it
    stopped_at: float | None = None  # wall clock when it was sent
    record: ErrorRecord | None = None
    crash_stack: str = ""  # faulthandler's output at a fatal signal
    crash_time: float | None = None
    live_stack: str = ""  # the stack the rank dumped on the launcher's request

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


def pick_root_cause(ranks: Sequence[RankOutcome]) -> RankOutcome | None:
    """The failed rank that failed first, preferring failures not caused by a peer."""
    failed = [rank for rank in ranks if rank.status == "failed"]
    primary = [rank for rank in failed if not rank.is_peer_failure]
    candidates = primary or failed
    if not candidates:
        return None
    return min(candidates, key=lambda rank: (rank.failure_time, rank.rank))


class Supervisor:
    """Waits for a group of workers and stops all of them when one fails.

    Args:
        workers: The started workers.
        files: Each worker's files, by global rank.
        grace_period: Seconds between SIGTERM and SIGKILL when stopping ranks.
        timeout: Seconds the whole group may run; None for no limit.
        selector: A selector the caller also registers its own descriptors on; the
            ``data`` of each such key is a callable run when it is ready.
    """

    def __init__(
        self,
        workers: Sequence[Worker],
        files: dict[int, RankFiles],
        *,
        grace_period: float,
        timeout: float | None = None,
        selector: selectors.BaseSelector | None = None,
    ) -> None:
        self.workers = list(workers)
        self.files = files
        self.grace_period = grace_period
        self.timeout = timeout
        self.selector = selector if selector is not None else selectors.DefaultSelector()
        self.outcomes = [RankOutcome(w.rank, w.local_rank, w.node_rank) for w in self.workers]
        self._signals: list[int] = []
        self._exit_fds: dict[int, int] = {}
        for index, worker in enumerate(self.workers):
            fd = worker.exit_fd()
            if fd is not None:
                self.selector.register(fd, selectors.EVENT_READ, None)
                self._exit_fds[index] = fd

    def interrupt(self, signum: int) -> None:
        """Records a signal the launcher received; the run loop forwards it to every rank."""
        self._signals.append(signum)

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
                self.selector.unregister(fd)

    def _live(self) -> list[int]:
        return [i for i, outcome in enumerate(self.outcomes) if outcome.status == "running"]

    def _wait(self, until: float | None) -> None:
        """Sleeps until a descriptor is ready or ``until`` (monotonic); runs callbacks."""
        delay = None if until is None else max(0.0, until - time.monotonic())
        for key, _ in self.selector.select(delay):
            if callable(key.data):
                key.data()

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

    def _stop(self, signum: int) -> None:
        live = self._live()
        for index in live:
            if self.outcomes[index].stop_signal is None:
                self.outcomes[index].stop_signal = signum
                self.outcomes[index].stopped_at = time.time()
        self._signal(live, signum, group=True)

    def dump_stacks(self) -> None:
        """Asks every live rank for its Python stack and keeps what each one wrote."""
        targets: dict[int, int] = {}
        for index in self._live():
            path = self.files[self.workers[index].rank].stack
            with contextlib.suppress(OSError):
                targets[index] = path.stat().st_size  # exists once the handler is armed
        self._signal(list(targets), STACK_DUMP_SIGNAL)
        pending = dict(targets)
        last_size: dict[int, int] = {}
        deadline = time.monotonic() + STACK_DUMP_SECONDS
        # faulthandler writes from its signal handler, line by line: a dump is complete
        # once the file has grown and then stopped growing.
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
        for index, before in targets.items():
            path = self.files[self.workers[index].rank].stack
            with contextlib.suppress(OSError), path.open("rb") as handle:
                handle.seek(before)
                text = handle.read().decode(errors="replace").strip()
                self.outcomes[index].live_stack = text or "(no stack received)"

    # -- the loop -------------------------------------------------------------------

    def run(self) -> GroupOutcome:
        """Waits until every rank ended, stopping them all after a failure.

        Returns:
            The group's outcome, with each rank's record and stacks read.
        """
        started = time.monotonic()
        deadline = None if self.timeout is None else started + self.timeout
        status: GroupStatus | None = None
        signum: int | None = None
        kill_at: float | None = None
        give_up_at: float | None = None
        while True:
            self._poll()
            live = self._live()
            now = time.monotonic()
            if self._signals:
                received = self._signals[:]
                self._signals.clear()
                if status != "interrupted":
                    status, signum = "interrupted", received.pop(0)
                    logger.debug(
                        "forwarding %s to %d rank(s)", signal.Signals(signum).name, len(live)
                    )
                    self._stop(signum)
                    kill_at = now + self.grace_period
                if received:
                    kill_at = now  # asked again: stop waiting for a clean exit
            if status is None and any(o.status == "failed" for o in self.outcomes):
                status = "failed"
                if live:
                    self.dump_stacks()
                    self._poll()
                    self._stop(signal.SIGTERM)
                    kill_at = time.monotonic() + self.grace_period
            if status is None and deadline is not None and now >= deadline:
                status = "timed_out"
                self.dump_stacks()
                self._poll()
                self._stop(signal.SIGTERM)
                kill_at = time.monotonic() + self.grace_period
            live = self._live()
            if not live:
                break
            now = time.monotonic()
            if kill_at is not None and now >= kill_at and give_up_at is None:
                logger.info("grace period over: SIGKILL to %d rank(s)", len(live))
                self._stop(signal.SIGKILL)
                give_up_at = now + KILL_WAIT_SECONDS
            if give_up_at is not None and now >= give_up_at:
                break
            wake_points = [
                t
                for t in (deadline if status is None else None, kill_at, give_up_at)
                if t is not None and t > now
            ]
            # The fd of a worker without one is not watched: poll it now and then.
            if len(self._exit_fds) < len(live):
                wake_points.append(now + 0.05)
            self._wait(min(wake_points) if wake_points else None)
        outcome = GroupOutcome(
            status=status or "succeeded",
            ranks=self.outcomes,
            signum=signum,
            timeout=self.timeout,
            unkillable=[self.workers[i].rank for i in self._live()],
        )
        self._read_records()
        return outcome

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
