"""A thread that asks, every interval, whether the current round must end."""

from __future__ import annotations

import threading
from collections.abc import Callable

from dist_launch.rendezvous.protocol import RoundChange


class PollingWatch:
    """Calls ``poll`` every ``interval`` seconds on a daemon thread until it says why.

    Args:
        poll: Why the round must end, or None; may block (bounded) for a store.
        interval: Seconds between polls (``--monitor-interval``).
        on_change: Called once, from the thread, with ``poll``'s first answer.
        grace: How much longer than one interval :meth:`stop` waits for a poll.
    """

    def __init__(
        self,
        poll: Callable[[], RoundChange | None],
        interval: float,
        on_change: Callable[[RoundChange], None],
        grace: float = 5.0,
    ) -> None:
        self._poll = poll
        self._interval = interval
        self._grace = grace
        self._on_change = on_change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="round-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            change = self._poll()
            if change is not None and not self._stop.is_set():
                self._on_change(change)
                return

    def stop(self) -> None:
        """Stops polling (bounded: one interval and the grace at most)."""
        self._stop.set()
        self._thread.join(self._interval + self._grace)
