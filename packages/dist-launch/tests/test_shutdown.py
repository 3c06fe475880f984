"""Stopping from outside: what reaches the fork server, the workers and the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
from launcher_nodes import LAUNCH
from launcher_signals import default_signal_handling
from test_cli import WAITING_SCRIPT, _read_ready_pids, _script

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux's /proc/PID/task/*/children)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def fork_server_of(launcher: int) -> int:
    """The fork server among the launcher's children (its title names it)."""
    for child in children(launcher):
        if b"fork server" in Path(f"/proc/{child}/cmdline").read_bytes():
            return child
    raise AssertionError(f"launcher {launcher} has no fork server among {children(launcher)}")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1])
def test_a_stop_signal_to_the_fork_server_alone_kills_no_worker(
    tmp_path: Path, signum: int
) -> None:
    script = _script(tmp_path, "wait.py", WAITING_SCRIPT)
    go = tmp_path / "go"
    launcher = subprocess.Popen(
        [*LAUNCH, "-n", "2", script, str(go)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=default_signal_handling,
    )
    try:
        _read_ready_pids(launcher, 2)
        server = fork_server_of(launcher.pid)
        os.kill(server, signum)
        go.touch()
        stdout, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode == 0, stderr
        assert stdout.count(b"done") == 2, stdout
    finally:
        launcher.kill()
        launcher.wait(30)
