"""The hang decision on samples: has a node's group been quiet for the timeout?

Pure: no processes, no clock of its own (the caller passes ``now``), so that a test
feeds it a sequence of samples.

A node's group makes progress when any of its ranks does: its stack counter, its
explicit counter or its count of completed collectives moved
(:mod:`dist_launch.in_worker.beacon`), or it wrote output. The
group is hung when none did for the timeout. Judging the group, not each rank, keeps a
job healthy while rank 0 evaluates or saves a checkpoint and the others wait for it in
a barrier; a real hang stops every rank, since the others soon wait for the stuck one.
"""

from __future__ import annotations

from dist_launch.plan.hang_policy import AUTO_FACTOR, AUTO_FLOOR_SECONDS, HangPolicy


class QuietWatch:
    """Follows one group's progress and says when it has been quiet too long.

    Args:
        policy: The ``--hang-timeout`` policy.
        now: When the group started (monotonic seconds).
        longest_quiet: The longest quiet interval earlier rounds of the job showed
            (``auto`` keeps what it learned across restarts).
    """

    def __init__(self, policy: HangPolicy, now: float, longest_quiet: float = 0.0) -> None:
        self.policy = policy
        self.last_progress = now
        self.longest_quiet = longest_quiet
        self._seen: dict[int, tuple[int, ...]] = {}

    def begin(self, now: float) -> None:
        """A rank was started at ``now``: the quiet clock starts again, nothing learned.

        The time the launcher took to start the ranks (seconds on a loaded host) is
        neither the group's silence nor a quiet interval ``auto`` should learn.
        """
        self.last_progress = max(self.last_progress, now)

    def progress(self, now: float) -> None:
        """Some rank made progress at ``now``; the quiet interval it ends is learned."""
        self.longest_quiet = max(self.longest_quiet, now - self.last_progress)
        self.last_progress = max(self.last_progress, now)

    def saw(self, rank: int, counters: tuple[int, ...], now: float) -> None:
        """A look at ``rank``'s counters: progress when any differs from the last look.

        The first look is progress unless every counter is still zero.
        """
        if self._seen.get(rank) != counters:
            first = rank not in self._seen
            self._seen[rank] = counters
            if not first or any(counters):
                self.progress(now)

    def timeout(self) -> float | None:
        """The current timeout in seconds (``auto`` grows with what it learned); None if off."""
        if self.policy.mode == "off":
            return None
        if self.policy.mode == "fixed":
            return self.policy.seconds
        return max(AUTO_FLOOR_SECONDS, AUTO_FACTOR * self.longest_quiet)

    def quiet_for(self, now: float) -> float:
        """Seconds since the last progress."""
        return max(0.0, now - self.last_progress)

    def hung(self, now: float) -> bool:
        """True once the group has been quiet for the timeout."""
        timeout = self.timeout()
        return timeout is not None and self.quiet_for(now) >= timeout
