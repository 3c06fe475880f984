"""Shared-memory segments: plain files under /dev/shm, named so leftovers can be found.

Plain ``os.open`` files on the tmpfs, not ``multiprocessing.shared_memory``, whose
resource_tracker warns about (and may unlink) segments it did not create. A name::

    dist-workspace.{uid}.{job}.{group}.{seq}.r{rank}.{pid}.{start}.{token}

``job`` and ``group`` tag the job id and the ranks (jobs and groups never collide),
``pid`` and ``start`` (clock ticks since boot) identify the creator even after its pid
is reused, and ``token`` (128 random bits) keeps the name unguessable. Segments are
created with ``O_EXCL | O_NOFOLLOW`` and mode 0600, in ``/dev/shm`` unless
``DIST_WORKSPACE_SHM_DIR`` names another directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import mmap
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from dist_workspace.errors import WorkspaceError
from dist_workspace.jobid import process_start_time
from dist_workspace.writer import PreparedRecord, write_record

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "dist-workspace"
_NAME = re.compile(
    r"^dist-workspace\.(?P<uid>\d+)\.(?P<job>[0-9a-f]+)\.(?P<group>[0-9a-f]+)\.(?P<seq>\d+)"
    r"\.r(?P<rank>\d+)\.(?P<pid>\d+)\.(?P<start>\d+)\.(?P<token>[0-9a-f]{32})$"
)
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.ENOMEM, errno.EFBIG, errno.EDQUOT})


def shm_directory() -> Path:
    """Where segments live: ``DIST_WORKSPACE_SHM_DIR`` or ``/dev/shm``."""
    return Path(os.environ.get("DIST_WORKSPACE_SHM_DIR", "/dev/shm"))


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged user can still allocate in ``directory``'s file system."""
    info = os.statvfs(directory)
    return info.f_bavail * info.f_frsize


@dataclasses.dataclass(frozen=True)
class SegmentName:
    """What a segment's name says of its owner and creator (the rest only names it)."""

    uid: int
    pid: int
    start: int

    @classmethod
    def parse(cls, name: str) -> SegmentName | None:
        """The parts of ``name``, or None when it is not a dist-workspace segment."""
        match = _NAME.match(name)
        if match is None:
            return None
        return cls(uid=int(match["uid"]), pid=int(match["pid"]), start=int(match["start"]))

    def creator_alive(self) -> bool:
        """True unless the process that created the segment is proven gone.

        A start time of 0 (``/proc`` was unreadable for the creator) counts as alive
        while the pid runs; so does every segment when this process cannot read
        ``/proc`` at all.
        """
        started = process_start_time(self.pid)
        if started is None:
            return not Path("/proc/self/stat").exists()
        return self.start == 0 or started == self.start


@dataclasses.dataclass
class Segment:
    """A segment this process created; it owns it and unlinks it."""

    path: Path
    fd: int
    size: int

    @property
    def name(self) -> str:
        """The file name under the shared-memory directory."""
        return self.path.name

    def close(self) -> None:
        """Closes the descriptor (the segment stays until :meth:`unlink`)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def unlink(self) -> None:
        """Closes and removes the segment; readers that mapped it keep their mapping."""
        self.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def too_small(rank: int, size: int, directory: Path) -> WorkspaceError:
    """The error for a segment of ``size`` bytes that ``directory`` cannot hold."""
    return WorkspaceError(
        f"rank {rank}: shared memory {directory} is too small: the segment needs "
        f"{size} bytes and {free_bytes(directory)} bytes are free. Enlarge it "
        "(docker --shm-size), free it (`dist-workspace clean`), or pass "
        "workspace_path to exchange through a directory"
    )


@contextlib.contextmanager
def _unlinked_on_failure(segment: Segment, rank: int) -> Iterator[None]:
    """Unlinks ``segment`` if the block fails; a full file system is :func:`too_small`."""
    try:
        yield
    except BaseException as error:
        segment.unlink()
        if isinstance(error, OSError) and error.errno in _FULL_ERRNOS:
            raise too_small(rank, segment.size, segment.path.parent) from None
        raise


def create_segment(size: int, *, job: str, group: str, seq: int, rank: int) -> Segment:
    """Creates an empty segment of ``size`` bytes exclusively, to be filled with ``pwrite``.

    First sweeps this user's dead segments (:func:`remove_dead_segments`), then refuses
    a size the file system has no room for. Nothing is reserved: ``posix_fallocate``
    costs as much as writing, and ``pwrite`` into a full tmpfs fails with ``ENOSPC``,
    never a SIGBUS (segments are never written through a mapping).

    Raises:
        WorkspaceError: Not enough space (naming the bytes needed and free).
    """
    directory = shm_directory()
    remove_dead_segments(directory)
    if size > free_bytes(directory):
        raise too_small(rank, size, directory)
    pid = os.getpid()
    name = (
        f"{SEGMENT_PREFIX}.{os.getuid()}.{job}.{group}.{seq}.r{rank}.{pid}."
        f"{process_start_time(pid) or 0}.{secrets.token_hex(16)}"
    )
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    path = directory / name
    segment = Segment(path, os.open(path, flags, 0o600), size)
    with _unlinked_on_failure(segment, rank):
        os.ftruncate(segment.fd, size)  # sparse: no page is allocated until written
    return segment


def write_segment(record: PreparedRecord, *, job: str, group: str, seq: int, rank: int) -> Segment:
    """A new segment holding ``record``, closed; unlinked again if writing fails.

    Raises:
        WorkspaceError: The shared-memory file system has no room (:func:`too_small`).
    """
    segment = create_segment(record.total_size, job=job, group=group, seq=seq, rank=rank)
    with _unlinked_on_failure(segment, rank):
        write_record(segment.fd, record)
        segment.close()
    return segment


def map_segment(name: str, expected_size: int, where: str) -> mmap.mmap:
    """Maps a peer's segment privately (copy-on-write); no byte is copied or touched.

    Only this user's dist-workspace segments are opened (without following symlinks),
    and only a regular file of this user of exactly ``expected_size`` bytes is mapped.
    The reader never unlinks it: the creator does.

    Raises:
        WorkspaceError: The name, owner, type or size is not what the writer announced.
    """
    parsed = SegmentName.parse(name)
    if parsed is None or parsed.uid != os.getuid():
        raise WorkspaceError(f"{where}: {name!r} is not one of this user's segments")
    path = os.path.join(shm_directory(), name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise WorkspaceError(f"{where}: cannot open segment {path}: {error}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise WorkspaceError(f"{where}: {path} is not a regular file owned by this user")
        if info.st_size != expected_size:
            raise WorkspaceError(
                f"{where}: segment {path} has {info.st_size} bytes, the writer announced "
                f"{expected_size}: truncated or replaced"
            )
        if expected_size == 0:
            return mmap.mmap(-1, 1)
        # Private and writable: a reader may modify its tensors without touching the
        # writer's pages, and torch gets a writable buffer.
        return mmap.mmap(
            fd, expected_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    finally:
        os.close(fd)


def list_segments(directory: Path | None = None) -> list[tuple[Path, SegmentName]]:
    """This user's dist-workspace segments in ``directory`` (default: the shm dir)."""
    uid = os.getuid()
    found = []
    try:
        entries = list(os.scandir(shm_directory() if directory is None else directory))
    except FileNotFoundError:
        return []
    for entry in entries:
        parsed = SegmentName.parse(entry.name)
        if parsed is None or parsed.uid != uid:
            continue
        with contextlib.suppress(FileNotFoundError):
            info = entry.stat(follow_symlinks=False)
            if info.st_uid == uid and stat.S_ISREG(info.st_mode):
                found.append((Path(entry.path), parsed))
    return found


def remove_dead_segments(directory: Path | None = None) -> list[Path]:
    """Unlinks this user's segments whose creating process has ended; returns them.

    A live job's segments are never touched, and unlinking one a reader still maps is
    safe: the mapping keeps the memory.
    """
    removed = []
    for path, parsed in list_segments(directory):
        if parsed.creator_alive():
            continue
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
            logger.info("removed shared-memory segment %s of dead process %d", path, parsed.pid)
    return removed
