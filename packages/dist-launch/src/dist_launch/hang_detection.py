"""When a group counts as hung: the ``--hang-timeout`` policy and the decision on samples.

Pure: no processes, no clock of its own (the caller passes ``now``), so that a test
feeds it a sequence of samples.

A node's group makes progress when any of its ranks does: its stack counter or its
explicit counter moved (:mod:`dist_launch.progress`), or it wrote output. The group
is hung when none did for the timeout. Judging the group, not each rank, keeps a job
healthy while rank 0 evaluates or saves a checkpoint and the others wait for it in a
barrier; a real hang stops every rank, since the others soon wait for the stuck one.

``--hang-timeout``:

- ``SECONDS``: hung after that long without progress.
- ``auto`` (the default): hung after ``max(AUTO_FLOOR_SECONDS, AUTO_FACTOR x`` the
  longest quiet interval this job has shown so far``)``. The interval is learned from
  the job itself, over every round of the run: a job whose checkpoint write keeps it
  quiet for 2 minutes gets 10 minutes, never less than the floor.
- ``off``: no hang detection.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

HangMode = Literal["off", "fixed", "auto"]

DEFAULT_HANG_TIMEOUT = "auto"
# The launcher's exit status after a hang with no restart left: not a crash's, so that a
# scheduler can tell them apart (sysexits.h's EX_TEMPFAIL: a temporary failure, worth
# a retry).
HANG_EXIT_STATUS = 75
# auto never calls a group hung before this many seconds without progress.
AUTO_FLOOR_SECONDS = 300.0
# auto's multiple of the longest quiet interval seen.
AUTO_FACTOR = 5.0
# Looks per timeout: a hang is found at most timeout/LOOKS_PER_TIMEOUT late.
LOOKS_PER_TIMEOUT = 30
MAX_LOOK_SECONDS = 0.5
MIN_LOOK_SECONDS = 0.02


@dataclass(frozen=True)
class HangPolicy:
    """What ``--hang-timeout`` asked for.

    Attributes:
        mode: ``off``, ``fixed`` (``seconds``) or ``auto``.
        seconds: The fixed timeout; None unless ``mode`` is ``fixed``.
    """

    mode: HangMode
    seconds: float | None = None

    @property
    def enabled(self) -> bool:
        """False for ``off``."""
        return self.mode != "off"

    @property
    def look_period(self) -> float:
        """Seconds between two looks at the workers' progress (theirs and the launcher's)."""
        base = AUTO_FLOOR_SECONDS if self.seconds is None else self.seconds
        return min(MAX_LOOK_SECONDS, max(MIN_LOOK_SECONDS, base / LOOKS_PER_TIMEOUT))

    def describe(self) -> str:
        """``--hang-timeout 3`` or ``--hang-timeout auto``, as the report quotes it."""
        if self.mode == "fixed":
            return f"--hang-timeout {self.seconds:g}"
        return f"--hang-timeout {self.mode}"


def parse_hang_timeout(value: str) -> HangPolicy:
    """Parses ``SECONDS``, ``auto`` or ``off`` (case-insensitive).

    Raises:
        ValueError: Anything else, or a number that is not positive; the message says
            what was given and what is accepted.
    """
    text = value.strip().lower()
    if text in ("off", "none", "0"):
        return HangPolicy("off")
    if text == "auto":
        return HangPolicy("auto")
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(
            f"--hang-timeout={value!r}: expected a number of seconds, 'auto' or 'off'"
        ) from None
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"--hang-timeout={value!r}: the seconds must be positive and finite")
    return HangPolicy("fixed", seconds)


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
        self._seen: dict[int, Hashable] = {}

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

    def saw(self, rank: int, token: Hashable, now: float) -> None:
        """A look at ``rank``'s counters: progress when ``token`` differs from the last one."""
        if self._seen.get(rank) != token:
            first = rank not in self._seen
            self._seen[rank] = token
            if not first or token != (0, 0):
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
