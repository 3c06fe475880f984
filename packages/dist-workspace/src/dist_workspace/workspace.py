"""NFSWorkspace: one safetensors file per rank in a directory every rank can see."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout

from dist_workspace.errors import WorkspaceError
from dist_workspace.fsutil import atomic_write, make_private_directory, write_all
from dist_workspace.jobid import current_job_id
from dist_workspace.reader import read_record_file
from dist_workspace.writer import prepare_record, write_record

logger = logging.getLogger(__name__)

RANK_FILE_PATTERN = re.compile(r"^rank-(\d+)\.safetensors$")
_JOB_MARKER = ".dist-workspace-job"
_WORKSPACE_LOCK = ".dist-workspace"  # its lock file is .dist-workspace.lock
DEFAULT_FILE_MODE = 0o600
DEFAULT_DIR_MODE = 0o700


def rank_file_name(rank: int) -> str:
    """The file name of a rank's record: ``rank-{rank}.safetensors``."""
    return f"rank-{rank}.safetensors"


def _current_rank() -> int:
    from dist_core.ranks import get_rank  # noqa: PLC0415 - keeps import light

    return get_rank()


class NFSWorkspace:
    """Configs and weights of every rank, exchanged through a shared directory.

    Each rank writes ``rank-{r}.safetensors`` (config JSON in the safetensors metadata,
    tensors as safetensors, a CRC-32 per tensor) next to a lock file
    ``rank-{r}.safetensors.lock``. Nothing is ever unpickled.

    Creating a workspace makes the directory (``dir_mode``, 0700 by default) and
    removes stale state once per job: under the workspace lock it compares the job id
    stored in ``.dist-workspace-job`` with this job's (see
    :func:`dist_workspace.jobid.current_job_id`). Only when they differ does it delete
    the rank files and leftover temporary files, then record this job's id. A rank of
    the same job arriving later finds its own job id there and deletes nothing, so a
    file that another rank of this job has just written is never removed. One job per
    directory at a time: two jobs writing into one directory at once clean each
    other's files.

    Reads the environment through :func:`dist_core.get_rank` (``RANK`` etc.) when no
    process group is initialized, and ``DIST_WORKSPACE_JOB_ID`` etc. for the job id.

    Args:
        workspace_path: The directory; None gives an uninitialized workspace
            (``is_initialized`` is False and reads and writes raise), as in the seed.
        file_mode: Permission bits of rank, lock and marker files (0600; pass e.g.
            0o640 for a directory shared with a group on NFS).
        dir_mode: Permission bits of a directory created here (0700).
        lock_timeout: Seconds to wait for a file lock before raising.
        durable: fsync each file and the directory before and after the rename (the
            default). False keeps writes atomic for readers but not crash-safe;
            faster on local disks, where the fsync waits for the device.
    """

    def __init__(
        self,
        workspace_path: str | os.PathLike[str] | None = None,
        *,
        file_mode: int = DEFAULT_FILE_MODE,
        dir_mode: int = DEFAULT_DIR_MODE,
        lock_timeout: float = 120.0,
        durable: bool = True,
    ) -> None:
        self.path: Path | None = None if workspace_path is None else Path(workspace_path)
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self.lock_timeout = lock_timeout
        self.durable = durable
        self.job_id = ""
        if self.path is not None:
            self.job_id = current_job_id()
            make_private_directory(self.path, dir_mode)
            self._remove_stale_state_once()

    @property
    def is_initialized(self) -> bool:
        """True when the workspace has a directory."""
        return self.path is not None

    def _directory(self) -> Path:
        if self.path is None:
            raise WorkspaceError(
                "this NFSWorkspace is not initialized: create it with a workspace_path"
            )
        return self.path

    def rank_path(self, rank: int) -> Path:
        """Where ``rank``'s record lives."""
        return self._directory() / rank_file_name(rank)

    def _lock(self, path: Path) -> FileLock:
        return FileLock(
            str(path) + ".lock", timeout=self.lock_timeout, mode=self.file_mode, thread_local=False
        )

    @contextlib.contextmanager
    def _locked(self, path: Path, what: str) -> Any:
        lock = self._lock(path)
        try:
            lock.acquire()
        except Timeout:
            raise WorkspaceError(
                f"{what}: timed out after {self.lock_timeout:g} s waiting for the lock "
                f"{lock.lock_file}; another process holds it (a hung rank, or a lock "
                "server problem on NFS)"
            ) from None
        try:
            yield
        finally:
            lock.release()

    def _remove_stale_state_once(self) -> None:
        directory = self._directory()
        marker = directory / _JOB_MARKER
        with self._locked(directory / _WORKSPACE_LOCK, f"workspace {directory}"):
            try:
                fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    recorded = os.read(fd, 4096).decode(errors="replace")
                finally:
                    os.close(fd)
            except FileNotFoundError:
                recorded = None
            if recorded == self.job_id:
                return
            removed = 0
            for entry in directory.iterdir():
                if RANK_FILE_PATTERN.match(entry.name) and not entry.is_dir():
                    with (
                        self._locked(entry, f"removing stale {entry}"),
                        contextlib.suppress(FileNotFoundError),
                    ):
                        entry.unlink()
                    removed += 1
                elif entry.name.startswith(".rank-") and entry.name.endswith(".tmp"):
                    with contextlib.suppress(FileNotFoundError):
                        entry.unlink()
                    removed += 1
            payload = self.job_id.encode()

            def fill(fd: int) -> None:
                write_all(fd, payload, 0)

            atomic_write(marker, len(payload), fill, self.file_mode)
            logger.debug(
                "workspace %s: job %s replaced %s, %d stale files removed",
                directory,
                self.job_id,
                recorded,
                removed,
            )

    def write_configs_and_weights(
        self,
        config_json: Any,
        weights: dict[str, torch.Tensor] | None,
        *,
        rank: int | None = None,
    ) -> Path:
        """Writes this rank's config and weights atomically.

        The config and weights are validated before anything touches the disk.

        Args:
            config_json: Any JSON value (tuples become lists); tensors inside it are
                stored beside it (see :mod:`dist_workspace.config_codec`).
            weights: Name to tensor (any dtype safetensors stores; views, shared
                storage, 0-d and empty tensors included); None writes no tensors.
            rank: The rank to write as; by default this process's rank.

        Returns:
            The path of the file written.

        Raises:
            TypeError: The config is not JSON (naming the key path) or a weight is not
                a storable tensor.
            WorkspaceError: Not initialized, or the lock could not be taken.
        """
        directory = self._directory()
        rank = _current_rank() if rank is None else rank
        record = prepare_record(
            {} if weights is None else weights, config_json, rank=rank, job=self.job_id
        )
        target = directory / rank_file_name(rank)
        with self._locked(target, f"rank {rank} writing {target}"):
            atomic_write(
                target,
                record.total_size,
                lambda fd: write_record(fd, record),
                self.file_mode,
                durable=self.durable,
            )
        return target

    def read_configs_and_weights_from_rank(
        self, target_rank: int
    ) -> tuple[Any, dict[str, torch.Tensor]] | tuple[None, None]:
        """Reads what ``target_rank`` wrote.

        Returns:
            ``(config, weights)``, or ``(None, None)`` when that rank has not written.

        Raises:
            WorkspaceError: Not initialized, or the file is truncated, corrupted (a
                checksum mismatch), a symlink, foreign (a pickle, another format), or
                written by another rank; the message names the rank and the path.
        """
        target = self.rank_path(target_rank)
        where = f"rank {target_rank}'s file {target}"
        if not os.path.lexists(target):  # not written: no lock file is created for it
            return None, None
        with self._locked(target, f"reading {where}"):
            try:
                config, weights, header = read_record_file(target, where)
            except FileNotFoundError:
                return None, None
            except OSError as error:
                raise WorkspaceError(f"{where}: cannot be opened safely: {error}") from None
        if header.rank is not None and header.rank != target_rank:
            raise WorkspaceError(
                f"{where} says it was written by rank {header.rank}; was it renamed or "
                "copied from another file?"
            )
        return config, weights

    def written_ranks(self) -> list[int]:
        """The ranks that have a file in the workspace, sorted."""
        directory = self._directory()
        ranks = []
        for entry in directory.iterdir():
            match = RANK_FILE_PATTERN.match(entry.name)
            if match:
                ranks.append(int(match.group(1)))
        return sorted(ranks)
