"""The launcher's scratch directories, and the sweep of those whose launcher died.

Each round keeps its rank files (failure records, stacks, progress files, request
FIFOs) in a private directory under the temporary directory. A launcher that ends
removes it; one that is SIGKILLed (the OOM killer, a scheduler after its grace period,
``kill -9``) cannot. Each directory therefore holds an owner file that its launcher
keeps locked with ``flock`` for as long as it lives: the kernel drops the lock with the
launcher, and the next launcher on the host removes every directory whose lock it can
take. A lock, not a pid, because containers that share ``/tmp`` need not share a pid
namespace, and a pid can be reused.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile

from dist_core.lock_files import try_lock_file

logger = logging.getLogger(__name__)

PREFIX = "dist-launch-"
OWNER_FILE = ".owner"


class ScratchDir:
    """A new private directory under ``parent`` (default: the temporary directory).

    Args:
        parent: Where to make it; ``None`` is :func:`tempfile.gettempdir` (``TMPDIR``).
    """

    def __init__(self, parent: str | None = None) -> None:
        self.path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
        # Locked under another name, then renamed: a sweep never finds it unlocked.
        unlocked = os.path.join(self.path, ".owner-new")
        self._lock_fd = os.open(unlocked, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(unlocked, os.path.join(self.path, OWNER_FILE))

    def close(self) -> None:
        """Removes the directory and releases it."""
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._lock_fd)


def sweep_dead_scratch_dirs(parent: str | None = None) -> list[str]:
    """Removes the scratch directories of launchers that died; returns their paths.

    Only this user's directories named ``dist-launch-*`` that hold an owner file are
    considered (never ``--log-dir``'s default ``dist-launch-logs-*``, which has none).

    Args:
        parent: Where to look; ``None`` is :func:`tempfile.gettempdir` (``TMPDIR``).
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
        if not entry.name.startswith(PREFIX):
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != uid:
                continue
        except OSError:
            continue
        # Removed while its lock is ours: a launcher never reopens a directory.
        with try_lock_file(os.path.join(entry.path, OWNER_FILE)) as owner_gone:
            if owner_gone:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    if removed:
        logger.info("removed %d scratch directories of launchers that died", len(removed))
    return removed
