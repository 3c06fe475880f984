"""The transports of an exchange, and the one rule that picks one for a call."""

from __future__ import annotations

import os
from pathlib import Path

from dist_workspace.dir_transport import DirectoryTransport
from dist_workspace.shm_transport import SharedMemoryTransport
from dist_workspace.transport import CallId, Transport


def open_transport(workspace_path: str | os.PathLike[str] | None, call: CallId) -> Transport:
    """Shared memory when ``workspace_path`` is None, else files under that directory."""
    if workspace_path is None:
        return SharedMemoryTransport(call)
    return DirectoryTransport(Path(workspace_path), call)
