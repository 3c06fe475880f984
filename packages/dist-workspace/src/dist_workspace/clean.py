"""What ``dist-workspace clean`` removes: only what it can prove is a workspace's or a dead job's.

A plan is made first (:func:`plan_clean`), so ``--dry-run`` prints exactly what a
real run would remove; :func:`carry_out` then removes the plan's entries, checking
each again at that moment.

In the directory given, an entry is removed only when it is a regular file (never a
symlink, never followed) that is provably the workspace's:

- ``rank-{r}.safetensors`` whose safetensors header carries the
  ``dist_workspace.format`` marker (any format version, so files of older versions and
  records with damaged data go too); a file of that name without the marker is kept;
- ``rank-{r}.safetensors.lock``, ``.dist-workspace.lock`` when empty (filelock's lock
  files are), ``.dist-workspace-job`` (at most 4 KiB);
- temporaries of an unfinished write, named exactly as the writer names them
  (``.rank-{r}.safetensors.{16 hex}.tmp``, ``..dist-workspace-job.{16 hex}.tmp``);
- ``exchange-{12 hex}-{16 hex}-{n}`` directories of the ``*_parallel`` helpers, entry
  by entry under the same rules, and then the directory, only if everything in it
  is provably the workspace's (no ``rmtree``).

A file whose lock is held at that moment (a live job is writing or reading it) is
kept. Otherwise the directory's workspace files go even while a job still uses the
directory (its job id cannot in general be proven alive or dead): run ``clean DIR``
after the job.

Shared-memory segments are removed only when they are this user's regular files,
named as dist-workspace names them, and their creator (pid and start time) has
ended. A segment whose name records no start time, or any segment when ``/proc``
cannot be read, is kept: its creator cannot be proven dead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import stat
import struct
from pathlib import Path

from dist_core.lock_files import try_lock_file
from dist_workspace.format import HEADER_DEPTH, MAX_HEADER_BYTES, META_FORMAT
from dist_workspace.jobid import process_start_time
from dist_workspace.safejson import JsonRefused, loads
from dist_workspace.shm import SegmentName, list_segments

_RANK_FILE = re.compile(r"^rank-([0-9]+)\.safetensors$")
_RANK_LOCK = re.compile(r"^rank-([0-9]+)\.safetensors\.lock$")
_RANK_TEMPORARY = re.compile(r"^\.rank-([0-9]+)\.safetensors\.[0-9a-f]{16}\.tmp$")
_MARKER_TEMPORARY = re.compile(r"^\.\.dist-workspace-job\.[0-9a-f]{16}\.tmp$")
_EXCHANGE_DIR = re.compile(r"^exchange-[0-9a-f]{12}-[0-9a-f]{16}-[0-9]+$")
_JOB_MARKER = ".dist-workspace-job"
_WORKSPACE_LOCK = ".dist-workspace.lock"
_MARKER_MAX_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class Removal:
    """Something clean removes, why it is provably removable, and the lock guarding it."""

    path: Path
    reason: str
    lock: Path | None = None  # must be free; held while removing
    directory: bool = False
    segment: SegmentName | None = None


@dataclasses.dataclass(frozen=True)
class Kept:
    """Something that looks like dist-workspace's but is left alone, and why."""

    path: Path
    reason: str
    expected: bool = False  # the normal state (a running job's segment): summarized, not listed


@dataclasses.dataclass
class CleanPlan:
    """What a clean would remove and what it leaves (with reasons)."""

    remove: list[Removal] = dataclasses.field(default_factory=list)
    kept: list[Kept] = dataclasses.field(default_factory=list)
    other_entries: int = 0  # entries of the directory that are not workspace-like at all


def record_marker_missing(path: Path) -> str | None:
    """None when ``path`` is a regular file whose safetensors header has the workspace marker.

    Otherwise the reason it is not provably a dist-workspace record. Reads the header
    only; nothing else of the file is interpreted.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as error:
        return f"cannot be opened: {error.strerror}"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return "not a regular file"
        if info.st_size < 8:
            return "shorter than a safetensors header"
        (length,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if length > MAX_HEADER_BYTES or 8 + length > info.st_size:
            return "its first 8 bytes are not a safetensors header length"
        text = os.pread(fd, length, 8)
    finally:
        os.close(fd)
    try:
        document = loads(text.decode("utf-8"), max_depth=HEADER_DEPTH)
    except (JsonRefused, UnicodeDecodeError):
        return "its header is not JSON"
    metadata = document.get("__metadata__") if isinstance(document, dict) else None
    if not isinstance(metadata, dict) or META_FORMAT not in metadata:
        return f"its safetensors metadata has no {META_FORMAT}"
    return None


def lock_is_held(lock: Path) -> bool:
    """Whether another open file description holds ``lock`` (filelock's ``flock``).

    False when the lock file does not exist or is not a regular file.
    """
    with try_lock_file(lock) as taken:
        return taken is False


def _plan_directory(directory: Path, plan: CleanPlan, *, nested: bool) -> bool:
    """Adds the workspace entries of ``directory`` to ``plan``.

    Returns:
        True when every entry of ``directory`` is to be removed.
    """
    everything = True
    for entry in sorted(os.scandir(directory), key=lambda item: item.name):
        path = Path(entry.path)
        name = entry.name
        lock: Path | None = None
        reason: str | None = None
        refusal: str | None = None
        is_file = entry.is_file(follow_symlinks=False)
        size = entry.stat(follow_symlinks=False).st_size if is_file else 0
        if match := _RANK_FILE.match(name):
            lock = directory / f"{name}.lock"
            reason = f"rank {match[1]}'s record"
            refusal = record_marker_missing(path) if is_file else None
            if refusal is not None:
                refusal = f"named like a rank file, but {refusal}"
        elif match := _RANK_LOCK.match(name):
            lock, reason = path, f"rank {match[1]}'s lock file"
            refusal = None if size == 0 else "named like a lock file, but not empty"
        elif name == _WORKSPACE_LOCK:
            lock, reason = path, "the workspace lock file"
            refusal = None if size == 0 else "named like a lock file, but not empty"
        elif name == _JOB_MARKER:
            lock, reason = directory / _WORKSPACE_LOCK, "the workspace's job marker"
            refusal = None if size <= _MARKER_MAX_BYTES else "larger than a job marker"
        elif match := _RANK_TEMPORARY.match(name):
            lock = directory / f"rank-{match[1]}.safetensors.lock"
            reason = f"an unfinished write of rank {match[1]}"
        elif _MARKER_TEMPORARY.match(name):
            lock, reason = directory / _WORKSPACE_LOCK, "an unfinished write of the job marker"
        elif not nested and _EXCHANGE_DIR.match(name) and entry.is_dir(follow_symlinks=False):
            inner = CleanPlan()
            if _plan_directory(path, inner, nested=True):
                plan.remove.extend(inner.remove)
                plan.remove.append(Removal(path, "an exchange directory", directory=True))
            else:
                plan.kept.extend(inner.kept)
                plan.kept.append(
                    Kept(path, "an exchange directory holding what clean cannot remove")
                )
                everything = False
            continue
        else:
            if nested:
                plan.kept.append(Kept(path, "not a workspace file"))
            else:
                plan.other_entries += 1
            everything = False
            continue
        if not is_file:
            refusal = "named like a workspace file, but not a regular file"
        elif refusal is None and lock is not None and lock_is_held(lock):
            refusal = f"in use: {lock.name} is locked by a running process"
        if refusal is not None:
            plan.kept.append(Kept(path, refusal))
            everything = False
        else:
            plan.remove.append(Removal(path, reason, lock))
    return everything


def _proc_readable() -> bool:
    return process_start_time(os.getpid()) is not None


def plan_clean(directory: Path | None, shm_dir: Path | None = None) -> CleanPlan:
    """What cleaning ``directory`` (if given) and the shared-memory directory would remove.

    Lock files come after the files they guard, directories after their contents.
    """
    plan = CleanPlan()
    if directory is not None:
        _plan_directory(directory, plan, nested=False)
    proc = _proc_readable()
    for path, parsed in list_segments(shm_dir):
        if not proc:
            plan.kept.append(Kept(path, "/proc cannot be read, so its creator's state is unknown"))
        elif parsed.start == 0:
            plan.kept.append(Kept(path, "its name records no start time for its creator"))
        elif parsed.creator_alive():
            reason = f"its creator, process {parsed.pid}, is running"
            plan.kept.append(Kept(path, reason, expected=True))
        else:
            reason = f"shared memory of process {parsed.pid}, which has ended"
            plan.remove.append(Removal(path, reason, segment=parsed))

    def order(removal: Removal) -> int:
        if removal.directory:
            return 3
        if removal.lock == removal.path:
            return 2 if removal.path.name == _WORKSPACE_LOCK else 1
        return 0

    plan.remove.sort(key=order)  # stable: the directory order is kept within a kind
    return plan


def carry_out(plan: CleanPlan) -> tuple[list[Removal], list[Kept]]:
    """Removes what ``plan`` lists, checking each entry again first.

    A file whose lock is now held, or a segment whose creator is back (it cannot be),
    is skipped. Each file is unlinked while its lock is held by this process.

    Returns:
        What was removed, and what was skipped (with why).
    """
    removed: list[Removal] = []
    skipped: list[Kept] = []
    for removal in plan.remove:
        if removal.segment is not None and removal.segment.creator_alive():
            skipped.append(Kept(removal.path, "its creator is running"))
            continue
        lock = removal.lock
        with contextlib.nullcontext(None) if lock is None else try_lock_file(lock) as taken:
            if taken is False:
                skipped.append(Kept(removal.path, "in use: its lock is held now"))
                continue
            if _RANK_FILE.match(removal.path.name):
                refusal = record_marker_missing(removal.path)
                if refusal is not None:  # replaced since the plan was made
                    skipped.append(Kept(removal.path, refusal))
                    continue
            try:
                if removal.directory:
                    os.rmdir(removal.path)
                else:
                    os.unlink(removal.path)
            except FileNotFoundError:
                continue
            except OSError as error:
                skipped.append(Kept(removal.path, f"cannot be removed: {error.strerror}"))
                continue
        removed.append(removal)
    return removed, skipped
