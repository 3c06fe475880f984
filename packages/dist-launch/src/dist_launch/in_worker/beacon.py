"""A worker's progress beacon: what the launcher's hang detection reads from each rank.

Each worker started by the ``dist-launch`` command shares a small file with its
launcher (``DIST_LAUNCH_PROGRESS_FILE``, mapped into memory on both sides). It holds
three counters, each with one writer:

- slot 0, the *stack* counter: a daemon thread started by the bootstrap looks at the
  main thread's Python stack every ``DIST_LAUNCH_PROGRESS_PERIOD`` seconds and adds
  one when it differs from the last look (another place in the code, or the same
  place entered anew), or when the main thread ran Python code meanwhile (see
  :class:`_PythonRunning`);
- slot 1, the *explicit* counter: :func:`report_progress` adds one;
- slot 2, the *collectives* counter: the same thread writes, at every look, how many
  collectives the rank's process groups have completed
  (:mod:`dist_launch.in_worker.completed_collectives`).

The launcher only asks whether any counter moved. A look costs a few microseconds for
the stack and about ten for torch's counters (no syscall: the counters live in shared
memory), so at the default of two looks a second the cost on a training step is far
below 1%.

A rank that sleeps between collectives, or waits on its data loader between steps,
keeps one stack, but its collectives complete: that is progress. A rank blocked in a
collective that never completes, a ``sleep`` or a lock with no collective completing
anywhere stands still; so does a rank inside one long native call (a matmul, a
checkpoint write) until the call returns, which is why the timeout must be longer
than the longest such call, or the script calls :func:`report_progress`.

The same thread answers the launcher's requests for the rank's collective records
(``DIST_LAUNCH_REQUESTS``, a FIFO: :mod:`dist_launch.in_worker.records`): it waits on
the FIFO between two looks, so a request is answered at once, also while the main
thread is blocked in a collective. It runs when either is asked for. Standard library
only: a worker must not pay for anything at start-up.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import select
import signal
import sys
import threading
import time
from types import FrameType

from dist_launch.in_worker.completed_collectives import CompletedCollectives
from dist_launch.in_worker.progress_file import (
    COLLECTIVES_OFFSET,
    EXPLICIT_OFFSET,
    PROGRESS_FILE_VARIABLE,
    PROGRESS_PERIOD_VARIABLE,
    bump_counter,
    map_progress_file,
    set_counter,
)
from dist_launch.in_worker.records import (
    MAX_REQUEST_BYTES,
    REQUESTS_VARIABLE,
    answer,
    parse_requests,
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


def _answer_requests(fd: int, requests: str, rank: int) -> None:
    """Answers every request waiting in the FIFO; a failed answer is the launcher's to see."""
    with contextlib.suppress(BlockingIOError):
        data = os.read(fd, MAX_REQUEST_BYTES)
        for request in parse_requests(data):
            with contextlib.suppress(Exception):  # the launcher reads no answer: it says so
                answer(requests, rank, request)


def _run_beacon(
    shared: mmap.mmap | None,
    period: float,
    main_id: int,
    requests: tuple[int, str] | None,
    rank: int,
) -> None:
    last: int | None = None
    running = _PythonRunning(main_id) if shared is not None else None
    completed = CompletedCollectives()
    wake = threading.Event()  # never set: a wait that sleeps without a busy loop

    def look() -> None:
        nonlocal last
        if shared is None or running is None:
            return
        frame = sys._current_frames().get(main_id)
        key = _stack_key(frame)
        del frame  # hold no frame between looks: it would keep the frame's locals alive
        if running.since_last_look() or key != last:
            last = key
            bump_counter(shared, 0)
        count = completed.read()
        if count is not None:
            set_counter(shared, COLLECTIVES_OFFSET, count)

    while True:
        look()
        if requests is None:
            wake.wait(period)
            continue
        fd, path = requests
        ready, _, _ = select.select([fd], [], [], period if shared is not None else None)
        if ready:
            # The counters are current before the answer exists: a launcher that suspects
            # a hang reads them again once every rank answered (the records' last word).
            look()
            _answer_requests(fd, path, rank)


def start_progress_beacon(environ: dict[str, str] | None = None) -> bool:
    """Starts this worker's beacon thread when the launcher asked for one.

    Reads (and removes from the environment, so that grandchildren do not inherit them)
    ``DIST_LAUNCH_PROGRESS_FILE``, ``DIST_LAUNCH_PROGRESS_PERIOD`` and
    ``DIST_LAUNCH_REQUESTS``; reads ``RANK``.

    Returns:
        True when a beacon was started.
    """
    global _shared
    env = os.environ if environ is None else environ
    path = env.pop(PROGRESS_FILE_VARIABLE, None)
    period = float(env.pop(PROGRESS_PERIOD_VARIABLE, "0.5") or "0.5")
    requests_path = env.pop(REQUESTS_VARIABLE, None)
    rank = int(env.get("RANK", "0") or "0")
    if path:
        with contextlib.suppress(OSError):
            _shared = map_progress_file(path)
    requests: tuple[int, str] | None = None
    if requests_path:
        with contextlib.suppress(OSError):
            # Read and write: the FIFO always has a writer, so it never reads as ended.
            flags = os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC
            requests = (os.open(requests_path, flags), requests_path)
    if _shared is None and requests is None:
        return False
    beacon = threading.Thread(
        target=_run_beacon,
        args=(_shared, period, threading.main_thread().ident, requests, rank),
        name="dist-launch-progress",
        daemon=True,
    )
    # A signal sent to the process goes to any thread that does not block it. The
    # script knows only its own threads: one that blocks a signal in them to wait for
    # it (sigwait, sigtimedwait) would lose it to the beacon. A thread inherits its
    # creator's mask, so the beacon blocks them from its first instruction.
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals() - _FAULT_SIGNALS)
    try:
        beacon.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
    return True
