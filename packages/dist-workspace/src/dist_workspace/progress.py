"""A progress line for long commands on a terminal: bytes done, GB/s, time left.

The command decides whether to show one (only when stderr is a terminal); this
module only draws it. The line is rewritten in place (a carriage return, then erase to the end
of the line) at most once per ``interval`` seconds, and ended with a newline by
:meth:`ProgressLine.finish`, so a log or a pipe never gets one.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from dist_workspace.units import format_bytes, format_duration, format_rate

DEFAULT_INTERVAL_S = 2.0
INTERVAL_VARIABLE = "DIST_WORKSPACE_PROGRESS_INTERVAL"


def interval_from_environ(environ: dict[str, str] | None = None) -> float:
    """Seconds between progress lines: ``DIST_WORKSPACE_PROGRESS_INTERVAL`` or 2.

    Raises:
        ValueError: The variable is not a number of seconds >= 0.
    """
    text = (os.environ if environ is None else environ).get(INTERVAL_VARIABLE, "")
    if not text:
        return DEFAULT_INTERVAL_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses NaN
        raise ValueError(f"{INTERVAL_VARIABLE}={text!r}: expected seconds >= 0, e.g. 0.5")
    return value


class ProgressLine:
    """Draws ``verb: 1.2 GiB of 4.0 GiB (30%), 1.05 GB/s, 2 min 41 s left``.

    Args:
        verb: What is being done (``"merging"``).
        total: Bytes the whole job will process.
        stream: Where to draw (a terminal).
        interval: Seconds between redraws; 0 redraws on every :meth:`advance`.
        clock: Monotonic seconds (a test may pass its own).
    """

    def __init__(
        self,
        verb: str,
        total: int,
        stream: TextIO,
        *,
        interval: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.verb = verb
        self.total = total
        self.stream = stream
        self.interval = interval
        self.clock = clock
        self.done = 0
        self.started = clock()
        self._last_drawn = self.started
        self._drawn = False

    def advance(self, nbytes: int) -> None:
        """Counts ``nbytes`` more as done; redraws when ``interval`` has passed."""
        self.done += nbytes
        now = self.clock()
        if now - self._last_drawn >= self.interval:
            self._draw(now)

    def text(self, now: float) -> str:
        """The line for the current count at ``now``."""
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        percent = 100.0 * self.done / self.total if self.total else 100.0
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        return (
            f"{self.verb}: {format_bytes(self.done)} of {format_bytes(self.total)} "
            f"({percent:.0f}%), {format_rate(rate)}, {format_duration(left)} left"
        )

    def _draw(self, now: float) -> None:
        self.stream.write(f"\r{self.text(now)}\x1b[K")
        self.stream.flush()
        self._last_drawn = now
        self._drawn = True

    def finish(self) -> None:
        """Draws the final count and ends the line, if a line was drawn at all.

        A job shorter than the interval leaves the terminal as it found it.
        """
        if self._drawn:
            self._draw(self.clock())
            self.stream.write("\n")
            self.stream.flush()


Advance = Callable[[int], None]
Start = Callable[[int], Advance]


@contextlib.contextmanager
def terminal_progress(verb: str, stream: TextIO) -> Iterator[Start | None]:
    """Progress lines on ``stream`` when it is a terminal, else nothing at all.

    Yields None when ``stream`` is not a terminal; else a function that starts a
    line for a given total and returns its ``advance``. Every started line is
    finished when the block exits (also on an error, so the prompt starts on a new
    line). The interval comes from :func:`interval_from_environ`.

    Raises:
        ValueError: ``DIST_WORKSPACE_PROGRESS_INTERVAL`` is malformed.
    """
    if not stream.isatty():
        yield None
        return
    interval = interval_from_environ()
    lines: list[ProgressLine] = []

    def start(total: int) -> Advance:
        line = ProgressLine(verb, total, stream, interval=interval)
        lines.append(line)
        return line.advance

    try:
        yield start
    finally:
        for line in lines:
            line.finish()
