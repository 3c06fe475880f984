"""The CLI's fork server: one interpreter imports torch once, then forks every worker.

Started by :class:`~dist_launch.workers.fork_server_client.ForkServerClient` as
``python -m dist_launch.in_worker.fork_server FD PADDING`` where FD is its end of a
``SOCK_SEQPACKET`` socket pair and PADDING (spaces, ignored) makes room for the process
titles (:mod:`dist_launch.in_worker.proctitle`): the server shows as
``dist-launch fork server (train.py)``, each worker as its own command line and rank.
Each request is a JSON message (the worker's environment, working directory and
bootstrap arguments) with the worker's stdout and stderr pipes attached
(``SCM_RIGHTS``). The server replies
``{"rank": r, "pid": p}``, and ``{"rank": r, "exit": status}`` when it reaps the
worker (``-N`` for signal N). The server dies with the launcher (parent-death
signal), and each worker dies with the server, so the chain holds under SIGKILL.

The server ignores the signals the outside world sends every process of a job
(:data:`OUTSIDE_SIGNALS` and the launcher's ``--signals-to-forward``, named in
:data:`FORWARDED_VARIABLE`): ``scancel``, a SLURM time limit, systemd's control-group
kill or ``kill -TERM -PGID`` reach it too, and a server dying of them would take every
worker with it (their parent-death signal) before any could checkpoint. Only the
launcher decides when workers stop. Each forked worker gets back the dispositions the
server started with (a signal ignored from the start, as under ``nohup``, stays
ignored).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys
from typing import Any, NoReturn

from dist_core.proc import set_parent_death_signal
from dist_launch.in_worker import import_time_env, proctitle

PRELOAD_VARIABLE = "DIST_LAUNCH_PRELOAD"
DEFAULT_PRELOAD = "torch,torch.distributed"
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# What `top` and `ps -o comm` show for the server (at most 15 bytes).
SERVER_THREAD_NAME = "dist-launch-fs"
# Signals a scheduler sends to every process of a job: the server ignores them.
OUTSIDE_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
# The launcher's --signals-to-forward (numbers, comma-separated), ignored too.
FORWARDED_VARIABLE = "DIST_LAUNCH_FORWARDED_SIGNALS"

SignalHandler = Any  # what signal.getsignal returns


def ignore_outside_signals(forwarded: str) -> dict[int, SignalHandler]:
    """Ignores :data:`OUTSIDE_SIGNALS` and ``forwarded``; returns what they were before.

    Ignored, not blocked: a blocked signal would stay pending into every fork.
    """
    numbers = [*OUTSIDE_SIGNALS, *(int(n) for n in forwarded.split(",") if n.strip())]
    before: dict[int, SignalHandler] = {}
    for signum in dict.fromkeys(numbers):
        before[signum] = signal.getsignal(signum)
        signal.signal(signum, signal.SIG_IGN)
    return before


def restore_signals(before: dict[int, SignalHandler]) -> None:
    """Puts back what :func:`ignore_outside_signals` replaced (in a forked worker)."""
    for signum, handler in before.items():
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        sock.send(json.dumps(message).encode())


def _preload() -> None:
    names = os.environ.get(PRELOAD_VARIABLE, DEFAULT_PRELOAD)
    for name in filter(None, (part.strip() for part in names.split(","))):
        # A module that fails to import here fails again, visibly, in the worker.
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def serve(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    """Forks workers on request; returns (request, fds) in a new worker, None at EOF."""
    ranks: dict[int, int] = {}  # pid -> rank
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ, "request")
    selector.register(wake_read, selectors.EVENT_READ, "child")
    titled = False
    while True:
        for key, _ in selector.select():
            if key.data == "child":
                with contextlib.suppress(OSError):
                    os.read(wake_read, 4096)
                while ranks:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                    if pid == 0:
                        break
                    rank = ranks.pop(pid, None)
                    if rank is not None:
                        _send(sock, {"rank": rank, "exit": os.waitstatus_to_exitcode(status)})
                continue
            data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE_BYTES, 2)
            if not data:
                return None  # the launcher closed its end
            request = json.loads(data)
            if not titled:  # the first request names what the job runs
                titled = proctitle.set_process_title(proctitle.fork_server_title(request["argv"]))
            pid = os.fork()
            if pid == 0:
                selector.close()
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(wake_read)
                os.close(wake_write)
                sock.close()
                return request, list(fds)
            # Both sides set the group (as shells do): it exists before the launcher
            # learns the pid, whichever side runs first.
            with contextlib.suppress(OSError):
                os.setpgid(pid, pid)
            for fd in fds:
                os.close(fd)
            ranks[pid] = int(request["rank"])
            _send(sock, {"rank": request["rank"], "pid": pid})


def _become_worker(
    request: dict[str, Any],
    fds: list[int],
    server_pid: int,
    imported_with: dict[str, str | None],
    signals_before: dict[int, SignalHandler],
) -> NoReturn:
    from dist_launch.in_worker import bootstrap  # noqa: PLC0415 - preloaded before the fork

    restore_signals(signals_before)
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # its own group, so that stopping it reaches its children too
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ[bootstrap.PARENT_PID_VARIABLE] = str(server_pid)
    files, rank = bootstrap.worker_setup()
    kind, name = bootstrap.prepare_target(list(request["argv"]))
    proctitle.name_worker(request["argv"], rank)
    # Last before the script: what it sets before `import torch` must count (where the
    # server imported it: otherwise the worker's own import reads the variables).
    if "torch" in sys.modules:
        import_time_env.apply_at_first_torch_import(imported_with)
    bootstrap.exit_without_teardown(bootstrap.run_target(kind, name, files, rank))


def main() -> int:
    """Runs the server; in each forked worker, runs the worker's target instead."""
    signals_before = ignore_outside_signals(os.environ.pop(FORWARDED_VARIABLE, ""))
    set_parent_death_signal(signal.SIGKILL)
    launcher = os.environ.get("DIST_LAUNCH_PARENT_PID", "")
    if launcher and os.getppid() != int(launcher):
        return 125  # the launcher died before the parent-death signal was armed
    sock = socket.socket(fileno=int(sys.argv[1]))
    proctitle.set_process_title(proctitle.fork_server_title())
    proctitle.set_thread_name(SERVER_THREAD_NAME)
    imported_with = import_time_env.snapshot(os.environ)
    _preload()
    import dist_launch.in_worker.bootstrap  # noqa: F401, PLC0415 - ready for the workers

    # What the server imported is never collected: a garbage collection in a worker
    # would otherwise touch, and so copy, every page it shares with the server.
    gc.freeze()
    server_pid = os.getpid()
    got = serve(sock)
    if got is None:
        return 0
    request, fds = got
    _become_worker(request, fds, server_pid, imported_with, signals_before)


if __name__ == "__main__":
    sys.exit(main())
