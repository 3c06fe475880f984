"""What every supervised worker installs first: die with its parent, report how it ended.

Used inside the worker by every runner of :class:`dist_core.supervisor.Supervisor`:
dist-launch's library launcher and CLI bootstrap, and :func:`dist_core.testing.run_ranks`.
The files it writes are those of :mod:`dist_core.rank_files`.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import traceback
from typing import IO, NoReturn

from dist_core.proc import set_parent_death_signal
from dist_core.rank_files import STACK_DUMP_SIGNAL, RankFiles, write_error_record

# Exit status of a worker that found its parent already gone at start-up.
ORPHANED_EXIT_STATUS = 125

# faulthandler writes to these files until the process ends: keep them open.
_open_files: list[IO[str]] = []


def install_worker_guards(files: RankFiles, parent_pid: int | None) -> None:
    """Ties this process's life to its parent's and arms the failure reporters.

    - The kernel sends SIGKILL to this process when its parent dies
      (``PR_SET_PDEATHSIG``), so no worker outlives its launcher, even one killed
      with SIGKILL. When the parent already died before the request was made, the
      worker exits at once.
    - A crash (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) writes the Python stack of
      every thread to ``files.fatal``.
    - :data:`~dist_core.rank_files.STACK_DUMP_SIGNAL` writes the live stack of every
      thread to ``files.stack``, which appears only once this handler is armed.

    Args:
        files: This rank's files.
        parent_pid: The pid the parent had when it started this worker; None when the
            parent is a fork server whose pid the launcher does not know.
    """
    set_parent_death_signal(signal.SIGKILL)
    parent_now = os.getppid()
    if (parent_pid is not None and parent_now != parent_pid) or parent_now == 1:
        os._exit(ORPHANED_EXIT_STATUS)
    fatal = open(files.fatal, "w")  # noqa: SIM115 - faulthandler writes until exit
    _open_files.append(fatal)
    faulthandler.enable(file=fatal, all_threads=True)
    partial = files.stack.with_name(files.stack.name + ".partial")
    stack = open(partial, "w")  # noqa: SIM115 - faulthandler writes until exit
    _open_files.append(stack)
    faulthandler.register(STACK_DUMP_SIGNAL, file=stack, all_threads=True, chain=False)
    os.replace(partial, files.stack)  # the supervisor may signal us from now on


def die_quietly_of_sigint() -> NoReturn:
    """Ends the process as killed by SIGINT, without a KeyboardInterrupt traceback.

    The launcher prints one line for a Ctrl-C; N ranks printing N tracebacks would
    bury it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(130)  # not reached unless SIGINT is blocked


def record_and_print(files: RankFiles, rank: int, error: BaseException) -> int:
    """Writes ``error``'s record for the supervisor and prints its traceback as Python would.

    Returns:
        The exit status for the process.
    """
    record = write_error_record(files.error, rank, error)
    if not isinstance(error, SystemExit):
        traceback.print_exception(error)
    elif error.code is not None and not isinstance(error.code, int):
        print(error.code, file=sys.stderr)
    sys.stderr.flush()
    return record.exitcode
