"""The per-rank files through which a worker tells its supervisor how it failed.

Each worker supervised by :class:`dist_core.supervisor.Supervisor` owns three files in
its run's private directory (the worker writes them through
:mod:`dist_core.worker_guards`; the supervisor reads them):

``rank{r}.error.json``
    Written by the worker itself when Python code fails (an exception, or
    ``sys.exit`` with a non-zero status): the exception, its formatted traceback,
    the wall-clock time *taken in the worker* at the moment of failure, and whether
    the worker had a default process group then (an error before it, such as an
    ImportError, fails again on a restart). The supervisor
    picks the root cause by these timestamps, not by the order in which it noticed
    processes ending. The file is JSON, written atomically (temporary file, rename):
    a reader never sees half a record and never unpickles anything.
``rank{r}.fatal``
    faulthandler's output when the worker dies of SIGSEGV, SIGBUS, SIGFPE, SIGILL or
    SIGABRT: the Python stack at the crash. Its modification time is the crash time.
``rank{r}.stack``
    faulthandler's output when the supervisor asks a live worker for its stack
    (:data:`STACK_DUMP_SIGNAL`). The file appears only once the worker's handler is
    installed, so the supervisor never sends the signal to a worker that would die of it.

Scripts decorated with torch's ``torch.distributed.elastic.multiprocessing.errors.record``
write torchelastic's own error file (``TORCHELASTIC_ERROR_FILE``); it is read as a
fallback. Standard library only: launchers and test runners read these files without
importing torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

RECORD_VERSION = 1

# A real-time signal rather than SIGUSR1: job schedulers and trainers (SLURM
# preemption, Lightning's requeue) give SIGUSR1 a meaning of their own.
STACK_DUMP_SIGNAL: int = int(getattr(signal, "SIGRTMIN", signal.SIGUSR1)) + (
    3 if hasattr(signal, "SIGRTMIN") else 0
)


@dataclass(frozen=True)
class RankFiles:
    """Where one rank's failure record, crash stack and live stack dumps go."""

    error: Path
    fatal: Path
    stack: Path
    torchelastic_error: Path

    @classmethod
    def for_rank(cls, run_dir: str | os.PathLike[str], rank: int) -> RankFiles:
        """The files of global rank ``rank`` inside ``run_dir``."""
        base = Path(run_dir)
        return cls(
            error=base / f"rank{rank}.error.json",
            fatal=base / f"rank{rank}.fatal",
            stack=base / f"rank{rank}.stack",
            torchelastic_error=base / f"rank{rank}.torchelastic.json",
        )


@dataclass(frozen=True)
class ErrorRecord:
    """How a worker's Python code failed, as the worker itself recorded it."""

    rank: int
    timestamp: float
    exception: str
    message: str
    traceback: str
    exitcode: int
    # Whether torch.distributed's default group existed when the error was raised;
    # None when the record does not say (torch's @record file, an older record).
    in_process_group: bool | None = None

    @property
    def summary(self) -> str:
        """``Type: message`` on one line."""
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.exception}: {first}" if first else self.exception


def exit_status_of(error: BaseException) -> int:
    """The process exit status Python uses when ``error`` ends the program."""
    if isinstance(error, SystemExit):
        code = error.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code & 0xFF
        return 1  # sys.exit("message") prints the message and exits with 1
    return 1


def process_group_exists() -> bool | None:
    """Whether this process has torch.distributed's default group now (None: unknown).

    Never imports torch: a process that has not imported ``torch.distributed`` has no
    group.
    """
    distributed = sys.modules.get("torch.distributed")
    if distributed is None:
        return False
    try:
        return bool(distributed.is_available() and distributed.is_initialized())
    except Exception:  # a half-imported or broken torch: do not hide the real error
        return None


def write_error_record(path: Path, rank: int, error: BaseException) -> ErrorRecord:
    """Records ``error`` (with its traceback and the current time) in ``path``.

    Called inside the failing worker, so the timestamp is the worker's own, and
    whether a process group existed is this process's (:func:`process_group_exists`).
    """
    timestamp = time.time()
    text = "".join(traceback.format_exception(error))
    record = ErrorRecord(
        rank=rank,
        timestamp=timestamp,
        exception=type(error).__qualname__,
        message=str(error),
        traceback=text,
        exitcode=exit_status_of(error),
        in_process_group=process_group_exists(),
    )
    payload = {"version": RECORD_VERSION, **record.__dict__}
    partial = path.with_name(path.name + f".{os.getpid()}.partial")
    with contextlib.suppress(OSError):  # a full disk must not hide the original error
        partial.write_text(json.dumps(payload))
        os.replace(partial, path)
    return record


def _field(data: dict[str, Any], name: str, kind: type, path: Path) -> Any:
    value = data.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{path}: field {name!r} should be {kind.__name__}, found {value!r}")
    return value


def _optional_bool(data: dict[str, Any], name: str, path: Path) -> bool | None:
    value = data.get(name)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{path}: field {name!r} should be a bool or null, found {value!r}")
    return value


def read_error_record(path: Path) -> ErrorRecord | None:
    """The record in ``path``; None when the worker wrote none or it is unreadable."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != RECORD_VERSION:
            raise ValueError(f"{path}: not a version {RECORD_VERSION} dist-* error record")
        return ErrorRecord(
            rank=_field(data, "rank", int, path),
            timestamp=float(_field(data, "timestamp", (int, float), path)),  # type: ignore[arg-type]
            exception=_field(data, "exception", str, path),
            message=_field(data, "message", str, path),
            traceback=_field(data, "traceback", str, path),
            exitcode=_field(data, "exitcode", int, path),
            in_process_group=_optional_bool(data, "in_process_group", path),
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        logger.warning("ignoring unreadable error record: %s", error)
        return None


def read_torchelastic_error(path: Path, rank: int) -> ErrorRecord | None:
    """Reads the JSON error file of torch's ``@record`` decorator, if the worker wrote one."""
    try:
        data = json.loads(path.read_text())
        message = data["message"]
        if isinstance(message, str):  # the decorator's format for non-Python failures
            return None
        extra = message.get("extraInfo", {})
        text = str(message.get("message", ""))
        exception, _, detail = text.partition(": ")
        return ErrorRecord(
            rank=rank,
            timestamp=float(extra.get("timestamp", path.stat().st_mtime)),
            exception=exception or "Error",
            message=detail,
            traceback=str(extra.get("py_callstack", text)),
            exitcode=1,
        )
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        logger.warning("ignoring unreadable torchelastic error file %s: %s", path, error)
        return None
