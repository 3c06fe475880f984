"""`python -m dist_core` as a user runs it, in a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes


def _run(env_overrides: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("SLURM_", "OMPI_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_"))
    }
    env.update(env_overrides)
    return subprocess.run(
        [sys.executable, "-m", "dist_core", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_reports_slurm_environment_and_installed_packages() -> None:
    completed = _run(
        {
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "8",
            "SLURM_NODEID": "1",
            "SLURM_TASKS_PER_NODE": "4(x2)",
            "SLURM_JOB_NODELIST": "gpu[01-02]",
            "SLURM_JOB_ID": "777",
        }
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["environment"]["source"] == "slurm"
    assert report["environment"]["rank"] == 5
    assert report["environment"]["local_rank"] == 1
    assert report["environment"]["master_addr"] == "gpu01"
    assert "dist-core" in report["versions"]


def test_malformed_environment_exits_non_zero_naming_the_variable() -> None:
    completed = _run({"RANK": "5", "WORLD_SIZE": "4"})
    assert completed.returncode == 1
    assert "RANK=5 with WORLD_SIZE=4" in completed.stdout
