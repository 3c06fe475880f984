"""The launcher's side of the CLI's fork server (:mod:`dist_launch.in_worker.fork_server`).

Workers forked from a server that imported torch once start in milliseconds instead
of each paying torch's import (about 2 s of CPU), which dominates start-up when
several ranks share a few cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
from typing import Any

from dist_launch.in_worker.proctitle import TITLE_ROOM
from dist_launch.plan.launch_plan import LaunchPlan, WorkerTarget
from dist_launch.workers.terminals import PIPES_ONLY, WorkerTerminals, open_outputs

# How long the server may take to fork one worker and reply (it may still be
# importing torch when the first request arrives).
REPLY_SECONDS = 120.0


class ForkedWorker:
    """A worker forked by the server; its exit status arrives as a message."""

    own_process_group = True

    def __init__(self, rank: int, local_rank: int, node_rank: int) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.node_rank = node_rank
        self._pid: int | None = None
        self.status: int | None = None

    @property
    def pid(self) -> int | None:
        """The process id (None until the server replied)."""
        return self._pid

    def returncode(self) -> int | None:
        """None while running; the exit status, or -N after signal N."""
        return self.status

    def exit_fd(self) -> int | None:
        """A descriptor readable once the process exited, if there is one."""
        return None  # the server's message wakes the supervisor's selector instead

    def close(self) -> None:
        """Nothing to release: the server, its parent, reaps the process."""


class ForkServerClient:
    """Starts the fork server and asks it for workers.

    Args:
        env: The server's environment (what every worker shares; read before torch's
            import, e.g. ``OMP_NUM_THREADS``).
        selector: The supervisor's selector; the server's messages are read through it.
    """

    def __init__(self, env: dict[str, str], selector: selectors.BaseSelector) -> None:
        self.selector = selector
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.workers: dict[int, ForkedWorker] = {}
        argv = [sys.executable, "-m", "dist_launch.in_worker.fork_server", str(theirs.fileno())]
        # A last argument the server ignores makes its argv area (which its workers
        # inherit) large enough for each worker's title: its own command line.
        used = sum(len(os.fsencode(arg)) + 1 for arg in argv)
        argv.append(" " * max(0, TITLE_ROOM - used - 1))
        try:
            self.process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                process_group=0,
            )
        finally:
            theirs.close()
        selector.register(self._sock, selectors.EVENT_READ, self._on_readable)
        self._closed = False

    def _handle(self, message: dict[str, Any]) -> None:
        worker = self.workers.get(int(message["rank"]))
        if worker is None:
            return
        if "pid" in message:
            worker._pid = int(message["pid"])
        if "exit" in message:
            worker.status = int(message["exit"])

    def _on_readable(self) -> None:
        try:
            data = self._sock.recv(65536)
        except BlockingIOError:
            return  # a spurious wake-up
        except OSError:
            data = b""
        if not data:
            self._server_gone()
            return
        self._handle(json.loads(data))

    def _server_gone(self) -> None:
        # Workers die with the server (parent-death signal): report them as killed.
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self._sock)
        for worker in self.workers.values():
            if worker.status is None:
                worker.status = -signal.SIGKILL

    def start(
        self,
        target: WorkerTarget,
        env: dict[str, str],
        rank: int,
        local_rank: int,
        node_rank: int,
        terminals: WorkerTerminals = PIPES_ONLY,
    ) -> tuple[ForkedWorker, int, int]:
        """Forks one worker; returns it and the read ends of its stdout and stderr.

        The worker's stdout and stderr are pipes, or pseudo-terminals where
        ``terminals`` gives them a size (:mod:`dist_launch.workers.terminals`).

        Raises:
            RuntimeError: The server died or did not answer in time.
        """
        (out_read, out_write), (err_read, err_write) = open_outputs(terminals)
        worker = ForkedWorker(rank, local_rank, node_rank)
        self.workers[rank] = worker
        request = {"rank": rank, "env": env, "cwd": os.getcwd(), "argv": target.bootstrap_argv()}
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], [out_write, err_write])
        except OSError as error:
            raise RuntimeError(f"the dist-launch fork server is gone: {error}") from error
        finally:
            os.close(out_write)
            os.close(err_write)
        self._sock.settimeout(REPLY_SECONDS)
        try:
            while worker.pid is None:
                data = self._sock.recv(65536)
                if not data:
                    self._server_gone()
                    raise RuntimeError(
                        "the dist-launch fork server exited before starting rank "
                        f"{rank} (exit status {self.process.poll()}); try --start-method spawn"
                    )
                self._handle(json.loads(data))
        except TimeoutError as error:
            raise RuntimeError(
                f"the dist-launch fork server did not start rank {rank} within {REPLY_SECONDS:g} s"
            ) from error
        finally:
            self._sock.setblocking(False)
        return worker, out_read, err_read

    def close(self) -> None:
        """Stops the server (its workers, if any are left, die with it)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self._sock)
        self._sock.close()
        try:
            self.process.wait(5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5.0)


def start_fork_server(
    plan: LaunchPlan, selector: selectors.BaseSelector
) -> ForkServerClient | None:
    """The fork server of a run, started now; None when the plan starts no Python.

    Its environment is :func:`dist_launch.workers.environment.node_environment` of the
    launcher's own (read now: variables read when torch is imported, such as
    ``OMP_NUM_THREADS``, are the ones every worker shares).
    """
    if plan.start_method != "forkserver" or plan.target.no_python:
        return None
    from dist_launch.workers.environment import node_environment  # noqa: PLC0415 - light

    return ForkServerClient(node_environment(plan, os.environ), selector)
