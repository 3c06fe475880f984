"""Where ``--log-dir`` puts each rank's output, and its error file in torch's format.

On one node the layout is torchrun's::

    <log_dir>/<run_id>/attempt_<n>/<local_rank>/stdout.log
                                               /stderr.log
                                               /error.json

On several nodes, whose launchers share the run id and may share ``log_dir`` (a
network file system), each launcher writes into a folder of its own inside the run's
directory, named by :func:`dist_launch.plan.run_identity.node_log_folder`::

    <log_dir>/<run_id>/<node>/attempt_<n>/<local_rank>/stdout.log ...

``<n>`` counts the restarts of the run (attempt_0, attempt_1, ...), as
``TORCHELASTIC_RESTART_COUNT`` does, and ``error.json`` is written in the format of
torch's ``ErrorHandler``, so that torch's ``ProcessFailure``, TorchX and schedulers
that know torchelastic read it as they read torchrun's.

A re-run never overwrites an earlier one. torch 2.13 achieves that by naming the run
directory ``<run_id>_<random>`` every time; we keep the plain ``<run_id>`` for the first
run with that id, so that its logs are where one looks for them, and name a later run
with the same id ``<run_id>_1``, ``<run_id>_2``, ... (the first free one, claimed with
an atomic ``mkdir``, so two launchers started at once never share a directory). On
several nodes the run's directory is shared on purpose, and the claim is of the
node's folder instead: ``<node>``, then ``<node>_1``, ... (a requeued job, a re-run
with the same id).
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


def _claim(parent: Path, name: str, what: str) -> Path:
    """Makes ``parent/name``, else the first free ``name_1``, ``name_2``, ... (atomic).

    Raises:
        FileExistsError: ``_MAX_RUN_DIRS`` of them exist already.
    """
    for index in range(_MAX_RUN_DIRS):
        path = parent / (name if index == 0 else f"{name}_{index}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        if index:
            logger.info("%s holds %s; this run logs to %s", parent / name, what, path)
        return path
    raise FileExistsError(
        f"{parent} holds {_MAX_RUN_DIRS} runs named {name!r} already: remove old ones "
        "or choose another --rdzv-id"
    )


@dataclass(frozen=True)
class LogLayout:
    """The log files of one launcher, inside its own directory ``launcher_dir``.

    Build it with :meth:`create`, which chooses and makes ``launcher_dir``: the run's
    directory on one node, this node's folder in it on several. The paths below are
    pure functions of ``launcher_dir``, the attempt and the local rank.
    """

    launcher_dir: Path

    @classmethod
    def create(
        cls,
        log_dir: str | os.PathLike[str] | None,
        run_id: str,
        node_folder: str | None = None,
    ) -> LogLayout:
        """Makes a fresh directory for this launcher's logs of ``run_id`` in ``log_dir``.

        Args:
            log_dir: The ``--log-dir`` value (made if missing); None for a new
                directory under the system's temporary directory (``TMPDIR``, read by
                :mod:`tempfile`).
            run_id: The run id; it names the run directory.
            node_folder: This node's folder in the run directory, shared by the
                nodes of the job; None on one node (the run directory is the
                launcher's own).

        Raises:
            ValueError: ``run_id`` or ``node_folder`` cannot name a directory.
            NotADirectoryError: ``log_dir`` is a file.
            FileExistsError: ``_MAX_RUN_DIRS`` runs with that id (of that node) exist
                already.
        """
        if not _names_a_directory(run_id):
            raise ValueError(
                f"run id {run_id!r} cannot name a log directory: it must be a non-empty "
                "name without '/' (choose another --rdzv-id)"
            )
        if node_folder is not None and not _names_a_directory(node_folder):
            raise ValueError(f"node folder {node_folder!r} cannot name a log directory")
        base = Path(tempfile.mkdtemp(prefix="dist-launch-logs-") if log_dir is None else log_dir)
        if base.is_file():
            raise NotADirectoryError(f"--log-dir {str(base)!r} is a file, not a directory")
        base.mkdir(parents=True, exist_ok=True)
        if node_folder is None:
            return cls(_claim(base, run_id, "an earlier run's logs"))
        run_dir = base / run_id
        run_dir.mkdir(exist_ok=True)  # shared by the job's nodes
        return cls(_claim(run_dir, node_folder, "an earlier run's logs of this node"))

    def attempt_dir(self, attempt: int) -> Path:
        """The directory of restart number ``attempt`` (0 for the first start)."""
        if attempt < 0:
            raise ValueError(f"attempt {attempt}: restarts are counted from 0")
        return self.launcher_dir / f"attempt_{attempt}"

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


def _names_a_directory(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


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
