"""NFSWorkspace: directory set-up, stale state, modes, atomicity, locks."""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from dist_core.testing import run_ranks
from dist_workspace import NFSWorkspace, WorkspaceError


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_uninitialized_workspace() -> None:
    workspace = NFSWorkspace()
    assert workspace.is_initialized is False
    with pytest.raises(WorkspaceError, match="not initialized"):
        workspace.write_configs_and_weights({}, {})
    with pytest.raises(WorkspaceError, match="not initialized"):
        workspace.read_configs_and_weights_from_rank(0)


@pytest.fixture
def umask() -> Iterator[Callable[[int], None]]:
    saved = os.umask(0o022)
    yield os.umask
    os.umask(saved)


def test_creates_private_directory_and_files(any_dir: Path, umask: Callable[[int], None]) -> None:
    umask(0o022)
    directory = any_dir / "a" / "ws"
    workspace = NFSWorkspace(directory)
    assert workspace.is_initialized
    assert _mode(directory) == 0o700
    assert workspace.read_configs_and_weights_from_rank(0) == (None, None)
    path = workspace.write_configs_and_weights({"k": 1}, {"w": torch.ones(2)}, rank=0)
    assert path.name == "rank-0.safetensors"
    assert _mode(path) == 0o600
    lock = directory / "rank-0.safetensors.lock"
    assert lock.exists() and _mode(lock) == 0o600
    assert workspace.written_ranks() == [0]


def test_caller_mode_for_shared_directories(tmp_path: Path, umask: Callable[[int], None]) -> None:
    umask(0o077)  # the caller's mode wins over the umask
    workspace = NFSWorkspace(tmp_path / "shared", file_mode=0o640, dir_mode=0o750)
    path = workspace.write_configs_and_weights({}, {}, rank=1)
    assert _mode(tmp_path / "shared") == 0o750
    assert _mode(path) == 0o640


def test_rank_defaults_to_the_environment(tmp_path: Path) -> None:
    os.environ.update(RANK="3", WORLD_SIZE="4")
    workspace = NFSWorkspace(tmp_path)
    assert workspace.write_configs_and_weights({}, {}).name == "rank-3.safetensors"


def test_stale_files_of_another_job_are_removed_once(tmp_path: Path) -> None:
    os.environ["DIST_WORKSPACE_JOB_ID"] = "old-job"
    NFSWorkspace(tmp_path).write_configs_and_weights({"old": True}, {}, rank=1)
    (tmp_path / ".rank-1.safetensors.dead.tmp").write_bytes(b"partial")
    os.environ["DIST_WORKSPACE_JOB_ID"] = "new-job"
    first = NFSWorkspace(tmp_path)
    assert first.read_configs_and_weights_from_rank(1) == (None, None)
    assert not list(tmp_path.glob("*.tmp"))
    first.write_configs_and_weights({"new": True}, {}, rank=1)
    # A later rank of the same job must not remove what rank 1 has just written.
    second = NFSWorkspace(tmp_path)
    assert second.read_configs_and_weights_from_rank(1)[0] == {"new": True}


def _write_then_read_all(directory: str) -> list[object]:
    import torch.distributed as dist

    workspace = NFSWorkspace(directory)
    rank = dist.get_rank()
    workspace.write_configs_and_weights({"rank": rank}, {"w": torch.full((3,), rank)})
    dist.barrier()
    # Late construction by a peer of the same job removes nothing.
    workspace = NFSWorkspace(directory)
    configs = []
    for peer in range(dist.get_world_size()):
        config, weights = workspace.read_configs_and_weights_from_rank(peer)
        assert weights is not None and torch.equal(weights["w"], torch.full((3,), peer))
        configs.append(config)
    return configs


@pytest.mark.processes
def test_ranks_of_one_job_share_a_directory(tmp_path: Path) -> None:
    (tmp_path / "rank-5.safetensors").write_bytes(b"stale file of an earlier job")
    results = run_ranks(_write_then_read_all, 3, str(tmp_path), timeout=90)
    assert results == [[{"rank": 0}, {"rank": 1}, {"rank": 2}]] * 3
    assert not (tmp_path / "rank-5.safetensors").exists()


def test_failed_write_leaves_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    workspace = NFSWorkspace(tmp_path)
    workspace.write_configs_and_weights({"v": 1}, {"w": torch.ones(4)}, rank=0)

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "simulated I/O error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="simulated"):
        workspace.write_configs_and_weights({"v": 2}, {"w": torch.zeros(4)}, rank=0)
    monkeypatch.undo()
    assert workspace.read_configs_and_weights_from_rank(0)[0] == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".dist")) == [
        "rank-0.safetensors",
        "rank-0.safetensors.lock",
    ]


def test_reader_never_sees_a_partial_file(any_dir: Path) -> None:
    os.environ["DIST_WORKSPACE_JOB_ID"] = "atomicity"
    workspace = NFSWorkspace(any_dir)
    workspace.write_configs_and_weights({"v": -1}, {"w": torch.full((50_000,), -1)}, rank=0)
    rounds = 20
    errors: list[BaseException] = []
    # The writer starts once the reader has read once: otherwise a loaded machine may
    # let it finish all its rounds before the reader's first read, which then only ever
    # sees the last version.
    reading = threading.Event()

    def rewrite() -> None:
        # Its own NFSWorkspace: its locks are separate open files, so flock excludes
        # the reader exactly as it would in another process.
        writer = NFSWorkspace(any_dir)
        try:
            assert reading.wait(60), "the reader never read"
            for version in range(rounds):
                writer.write_configs_and_weights(
                    {"v": version}, {"w": torch.full((50_000,), version)}, rank=0
                )
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=rewrite)
    thread.start()
    deadline = time.monotonic() + 120
    while thread.is_alive() and time.monotonic() < deadline:
        config, weights = workspace.read_configs_and_weights_from_rank(0)
        assert isinstance(config, dict) and weights is not None
        assert torch.equal(weights["w"], torch.full((50_000,), config["v"]))
        reading.set()
    thread.join(60)
    assert not errors and not thread.is_alive()
    # The loop's last read may have come just before the last write: read once more.
    config, _ = workspace.read_configs_and_weights_from_rank(0)
    assert isinstance(config, dict) and config["v"] == rounds - 1


def test_symlink_planted_as_rank_file_is_not_followed(tmp_path: Path) -> None:
    workspace = NFSWorkspace(tmp_path / "ws")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "ws" / "rank-0.safetensors").symlink_to(victim)
    with pytest.raises(WorkspaceError, match="rank 0's file"):
        workspace.read_configs_and_weights_from_rank(0)
    workspace.write_configs_and_weights({}, {}, rank=0)  # replaces the link, not the victim
    assert victim.read_text() == "precious"
    assert not (tmp_path / "ws" / "rank-0.safetensors").is_symlink()


def test_config_only_write(tmp_path: Path) -> None:
    workspace = NFSWorkspace(tmp_path)
    workspace.write_configs_and_weights({"only": "config"}, None, rank=0)
    assert workspace.read_configs_and_weights_from_rank(0) == ({"only": "config"}, {})
