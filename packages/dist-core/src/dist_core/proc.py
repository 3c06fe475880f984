"""Process helpers shared by dist-core's test runner and the dist-* launchers."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Asks the kernel to send ``signum`` to this process when its parent exits.

    Linux only (``prctl(PR_SET_PDEATHSIG)``); elsewhere a no-op. The signal follows
    the death of the *thread* that forked this process, so call it from a child whose
    parent forks from its main thread.

    Returns:
        True when the kernel accepted the request.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        # The symbols the process already has (libc's prctl among them): find_library
        # would run ldconfig in a subprocess, at every worker's start.
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0)
    except OSError:
        logger.debug("prctl(PR_SET_PDEATHSIG) is unavailable", exc_info=True)
        return False


def close_inherited_forkserver_fd() -> None:
    """Drops a forkserver child's copy of the server's keep-alive pipe.

    multiprocessing hands every child of a fork server the write end of the pipe whose
    end of file tells the server that its own parent died. While children hold it, a
    SIGKILLed parent leaves the server, and every child whose parent-death signal
    follows the server, running. Call it first thing in a forkserver child; elsewhere
    it does nothing.
    """
    from multiprocessing import forkserver  # noqa: PLC0415 - only forkserver children

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


def describe_exit(exitcode: int | None) -> str:
    """Says how a process ended: ``exit code 3``, ``signal SIGKILL``, ``still running``.

    Takes multiprocessing's convention, where ``-N`` means killed by signal N.
    """
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"signal {name}"
    return f"exit code {exitcode}"


# Messages of errors that a rank raises *because another rank died or stalled*: the
# transport saw its peer vanish. When ranks fail together these are consequences, and
# the rank that died (often without any traceback) is the root cause.
_PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "remote worker",
    "Broken pipe",
    "NCCL communicator was aborted",
    "ProcessGroupNCCL's watchdog",
    "Socket Timeout",
    "DistNetworkError",
    "DistStoreError",
)


def is_peer_failure(error_text: str) -> bool:
    """True when an error's text says a *peer* failed (a consequence, not a root cause).

    Args:
        error_text: A formatted traceback or error message.
    """
    return any(marker in error_text for marker in _PEER_FAILURE_MARKERS)
