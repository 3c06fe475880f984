"""Lock files that tell whether their owner still runs, and directories owned by one.

A process that owns something on disk (a launcher's scratch directory, a workspace
file being written) keeps a file ``flock``ed while it runs; the kernel drops the lock
when the process ends, SIGKILL included. Whoever cleans up takes the lock without
waiting: if it can, the owner is gone. A lock rather than a pid: containers that share
``/tmp`` need not share a pid namespace, and a pid can be reused.

:class:`OwnedDir` is a temporary directory that holds such a lock (its owner file);
:func:`sweep_dead_dirs` removes those of one prefix whose owner died without removing
its own (the OOM killer, a scheduler after its grace period, ``kill -9``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from types import TracebackType

logger = logging.getLogger(__name__)

OWNER_FILE = ".owner"


@contextlib.contextmanager
def try_lock_file(path: str | os.PathLike[str]) -> Iterator[bool | None]:
    """Takes the ``flock`` of ``path`` without waiting, for the length of the block.

    The file is opened read-only, without blocking and without following a link: a
    FIFO or a device under the name would otherwise block the caller in ``open()``.
    Anything but a regular file counts as no lock file. The lock, when taken, is
    released when the block ends.

    Args:
        path: The lock file.

    Yields:
        True when the lock is now this process's (its owner is gone), False when
        another open file holds it or it cannot be taken, None when ``path`` is not a
        regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        yield None
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            yield None
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # EWOULDBLOCK: held; ENOLCK and the like: cannot tell, keep it
            yield False
            return
        yield True
    finally:
        os.close(fd)  # also releases the flock


class OwnedDir:
    """A new private directory under ``parent``, its owner file locked while it lives.

    Removed by :meth:`close` (or leaving a ``with`` block); if its process dies first,
    by the next :func:`sweep_dead_dirs` of its prefix. A process forked from the owner
    keeps the lock too, so a directory its children still use is never swept.

    Args:
        prefix: The start of its name, which :func:`sweep_dead_dirs` looks for.
        parent: Where to make it; ``None`` is :func:`tempfile.gettempdir` (``TMPDIR``).
    """

    def __init__(self, prefix: str, parent: str | None = None) -> None:
        self.path = tempfile.mkdtemp(prefix=prefix, dir=parent)
        # Locked under another name, then renamed: a sweep never finds it unlocked.
        unlocked = os.path.join(self.path, OWNER_FILE + "-new")
        self._lock_fd = os.open(unlocked, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(unlocked, os.path.join(self.path, OWNER_FILE))

    def close(self) -> None:
        """Removes the directory and releases it."""
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)

    def __enter__(self) -> OwnedDir:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def sweep_dead_dirs(prefix: str, parent: str | None = None) -> list[str]:
    """Removes the :class:`OwnedDir` directories of ``prefix`` whose owner died.

    Only this user's directories whose name starts with ``prefix`` and that hold an
    owner file are considered; each is removed while its lock is this process's.

    Args:
        prefix: The directories' prefix.
        parent: Where to look; ``None`` is :func:`tempfile.gettempdir` (``TMPDIR``).

    Returns:
        The paths removed.
    """
    base = parent if parent is not None else tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError as error:
        logger.debug("could not list %s: %s", base, error)
        return removed
    uid = os.getuid()
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != uid:
                continue
        except OSError:
            continue
        with try_lock_file(os.path.join(entry.path, OWNER_FILE)) as owner_gone:
            if owner_gone:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    if removed:
        logger.info("removed %d %s* directories whose owner died", len(removed), prefix)
    return removed
