"""Scratch directories: a live launcher's is kept, a dead one's is swept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dist_launch.output.scratch import OWNER_FILE, ScratchDir, sweep_dead_scratch_dirs


def test_a_held_directory_is_kept_and_a_released_one_is_swept(tmp_path: Path) -> None:
    alive = ScratchDir(str(tmp_path))
    dead = ScratchDir(str(tmp_path))
    os.close(dead._lock_fd)  # what the kernel does when a launcher is SIGKILLed
    try:
        assert sweep_dead_scratch_dirs(str(tmp_path)) == [dead.path]
        assert Path(alive.path, OWNER_FILE).exists()
        assert not Path(dead.path).exists()
    finally:
        alive.close()
    assert not Path(alive.path).exists()


def test_directories_without_an_owner_file_or_of_another_name_are_left(tmp_path: Path) -> None:
    logs = tmp_path / "dist-launch-logs-abc"  # --log-dir's default: the user's logs
    logs.mkdir()
    older = tmp_path / "dist-launch-old"  # another version's, or one being made
    older.mkdir()
    other = tmp_path / "unrelated"
    other.mkdir()
    (other / OWNER_FILE).touch()
    assert sweep_dead_scratch_dirs(str(tmp_path)) == []
    assert logs.exists() and older.exists() and other.exists()


def test_a_missing_parent_sweeps_nothing(tmp_path: Path) -> None:
    assert sweep_dead_scratch_dirs(str(tmp_path / "absent")) == []


@pytest.mark.timeout(20)
def test_an_owner_that_is_not_a_regular_file_is_left_without_blocking(tmp_path: Path) -> None:
    """A FIFO named like the owner file would block an open without O_NONBLOCK for ever."""
    odd = tmp_path / "dist-launch-fifo"
    odd.mkdir()
    os.mkfifo(odd / OWNER_FILE)
    assert sweep_dead_scratch_dirs(str(tmp_path)) == []
    assert odd.exists()
