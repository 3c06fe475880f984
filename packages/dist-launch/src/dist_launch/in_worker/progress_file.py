"""The progress file a worker shares with its launcher: two counters in shared memory.

The worker's beacon (:mod:`dist_launch.in_worker.beacon`) writes them, the launcher's
hang watch (:mod:`dist_launch.watch.hang_watch`) reads them. Standard library only.
"""

from __future__ import annotations

import mmap
import os
import struct

PROGRESS_FILE_VARIABLE = "DIST_LAUNCH_PROGRESS_FILE"
PROGRESS_PERIOD_VARIABLE = "DIST_LAUNCH_PROGRESS_PERIOD"
# Two unsigned 64-bit counters: the stack counter, the explicit one.
PROGRESS_FORMAT = "=QQ"
PROGRESS_SIZE = struct.calcsize(PROGRESS_FORMAT)
EXPLICIT_OFFSET = 8
_COUNTER = struct.Struct("=Q")


def create_progress_file(path: str | os.PathLike[str]) -> None:
    """Creates a zeroed progress file for one worker (the launcher, before the start)."""
    with open(path, "wb") as file:
        file.write(bytes(PROGRESS_SIZE))


def read_progress(shared: mmap.mmap) -> tuple[int, int]:
    """The two counters (stack, explicit) of a mapped progress file."""
    stack, explicit = struct.unpack_from(PROGRESS_FORMAT, shared, 0)
    return int(stack), int(explicit)


def map_progress_file(path: str | os.PathLike[str]) -> mmap.mmap:
    """Maps a progress file shared (both sides call this)."""
    with open(path, "r+b") as file:
        return mmap.mmap(file.fileno(), PROGRESS_SIZE)


def bump_counter(shared: mmap.mmap, offset: int) -> None:
    """Adds one to the counter at ``offset`` of a mapped progress file."""
    (value,) = _COUNTER.unpack_from(shared, offset)
    _COUNTER.pack_into(shared, offset, (value + 1) & 0xFFFFFFFFFFFFFFFF)
