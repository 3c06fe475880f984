"""The launcher's signal handling: signals recorded for its loop, never acted on in a handler."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable

# Dumps every rank's stack and stops nothing (as the JVM's thread dump does).
DUMP_SIGNAL = signal.SIGQUIT


class SignalInbox:
    """Records the handled signals and wakes a selector through a pipe.

    A signal ignored by whoever started the launcher (``nohup``, a background shell
    job) stays ignored, here and, through inheritance, in the workers.

    Args:
        signums: The signals to record (``--signals-to-handle``).
    """

    def __init__(self, signums: Iterable[int]) -> None:
        self.pending: list[int] = []
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._previous_wakeup = signal.set_wakeup_fd(self._write_fd)
        self._previous: dict[int, signal._HANDLER] = {}
        for signum in dict.fromkeys(signums):
            handler = signal.getsignal(signum)
            if handler is signal.SIG_IGN:
                continue
            self._previous[signum] = handler
            signal.signal(signum, self._record)

    def _record(self, signum: int, frame: object) -> None:
        self.pending.append(signum)

    def take(self) -> list[int]:
        """The signals received since the last call (drains the wake-up pipe)."""
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self.read_fd, 4096):
                pass
        received, self.pending[:] = self.pending[:], []
        return received

    def close(self) -> None:
        """Puts the previous handlers back."""
        signal.set_wakeup_fd(self._previous_wakeup)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        os.close(self.read_fd)
        os.close(self._write_fd)
