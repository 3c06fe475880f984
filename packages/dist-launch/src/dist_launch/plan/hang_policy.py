"""The ``--hang-timeout`` policy: when a group counts as hung, and the hang's exit status.

``--hang-timeout``:

- ``SECONDS``: hung after that long without progress.
- ``auto`` (the default): hung after ``max(AUTO_FLOOR_SECONDS, AUTO_FACTOR x`` the
  longest quiet interval this job has shown so far``)``. The interval is learned from
  the job itself, over every round of the run: a job whose checkpoint write keeps it
  quiet for 2 minutes gets 10 minutes, never less than the floor.
- ``off``: no hang detection.

The decision on samples is :class:`~dist_launch.watch.quiet_watch.QuietWatch`. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

HangMode = Literal["off", "fixed", "auto"]

DEFAULT_HANG_TIMEOUT = "auto"
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
