"""In-worker entry point of the CLI: ``python -m dist_launch.in_worker.bootstrap TARGET ARGS``.

Runs an unmodified script (``script.py ARGS``) or module (``-m pkg.module ARGS``)
exactly as ``python`` would (``sys.argv``, ``sys.path[0]``, ``__main__``), after
installing the worker guards (:mod:`dist_core.worker_guards`), and records an uncaught
exception or a non-zero ``sys.exit`` in the rank's error file with the worker's own
timestamp. Reads (and removes from ``os.environ``, so grandchildren do not inherit
them) ``DIST_LAUNCH_RUN_DIR`` and ``DIST_LAUNCH_PARENT_PID``, and the progress
beacon's variables (:mod:`dist_launch.in_worker.beacon`); reads ``RANK``.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import gc
import importlib.machinery
import io
import os
import runpy
import sys
import threading
import types
import zipfile
from types import TracebackType
from typing import NoReturn

from dist_core.rank_files import RankFiles
from dist_core.worker_guards import die_quietly_of_sigint, install_worker_guards, record_and_print
from dist_launch.in_worker import proctitle
from dist_launch.in_worker.beacon import start_progress_beacon

RUN_DIR_VARIABLE = "DIST_LAUNCH_RUN_DIR"
PARENT_PID_VARIABLE = "DIST_LAUNCH_PARENT_PID"

_OWN_FILES = {
    os.path.abspath(__file__),
    os.path.abspath(runpy.__file__),
    os.path.abspath(os.path.join(os.path.dirname(__file__), "fork_server.py")),
    "<frozen runpy>",
}


def _is_own(filename: str) -> bool:
    return filename in _OWN_FILES or os.path.abspath(filename) in _OWN_FILES


def _without_launcher_frames(error: BaseException) -> BaseException:
    """Drops the bootstrap's and runpy's frames, so the traceback starts in the script."""
    tb: TracebackType | None = error.__traceback__
    while tb is not None and _is_own(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return error.with_traceback(tb) if tb is not None else error


def prepare_target(argv: list[str]) -> tuple[str, str]:
    """Sets ``sys.argv`` and ``sys.path[0]`` for the target; returns (kind, name).

    Raises:
        SystemExit: No target was given.
    """
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        raise SystemExit(
            "usage: python -m dist_launch.in_worker.bootstrap (-m MODULE | SCRIPT) [ARGS...]"
        )
    if argv[0] == "-m":
        # As `python -m`: sys.path[0] is the working directory, argv[0] set by runpy.
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        return "module", argv[1]
    script = argv[0]
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    return "script", script


def run_script(path: str) -> None:
    """Runs a script as ``python script.py`` does, with ``__file__`` its absolute path.

    ``sys.argv[0]`` stays as given (as Python leaves it); ``__file__`` and the
    traceback's file names are absolute, so that a script that changes directory
    still finds its own files. A directory or zip archive goes to :mod:`runpy`.
    """
    absolute = os.path.abspath(path)
    if not os.path.isfile(absolute) or zipfile.is_zipfile(absolute):
        runpy.run_path(path, run_name="__main__")
        return
    with io.open_code(absolute) as source:
        # dont_inherit: this module's `from __future__` imports are not the script's.
        code = compile(source.read(), absolute, "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__dict__.update(
        __file__=absolute,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", absolute),
        __package__=None,
        __spec__=None,
        __builtins__=builtins,
    )
    # As runpy: the script's module is `__main__` while it runs (pickle finds its classes).
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def run_target(kind: str, name: str, files: RankFiles, rank: int) -> int:
    """Runs the script or module as ``__main__``; returns the process's exit status."""
    try:
        if kind == "module":
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            run_script(name)
    except KeyboardInterrupt:
        die_quietly_of_sigint()
    except SystemExit as error:
        if error.code is None or error.code == 0:
            return 0
        return record_and_print(files, rank, _without_launcher_frames(error))
    except BaseException as error:
        return record_and_print(files, rank, _without_launcher_frames(error))
    return 0


def exit_without_teardown(status: int) -> NoReturn:
    """Ends the process as Python's shutdown would, minus the module teardown.

    Joins the non-daemon threads, runs the ``atexit`` handlers (logging, torch,
    trackers), collects garbage created since the fork (closing and flushing files the
    script left open), flushes stdio, then ``os._exit``. Tearing down every module of
    torch takes most of a CPU second per worker and, in a forked worker, writes to
    every page it shares with the fork server; Python does not promise that teardown
    anyway.
    """
    main_thread = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main_thread and not thread.daemon:
            thread.join()
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if run_exitfuncs is not None:
        run_exitfuncs()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)


def worker_setup() -> tuple[RankFiles, int]:
    """Reads the launcher's variables and installs the guards; returns (files, rank)."""
    run_dir = os.environ.pop(RUN_DIR_VARIABLE, None)
    parent = os.environ.pop(PARENT_PID_VARIABLE, "")
    if run_dir is None:
        raise SystemExit(f"{RUN_DIR_VARIABLE} is not set: this module is started by dist-launch")
    rank = int(os.environ.get("RANK", "0"))
    files = RankFiles.for_rank(run_dir, rank)
    install_worker_guards(files, int(parent) if parent else None)
    start_progress_beacon()
    return files, rank


def main(argv: list[str] | None = None) -> int:
    """Guards, then the target; returns its exit status."""
    files, rank = worker_setup()
    target_argv = list(sys.argv[1:] if argv is None else argv)
    kind, name = prepare_target(target_argv)
    # `ps` shows the worker as the user's command (this argv area holds it already).
    proctitle.name_worker(target_argv, rank)
    status = run_target(kind, name, files, rank)
    if status != 0:
        # Tell the launcher at once; a slow teardown would delay stopping the others.
        exit_without_teardown(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
