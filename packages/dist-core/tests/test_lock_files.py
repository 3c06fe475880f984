"""try_lock_file and OwnedDir: what a cleaner learns from a lock file, in one process.

``flock`` locks belong to open file descriptions, so a second ``open`` in this
process conflicts with the first exactly as another process's would.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from dist_core.lock_files import OWNER_FILE, OwnedDir, sweep_dead_dirs, try_lock_file


def test_a_lock_nobody_holds_is_taken_for_the_block(tmp_path: Path) -> None:
    lock = tmp_path / "owner"
    lock.touch()
    with try_lock_file(lock) as taken:
        assert taken is True
        with try_lock_file(lock) as again:
            assert again is False  # ours while the block runs
    with try_lock_file(lock) as after:
        assert after is True  # released when it ended


def test_a_held_lock_is_reported_held(tmp_path: Path) -> None:
    lock = tmp_path / "owner"
    lock.touch()
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with try_lock_file(lock) as taken:
            assert taken is False
    finally:
        os.close(fd)


def test_no_regular_file_is_no_lock_and_never_blocks(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # open() without O_NONBLOCK would wait for a writer for ever
    target = tmp_path / "target"
    target.touch()
    link = tmp_path / "link"
    link.symlink_to(target)
    for path in (tmp_path / "missing", fifo, link, tmp_path):
        with try_lock_file(path) as taken:
            assert taken is None, path


def test_an_owned_dir_is_kept_while_its_owner_lives_and_swept_after(tmp_path: Path) -> None:
    alive = OwnedDir("run-", str(tmp_path))
    dead = OwnedDir("run-", str(tmp_path))
    other = OwnedDir("other-", str(tmp_path))
    os.close(dead._lock_fd)  # what the kernel does when its owner is SIGKILLed
    os.close(other._lock_fd)
    try:
        assert sweep_dead_dirs("run-", str(tmp_path)) == [dead.path]
        assert (Path(alive.path) / OWNER_FILE).exists()
        assert Path(other.path).exists()  # another prefix: not this sweep's
    finally:
        alive.close()
        other.close()
    assert not Path(alive.path).exists()
    with OwnedDir("run-", str(tmp_path)) as owned:
        assert Path(owned.path).is_dir()
    assert not Path(owned.path).exists()


def test_a_directory_without_an_owner_file_is_never_swept(tmp_path: Path) -> None:
    (tmp_path / "run-made-by-hand").mkdir()
    assert sweep_dead_dirs("run-", str(tmp_path)) == []
    assert sweep_dead_dirs("run-", str(tmp_path / "absent")) == []
    assert (tmp_path / "run-made-by-hand").is_dir()
