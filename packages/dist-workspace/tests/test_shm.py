"""Shared-memory segments: reservation, ownership, leftovers of killed jobs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from dist_workspace import WorkspaceError
from dist_workspace.cli import main
from dist_workspace.shm import create_segment, free_bytes, list_segments, map_segment, shm_directory

# Segments of these tests in a directory of their own: other tests and jobs of this user
# may create or remove segments in /dev/shm meanwhile, and the tests count them.
pytestmark = pytest.mark.usefixtures("private_shm_dir")


def test_full_shm_is_an_error_naming_sizes_not_sigbus() -> None:
    free = free_bytes(shm_directory())
    needed = free + (1 << 30)
    before = {path for path, _ in list_segments()}
    with pytest.raises(WorkspaceError) as raised:
        create_segment(needed, job="abc", group="def", seq=0, rank=5)
    message = str(raised.value)
    assert (
        f"needs {needed} bytes" in message and "bytes are free" in message and "rank 5" in message
    )
    assert {path for path, _ in list_segments()} == before


def test_segment_is_private_exclusive_and_reader_does_not_unlink() -> None:
    segment = create_segment(4096, job="abc", group="def", seq=1, rank=0)
    try:
        info = segment.path.stat()
        assert info.st_mode & 0o777 == 0o600 and info.st_size == 4096
        os.pwrite(segment.fd, b"hello", 0)
        mapping = map_segment(segment.name, 4096, "test")
        assert mapping[:5] == b"hello"
        mapping[:5] = b"HELLO"  # copy-on-write: the writer's bytes do not change
        assert os.pread(segment.fd, 5, 0) == b"hello"
        assert segment.path.exists()
        with pytest.raises(WorkspaceError, match="has 4096 bytes, the writer announced 100"):
            map_segment(segment.name, 100, "rank 3's segment")
        with pytest.raises(WorkspaceError, match="not one of this user's segments"):
            map_segment("../../etc/passwd", 100, "rank 3's segment")
    finally:
        segment.unlink()
    assert not segment.path.exists()


def test_every_creation_removes_segments_whose_creator_is_gone() -> None:
    """Not only a process's first: a creator whose start time differs is gone (pid reused)."""
    uid, pid = os.getuid(), os.getpid()
    for seq in range(2):
        dead = shm_directory() / f"dist-workspace.{uid}.abc.def.{seq}.r1.{pid}.1.{'0' * 32}"
        dead.touch(mode=0o600)
        create_segment(64, job="abc", group="def", seq=seq, rank=0).unlink()
        assert not dead.exists(), seq


_CHILD = textwrap.dedent(
    """
    import os, sys
    from dist_workspace.shm import create_segment
    size, filled = int(sys.argv[1]), sys.argv[2] == "filled"
    segment = create_segment(size, job="0123456789ab", group="cafe", seq=0, rank=1)
    if filled:
        os.pwrite(segment.fd, b"x" * size, 0)
    print(segment.name, flush=True)
    sys.stdin.read()  # holds the segment until killed
    """
)


def _killed_job_segment(size: int = 1 << 20, *, filled: bool = False) -> Path:
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(size), "filled" if filled else "sparse"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    name = child.stdout.readline().strip()
    path = shm_directory() / name
    assert path.exists()
    # While its creator lives, neither clean nor a new creation touches it.
    assert main(["clean"]) == 0
    assert path.exists()
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    assert path.exists()  # a killed job leaves it behind ...
    return path


@pytest.mark.processes
def test_clean_removes_segments_of_killed_jobs() -> None:
    path = _killed_job_segment()
    assert main(["clean"]) == 0
    assert not path.exists()


@pytest.mark.processes
def test_a_process_first_creation_removes_segments_of_killed_jobs() -> None:
    path = _killed_job_segment()
    script = (
        "from dist_workspace.shm import create_segment\n"
        "create_segment(64, job='abc', group='def', seq=2, rank=0).unlink()\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert not path.exists()


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A private 8 MiB tmpfs as the shared-memory directory (mounting needs root)."""
    mount_point = tmp_path / "shm"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if mounted.returncode != 0:
        problem = f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}"
        if os.environ.get("CI"):  # CI runs as root: there the test must run
            pytest.fail(problem)
        pytest.skip(problem)
    os.environ["DIST_WORKSPACE_SHM_DIR"] = str(mount_point)  # the child inherits it
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], timeout=60, check=False)


@pytest.mark.processes
def test_a_creation_short_of_room_removes_segments_of_killed_jobs_first(
    small_tmpfs: Path,
) -> None:
    create_segment(64, job="abc", group="def", seq=0, rank=0).unlink()  # swept just now
    dead = _killed_job_segment(6 << 20, filled=True)
    assert free_bytes(small_tmpfs) < 4 << 20
    segment = create_segment(4 << 20, job="abc", group="def", seq=1, rank=0)
    segment.unlink()
    assert not dead.exists()


@pytest.mark.processes
def test_no_resource_tracker_warnings() -> None:
    script = textwrap.dedent(
        """
        from dist_workspace.shm import create_segment, map_segment
        segment = create_segment(4096, job="abc", group="def", seq=3, rank=0)
        mapping = map_segment(segment.name, 4096, "test")
        segment.unlink()
        """
    )
    done = subprocess.run(
        [sys.executable, "-W", "always", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "resource_tracker" not in done.stderr and "leaked" not in done.stderr


@pytest.mark.processes
def test_zombie_creator_counts_as_dead() -> None:
    """An exited, unreaped creator (a container whose init does not reap) is gone."""
    import time

    from dist_workspace.jobid import process_start_time

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stat = Path(f"/proc/{child.pid}/stat").read_text()
            state = stat.rsplit(")", 1)[1].split()[0]
            if state == "Z":
                break
            time.sleep(0.02)  # polling: the child exits on its own time
        assert state == "Z"
        assert process_start_time(child.pid) is None
    finally:
        child.wait(timeout=30)
    assert process_start_time(os.getpid()) is not None


def test_a_tmpfs_filled_while_writing_is_the_same_error_and_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import errno

    import torch

    from dist_workspace import shm
    from dist_workspace.writer import prepare_record

    def full(fd: int, record: object) -> None:
        os.pwrite(fd, b"partial", 0)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm, "write_record", full)
    before = {path for path, _ in list_segments()}
    record = prepare_record({"tensor": torch.ones(1000)}, None, rank=3, job="j", checksums=False)
    with pytest.raises(WorkspaceError, match=r"rank 3: shared memory .* is too small: the segment"):
        shm.write_segment(record, job="0123abcd", group="cafe", seq=0, rank=3)
    assert {path for path, _ in list_segments()} == before


def test_segments_are_not_reserved_up_front() -> None:
    """Space comes with the writes (pwrite), not from posix_fallocate, which costs as much."""
    segment = create_segment(64 << 20, job="abc", group="def", seq=5, rank=0)
    try:
        assert segment.path.stat().st_size == 64 << 20
        assert segment.path.stat().st_blocks == 0
    finally:
        segment.unlink()
