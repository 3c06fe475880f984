"""Where ``--log-dir`` puts each rank's output, and its error file in torch's format.

The layout is torchrun's::

    <log_dir>/<run_id>/attempt_<n>/<local_rank>/stdout.log
                                               /stderr.log
                                               /error.json

``<n>`` counts the restarts of the run (attempt_0, attempt_1, ...), as
``TORCHELASTIC_RESTART_COUNT`` does, and ``error.json`` is written in the format of
torch's ``ErrorHandler``, so that torch's ``ProcessFailure``, TorchX and schedulers
that know torchelastic read it as they read torchrun's.

A re-run never overwrites an earlier one. torch 2.13 achieves that by naming the run
directory ``<run_id>_<random>`` every time; we keep the plain ``<run_id>`` for the first
run with that id, so that its logs are where one looks for them, and name a later run
with the same id ``<run_id>_1``, ``<run_id>_2``, ... (the first free one, claimed with
an atomic ``mkdir``, so two launchers started at once never share a directory).
Without ``--log-dir``, a layout is only needed when ``--redirects``/``--tee`` send
something to a file; like torchrun, the launcher then uses a fresh directory under the
system's temporary directory (see :meth:`LogLayout.create`) and says where it is.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# A run id chosen a thousand times in one log directory is a mistake, not a history.
_MAX_RUN_DIRS = 1000


@dataclass(frozen=True)
class LogLayout:
    """The log files of one run, inside its own directory ``run_dir``.

    Build it with :meth:`create`, which chooses and makes ``run_dir``; the paths
    below are pure functions of ``run_dir``, the attempt and the local rank.
    """

    run_dir: Path

    @classmethod
    def create(cls, log_dir: str | os.PathLike[str] | None, run_id: str) -> LogLayout:
        """Makes a fresh run directory for ``run_id`` in ``log_dir`` (made if missing).

        Args:
            log_dir: The ``--log-dir`` value; None for a new directory under the
                system's temporary directory (``TMPDIR``, read by :mod:`tempfile`).
            run_id: The run id (``--rdzv-id``); it names the run directory.

        Raises:
            ValueError: ``run_id`` cannot name a directory.
            NotADirectoryError: ``log_dir`` is a file.
            FileExistsError: ``_MAX_RUN_DIRS`` runs with that id exist already.
        """
        if not run_id or run_id in (".", "..") or "/" in run_id or "\0" in run_id:
            raise ValueError(
                f"run id {run_id!r} cannot name a log directory: it must be a non-empty "
                "name without '/' (choose another --rdzv-id)"
            )
        base = Path(tempfile.mkdtemp(prefix="dist-launch-logs-") if log_dir is None else log_dir)
        if base.is_file():
            raise NotADirectoryError(f"--log-dir {str(base)!r} is a file, not a directory")
        base.mkdir(parents=True, exist_ok=True)
        for index in range(_MAX_RUN_DIRS):
            run_dir = base / (run_id if index == 0 else f"{run_id}_{index}")
            try:
                run_dir.mkdir()
            except FileExistsError:
                continue
            if index:
                logger.info(
                    "%s holds an earlier run's logs; this run logs to %s", base / run_id, run_dir
                )
            return cls(run_dir)
        raise FileExistsError(
            f"{base} holds {_MAX_RUN_DIRS} runs named {run_id!r} already: remove old ones "
            "or choose another --rdzv-id"
        )

    def attempt_dir(self, attempt: int) -> Path:
        """The directory of restart number ``attempt`` (0 for the first start)."""
        if attempt < 0:
            raise ValueError(f"attempt {attempt}: restarts are counted from 0")
        return self.run_dir / f"attempt_{attempt}"

    def rank_dir(self, attempt: int, local_rank: int) -> Path:
        """The directory of one local rank's files in one attempt."""
        if local_rank < 0:
            raise ValueError(f"local rank {local_rank}: local ranks are counted from 0")
        return self.attempt_dir(attempt) / str(local_rank)

    def stdout(self, attempt: int, local_rank: int) -> Path:
        """Where the rank's standard output goes."""
        return self.rank_dir(attempt, local_rank) / "stdout.log"

    def stderr(self, attempt: int, local_rank: int) -> Path:
        """Where the rank's standard error goes."""
        return self.rank_dir(attempt, local_rank) / "stderr.log"

    def error_file(self, attempt: int, local_rank: int) -> Path:
        """Where the rank's failure is recorded in torch's error-file format."""
        return self.rank_dir(attempt, local_rank) / "error.json"

    def create_attempt(self, attempt: int, local_ranks: Iterable[int]) -> Path:
        """Makes the attempt's directory and one directory per local rank in it.

        Raises:
            FileExistsError: The attempt was created before (a restart must count up).
        """
        path = self.attempt_dir(attempt)
        path.mkdir()
        for local_rank in local_ranks:
            self.rank_dir(attempt, local_rank).mkdir()
        return path


def write_torch_error_file(
    path: str | os.PathLike[str],
    *,
    message: str,
    traceback: str,
    timestamp: float,
    extra: Mapping[str, object] | None = None,
) -> None:
    """Writes a failure as torch's ``ErrorHandler.record_exception`` does, atomically.

    The reader sees either no file or the whole record (temporary file, then rename).
    The timestamp is stored as whole seconds in a string, as torch stores it and as
    ``ProcessFailure`` parses it.

    Args:
        path: The error file (``error.json`` of the rank, see :class:`LogLayout`).
        message: One line naming the failure, ``"ValueError: bad lr"`` as torch writes it.
        traceback: The formatted traceback (torch's ``py_callstack``).
        timestamp: When the worker failed, seconds since the epoch.
        extra: More ``extraInfo`` fields (the run's ``exit_code`` and ``exit_class``).
    """
    info: dict[str, object] = {"py_callstack": traceback, "timestamp": str(int(timestamp))}
    info.update(extra or {})
    record = {"message": {"message": message, "extraInfo": info}}
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as file:
            json.dump(record, file)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
