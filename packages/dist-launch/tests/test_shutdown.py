"""Stopping from outside: what reaches the fork server, the workers and the launcher."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from launcher_nodes import LAUNCH
from launcher_scripts import WAITING_SCRIPT, read_ready_pids, write_script
from launcher_signals import default_signal_handling

from dist_launch.output.scratch import OWNER_FILE

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
    script = write_script(tmp_path, "wait.py", WAITING_SCRIPT)
    go = tmp_path / "go"
    with launched(tmp_path, script, [str(go)]) as (launcher, _):
        os.kill(fork_server_of(launcher.pid), signum)
        go.touch()
        status, stderr, stdout = ended(launcher)
    assert status == 0, stderr
    assert stdout.count(b"done") == 2, stdout


# Each rank notes every SIGTERM and SIGUSR1 it gets, says "ready PID", and waits: after
# the first SIGTERM it takes a 1.5 s "checkpoint" and exits 0; after the first SIGUSR1
# it writes that it was notified and exits 0 (training went on to its end).
CHECKPOINT_SCRIPT = """\
import json, os, signal, sys, time
directory, rank = sys.argv[1], os.environ["RANK"]
got = {"SIGTERM": 0, "SIGUSR1": 0}
def note(signum, frame):
    got[signal.Signals(signum).name] += 1
signal.signal(signal.SIGTERM, note)
signal.signal(signal.SIGUSR1, note)
print("ready", os.getpid(), flush=True)
deadline = time.monotonic() + 120
while not any(got.values()) and time.monotonic() < deadline:
    time.sleep(0.01)
if got["SIGTERM"]:
    time.sleep(1.5)
with open(os.path.join(directory, f"rank{rank}.json"), "w") as file:
    json.dump(got, file)
"""


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, as SLURM's linuxproc finds a step's processes."""
    found: list[int] = []
    pending = [pid]
    while pending:
        for child in children(pending.pop()):
            found.append(child)
            pending.append(child)
    return found


def signals_seen(directory: Path, ranks: int) -> list[dict[str, int]]:
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(ranks)]


@contextlib.contextmanager
def launched(
    tmp_path: Path, script: str, args: list[str], *flags: str
) -> Iterator[tuple[subprocess.Popen[bytes], list[int]]]:
    """A 2-rank launcher in a session of its own (as a job step), once both ranks said
    ready; killed and reaped on the way out."""
    launcher = subprocess.Popen(
        [*LAUNCH, *flags, "-n", "2", script, *args],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=default_signal_handling,
        start_new_session=True,  # signals to its group reach nothing else here
    )
    try:
        yield launcher, read_ready_pids(launcher, 2)
    finally:
        launcher.kill()
        launcher.wait(30)


def ended(launcher: subprocess.Popen[bytes]) -> tuple[int, str, bytes]:
    """The launcher's exit status, stderr and stdout, once it ended (bounded)."""
    stdout, stderr = launcher.communicate(timeout=60)
    return launcher.returncode, stderr.decode(errors="replace"), stdout


def checkpointing(
    tmp_path: Path, *flags: str
) -> contextlib.AbstractContextManager[tuple[subprocess.Popen[bytes], list[int]]]:
    script = write_script(tmp_path, "ckpt.py", CHECKPOINT_SCRIPT)
    return launched(tmp_path, script, [str(tmp_path)], *flags)


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_sigterm_to_every_process_gives_each_rank_one_and_its_checkpoint(
    tmp_path: Path, method: str
) -> None:
    # systemd's KillMode=control-group, SLURM's scancel: every process, the launcher too.
    with checkpointing(tmp_path, "--start-method", method) as (launcher, _):
        for pid in [launcher.pid, *descendants(launcher.pid)]:
            os.kill(pid, signal.SIGTERM)
        status, stderr, _ = ended(launcher)
    assert status == 143, stderr
    assert signals_seen(tmp_path, 2) == [{"SIGTERM": 1, "SIGUSR1": 0}] * 2, stderr
    assert "SIGTERM reached every process of the job" in stderr, stderr


def test_sigterm_to_the_launcher_alone_is_passed_on_once_and_a_second_changes_nothing(
    tmp_path: Path,
) -> None:
    # Kubernetes signals the container's first process; SLURM sends a second SIGTERM
    # at a time limit.
    with checkpointing(tmp_path) as (launcher, _):
        launcher.send_signal(signal.SIGTERM)
        time.sleep(0.05)  # not synchronisation: the second copy comes a moment later
        launcher.send_signal(signal.SIGTERM)
        status, stderr, _ = ended(launcher)
    assert status == 143, stderr
    assert signals_seen(tmp_path, 2) == [{"SIGTERM": 1, "SIGUSR1": 0}] * 2, stderr


def test_a_forwarded_signal_reaches_each_rank_once_and_stops_nothing(tmp_path: Path) -> None:
    with checkpointing(tmp_path, "--signals-to-forward", "USR1") as (launcher, _):
        launcher.send_signal(signal.SIGUSR1)
        status, stderr, _ = ended(launcher)
    assert status == 0, stderr
    assert signals_seen(tmp_path, 2) == [{"SIGTERM": 0, "SIGUSR1": 1}] * 2, stderr


def test_a_rank_the_sigterm_reached_before_the_launcher_is_stopped_not_failed(
    tmp_path: Path,
) -> None:
    # Ranks without a handler die at the scheduler's SIGTERM, maybe before the
    # launcher reads its own copy: a preemption, not a failure.
    script = write_script(tmp_path, "wait.py", WAITING_SCRIPT)
    with launched(tmp_path, script, [str(tmp_path / "never")]) as (launcher, pids):
        for pid in [*pids, launcher.pid]:  # the workers first
            os.kill(pid, signal.SIGTERM)
        status, stderr, _ = ended(launcher)
    assert status == 143, stderr
    assert "failed first" not in stderr, stderr
    assert "dist-launch: interrupted by SIGTERM" in stderr, stderr


def test_a_sigkilled_launchers_scratch_directory_is_removed_by_the_next_launcher(
    tmp_path: Path,
) -> None:
    # The OOM killer, a scheduler's SIGKILL after its grace period: no cleanup runs.
    scratch_parent = tmp_path / "tmp"
    scratch_parent.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch_parent)}
    script = write_script(tmp_path, "wait.py", WAITING_SCRIPT)
    launcher = subprocess.Popen(
        [*LAUNCH, "-n", "2", script, str(tmp_path / "never")],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=default_signal_handling,
        start_new_session=True,
    )
    try:
        read_ready_pids(launcher, 2)
        held = [path for path in scratch_parent.iterdir() if (path / OWNER_FILE).exists()]
        assert len(held) == 1, list(scratch_parent.iterdir())
    finally:
        launcher.kill()
        launcher.communicate(timeout=30)
    assert held[0].exists()  # nothing ran to remove it
    done = write_script(tmp_path, "done.py", "print('done', flush=True)\n")
    second = subprocess.run(
        [*LAUNCH, "-n", "1", done], cwd=tmp_path, env=env, capture_output=True, timeout=120
    )
    assert second.returncode == 0, second.stderr
    assert not held[0].exists()
