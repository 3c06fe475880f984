"""The launcher's one event loop: the only owner of its selector and its only ``select()``.

Everything the agent waits for arrives here: a signal (the signal inbox's pipe), a
worker's output or exit, the fork server's replies, the end of a call on a thread
(joining a rendezvous), a change another thread saw (the membership watch), and the
timers of whatever is due at a time (the supervisor's next step, the hang watch's next
look, a partial line to show). Callbacks run on the loop's thread, one at a time, so
the state they touch needs no lock; another thread hands the loop work with
:meth:`EventLoop.post`.

The loop runs in phases: :meth:`EventLoop.run_until` serves every descriptor and timer
until a condition holds or a deadline passes, then the caller does the next step of its
sequence (start the workers, wait for them, collect their records) and runs it again.
No callback runs the loop itself.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import os
import selectors
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class HasFileno(Protocol):
    """A socket or file: anything with a descriptor."""

    def fileno(self) -> int:
        """The descriptor."""


Watchable = int | HasFileno
# ``due(now)`` does what is due at ``now`` (monotonic) and returns when it needs the next
# call, or None; it is called on every turn of the loop.
Timer = Callable[[float], float | None]


class Pending(Generic[T]):
    """The result of :meth:`EventLoop.call_in_thread`, filled in on the loop's thread.

    Attributes:
        done: True once the call returned or raised.
        error: What it raised, if it did.
    """

    def __init__(self) -> None:
        self.done = False
        self.error: BaseException | None = None
        self._result: T | None = None

    @property
    def result(self) -> T:
        """What the call returned.

        Raises:
            RuntimeError: The call has not ended, or it raised (see :attr:`error`).
        """
        if not self.done or self.error is not None:
            state = "has not ended" if not self.done else f"raised {self.error!r}"
            raise RuntimeError(f"the call {state}: it has no result")
        return self._result  # type: ignore[return-value]


class EventLoop:
    """The selector, the timers and the posted calls of one launcher.

    Create it once (the CLI does, before the fork server starts) and close it when the
    launcher ends; :meth:`close` unregisters everything still watched.
    """

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self._timers: dict[int, Timer] = {}
        self._handles = itertools.count()
        self._posted: collections.deque[Callable[[], None]] = collections.deque()
        # post() may run on any thread, also after close(): the lock keeps it from
        # writing to a descriptor number that close() released for reuse.
        self._lock = threading.Lock()
        self._closed = False
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self.selector.register(self._wake_read, selectors.EVENT_READ, self._run_posted)

    # -- what the loop serves -------------------------------------------------------

    def watch(self, fd: Watchable, callback: Callable[[], None] | None) -> None:
        """Calls ``callback`` on the loop whenever ``fd`` is readable.

        With ``callback`` None the descriptor only wakes the loop (the timers then run:
        a worker's exit descriptor, read by the supervisor's next step).
        """
        self.selector.register(fd, selectors.EVENT_READ, callback)

    def unwatch(self, fd: Watchable) -> None:
        """Stops watching ``fd``; one that is not watched (any more) is ignored."""
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(fd)

    def add_timer(self, due: Timer) -> int:
        """Calls ``due(now)`` on every turn of the loop; returns a handle for :meth:`remove_timer`.

        The loop wakes by the time ``due`` returns (None: no time of its own).
        """
        handle = next(self._handles)
        self._timers[handle] = due
        return handle

    def remove_timer(self, handle: int) -> None:
        """Stops calling the timer of ``handle``; an unknown handle is ignored."""
        self._timers.pop(handle, None)

    def post(self, callback: Callable[[], None]) -> None:
        """Runs ``callback`` on the loop's thread at its next turn; safe from any thread.

        After :meth:`close` the call is dropped: nobody is left to serve it.
        """
        with self._lock:
            if self._closed:
                return
            self._posted.append(callback)
            with contextlib.suppress(BlockingIOError):  # a full pipe wakes the loop anyway
                os.write(self._wake_write, b"x")

    def call_in_thread(self, call: Callable[[], T], name: str = "dist-launch-call") -> Pending[T]:
        """Runs a blocking ``call`` on a daemon thread; its end is posted to the loop.

        For calls that may block for long (joining a rendezvous that waits for other
        nodes, connecting to a store) while the loop keeps serving signals. The thread
        is a daemon: a call that never returns does not keep the launcher alive.
        """
        pending: Pending[T] = Pending()

        def run() -> None:
            result: T | None = None
            error: BaseException | None = None
            try:
                result = call()
            except BaseException as raised:
                error = raised

            def finish() -> None:
                pending._result, pending.error, pending.done = result, error, True

            self.post(finish)

        threading.Thread(target=run, name=name, daemon=True).start()
        return pending

    # -- running --------------------------------------------------------------------

    def _run_posted(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_read, 4096):
                pass
        while self._posted:
            self._posted.popleft()()

    def run_posted(self) -> None:
        """Runs the calls posted so far, now (after stopping a thread that may have posted)."""
        self._run_posted()

    def _run_timers(self, now: float) -> float | None:
        wake_points: list[float] = []
        for due in list(self._timers.values()):
            when = due(now)
            if when is not None:
                wake_points.append(when)
        return min(wake_points, default=None)

    def run_until(self, done: Callable[[], bool], deadline: float | None = None) -> bool:
        """Serves descriptors, posted calls and timers until ``done()`` or ``deadline``.

        Each turn runs every timer, then checks ``done``, then waits for a descriptor
        until the earliest time a timer or the deadline names, and runs the callbacks
        of those that are ready.

        Args:
            done: The condition, checked on the loop's thread after the timers ran.
            deadline: Monotonic time after which to give up; None for none.

        Returns:
            True when ``done()`` held, False when the deadline passed first.
        """
        while True:
            wake_at = self._run_timers(time.monotonic())
            if done():
                return True
            now = time.monotonic()
            if deadline is not None:
                if now >= deadline:
                    return False
                wake_at = deadline if wake_at is None else min(wake_at, deadline)
            timeout = None if wake_at is None else max(0.0, wake_at - now)
            for key, _ in self.selector.select(timeout):
                # An earlier callback of this turn may have unwatched this descriptor.
                current = self.selector.get_map().get(key.fd)
                if current is not None and current.data is key.data and key.data is not None:
                    key.data()

    def close(self) -> None:
        """Unregisters everything, drops the timers and posted calls; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._posted.clear()
            self._timers.clear()
            for key in list(self.selector.get_map().values()):
                self.unwatch(key.fileobj)
            self.selector.close()
            for fd in (self._wake_read, self._wake_write):
                with contextlib.suppress(OSError):
                    os.close(fd)
