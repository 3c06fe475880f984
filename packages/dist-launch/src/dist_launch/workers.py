"""Start CLI workers as fresh interpreters (``spawn``): ``python -m dist_launch._bootstrap``."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from dist_launch.plan import WorkerTarget


class PopenWorker:
    """A worker started as a child process; exit observed through a pidfd."""

    own_process_group = True

    def __init__(
        self, popen: subprocess.Popen[bytes], rank: int, local_rank: int, node_rank: int
    ) -> None:
        self.popen = popen
        self.rank = rank
        self.local_rank = local_rank
        self.node_rank = node_rank
        self._pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):  # pidfds need Linux 5.3
            self._pidfd = os.pidfd_open(popen.pid)

    @property
    def pid(self) -> int | None:
        """The process id (None until the server replied)."""
        return self.popen.pid

    def returncode(self) -> int | None:
        """None while running; the exit status, or -N after signal N."""
        return self.popen.poll()

    def exit_fd(self) -> int | None:
        """A descriptor readable once the process exited, if there is one."""
        return self._pidfd

    def close(self) -> None:
        """Reaps the process (bounded) and releases the pidfd."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5.0)
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None


def start_subprocess_worker(
    target: WorkerTarget,
    env: dict[str, str],
    rank: int,
    local_rank: int,
    node_rank: int,
    cwd: str | None = None,
) -> tuple[PopenWorker, int, int]:
    """Starts one worker interpreter; returns it and the read ends of its stdout and stderr.

    The worker gets its own process group, so that a terminal's Ctrl-C reaches it once,
    through the launcher, and not twice.
    """
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        popen = subprocess.Popen(
            [sys.executable, "-m", "dist_launch._bootstrap", *target.bootstrap_argv()],
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
