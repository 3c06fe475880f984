"""Faults across packages: a crash inside all_to_all, a rank killed mid-write, the
launcher SIGKILLed. Each ends promptly, with no partial file, orphan or segment left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

SCRIPTS = Path(__file__).resolve().parent / "scripts"
BIN = Path(sys.executable).parent


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _descendants(root: int) -> set[int]:
    """Every live process below ``root`` in the process tree (scans /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found: set[int] = set()
    pending = [root]
    while pending:
        for child in children.get(pending.pop(), []):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


def _wait_until_gone(pids: set[int], seconds: float) -> set[int]:
    deadline = time.monotonic() + seconds
    left = {pid for pid in pids if _alive(pid)}
    while left and time.monotonic() < deadline:
        time.sleep(0.05)  # polling /proc: the kernel does not tell us of non-children
        left = {pid for pid in left if _alive(pid)}
    return left


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A private segment directory, so leftovers of this test alone can be counted.

    Named by mkdtemp, not after tmp_path: pytest-xdist workers' tmp_path names repeat.
    """
    directory = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="dist-it-"))
    yield directory
    for leftover in directory.iterdir():
        leftover.unlink()
    directory.rmdir()


def _launch_three(script: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Runs ``dist-launch -n 3 --grace-period 2 SCRIPT ARGS`` to its end (at most 120 s).

    Returns its exit status and everything it printed.
    """
    completed = subprocess.run(
        [str(BIN / "dist-launch"), "-n", "3", "--grace-period", "2", str(SCRIPTS / script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    return completed.returncode, completed.stdout + completed.stderr


def test_rank_crashing_inside_all_to_all_is_reported_first() -> None:
    started = time.monotonic()
    returncode, output = _launch_three("crash_in_all_to_all.py")
    elapsed = time.monotonic() - started
    assert returncode == 1, output
    report = output[output.find("rank 1") :]
    assert "all_to_all_v" in report and "ValueError" in report, output
    assert elapsed < 60, elapsed


@pytest.mark.parametrize("victim", [2, 0], ids=["sender", "receiver"])
def test_rank_killed_between_exchanges_is_reported_first_at_once(
    shm_dir: Path, victim: int
) -> None:
    env = {**os.environ, "DIST_WORKSPACE_SHM_DIR": str(shm_dir)}
    # The exchange's own timeout is an hour, the launch's 120 s.
    returncode, output = _launch_three("shm_exchange_killed.py", str(victim), env=env)
    # The peers raise at once (their connection to the dead rank closed), maybe before
    # the launcher sees the death; still the dead rank is the root cause, and a rank
    # killed by a signal makes the launcher's exit code INFRASTRUCTURE (137).
    assert returncode == 137, output
    assert f"rank {victim} (local rank {victim}, node 0) failed first with signal SIGKILL" in (
        output
    ), output
    assert "(a consequence: a peer vanished)" in output, output


def test_rank_killed_mid_write_leaves_no_partial_file(tmp_path: Path) -> None:
    workspace_dir = tmp_path / "workspace"
    writer = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "workspace_writer.py"), str(workspace_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "RANK": "1", "WORLD_SIZE": "2"},
    )
    try:
        assert writer.stdout is not None
        pid = int(writer.stdout.readline().split("=")[1])
        # Kill it while a write is in flight: wait for a temporary file to appear.
        deadline = time.monotonic() + 120
        mid_write = False
        while not mid_write and time.monotonic() < deadline:
            names = [p.name for p in workspace_dir.iterdir()] if workspace_dir.exists() else []
            mid_write = any(name.endswith(".tmp") for name in names)
            if not mid_write:
                time.sleep(0.005)  # polling for a file a separate process creates
        os.kill(pid, signal.SIGKILL)
        assert mid_write, "never saw a write in flight"
        writer.wait(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
    from dist_workspace import NFSWorkspace

    visible = workspace_dir / "rank-1.safetensors"
    if visible.exists():  # a complete earlier round, never a partial one
        config, weights = NFSWorkspace(str(workspace_dir)).read_configs_and_weights_from_rank(1)
        assert weights is not None and weights["big"].numel() == 32 * 1024 * 1024
        assert isinstance(config, dict) and config["round"] >= 1
    cleaned = subprocess.run(
        [str(BIN / "dist-workspace"), "clean", str(workspace_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert cleaned.returncode == 0, cleaned.stderr
    assert [
        p.name for p in workspace_dir.iterdir() if p.name.endswith((".tmp", ".safetensors"))
    ] == []


def test_launcher_sigkilled_leaves_no_orphan_and_no_segment(shm_dir: Path) -> None:
    env = {**os.environ, "DIST_WORKSPACE_SHM_DIR": str(shm_dir)}
    launcher = subprocess.Popen(
        [str(BIN / "dist-launch"), "-n", "3", str(SCRIPTS / "shm_exchange_blocked.py"), "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert launcher.stdout is not None
        pids = []
        while len(pids) < 3:
            line = launcher.stdout.readline()
            assert line, "launcher ended before its ranks started"
            match = re.search(r"rank=\d+ pid=(\d+)", line)
            if match:
                pids.append(int(match.group(1)))
        # Ranks 0 and 1 now wait in the exchange for rank 2, which never arrives.
        deadline = time.monotonic() + 60
        while not any(shm_dir.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the segment another process creates
        workers = _descendants(launcher.pid)
        assert set(pids) <= workers
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert _wait_until_gone(workers, 30) == set()
    # The ranks died by SIGKILL and could not clean up; clean (as the next exchange
    # would) finds the dead job's segments and removes them.
    cleaned = subprocess.run(
        [str(BIN / "dist-workspace"), "clean"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert cleaned.returncode == 0, cleaned.stderr
    assert list(shm_dir.iterdir()) == []
