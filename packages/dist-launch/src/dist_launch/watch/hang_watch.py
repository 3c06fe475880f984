"""One round's hang watch: reads the workers' progress, decides, and raises the alarm once.

:class:`HangWatch` gives each worker its progress file (:mod:`dist_launch.in_worker.beacon`),
looks at the counters every ``look_period`` from the supervisor's loop, counts the
output the launcher relays as progress, and asks :class:`~dist_launch.watch.quiet_watch.QuietWatch`
whether the group is hung.

A quiet group is first only *suspected* (:attr:`HangWatch.suspicion`): the round asks
the ranks for their collective records, and the records have the last word. When
they show the ranks alive (:meth:`HangWatch.dismiss`) the watch goes on as if nothing
happened; otherwise :meth:`HangWatch.confirm` raises the alarm (:attr:`HangWatch.reason`),
and, with several nodes, tells the others on the job board. An expired torch elastic
timer (:class:`~dist_launch.watch.file_timer.FileTimerWatch`) and another node's alarm
are hangs at once, with no suspicion first.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import time
from pathlib import Path

from dist_launch.in_worker.progress_file import (
    PROGRESS_FILE_VARIABLE,
    PROGRESS_PERIOD_VARIABLE,
    create_progress_file,
    map_progress_file,
    read_progress,
)
from dist_launch.plan.hang_policy import HangPolicy
from dist_launch.rendezvous.job_board import JobBoard
from dist_launch.watch.file_timer import FileTimerWatch
from dist_launch.watch.quiet_watch import QuietWatch

logger = logging.getLogger(__name__)


class HangWatch:
    """The hang watch of one round on this node.

    Args:
        policy: ``--hang-timeout``.
        run_dir: The round's private directory (progress files go there).
        node: How the report names this node (``host (node 1)``).
        timers: The torch elastic timer server, if one is served.
        longest_quiet: What ``auto`` learned in earlier rounds.
        board: The job board (several nodes sharing a store): progress on another
            node counts here too, and a hang found there is one here.
    """

    def __init__(
        self,
        policy: HangPolicy,
        run_dir: str,
        node: str,
        timers: FileTimerWatch | None = None,
        longest_quiet: float = 0.0,
        board: JobBoard | None = None,
    ) -> None:
        self.policy = policy
        self.run_dir = run_dir
        self.node = node
        self.timers = timers
        self.board = board
        self.quiet = QuietWatch(policy, time.monotonic(), longest_quiet)
        self.reason: str | None = None  # why the group was found hung, once it was
        self.suspicion: str | None = None  # why it looks hung, until the records answer
        self._shared: dict[int, mmap.mmap] = {}
        self._pids: dict[int, int] = {}  # pid -> rank
        self._next_look = 0.0

    @property
    def watches_progress(self) -> bool:
        """False when only torch elastic timers are served (``--hang-timeout off``)."""
        return self.policy.enabled

    def worker_variables(self, rank: int) -> dict[str, str]:
        """Creates ``rank``'s progress file; the variables that tell the worker about it."""
        if not self.watches_progress:
            return {}
        path = Path(self.run_dir, f"rank{rank}.progress")
        create_progress_file(path)
        self._shared[rank] = map_progress_file(path)
        return {
            PROGRESS_FILE_VARIABLE: str(path),
            PROGRESS_PERIOD_VARIABLE: f"{self.policy.look_period:g}",
        }

    def started(self, rank: int, pid: int | None) -> None:
        """A worker was started: ties its pid to its rank (expired timers name a pid).

        The quiet clock starts again: the group is judged from its last rank's start.
        """
        self.quiet.begin(time.monotonic())
        if pid is not None:
            self._pids[pid] = rank

    def output(self) -> None:
        """The launcher relayed output of some rank: progress."""
        self.quiet.progress(time.monotonic())

    def _alarm(self, reason: str, *, tell_others: bool = True) -> None:
        if self.reason is None:
            self.reason = reason
            logger.debug("hang: %s", reason)
            if self.board is not None and tell_others:
                self.board.raise_alarm(reason)

    def confirm(self) -> None:
        """The records did not show the suspected group alive: it is hung."""
        if self.suspicion is not None:
            self._alarm(self.suspicion)
            self.suspicion = None

    def dismiss(self, now: float, alive_at: float | None = None) -> None:
        """The records show the suspected group alive: back to watching.

        Args:
            now: The monotonic clock now.
            alive_at: When the ranks last showed life (monotonic); ``now`` when None.
        """
        logger.debug("not hung after all (%s): the ranks' records show progress", self.suspicion)
        self.suspicion = None
        self.quiet.progress(now if alive_at is None else min(now, alive_at))
        self._next_look = now

    def look_again(self, now: float) -> bool:
        """Reads the counters once more (the beacons update them before they answer).

        Returns:
            True when some rank made progress since the last look.
        """
        before = self.quiet.last_progress
        self._look(now)
        return self.quiet.last_progress > before

    def _look(self, now: float) -> None:
        for rank, shared in self._shared.items():
            with contextlib.suppress(ValueError, OSError):
                self.quiet.saw(rank, read_progress(shared), now)

    def due(self, now: float) -> float | None:
        """The supervisor's timer: looks when a look is due; returns when the next one is."""
        if self.reason is not None or (self.timers is None and not self.watches_progress):
            return None
        if self.suspicion is not None:
            # The records are asked for; until they answer (confirm, dismiss) there is
            # nothing to look at, and a due time in the past would spin the loop.
            return max(self._next_look, now + self.policy.look_period)
        if now < self._next_look:
            return self._next_look
        self._next_look = now + (self.policy.look_period if self.policy.enabled else 0.1)
        if self.timers is not None:
            for expired in self.timers.take_expired():
                rank = self._pids.get(expired.pid)
                if rank is None:
                    continue  # a grandchild's timer, or an earlier round's worker
                self._alarm(
                    f"rank {rank}'s torch elastic timer {expired.scope!r} expired "
                    "(FileTimerClient, expires(after=...))"
                )
                return None
        if not self.watches_progress:
            return self._next_look
        self._look(now)
        if self.board is not None and self._share(now):
            return None  # another node found the job hung
        if self.quiet.hung(now):
            timeout = self.quiet.timeout()
            assert timeout is not None
            where = "of the job" if self.board is not None else "on this node"
            self.suspicion = (
                f"no rank {where} made progress for {self.quiet.quiet_for(now):.0f} s "
                f"({self.policy.describe()}"
                + (f": {timeout:g} s" if self.policy.mode == "auto" else "")
                + ")"
            )
        return self._next_look

    def _share(self, now: float) -> bool:
        """Publishes this node's latest progress; takes a later one of another node.

        Returns:
            True when another node found the job hung (the alarm is raised here too).
        """
        assert self.board is not None
        elsewhere_alarm = self.board.alarm_elsewhere()
        if elsewhere_alarm is not None:
            self._alarm(f"the job was found hung on {elsewhere_alarm}", tell_others=False)
            return True
        wall_now = time.time()
        self.board.publish(wall_now - self.quiet.quiet_for(now))
        elsewhere = self.board.latest_elsewhere()
        if elsewhere is not None:
            at = min(now, now - (wall_now - elsewhere))
            if at > self.quiet.last_progress:
                self.quiet.progress(at)
        return False

    def close(self) -> None:
        """Unmaps the progress files."""
        for shared in self._shared.values():
            with contextlib.suppress(BufferError, ValueError):
                shared.close()
        self._shared.clear()


def node_name(hostname: str, group_rank: int) -> str:
    """``host (node 1)``: how the hang report names a node."""
    return f"{hostname} (node {group_rank})"
