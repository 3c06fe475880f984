"""Progress of merge and inspect --verify: on a terminal only, never in a pipe or a log."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_workspace import NFSWorkspace

pytestmark = pytest.mark.processes


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DIST_WORKSPACE_JOB_ID", "test-job")
    directory = tmp_path / "ws"
    workspace = NFSWorkspace(directory, durable=False)
    for rank in range(3):
        weights = {f"w{rank}.{i}": torch.randn(64, 1024) for i in range(4)}
        workspace.write_configs_and_weights({}, weights, rank=rank)
    return directory


def _run_with_stderr_on_a_terminal(args: list[str], interval: str) -> tuple[int, str, str]:
    """Runs the CLI with stderr on a pseudo-terminal; returns (status, stdout, terminal)."""
    controller, terminal = pty.openpty()
    env = {**os.environ, "DIST_WORKSPACE_PROGRESS_INTERVAL": interval}
    child = subprocess.Popen(
        [sys.executable, "-m", "dist_workspace", *args],
        stdout=subprocess.PIPE,
        stderr=terminal,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    os.close(terminal)  # the child holds the only other end: EOF (EIO) when it exits
    chunks = []
    while True:
        try:
            data = os.read(controller, 65536)
        except OSError:  # EIO: the terminal's last writer has gone
            break
        if not data:
            break
        chunks.append(data)
    os.close(controller)
    assert child.stdout is not None
    stdout = child.stdout.read().decode()
    child.stdout.close()
    return child.wait(60), stdout, b"".join(chunks).decode()


def test_merge_draws_progress_on_a_terminal(workspace: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    status, stdout, terminal = _run_with_stderr_on_a_terminal(
        ["merge", str(workspace), str(out)], interval="0"
    )
    assert status == 0, terminal
    assert "wrote 12 tensors" in stdout and "merging" not in stdout
    draws = terminal.split("\r")
    progress = [draw for draw in draws if draw.startswith("merging: ")]
    assert len(progress) >= 12  # interval 0: one draw per tensor at least
    assert "GB/s" in progress[0] or "MB/s" in progress[0] or "kB/s" in progress[0]
    assert " left" in progress[0] and "of 3.00 MiB" in progress[0]
    assert "(100%)" in progress[-1] and terminal.endswith("\n")


def test_verify_draws_progress_on_a_terminal(workspace: Path) -> None:
    status, stdout, terminal = _run_with_stderr_on_a_terminal(
        ["inspect", str(workspace), "--verify"], interval="0"
    )
    assert status == 0, terminal
    assert "verifying: " in terminal and "(100%)" in terminal
    assert stdout.splitlines()[-1].startswith("verified 12 tensors in 3 files (3.00 MiB)")


def test_a_merge_shorter_than_the_interval_leaves_the_terminal_alone(
    workspace: Path, tmp_path: Path
) -> None:
    status, _, terminal = _run_with_stderr_on_a_terminal(
        ["merge", str(workspace), str(tmp_path / "m.safetensors")], interval="3600"
    )
    assert status == 0 and terminal == ""


def test_nothing_extra_when_stderr_is_a_pipe(workspace: Path, tmp_path: Path) -> None:
    env = {**os.environ, "DIST_WORKSPACE_PROGRESS_INTERVAL": "0"}
    for args in (
        ["merge", str(workspace), str(tmp_path / "model.safetensors")],
        ["merge", str(workspace), str(tmp_path / "hf"), "--max-shard-size", "1MB"],
        ["inspect", str(workspace), "--verify"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "dist_workspace", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
            check=False,
        )
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert "\r" not in done.stdout and "left" not in done.stdout
