"""The directory of one call given ``workspace_path``: ``exchange-{job}-{ranks}-{seq}/``.

Records too large for the link lie there as :class:`~dist_workspace.workspace.NFSWorkspace`
writes them (atomic, CRC-checked), so the ranks may be on any hosts that see
``workspace_path``. The receiver reads them and removes the directory;
``dist-workspace clean`` knows the name of one a killed job left.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

from dist_workspace.errors import WorkspaceError
from dist_workspace.fsutil import make_private_directory
from dist_workspace.workspace import DEFAULT_DIR_MODE, NFSWorkspace

_POLL_SECONDS = 0.2


class CallDirectory:
    """``root/exchange-{job}-{ranks}-{seq}``: the files of one call."""

    def __init__(self, root: Path, *, job: str, group: str, seq: int) -> None:
        self.root = root
        self.path = root / f"exchange-{job}-{group}-{seq}"

    def write(self, rank: int, weights: dict[str, torch.Tensor], config: Any) -> None:
        """Writes ``rank``'s record atomically."""
        make_private_directory(self.root, DEFAULT_DIR_MODE)
        NFSWorkspace(self.path).write_configs_and_weights(config, weights, rank=rank)

    def read(self, sender: int, timeout: float, kind: str) -> tuple[Any, dict[str, torch.Tensor]]:
        """Reads and CRC-checks ``sender``'s file, waiting up to ``timeout`` to see it.

        Raises:
            WorkspaceError: The file stays invisible, or is broken (naming rank and path).
        """
        workspace = NFSWorkspace(self.path)
        deadline = time.monotonic() + timeout
        while True:
            config, weights = workspace.read_configs_and_weights_from_rank(sender)
            if weights is not None:
                return config, weights
            # NFS may hide a file another client just renamed into place until the
            # directory's attribute cache expires (acdirmin, 30 s by default).
            if time.monotonic() > deadline:
                raise WorkspaceError(
                    f"{kind}: rank {sender} reported writing {workspace.rank_path(sender)} "
                    f"but it is not visible after {timeout:g} s (NFS attribute caching? "
                    "mount with actimeo lower)"
                )
            time.sleep(_POLL_SECONDS)

    def remove(self) -> None:
        """Removes the directory and every file in it."""
        shutil.rmtree(self.path, ignore_errors=True)
