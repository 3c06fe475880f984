"""The transports of an exchange, and the one rule that picks one for a call."""

from __future__ import annotations

import os
from pathlib import Path

from dist_workspace.dir_transport import DirectoryTransport
from dist_workspace.shm_transport import SharedMemoryTransport
from dist_workspace.transport import CallId, Transport


def open_transport(
    workspace_path: str | os.PathLike[str] | None, call: CallId, *, inline: bool = False
) -> Transport:
    """Shared memory when ``workspace_path`` is None, else files under that directory.

    ``inline``: small records may travel inside the status (the caller's store frees
    what the receiver deletes); by default every record goes through a segment.
    """
    if workspace_path is None:
        return SharedMemoryTransport(call, inline=inline)
    return DirectoryTransport(Path(workspace_path), call)
