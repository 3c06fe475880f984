"""Lock files that tell whether their owner still runs.

A process that owns something on disk (a launcher's scratch directory, a workspace
file being written) keeps a file ``flock``ed while it runs; the kernel drops the lock
when the process ends, SIGKILL included. Whoever cleans up takes the lock without
waiting: if it can, the owner is gone. A lock rather than a pid: containers that share
``/tmp`` need not share a pid namespace, and a pid can be reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator


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
