"""The launcher's scratch directories, and the sweep of those whose launcher died.

Each round keeps its rank files (failure records, stacks, progress files, request
FIFOs) in a private directory under the temporary directory. A launcher that ends
removes it; one that is SIGKILLed (the OOM killer, a scheduler after its grace period,
``kill -9``) cannot. Each directory therefore holds an owner file that its launcher
keeps locked with ``flock`` for as long as it lives (:class:`dist_core.lock_files.OwnedDir`):
the kernel drops the lock with the launcher, and the next launcher on the host removes
every directory whose lock it can take.
"""

from __future__ import annotations

from dist_core.lock_files import OWNER_FILE, OwnedDir, sweep_dead_dirs

__all__ = ["OWNER_FILE", "PREFIX", "ScratchDir", "sweep_dead_scratch_dirs"]

PREFIX = "dist-launch-"


class ScratchDir(OwnedDir):
    """A new private ``dist-launch-*`` directory under ``parent``.

    Args:
        parent: Where to make it; ``None`` is :func:`tempfile.gettempdir` (``TMPDIR``).
    """

    def __init__(self, parent: str | None = None) -> None:
        super().__init__(PREFIX, parent)


def sweep_dead_scratch_dirs(parent: str | None = None) -> list[str]:
    """Removes the scratch directories of launchers that died; returns their paths.

    Only this user's directories named ``dist-launch-*`` that hold an owner file are
    considered (never ``--log-dir``'s default ``dist-launch-logs-*``, which has none).

    Args:
        parent: Where to look; ``None`` is :func:`tempfile.gettempdir` (``TMPDIR``).
    """
    return sweep_dead_dirs(PREFIX, parent)
