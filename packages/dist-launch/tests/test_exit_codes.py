"""The launcher's exit code for each class of ending, and the run's error.json.

Hung (75): test_hang.py; timed out (124), interrupted (130) and a bad command line (2):
test_cli.py; preempted by a scheduler's SIGTERM (143): test_shutdown.py. Here: success,
the failures (deterministic, another error, infrastructure) and what error.json says.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from launcher_nodes import LAUNCH, run_launcher
from launcher_scripts import WAITING_SCRIPT, read_ready_pids, write_script

from dist_launch import ExitCode

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

# Workers started as fresh interpreters that never import torch: these tests are about
# the launcher's decisions, and cost no torch import.
FAST = ["--start-method", "spawn", "-n", "2"]


def launch(tmp_path: Path, *argv: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    return run_launcher(tmp_path, *argv, env=env)


def run_error(log_dir: Path, run_id: str) -> dict[str, object]:
    info = json.loads((log_dir / run_id / "error.json").read_text())["message"]
    assert isinstance(info, dict)
    return info


def test_success_is_0_and_writes_no_run_error(tmp_path: Path) -> None:
    script = write_script(tmp_path, "ok.py", "print('ok')\n")
    logs = tmp_path / "logs"
    status, stderr = launch(tmp_path, *FAST, "--log-dir", str(logs), "--run-id", "r", script)
    assert status == ExitCode.SUCCESS, stderr
    assert not (logs / "r" / "error.json").exists()


def test_an_import_error_ends_at_once_spending_no_restart(tmp_path: Path) -> None:
    script = write_script(tmp_path, "train.py", "import os\nimport no_such_trainer_module\n")
    logs = tmp_path / "logs"
    argv = [*FAST, "--max-restarts", "3", "--log-dir", str(logs), "--run-id", "r", script]
    status, stderr = launch(tmp_path, *argv)
    assert status == ExitCode.FAILED, stderr
    assert "restarting" not in stderr.replace("not restarting", ""), stderr
    named = r"not restarting: rank [01] on node 0 \(\S+\): ModuleNotFoundError at "
    assert re.search(named, stderr), stderr
    assert "before the process group existed" in stderr, stderr
    assert sorted(p.name for p in (logs / "r").glob("attempt_*")) == ["attempt_0"]
    info = run_error(logs, "r")
    assert info["message"] == "ModuleNotFoundError: No module named 'no_such_trainer_module'"
    extra = info["extraInfo"]
    assert isinstance(extra, dict)
    assert (extra["exit_code"], extra["exit_class"]) == (1, "FAILED")
    assert "train.py" in str(extra["py_callstack"])


def test_the_same_error_twice_is_deterministic_after_one_restart(tmp_path: Path) -> None:
    script = write_script(tmp_path, "train.py", "raise ValueError('bad lr 0.3')\n")
    status, stderr = launch(tmp_path, *FAST, "--max-restarts", "3", script)
    assert status == ExitCode.FAILED, stderr
    assert stderr.count("restarting the local worker group (restart 1 of 3)") == 1, stderr
    assert "restart 2 of 3" not in stderr, stderr
    assert re.search(
        r"not restarting: rank [01] on node 0 \(\S+\): ValueError at \S+ again, as the last time",
        stderr,
    ), stderr


def test_a_rank_killed_by_a_signal_is_restarted_then_infrastructure(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "train.py",
        "import os, signal\nif os.environ['RANK'] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n",
    )
    logs = tmp_path / "logs"
    argv = [*FAST, "--max-restarts", "1", "--log-dir", str(logs), "--run-id", "r", script]
    status, stderr = launch(tmp_path, *argv)
    assert status == ExitCode.INFRASTRUCTURE == 137, stderr
    assert "restart 1 of 1" in stderr, stderr
    extra = run_error(logs, "r")["extraInfo"]
    assert isinstance(extra, dict) and extra["exit_class"] == "INFRASTRUCTURE"


def test_a_preemption_is_143_in_the_run_error_and_the_parents_error_file(
    tmp_path: Path,
) -> None:
    # torchrun's contract with whatever started it: TORCHELASTIC_ERROR_FILE in the
    # launcher's own environment is where it reports how it ended.
    script = write_script(tmp_path, "wait.py", WAITING_SCRIPT)
    parent_file = tmp_path / "parent-error.json"
    logs = tmp_path / "logs"
    launcher = subprocess.Popen(
        [*LAUNCH, *FAST, "--log-dir", str(logs), "--run-id", "r", script, str(tmp_path / "x")],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(parent_file)},
        start_new_session=True,
    )
    try:
        read_ready_pids(launcher, 2)
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode == ExitCode.PREEMPTED, stderr
    finally:
        launcher.kill()
        launcher.wait(30)
    for info in (run_error(logs, "r"), json.loads(parent_file.read_text())["message"]):
        assert info["message"] == "interrupted by SIGTERM"
        assert info["extraInfo"]["exit_code"] == 143  # type: ignore[index]
        assert info["extraInfo"]["exit_class"] == "PREEMPTED"  # type: ignore[index]
