"""A test process SIGKILLed while run_ranks runs leaves no worker behind, and no litter."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from dist_core.testing import run_ranks

    def park(directory):
        Path(directory, str(os.getpid())).touch()
        time.sleep(600)

    def finish(directory):
        return None

    if __name__ == "__main__":
        run_ranks(globals()[sys.argv[2]], int(sys.argv[3]), sys.argv[1], timeout=600)
    """
)


def test_sigkilled_caller_takes_its_workers_down(
    tmp_path: Path, alive: Callable[[int], bool]
) -> None:
    script = tmp_path / "caller.py"
    script.write_text(SCRIPT)
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    # Where run_ranks keeps its rank files. Not under tmp_path: multiprocessing's fork
    # server binds a socket in TMPDIR, and pytest's numbered directories (pytest-102/
    # popen-gw2/...) made that path longer than a Unix socket's 107 bytes.
    scratch = Path(tempfile.mkdtemp(prefix="orphans-"))
    env = {**os.environ, "TMPDIR": str(scratch)}
    caller = subprocess.Popen([sys.executable, str(script), str(pids_dir), "park", "2"], env=env)
    try:
        deadline = time.monotonic() + 120
        while len(list(pids_dir.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for files the workers create
        workers = [int(path.name) for path in pids_dir.iterdir()]
        assert len(workers) == 2
        os.kill(caller.pid, signal.SIGKILL)
        caller.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling /proc: these are not our children
        assert not [pid for pid in workers if alive(pid)]
        (left,) = scratch.glob("dist-core-run-ranks-*")  # the killed caller could not
        # The next caller on the host removes it.
        subprocess.run(
            [sys.executable, str(script), str(pids_dir), "finish", "1"],
            env=env,
            check=True,
            timeout=120,
        )
        assert not left.exists()
        assert not list(scratch.glob("dist-core-run-ranks-*"))
    finally:
        if caller.poll() is None:
            caller.kill()
        shutil.rmtree(scratch, ignore_errors=True)
