"""The progress file a worker shares with its launcher: three counters in shared memory.

The worker's beacon (:mod:`dist_launch.in_worker.beacon`) writes them, the launcher's
hang watch (:mod:`dist_launch.watch.hang_watch`) reads them. Standard library only.
"""

from __future__ import annotations

import mmap
import os
import struct

PROGRESS_FILE_VARIABLE = "DIST_LAUNCH_PROGRESS_FILE"
PROGRESS_PERIOD_VARIABLE = "DIST_LAUNCH_PROGRESS_PERIOD"
# Three unsigned 64-bit counters: the stack counter, the explicit one, and the number of
# collectives the rank completed.
PROGRESS_FORMAT = "=QQQ"
PROGRESS_SIZE = struct.calcsize(PROGRESS_FORMAT)
EXPLICIT_OFFSET = 8
COLLECTIVES_OFFSET = 16
_COUNTER = struct.Struct("=Q")


def create_progress_file(path: str | os.PathLike[str]) -> None:
    """Creates a zeroed progress file for one worker (the launcher, before the start)."""
    with open(path, "wb") as file:
        file.write(bytes(PROGRESS_SIZE))


def read_progress(shared: mmap.mmap) -> tuple[int, int, int]:
    """The three counters (stack, explicit, completed collectives) of a mapped file."""
    stack, explicit, collectives = struct.unpack_from(PROGRESS_FORMAT, shared, 0)
    return int(stack), int(explicit), int(collectives)


def map_progress_file(path: str | os.PathLike[str]) -> mmap.mmap:
    """Maps a progress file shared (both sides call this)."""
    with open(path, "r+b") as file:
        return mmap.mmap(file.fileno(), PROGRESS_SIZE)


def set_counter(shared: mmap.mmap, offset: int, value: int) -> None:
    """Writes the counter at ``offset`` of a mapped progress file."""
    _COUNTER.pack_into(shared, offset, value & 0xFFFFFFFFFFFFFFFF)


def bump_counter(shared: mmap.mmap, offset: int) -> None:
    """Adds one to the counter at ``offset`` of a mapped progress file."""
    (value,) = _COUNTER.unpack_from(shared, offset)
    _COUNTER.pack_into(shared, offset, (value + 1) & 0xFFFFFFFFFFFFFFFF)
