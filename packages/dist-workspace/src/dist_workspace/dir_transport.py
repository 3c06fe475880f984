"""The directory transport: one record file per sender in a per-call subdirectory.

A record of at most :data:`dist_workspace.protocol.LINK_MAX_BYTES` skips the file and
travels in the sender's frame, as through shared memory.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dist_workspace import protocol
from dist_workspace.errors import WorkspaceError
from dist_workspace.fsutil import make_private_directory
from dist_workspace.shm_transport import LinkParcel, frame_values
from dist_workspace.workspace import DEFAULT_DIR_MODE, NFSWorkspace
from dist_workspace.writer import prepare_record

if TYPE_CHECKING:
    from dist_workspace.transport import CallId

_POLL_SECONDS = 0.2


class _FileParcel:
    """A written file; the receiver removes the whole call directory."""

    def status(self) -> dict[str, Any]:
        return {"route": "file"}

    def body(self) -> Sequence[Any]:
        return ()

    def release(self) -> None:
        """The file stays until the receiver has read it (it removes the directory)."""


class DirectoryTransport:
    """Records as ``exchange-{job}-{group}-{seq}/rank-{r}.safetensors`` under ``root``.

    Works across hosts wherever every rank sees ``root`` (NFS and the like).
    """

    one_host = False

    def __init__(self, root: Path, call: CallId) -> None:
        self._root = root
        self._call = call
        self.directory = root / f"exchange-{call.job}-{call.group}-{call.seq}"

    def send(self, weights: dict[str, torch.Tensor], config: Any) -> LinkParcel | _FileParcel:
        """The record in the frame, or ``rank-{r}.safetensors`` written atomically."""
        call = self._call
        record = prepare_record(weights, config, rank=call.rank, job=call.job, checksums=False)
        if protocol.route(record.total_size, self._root) == "link":
            return LinkParcel(record)
        make_private_directory(self._root, DEFAULT_DIR_MODE)
        NFSWorkspace(self.directory).write_configs_and_weights(
            config, weights, rank=self._call.rank
        )
        return _FileParcel()

    def receive(
        self, sender: int, status: dict[str, Any], body: torch.Tensor | None
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """Reads and CRC-checks the sender's file, retrying until it is visible."""
        if status.get("route") == "link":
            return frame_values(status, body, sender)
        workspace = NFSWorkspace(self.directory)
        deadline = time.monotonic() + self._call.timeout
        while True:
            config, weights = workspace.read_configs_and_weights_from_rank(sender)
            if weights is not None:
                return config, weights
            # On NFS a file another client has just renamed into place may stay
            # invisible until the directory's attribute cache expires (acdirmin, 30 s
            # by default).
            if time.monotonic() > deadline:
                raise WorkspaceError(
                    f"{self._call.kind}: rank {sender} reported writing "
                    f"{workspace.rank_path(sender)} but it is not visible after "
                    f"{self._call.timeout:g} s (NFS attribute caching? mount with actimeo lower)"
                )
            time.sleep(_POLL_SECONDS)

    def close(self) -> None:
        """Removes the call's directory and every file in it."""
        shutil.rmtree(self.directory, ignore_errors=True)
