"""`dist-workspace clean`: removes only what it proves is a workspace's or a dead job's."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_core import lock_files
from dist_workspace import NFSWorkspace
from dist_workspace.cli import main
from dist_workspace.jobid import process_start_time


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private shared-memory directory, so no real segment of anyone is touched."""
    directory = tmp_path / "shm"
    directory.mkdir()
    monkeypatch.setenv("DIST_WORKSPACE_SHM_DIR", str(directory))
    monkeypatch.setenv("DIST_WORKSPACE_JOB_ID", "finished-job")
    return directory


def _segment(shm: Path, pid: int, start: int, uid: int | None = None) -> Path:
    uid = os.getuid() if uid is None else uid
    name = f"dist-workspace.{uid}.0123456789ab.cafe.0.r1.{pid}.{start}.{'ab' * 16}"
    path = shm / name
    path.write_bytes(b"x" * 64)
    return path


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(60)
    return child.pid


def _listed(text: str, verb: str) -> set[str]:
    return set(re.findall(rf"^{verb} (\S+) \(", text, flags=re.MULTILINE))


def _tree(directory: Path) -> set[str]:
    return {str(path) for path in directory.rglob("*")}


@pytest.mark.processes
def test_dry_run_lists_exactly_what_clean_removes_and_removes_nothing(
    tmp_path: Path, shm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace_dir = tmp_path / "ws"
    workspace = NFSWorkspace(workspace_dir)
    workspace.write_configs_and_weights({"a": 1}, {"w": torch.ones(3)}, rank=0)
    workspace.write_configs_and_weights({"a": 2}, {"w": torch.ones(3)}, rank=1)
    exchange = workspace_dir / "exchange-0123456789ab-0123456789abcdef-3"
    NFSWorkspace(exchange).write_configs_and_weights({}, {"x": torch.ones(1)}, rank=2)
    (workspace_dir / ".rank-4.safetensors.0123456789abcdef.tmp").write_bytes(b"partial")
    foreign = workspace_dir / "notes.txt"
    foreign.write_text("mine")
    not_a_record = workspace_dir / "rank-7.safetensors"
    torch.save({"w": torch.ones(1)}, not_a_record)  # named like a rank file, but a pickle
    dead = _segment(shm, _dead_pid(), 12345)
    live = _segment(shm, os.getpid(), process_start_time(os.getpid()) or 0)
    no_start = _segment(shm, _dead_pid(), 0)
    other_user = _segment(shm, _dead_pid(), 12345, uid=os.getuid() + 1)
    before = _tree(tmp_path)

    assert main(["clean", str(workspace_dir), "--dry-run"]) == 0
    dry = capsys.readouterr().out
    assert _tree(tmp_path) == before  # nothing removed
    would = _listed(dry, "would remove")
    assert "nothing was removed" in dry

    assert main(["clean", str(workspace_dir)]) == 0
    real = capsys.readouterr().out
    removed = _listed(real, "removed")
    assert removed == would == before - _tree(tmp_path)
    assert str(dead) in removed and str(exchange) in removed
    assert str(workspace_dir / ".rank-4.safetensors.0123456789abcdef.tmp") in removed
    for kept in (foreign, not_a_record, live, no_start, other_user):
        assert kept.exists(), kept
    assert f"kept {not_a_record}: named like a rank file, but" in real
    assert "no start time" in real and "1 shared-memory segments of running processes" in real
    assert sorted(os.listdir(workspace_dir)) == ["notes.txt", "rank-7.safetensors"]


def test_a_file_in_use_is_kept(
    tmp_path: Path, shm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace = NFSWorkspace(tmp_path)
    path = workspace.write_configs_and_weights({}, {"w": torch.ones(3)}, rank=0)
    lock = Path(f"{path}.lock")
    holder = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # as a rank writing or reading it
        assert main(["clean", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert path.exists() and lock.exists()
        assert f"kept {path}: in use" in out
    finally:
        os.close(holder)
    assert main(["clean", str(tmp_path)]) == 0
    assert not path.exists() and not lock.exists()


def test_a_lock_that_cannot_be_taken_keeps_its_file(
    tmp_path: Path, shm: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ENOLCK (an NFS mount without a lock manager): no proof the owner is gone."""
    workspace = NFSWorkspace(tmp_path)
    path = workspace.write_configs_and_weights({}, {"w": torch.ones(3)}, rank=0)

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(lock_files.fcntl, "flock", no_locks)
    assert main(["clean", str(tmp_path)]) == 0
    assert f"kept {path}: in use" in capsys.readouterr().out
    assert path.exists() and Path(f"{path}.lock").exists()


def test_symlinks_and_foreign_exchange_directories_are_kept(
    tmp_path: Path, shm: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "precious.safetensors"
    NFSWorkspace(tmp_path / "elsewhere").write_configs_and_weights({}, {"w": torch.ones(1)}, rank=0)
    os.rename(tmp_path / "elsewhere" / "rank-0.safetensors", target)
    workspace_dir = tmp_path / "ws"
    workspace_dir.mkdir()
    (workspace_dir / "rank-0.safetensors").symlink_to(target)
    exchange = workspace_dir / "exchange-0123456789ab-0123456789abcdef-0"
    exchange.mkdir()
    (exchange / "results.csv").write_text("a,b")
    assert main(["clean", str(workspace_dir)]) == 0
    out = capsys.readouterr().out
    assert target.exists() and (workspace_dir / "rank-0.safetensors").is_symlink()
    assert (exchange / "results.csv").exists()
    assert "not a regular file" in out and "holding what clean cannot remove" in out
    assert main(["clean", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
