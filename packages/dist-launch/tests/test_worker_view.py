"""What a worker's script sees is what it sees under torchrun: real launches of both."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(240)

LAUNCH = [sys.executable, "-m", "dist_launch"]
BOUND = 120

# Reads a file beside itself after leaving the directory it was started from.
OWN_FILES_SCRIPT = """\
import os, sys
os.chdir("/")
with open(os.path.join(os.path.dirname(__file__), "data.txt")) as f:
    print("file", __file__, "argv0", sys.argv[0], "data", f.read().strip())
"""


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command, cwd=cwd, capture_output=True, text=True, timeout=BOUND, check=False
    )


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
