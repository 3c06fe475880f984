"""The processes a test started: found by their environment or open files, read, killed.

Used where parentage cannot be trusted: SLURM's daemons and job steps reparent to init.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

# Tests put DIST_TEST_TAG=<tag> in the environment of every job they start.
TAG_VARIABLE = "DIST_TEST_TAG"


def _environ_of(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/environ").read_bytes()
    return b""


def pids_with_variable(name: str, value: str) -> list[int]:
    """Every process (but this one) whose environment holds ``name=value``."""
    needle = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        if needle in _environ_of(int(entry.name)).split(b"\0"):
            found.append(int(entry.name))
    return found


def pids_holding(directory: Path) -> list[int]:
    """Every process (but this one) with a file under ``directory`` open."""
    prefix = str(directory) + "/"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd).startswith(prefix):
                        found.append(int(entry.name))
                        break
    return found


def leftovers(tag: str) -> list[int]:
    """The processes still alive that a test started with ``DIST_TEST_TAG=<tag>``."""
    alive = []
    for pid in pids_with_variable(TAG_VARIABLE, tag):
        with contextlib.suppress(OSError):
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                alive.append(pid)
    return alive


def read_until(process: subprocess.Popen[str], text: str, count: int, timeout: float) -> str:
    """Reads ``process``'s stdout until ``text`` appeared ``count`` times; returns what it read.

    Raises:
        TimeoutError: Not within ``timeout`` seconds, or the output ended first (the
            message holds what was read).
    """
    assert process.stdout is not None
    fd = process.stdout.fileno()
    read = b""
    deadline = time.monotonic() + timeout
    while read.decode(errors="replace").count(text) < count:
        remaining = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(0.0, remaining))
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            why = "the output ended" if ready else f"{timeout:g} s passed"
            err = ""
            if ready and process.stderr is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    err = process.communicate(timeout=10)[1]
            raise TimeoutError(
                f"{why} before {count} x {text!r}; read:\n{read.decode()}\nstderr:\n{err}"
            )
        read += chunk
    return read.decode(errors="replace")


def wait_for_file(path: Path, timeout: float) -> None:
    """Polls until ``path`` exists.

    Raises:
        TimeoutError: Not within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout:g} s")
        time.sleep(0.05)


def wait_for_text(path: Path, text: str, count: int, timeout: float) -> None:
    """Polls a file (a batch job's output) until ``text`` appears in it ``count`` times.

    Raises:
        TimeoutError: Not within ``timeout`` seconds (the message holds the file).
    """
    deadline = time.monotonic() + timeout
    while True:
        found = path.read_text(errors="replace") if path.exists() else ""
        if found.count(text) >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} x {text!r} not in {path} after {timeout:g} s:\n{found}")
        time.sleep(0.05)


def kill_pids(pids: Sequence[int]) -> None:
    """SIGKILL to each pid (gone ones are skipped)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
