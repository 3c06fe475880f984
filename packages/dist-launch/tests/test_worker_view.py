"""What a worker's script sees is what it sees under torchrun: real launches of both."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dist_core.ports import get_unused_port
from dist_launch.in_worker.import_time_env import threads_at_import

pytestmark = pytest.mark.timeout(240)

LAUNCH = [sys.executable, "-m", "dist_launch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
BOUND = 120

# Reads a file beside itself after leaving the directory it was started from.
OWN_FILES_SCRIPT = """\
import os, sys
os.chdir("/")
with open(os.path.join(os.path.dirname(__file__), "data.txt")) as f:
    print("file", __file__, "argv0", sys.argv[0], "data", f.read().strip())
"""

# Sets a variable torch reads at import, before importing it (through a library's
# `from torch import ...`, as a script that imports its framework first would).
THREADS_SCRIPT = """\
import os
os.environ["{name}"] = "{value}"
import sys
from torch import get_num_threads
# One write: under torchrun both workers share the test's pipe, and print's separate
# writes of words and newline can interleave between the two.
sys.stdout.write(f"threads {{get_num_threads()}}\\n")
sys.stdout.flush()
"""


def run(
    command: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=BOUND, check=False
    )


@pytest.mark.processes
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_file_is_absolute_so_a_script_that_changes_directory_finds_its_files(
    tmp_path: Path, method: str
) -> None:
    job = tmp_path / "job"
    job.mkdir()
    (job / "train.py").write_text(OWN_FILES_SCRIPT)
    (job / "data.txt").write_text("beside the script\n")
    result = run(
        [*LAUNCH, "-n", "2", "--start-method", method, os.path.join("job", "train.py")], tmp_path
    )
    assert result.returncode == 0, result.stderr
    # As `python job/train.py`: __file__ absolute, argv[0] as typed.
    expected = f"file {job / 'train.py'} argv0 job/train.py data beside the script"
    assert result.stdout.count(expected) == 2, result.stdout


def _threads(result: subprocess.CompletedProcess[str]) -> list[int]:
    assert result.returncode == 0, result.stderr
    return [int(n) for n in re.findall(r"threads (\d+)", result.stdout)]


@pytest.mark.processes
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: every count is 1")
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
@pytest.mark.parametrize("name", ["OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_thread_variable_set_before_import_torch_counts_as_under_torchrun(
    tmp_path: Path, method: str, name: str
) -> None:
    import torch

    if name == "MKL_NUM_THREADS" and not torch.backends.mkl.is_available():
        pytest.skip("this torch has no MKL: it does not read MKL_NUM_THREADS")
    script = tmp_path / "threads.py"
    script.write_text(THREADS_SCRIPT.format(name=name, value=2))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    ours = run([*LAUNCH, "-n", "2", "--start-method", method, str(script)], tmp_path, env)
    # A free port: torchrun's default (29500) may be another test's at this moment.
    port = str(get_unused_port())
    theirs = run([*TORCHRUN, "--master-port", port, "--nproc-per-node", "2", str(script)],
                 tmp_path, env)  # fmt: skip
    # Both launchers set OMP_NUM_THREADS=1 for two workers; the script's 2 wins in both.
    assert _threads(theirs) == [2, 2]
    assert _threads(ours) == _threads(theirs), ours.stdout


def test_import_time_thread_count_follows_torchs_precedence() -> None:
    both = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "3"}
    assert threads_at_import(both, has_mkl=True, cpus=8) == 3
    assert threads_at_import(both, has_mkl=False, cpus=8) == 1
    assert threads_at_import({"OMP_NUM_THREADS": "16"}, has_mkl=True, cpus=8) == 8
    assert threads_at_import({"OMP_NUM_THREADS": "x"}, has_mkl=True, cpus=8) is None
