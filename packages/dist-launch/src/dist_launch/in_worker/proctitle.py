"""Process titles: what ``ps`` and ``top`` show for a worker and for the fork server.

Linux only, without privileges and without a dependency: ``ps -o args`` reads
``/proc/PID/cmdline``, which the kernel copies from the process's own argv area
(``arg_start`` to ``arg_end`` in ``/proc/self/stat``). Python keeps its own copy of the
arguments, so that area can be overwritten in place; the new title must fit in it
(the fork server is started with a padded argv, see :data:`TITLE_ROOM`), and a longer
one is cut. ``ps -o comm`` and ``top`` show the thread name instead
(``prctl(PR_SET_NAME)``, 15 bytes).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Sequence

logger = logging.getLogger(__name__)

# Where this process's own files are; a test points it at a directory without them.
PROC_SELF = "/proc/self"
# How many bytes of argv a process started for the purpose (the fork server) gets, so
# that a worker forked from it can show a long command line.
TITLE_ROOM = 4096
# The kernel's limit on a thread name, without its terminating NUL.
NAME_BYTES = 15

_PR_SET_NAME = 15
# Fields 48 and 49 of /proc/self/stat, counted from 1; field 3 is the first one after
# the command name, which is in parentheses and may itself contain spaces or ")".
_ARG_START_FIELD = 48
_FIRST_FIELD_AFTER_NAME = 3


def _argv_area() -> tuple[int, int] | None:
    """The address and size of this process's argv area, if it can be rewritten."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open(os.path.join(PROC_SELF, "stat"), "rb") as handle:
            stat = handle.read()
        with open(os.path.join(PROC_SELF, "cmdline"), "rb") as handle:
            cmdline = handle.read()
        fields = stat.rsplit(b")", 1)[1].split()
        index = _ARG_START_FIELD - _FIRST_FIELD_AFTER_NAME
        start, end = int(fields[index]), int(fields[index + 1])
    except (OSError, IndexError, ValueError):
        return None
    size = end - start
    # The kernel returns the whole area only while it ends with a NUL, as an exec'd
    # argv does (and as every title written here does): then what it returned proves
    # the addresses are ours and mapped. Anything else (a title set by other means,
    # an area the kernel could not read) is left alone.
    if start <= 0 or size <= 0 or len(cmdline) != size or not cmdline.endswith(b"\0"):
        return None
    return start, size


def _fit(pieces: Sequence[str], size: int) -> bytes:
    """The pieces NUL-separated, cut to ``size - 1`` bytes, NUL-padded to ``size``."""
    # Arguments hold undecodable bytes as surrogates (os.fsdecode): give them back.
    text = "\0".join(pieces).encode(sys.getfilesystemencoding(), "surrogateescape")
    if len(text) > size - 1:
        cut = size - 1
        while cut > 0 and text[cut] & 0xC0 == 0x80:  # not inside a UTF-8 character
            cut -= 1
        text = text[:cut].rstrip(b"\0")  # nor with a dangling separator
    return text.ljust(size, b"\0")


def set_process_argv(argv: Sequence[str]) -> bool:
    """Makes ``/proc/PID/cmdline`` read as ``argv`` (``ps -o args`` joins it with spaces).

    Each piece ends with a NUL, as an exec'd argv does; the rest of the area is NULs.
    A title longer than the area is cut to fit.

    Returns:
        True when the title was written; False where the platform does not allow it
        (not Linux, no ``/proc``, an argv area that is not as exec left it). Never
        raises.
    """
    try:
        area = _argv_area()
        if area is None:
            return False
        start, size = area
        data = _fit(argv, size)
        ctypes.memmove(start, data, size)
        return True
    except Exception:  # a title is cosmetic: never let it fail the process
        logger.debug("could not set the process title", exc_info=True)
        return False


def set_process_title(title: str) -> bool:
    """Makes ``ps -o args`` show ``title`` for this process (one piece of argv).

    Returns:
        As :func:`set_process_argv`.
    """
    return set_process_argv([title])


def set_thread_name(name: str) -> bool:
    """Names the calling thread (``ps -o comm``, ``top``), cut to 15 bytes.

    Threads started afterwards inherit the name.

    Returns:
        True when the kernel took it; False elsewhere. Never raises.
    """
    if not sys.platform.startswith("linux"):
        return False
    data = name.encode(errors="replace")[:NAME_BYTES].decode(errors="ignore").encode()
    try:
        # The symbols the process already has (libc's prctl among them): find_library
        # would run ldconfig in a subprocess, at every worker's start.
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_NAME, ctypes.c_char_p(data), 0, 0, 0) == 0)
    except Exception:  # a name is cosmetic
        logger.debug("prctl(PR_SET_NAME) is unavailable", exc_info=True)
        return False


def worker_argv(target_argv: Sequence[str], rank: int) -> list[str]:
    """A worker's title as the user typed its command: ``python3 train.py --lr 0.1 [rank 3]``.

    Args:
        target_argv: The bootstrap's arguments: ``SCRIPT ARGS`` or ``-m MODULE ARGS``.
        rank: The worker's global rank.
    """
    return [os.path.basename(sys.executable), *target_argv, f"[rank {rank}]"]


def target_name(target_argv: Sequence[str]) -> str:
    """The short name of what a worker runs: the script's file name, or the module."""
    if target_argv and target_argv[0] == "-m":
        return target_argv[1] if len(target_argv) > 1 else "-m"
    return os.path.basename(target_argv[0]) if target_argv else ""


def name_worker(target_argv: Sequence[str], rank: int) -> bool:
    """Titles this worker process and names its thread after its target.

    Returns:
        True when the title was set (see :func:`set_process_argv`).
    """
    set_thread_name(target_name(target_argv))
    return set_process_argv(worker_argv(target_argv, rank))


def fork_server_title(target_argv: Sequence[str] | None = None) -> str:
    """``dist-launch fork server (train.py)``, or without the target while unknown."""
    name = target_name(target_argv) if target_argv else ""
    return f"dist-launch fork server ({name})" if name else "dist-launch fork server"
