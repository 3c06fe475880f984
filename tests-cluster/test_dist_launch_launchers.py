"""dist-launch under real srun and sbatch on one node: failure, preemption, two steps.

A launcher started by srun or sbatch, and stopped by ``scancel --signal=TERM``, is
tested on two nodes (test_multi_node_slurm.py); here what one node shows alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from job_output import checkpoints, ranks_of, two_steps_at_once
from one_host_slurm import SlurmCluster
from processes import read_until, wait_for_file, wait_for_text

from conftest import SCRIPTS

pytestmark = pytest.mark.processes

PY = sys.executable
LAUNCH = [PY, "-m", "dist_launch"]
CHECKPOINT = str(SCRIPTS / "checkpoint_on_sigterm.py")


def exit_class(tmp_path: Path) -> object:
    """The class of ending the run's error.json names (dist_launch.ExitCode)."""
    error = json.loads((tmp_path / "logs" / "run" / "error.json").read_text())
    return error["message"]["extraInfo"]["exit_class"]


def test_failing_rank_is_named_first_with_its_traceback(
    slurm: SlurmCluster, job_env: dict[str, str]
) -> None:
    argv = ["srun", "-n1", *LAUNCH, "-n", "4", str(SCRIPTS / "fail_rank.py")]
    done = slurm.run(argv, job_env, timeout=90)
    report = done.stderr
    assert done.returncode == 1, report
    # After the ranks' own output, the launcher's report: the root cause first.
    tail = report[report.index("dist-launch: rank 1 (local rank 1, node 0) failed first") :]
    assert tail.index("ValueError: rank 1 fails on purpose") < tail.index("other ranks:"), report


def test_two_launcher_steps_in_one_allocation(
    slurm: SlurmCluster, job_env: dict[str, str], tmp_path: Path
) -> None:
    meet = tmp_path / "meet"
    meet.mkdir()
    launch = " ".join(
        [*LAUNCH, "-n", "2", str(SCRIPTS / "init_group.py"), "--meet", str(meet), "2"]
    )
    step = f"srun --exact -n1 -c1 {launch}"
    state, out = slurm.batch(
        two_steps_at_once(step, tmp_path), "-n2", "-c1", env=job_env, timeout=90
    )
    assert state == "COMPLETED", out[-3000:]
    assert [ranks_of((tmp_path / name).read_text()) for name in ("a.txt", "b.txt")] == [
        [(0, 2), (1, 2)]
    ] * 2


def _run_until_signalled(
    slurm: SlurmCluster,
    job_env: dict[str, str],
    tag: str,
    tmp_path: Path,
    scancel: list[str],
    launcher_flags: tuple[str, ...] = (),
    script: str = CHECKPOINT,
) -> tuple[int, str]:
    """A 4-rank job under default flags, signalled as ``scancel`` says once it trains.

    Its logs (and the run's error.json) go to ``tmp_path/logs/run``.
    """
    logs = ["--log-dir", str(tmp_path / "logs"), "--run-id", "run"]
    argv = ["srun", "-n1", "-J", tag, *LAUNCH, *launcher_flags, *logs, "-n", "4", script]
    srun = slurm.popen([*argv, str(tmp_path)], job_env)
    try:
        read_until(srun, "training", 4, timeout=60)
        slurm.scancel(slurm.job_id(tag), *scancel)
        _, err = srun.communicate(timeout=60)
    finally:
        srun.kill()
        srun.wait(10)
    return srun.returncode, err


def test_plain_scancel_completes_every_checkpoint(
    slurm: SlurmCluster, job_env: dict[str, str], tag: str, tmp_path: Path
) -> None:
    _, err = _run_until_signalled(slurm, job_env, tag, tmp_path, [])
    assert sorted(checkpoints(tmp_path)) == [0, 1, 2, 3], err
    assert [c["SIGTERM"] for c in checkpoints(tmp_path).values()] == [1] * 4
    # srun's own status reflects the cancel; the launcher's class is in error.json.
    assert exit_class(tmp_path) == "PREEMPTED"


def test_spawn_start_method_completes_every_checkpoint(
    slurm: SlurmCluster, job_env: dict[str, str], tag: str, tmp_path: Path
) -> None:
    flags = ("--start-method", "spawn")
    status, err = _run_until_signalled(slurm, job_env, tag, tmp_path, ["--signal=TERM"], flags)
    assert sorted(checkpoints(tmp_path)) == [0, 1, 2, 3], err
    assert [c["SIGTERM"] for c in checkpoints(tmp_path).values()] == [1] * 4
    assert status == 143, err


def test_a_requeued_jobs_workers_count_its_restarts(
    slurm: SlurmCluster, job_env: dict[str, str], tmp_path: Path
) -> None:
    launch = " ".join([*LAUNCH, "-n", "1", str(SCRIPTS / "restart_count.py"), str(tmp_path)])
    job = slurm.sbatch(f"#!/bin/bash\nexec {launch}\n", "--requeue", "-o", "/dev/null", env=job_env)
    wait_for_file(tmp_path / "restart-0", timeout=60)
    slurm.requeue_now(job)
    assert slurm.wait_job(job, 60)["JobState"] == "COMPLETED"
    assert sorted(p.name for p in tmp_path.glob("restart-*")) == ["restart-0", "restart-1"]


def test_scancel_usr1_notifies_each_rank_once_and_training_goes_on(
    slurm: SlurmCluster, job_env: dict[str, str], tag: str, tmp_path: Path
) -> None:
    flags = ("--signals-to-forward", "USR1")
    script = str(SCRIPTS / "notify_on_usr1.py")
    status, err = _run_until_signalled(
        slurm, job_env, tag, tmp_path, ["--signal=USR1"], flags, script
    )
    assert status == 0, err
    notified = {p.name: p.read_text() for p in tmp_path.glob("notified-*")}
    assert notified == {f"notified-{rank}": "1" for rank in range(4)}, err


def test_a_batch_script_launcher_passes_a_sigterm_on_once(
    slurm: SlurmCluster, job_env: dict[str, str], tmp_path: Path
) -> None:
    # scancel --full signals the batch shell's process group only (the launcher, exec'd
    # there): the workers, in groups of their own, get SIGTERM from the launcher alone.
    out = tmp_path / "out.txt"
    launch = " ".join([*LAUNCH, "-n", "4", CHECKPOINT, str(tmp_path)])
    job = slurm.sbatch(f"#!/bin/bash\nexec {launch}\n", "-o", str(out), env=job_env)
    wait_for_text(out, "training", 4, timeout=60)
    slurm.scancel(job, "--full", "--signal=TERM")
    slurm.wait_job(job, 60)
    assert sorted(checkpoints(tmp_path)) == [0, 1, 2, 3], out.read_text()
    assert [c["SIGTERM"] for c in checkpoints(tmp_path).values()] == [1] * 4
