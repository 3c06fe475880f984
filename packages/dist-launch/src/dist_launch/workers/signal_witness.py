"""A process placed as a worker is, that tells the launcher which signals reached it.

When the launcher is told to stop, it must know whether the workers got the signal
too. SLURM (``scancel``, a time limit, a preemption), systemd's control-group kill and
``kill -TERM -1`` signal every process of the job: each worker's handler is already
running, and a second copy from the launcher could cut it short (a script whose second
SIGTERM means "quit now"). Kubernetes (the container's first process), ``docker stop``
and a terminal's Ctrl-C (the launcher's process group) signal the launcher alone: it
must pass the signal on.

The witness is a tiny Python process (no torch, no site packages; about 15 ms to start)
in a process group of its own, as each worker is, so it is signalled exactly when they
are. Its handlers only exist so that CPython's C-level handler writes each signal's
number to a pipe the launcher reads (``signal.set_wakeup_fd``), at delivery. It dies
with the launcher (parent-death signal). The launcher waits for it to be ready before
it starts any worker: a signal that reached a fast worker before the witness had its
handlers would kill the witness, and the launcher would pass the signal on a second time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)

# How long the launcher waits for the witness after its own copy of a signal: a
# scheduler signals every process of the job within a millisecond or so.
WITNESS_WAIT_SECONDS = 0.5
# How long the launcher waits for the witness to be ready before the first workers: it
# starts in about 15 ms, but a loaded machine can take seconds to run a new process.
WITNESS_READY_SECONDS = 10.0

_WITNESS_CODE = """
import ctypes, os, signal, sys
fd, launcher, signums = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG: SIGKILL with the launcher
if os.getppid() != launcher:
    sys.exit(0)
os.set_blocking(fd, False)
signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
for signum in signums.split(","):
    signal.signal(int(signum), lambda *_: None)
os.write(fd, b"\\0")  # ready
while True:
    signal.pause()
"""


class SignalWitness:
    """Starts the witness for ``signums``; :meth:`saw` says whether a signal reached it.

    Args:
        signums: The signals to witness (the launcher's stop and forwarded signals).
    """

    def __init__(self, signums: Iterable[int]) -> None:
        numbers = sorted(set(signums))
        self.read_fd, write_fd = os.pipe()
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    "-c",
                    _WITNESS_CODE,
                    str(write_fd),
                    str(os.getpid()),
                    ",".join(str(n) for n in numbers),
                ],
                stdin=subprocess.DEVNULL,
                pass_fds=(write_fd,),
                process_group=0,
            )
        except BaseException:
            os.close(self.read_fd)
            raise
        finally:
            os.close(write_fd)
        os.set_blocking(self.read_fd, False)
        self._gone = False
        self.ready = False  # its handlers are installed
        self._seen: list[int] = []

    def _read(self, timeout: float) -> None:
        """Reads what the witness wrote, waiting up to ``timeout`` for something."""
        if self._gone:
            return
        if timeout > 0:
            with contextlib.suppress(OSError, ValueError):
                select.select([self.read_fd], [], [], timeout)
        try:
            data = os.read(self.read_fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._gone = True
            return
        if 0 in data:
            self.ready = True
        self._seen.extend(byte for byte in data if byte != 0)  # 0: the witness is ready

    def _read_until(self, done: Callable[[], bool], timeout: float) -> None:
        """Reads until ``done()``, the witness is gone, or ``timeout`` seconds passed."""
        deadline = time.monotonic() + timeout
        while not done() and not self._gone:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._read(remaining)

    def wait_ready(self, timeout: float = WITNESS_READY_SECONDS) -> bool:
        """Waits up to ``timeout`` seconds for the witness's handlers; whether it is ready."""
        self._read_until(lambda: self.ready, timeout)
        return self.ready and not self._gone

    def saw(self, signum: int, wait: float = WITNESS_WAIT_SECONDS) -> bool:
        """Whether ``signum`` reached the witness (waiting up to ``wait`` seconds).

        Each copy the witness received answers one call: a scheduler's second SIGTERM
        is matched with the launcher's second one.
        """
        self._read_until(lambda: signum in self._seen, wait)
        if signum in self._seen:
            self._seen.remove(signum)
            return True
        if self._gone:
            logger.debug("the signal witness is gone: passing %d on", signum)
        return False

    def close(self) -> None:
        """Stops the witness and reaps it."""
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5.0)
        with contextlib.suppress(OSError):
            os.close(self.read_fd)
