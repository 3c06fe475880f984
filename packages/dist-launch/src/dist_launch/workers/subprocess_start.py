"""Start CLI workers as fresh interpreters (``spawn``), each running the bootstrap.

Each runs ``python -m dist_launch.in_worker.bootstrap`` and becomes a
:class:`~dist_core.supervisor.PopenWorker` (re-exported here).
"""

from __future__ import annotations

import os
import subprocess
import sys

from dist_core.supervisor import PopenWorker
from dist_launch.plan.launch_plan import WorkerTarget
from dist_launch.workers.terminals import PIPES_ONLY, WorkerTerminals, open_outputs

__all__ = ["PopenWorker", "WorkerTarget", "start_subprocess_worker"]


def start_subprocess_worker(
    target: WorkerTarget,
    env: dict[str, str],
    rank: int,
    local_rank: int,
    node_rank: int,
    cwd: str | None = None,
    terminals: WorkerTerminals = PIPES_ONLY,
) -> tuple[PopenWorker, int, int]:
    """Starts one worker interpreter; returns it and the read ends of its stdout and stderr.

    A ``--no-python`` target runs as the program it names, without the bootstrap (and
    so without an error record: the report has its exit status). The worker gets its
    own process group, so that a terminal's Ctrl-C reaches it once, through the
    launcher, and not twice. Its stdout and stderr are pipes, or pseudo-terminals
    where ``terminals`` gives them a size (:mod:`dist_launch.workers.terminals`).
    """
    if target.no_python:
        argv = [target.name, *target.args]
    else:
        argv = [sys.executable, "-m", "dist_launch.in_worker.bootstrap", *target.bootstrap_argv()]
    (out_read, out_write), (err_read, err_write) = open_outputs(terminals)
    try:
        popen = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out_write,
            stderr=err_write,
            process_group=0,
        )
    except BaseException:
        for fd in (out_read, err_read):
            os.close(fd)
        raise
    finally:
        os.close(out_write)
        os.close(err_write)
    return PopenWorker(popen, rank, local_rank, node_rank), out_read, err_read
