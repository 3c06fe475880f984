"""A worker's progress beacon: what the launcher's hang detection reads from each rank.

Each worker started by the ``dist-launch`` command shares a small file with its
launcher (``DIST_LAUNCH_PROGRESS_FILE``, mapped into memory on both sides). It holds
two counters, each with one writer:

- slot 0, the *stack* counter: a daemon thread started by the bootstrap looks at the
  main thread's Python stack every ``DIST_LAUNCH_PROGRESS_PERIOD`` seconds and adds
  one when it differs from the last look (another place in the code, or the same
  place entered anew), or when the main thread ran Python code meanwhile (see
  :class:`_PythonRunning`);
- slot 1, the *explicit* counter: :func:`report_progress` adds one.

The launcher only asks whether either counter moved. Looking at a stack costs a few
microseconds per look (no syscall: the counter lives in shared memory), so at the
default of two looks a second the cost on a training step is far below 1%.

A rank blocked in a collective, a ``sleep``, a lock or a queue keeps one stack and the
counters stand still; a rank inside one long native call (a matmul, a checkpoint
write) also stands still until the call returns, which is why the timeout must be
longer than the longest such call, or the script calls :func:`report_progress`.
Standard library only: a worker must not pay for anything at start-up.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import sys
import threading
import time
from types import FrameType

from dist_launch.in_worker.progress_file import (
    EXPLICIT_OFFSET,
    PROGRESS_FILE_VARIABLE,
    PROGRESS_PERIOD_VARIABLE,
    bump_counter,
    map_progress_file,
)

# The shared counters of this worker; None outside dist-launch (report_progress is then
# a no-op).
_shared: mmap.mmap | None = None


def report_progress() -> None:
    """Tells ``dist-launch``'s hang detection that this rank is making progress.

    Needed only where a healthy rank shows no sign of life for longer than the hang
    timeout: no output, and one Python stack that does not change, e.g. a step that
    spends all its time in one native call longer than ``--hang-timeout``. Costs well
    under a microsecond; outside a worker of the ``dist-launch`` command it does
    nothing.
    """
    shared = _shared
    if shared is not None:
        bump_counter(shared, EXPLICIT_OFFSET)


def _stack_key(frame: FrameType | None) -> int:
    """A key of the place the stack is at, and of which calls are on it.

    The code object, the instruction offset and the frame object's identity of every
    frame: the identity differs when a call returned and the same function was
    entered again (a new frame object), so that a loop that spends almost all of its
    time on one line still shows progress most of the time.
    """
    parts: list[tuple[int, int, int]] = []
    while frame is not None:
        parts.append((id(frame.f_code), frame.f_lasti, id(frame)))
        frame = frame.f_back
    return hash(tuple(parts))


def _cpu_clock(thread_id: int) -> int | None:
    """The CPU-time clock of a thread of this process, where the platform has one."""
    try:
        return time.pthread_getcpuclockid(thread_id)
    except (AttributeError, OSError):
        return None


class _PythonRunning:
    """Tells whether the main thread ran Python code since the last look.

    A look sees the main thread only where it lets go of the GIL, which, in a loop of
    Python code, is the same few instructions every time: the stack looks the same
    although the loop runs. Two signs together say it ran: taking the GIL back after
    releasing it took a switch interval (some thread held it, running Python), and the
    main thread used CPU time meanwhile. A rank blocked in a collective, a sleep or a
    lock holds no GIL; one spinning in native code (a CUDA synchronisation) uses CPU
    time but holds no GIL either.
    """

    def __init__(self, main_id: int) -> None:
        self._clock = _cpu_clock(main_id)
        self._threshold = sys.getswitchinterval() / 2
        self._cpu = self._cpu_time()

    def _cpu_time(self) -> float:
        return 0.0 if self._clock is None else time.clock_gettime(self._clock)

    def since_last_look(self) -> bool:
        if self._clock is None:
            return False
        start = time.perf_counter()
        time.sleep(0)  # lets go of the GIL and takes it back
        contended = time.perf_counter() - start >= self._threshold
        cpu, self._cpu = self._cpu, self._cpu_time()
        return contended and self._cpu - cpu >= self._threshold


# Signals raised by a thread's own fault: blocking them would not stop them, only
# lose faulthandler's report of the thread.
_FAULT_SIGNALS = {signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGTRAP}


def _sample_main_thread(shared: mmap.mmap, period: float, main_id: int) -> None:
    last: int | None = None
    running = _PythonRunning(main_id)
    wake = threading.Event()  # never set: a wait that sleeps without a busy loop
    while True:
        frame = sys._current_frames().get(main_id)
        key = _stack_key(frame)
        del frame  # hold no frame between looks: it would keep the frame's locals alive
        if running.since_last_look() or key != last:
            last = key
            bump_counter(shared, 0)
        wake.wait(period)


def start_progress_beacon(environ: dict[str, str] | None = None) -> bool:
    """Starts the stack sampler of this worker when the launcher asked for one.

    Reads (and removes from the environment, so that grandchildren do not inherit it)
    ``DIST_LAUNCH_PROGRESS_FILE`` and ``DIST_LAUNCH_PROGRESS_PERIOD``.

    Returns:
        True when a sampler was started.
    """
    global _shared
    env = os.environ if environ is None else environ
    path = env.pop(PROGRESS_FILE_VARIABLE, None)
    period = float(env.pop(PROGRESS_PERIOD_VARIABLE, "0.5") or "0.5")
    if not path:
        return False
    with contextlib.suppress(OSError):
        _shared = map_progress_file(path)
    if _shared is None:
        return False
    sampler = threading.Thread(
        target=_sample_main_thread,
        args=(_shared, period, threading.main_thread().ident),
        name="dist-launch-progress",
        daemon=True,
    )
    # A signal sent to the process goes to any thread that does not block it. The
    # script knows only its own threads: one that blocks a signal in them to wait for
    # it (sigwait, sigtimedwait) would lose it to the sampler. A thread inherits its
    # creator's mask, so the sampler blocks them from its first instruction.
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - _FAULT_SIGNALS)
    try:
        sampler.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
    return True
