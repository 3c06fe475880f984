"""The launcher's side of the CLI's fork server (:mod:`dist_launch.in_worker.fork_server`).

Workers forked from a server that imported torch once start in milliseconds instead
of each paying torch's import (about 2 s of CPU), which dominates start-up when
several ranks share a few cores.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from dist_launch.in_worker.fork_server import FORWARDED_VARIABLE, PRELOAD_VARIABLE
from dist_launch.in_worker.proctitle import TITLE_ROOM
from dist_launch.plan.launch_plan import LaunchPlan, WorkerTarget
from dist_launch.workers.preload import preload_modules
from dist_launch.workers.terminals import PIPES_ONLY, WorkerTerminals, open_outputs

# How long the server may take to fork one worker and reply (it may still be
# importing torch when the first request arrives).
REPLY_SECONDS = 120.0


class Loop(Protocol):
    """What the client needs of the launcher's event loop (:mod:`dist_launch.agent.event_loop`)."""

    def watch(self, fd: int | socket.socket, callback: Callable[[], None] | None) -> None:
        """Calls ``callback`` on the loop whenever ``fd`` is readable."""

    def unwatch(self, fd: int | socket.socket) -> None:
        """Stops watching ``fd``."""

    def run_until(self, done: Callable[[], bool], deadline: float | None = None) -> bool:
        """Serves the loop until ``done()``; False when ``deadline`` passed first."""


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

    The server's messages (a worker's pid, its exit status) are read by the launcher's
    event loop; :meth:`start` sends a request and returns at once, and
    :meth:`wait_until_started` serves the loop until every pid arrived.

    Args:
        env: The server's environment (what every worker shares; read before torch's
            import, e.g. ``OMP_NUM_THREADS``).
        loop: The launcher's event loop.
    """

    def __init__(self, env: dict[str, str], loop: Loop) -> None:
        self.loop = loop
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
        self._sock.setblocking(False)
        loop.watch(self._sock, self._on_readable)
        self._closed = False
        self._gone = False

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
        self._gone = True
        self.loop.unwatch(self._sock)
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
        """Asks for one worker; returns it and the read ends of its stdout and stderr.

        The worker's pid arrives later, through the loop (:meth:`wait_until_started`).
        Its stdout and stderr are pipes, or pseudo-terminals where ``terminals`` gives
        them a size (:mod:`dist_launch.workers.terminals`).

        Raises:
            RuntimeError: The server is gone.
        """
        (out_read, out_write), (err_read, err_write) = open_outputs(terminals)
        worker = ForkedWorker(rank, local_rank, node_rank)
        self.workers[rank] = worker
        request = {"rank": rank, "env": env, "cwd": os.getcwd(), "argv": target.bootstrap_argv()}
        # Blocking, bounded: many requests may fill the socket's buffer while the server
        # still imports torch (it reads them once it has).
        self._sock.settimeout(REPLY_SECONDS)
        try:
            if self._gone:
                raise OSError("it exited")
            socket.send_fds(self._sock, [json.dumps(request).encode()], [out_write, err_write])
        except OSError as error:
            for fd in (out_read, err_read):
                os.close(fd)
            raise RuntimeError(f"the dist-launch fork server is gone: {error}") from error
        finally:
            self._sock.setblocking(False)
            os.close(out_write)
            os.close(err_write)
        return worker, out_read, err_read

    def wait_until_started(self, workers: Sequence[ForkedWorker]) -> None:
        """Serves the loop until the server told each worker's pid (at most REPLY_SECONDS).

        Raises:
            RuntimeError: The server died, or did not answer in time; names the rank.
        """
        deadline = time.monotonic() + REPLY_SECONDS
        self.loop.run_until(
            lambda: self._gone or all(worker.pid is not None for worker in workers), deadline
        )
        for worker in workers:
            if worker.pid is not None:
                continue
            if self._gone:
                raise RuntimeError(
                    "the dist-launch fork server exited before starting rank "
                    f"{worker.rank} (exit status {self.process.poll()}); "
                    "try --start-method spawn"
                )
            raise RuntimeError(
                f"the dist-launch fork server did not start rank {worker.rank} "
                f"within {REPLY_SECONDS:g} s"
            )

    def close(self) -> None:
        """Stops the server (its workers, if any are left, die with it)."""
        if self._closed:
            return
        self._closed = True
        self.loop.unwatch(self._sock)
        self._sock.close()
        try:
            self.process.wait(5.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5.0)


def start_fork_server(plan: LaunchPlan, loop: Loop) -> ForkServerClient | None:
    """The fork server of a run, started now; None when the plan starts no Python.

    Its environment is :func:`dist_launch.workers.environment.node_environment` of the
    launcher's own (read now: variables read when torch is imported, such as
    ``OMP_NUM_THREADS``, are the ones every worker shares), with the modules to preload
    (:func:`dist_launch.workers.preload.preload_modules`; reads ``DIST_LAUNCH_PRELOAD``).
    """
    if plan.start_method != "forkserver" or plan.target.no_python:
        return None
    from dist_launch.workers.environment import node_environment  # noqa: PLC0415 - light

    env = node_environment(plan, os.environ)
    env[FORWARDED_VARIABLE] = ",".join(str(signum) for signum in plan.signals_to_forward)
    env[PRELOAD_VARIABLE] = preload_modules(plan.target, os.environ, Path.cwd())
    return ForkServerClient(env, loop)
