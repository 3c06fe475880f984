"""The ``dist-launch`` command: torchrun's interface, with loud failures and no orphans.

``dist-launch -n 4 train.py --lr 0.1`` starts four workers on this node with the
variables torchrun sets, prefixes their output with ``[rank{r}]:`` (and a space), and when one
fails stops the others and prints the root cause with its traceback first.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import re
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from dist_core.ports import DEFAULT_PORT, get_unused_port, release_port
from dist_launch._bootstrap import PARENT_PID_VARIABLE, RUN_DIR_VARIABLE
from dist_launch.output import LineRelay
from dist_launch.records import RankFiles
from dist_launch.report import format_report, group_exit_status
from dist_launch.supervisor import GroupOutcome, Supervisor, Worker
from dist_launch.workers import WorkerTarget, start_subprocess_worker
from dist_launch.zygote import Zygote

logger = logging.getLogger(__name__)

PROG = "dist-launch"
USAGE_EXIT_STATUS = 2
# After the workers ended, how long a grandchild holding their pipes may delay us.
DRAIN_SECONDS = 2.0
# How many times an automatically chosen master port that turned out taken is replaced.
PORT_RETRIES = 3
_ADDRESS_IN_USE = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)


class UsageError(Exception):
    """A command-line value is wrong; the message says which and why."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (torchrun's flag names, with ``-`` or ``_``)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Run a script or module on N local processes (and across nodes), with "
            "torchrun's variables; stop every rank when one fails and report the root "
            "cause first."
        ),
    )
    add = parser.add_argument
    add(
        "-n",
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        default=1,
        metavar="N",
        help="worker processes on this node (default 1)",
    )
    add("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    add("--node-rank", "--node_rank", type=int, default=0, help="this node's rank (default 0)")
    add(
        "--master-addr",
        "--master_addr",
        default="127.0.0.1",
        help="host of rank 0's rendezvous store (default 127.0.0.1)",
    )
    add(
        "--master-port",
        "--master_port",
        type=int,
        default=None,
        help="port of the store; default: a free port on one node, 29500 on several",
    )
    add(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help="restart the local worker group up to this many times after a failure",
    )
    add(
        "--log-dir",
        "--log_dir",
        default=None,
        metavar="DIR",
        help="also write each rank's output to DIR/rank{r}.log",
    )
    add(
        "--grace-period",
        "--grace_period",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="after a failure, seconds between SIGTERM and SIGKILL to the others (default 5)",
    )
    add(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop the job after this long, showing where each rank was",
    )
    add(
        "--start-method",
        "--start_method",
        choices=("forkserver", "spawn"),
        default="forkserver",
        help="forkserver: fork workers from one interpreter that imported torch once "
        "(default); spawn: one fresh interpreter per worker",
    )
    add(
        "--run-id",
        "--run_id",
        default=None,
        help="TORCHELASTIC_RUN_ID (default: random on one node, 'none' on several)",
    )
    add(
        "-m",
        "--module",
        action="store_true",
        help="the target is a module name, run as `python -m`",
    )
    add("target", metavar="script|module", help="the script (or, with -m, module) to run")
    add("target_args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


@dataclass(frozen=True)
class LaunchPlan:
    """The validated command line."""

    target: WorkerTarget
    nproc: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    max_restarts: int
    log_dir: str | None
    grace_period: float
    timeout: float | None
    start_method: str
    run_id: str

    @property
    def world_size(self) -> int:
        """Ranks over all nodes."""
        return self.nproc * self.nnodes


def plan_from_args(argv: Sequence[str] | None = None) -> LaunchPlan:
    """Parses and validates the command line.

    Raises:
        UsageError: A value is out of range; the message names the flag.
        SystemExit: argparse's own errors and ``--help``.
    """
    args = build_parser().parse_args(argv)
    if args.nproc_per_node < 1:
        raise UsageError(f"--nproc-per-node={args.nproc_per_node}: need at least 1 process")
    if args.nnodes < 1:
        raise UsageError(f"--nnodes={args.nnodes}: need at least 1 node")
    if not 0 <= args.node_rank < args.nnodes:
        raise UsageError(f"--node-rank={args.node_rank}: must lie in [0, --nnodes={args.nnodes})")
    if args.master_port is not None and not 1 <= args.master_port <= 65535:
        raise UsageError(f"--master-port={args.master_port} is not a TCP port (1-65535)")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts={args.max_restarts} must be 0 or more")
    if args.grace_period <= 0:
        raise UsageError(f"--grace-period={args.grace_period:g} must be positive")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout={args.timeout:g} must be positive")
    if not args.module and not os.path.isfile(args.target):
        raise UsageError(f"script {args.target!r} does not exist (use -m for a module name)")
    run_id = args.run_id or (uuid.uuid4().hex if args.nnodes == 1 else "none")
    return LaunchPlan(
        target=WorkerTarget(args.target, tuple(args.target_args), args.module),
        nproc=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        log_dir=args.log_dir,
        grace_period=args.grace_period,
        timeout=args.timeout,
        start_method=args.start_method,
        run_id=run_id,
    )


def port_is_free(port: int) -> bool:
    """True when a TCP listener could bind ``port`` on this host now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                return False
            raise
    return True


def worker_environment(
    plan: LaunchPlan, base: dict[str, str], port: int, restart_count: int
) -> dict[str, str]:
    """The variables every local worker shares (rank variables are added per worker).

    ``OMP_NUM_THREADS=1`` unless set (as torchrun, when several workers share a node),
    ``PYTHONUNBUFFERED=1`` unless set (so that prefixed lines arrive as written), and
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` unless set (as torchrun).
    """
    env = dict(base)
    if "OMP_NUM_THREADS" not in env and plan.nproc > 1:
        env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    env.update(
        {
            "GROUP_RANK": str(plan.node_rank),
            "NODE_RANK": str(plan.node_rank),
            "ROLE_NAME": "default",
            "WORLD_SIZE": str(plan.world_size),
            "LOCAL_WORLD_SIZE": str(plan.nproc),
            "GROUP_WORLD_SIZE": str(plan.nnodes),
            "ROLE_WORLD_SIZE": str(plan.world_size),
            "MASTER_ADDR": plan.master_addr,
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(plan.max_restarts),
            "TORCHELASTIC_RUN_ID": plan.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "False",
        }
    )
    return env


def rank_environment(env: dict[str, str], rank: int, local_rank: int) -> dict[str, str]:
    """``env`` plus one worker's rank variables."""
    return {
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "ROLE_RANK": str(rank),
    }


class _Signals:
    """SIGINT, SIGTERM and SIGHUP recorded for the run loop; ignored ones stay ignored."""

    HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.read_fd, self._write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._previous_wakeup = signal.set_wakeup_fd(self._write_fd)
        self._previous: dict[int, signal._HANDLER] = {}
        for signum in self.HANDLED:
            handler = signal.getsignal(signum)
            # A signal ignored by whoever started us (nohup, a background shell job)
            # stays ignored, here and, through inheritance, in the workers.
            if handler is signal.SIG_IGN:
                continue
            self._previous[signum] = handler
            signal.signal(signum, self._record)

    def _record(self, signum: int, frame: object) -> None:
        self.pending.append(signum)

    def drain(self) -> None:
        """Empties the wake-up pipe (the handlers already recorded the signals)."""
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self.read_fd, 4096):
                pass

    def close(self) -> None:
        """Puts the previous handlers back."""
        signal.set_wakeup_fd(self._previous_wakeup)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        os.close(self.read_fd)
        os.close(self._write_fd)


class Launcher:
    """Runs a :class:`LaunchPlan` on this node, restarting the group when allowed."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.signals: _Signals | None = None
        self._supervisor: Supervisor | None = None
        self._interrupted: int | None = None  # the first signal received, if any

    def _on_signal(self) -> None:
        assert self.signals is not None
        self.signals.drain()
        received = self.signals.pending[:]
        self.signals.pending.clear()
        for signum in received:
            if self._interrupted is None:
                self._interrupted = signum
            if self._supervisor is not None:
                self._supervisor.interrupt(signum)

    def _choose_port(self, auto: bool, avoid: int | None) -> int:
        plan = self.plan
        if not auto:
            assert plan.master_port is not None
            return plan.master_port
        if plan.nnodes > 1:
            return DEFAULT_PORT  # every node must agree without talking
        return get_unused_port(DEFAULT_PORT if avoid is None else 0)

    def run(self) -> int:
        """Runs the job; returns the exit status."""
        plan = self.plan
        auto_port = plan.master_port is None
        port = self._choose_port(auto_port, None)
        if plan.node_rank == 0 and not port_is_free(port):
            how = "--master-port" if not auto_port else "the default master port"
            print(
                f"{PROG}: {how} {port} is already in use on this host; choose a free port "
                "or leave --master-port out to get one",
                file=sys.stderr,
            )
            return USAGE_EXIT_STATUS
        self.signals = _Signals()
        deadline = None if plan.timeout is None else time.monotonic() + plan.timeout
        restart_count = 0
        port_retries = 0
        try:
            while True:
                if self.signals.pending or self._interrupted is not None:
                    # Never restart after a signal, even one that came as a group ended.
                    signum = self._interrupted or self.signals.pending[0]
                    print(f"{PROG}: interrupted by {signal.Signals(signum).name}", file=sys.stderr)
                    return 128 + signum
                remaining = None if deadline is None else max(0.01, deadline - time.monotonic())
                try:
                    outcome = self._run_group(port, restart_count, remaining)
                except (OSError, RuntimeError) as error:
                    print(f"{PROG}: error: could not start the workers: {error}", file=sys.stderr)
                    return 1
                if outcome.status == "succeeded":
                    return 0
                root = outcome.root_cause
                if (
                    outcome.status == "failed"
                    and auto_port
                    and plan.nnodes == 1
                    and port_retries < PORT_RETRIES
                    and root is not None
                    and root.record is not None
                    and _ADDRESS_IN_USE.search(root.record.traceback)
                ):
                    port_retries += 1
                    release_port(port)
                    old, port = port, self._choose_port(auto_port, port)
                    logger.warning("master port %d was taken meanwhile; retrying on %d", old, port)
                    continue
                if outcome.status == "failed" and restart_count < plan.max_restarts:
                    restart_count += 1
                    logger.warning(
                        "restarting the local worker group (restart %d of %d) after: %s",
                        restart_count,
                        plan.max_restarts,
                        _one_line_cause(outcome),
                    )
                    continue
                print(format_report(outcome, PROG), file=sys.stderr, flush=True)
                return group_exit_status(outcome)
        finally:
            self.signals.close()
            self.signals = None
            if auto_port:
                release_port(port)

    def _open_logs(self, restart_count: int) -> dict[int, BinaryIO]:
        plan = self.plan
        logs: dict[int, BinaryIO] = {}
        if plan.log_dir is None:
            return logs
        os.makedirs(plan.log_dir, exist_ok=True)
        for local_rank in range(plan.nproc):
            rank = plan.node_rank * plan.nproc + local_rank
            path = os.path.join(plan.log_dir, f"rank{rank}.log")
            logs[rank] = open(path, "ab" if restart_count else "wb")  # noqa: SIM115
        return logs

    def _run_group(self, port: int, restart_count: int, timeout: float | None) -> GroupOutcome:
        plan = self.plan
        assert self.signals is not None
        run_dir = tempfile.mkdtemp(prefix="dist-launch-")
        selector = selectors.DefaultSelector()
        selector.register(self.signals.read_fd, selectors.EVENT_READ, self._on_signal)
        logs = self._open_logs(restart_count)
        relays: list[LineRelay] = []
        workers: list[Worker] = []
        spawner: Zygote | None = None
        try:
            env = worker_environment(plan, dict(os.environ), port, restart_count)
            env[RUN_DIR_VARIABLE] = run_dir
            env[PARENT_PID_VARIABLE] = str(os.getpid())
            if plan.start_method == "forkserver":
                spawner = Zygote(env, selector)
            for local_rank in range(plan.nproc):
                rank = plan.node_rank * plan.nproc + local_rank
                rank_env = rank_environment(env, rank, local_rank)
                rank_env["TORCHELASTIC_ERROR_FILE"] = str(
                    RankFiles.for_rank(run_dir, rank).torchelastic_error
                )
                worker: Worker
                if spawner is not None:
                    worker, out_fd, err_fd = spawner.start(
                        plan.target, rank_env, rank, local_rank, plan.node_rank
                    )
                else:
                    worker, out_fd, err_fd = start_subprocess_worker(
                        plan.target, rank_env, rank, local_rank, plan.node_rank
                    )
                workers.append(worker)
                prefix = f"[rank{rank}]: ".encode()
                for fd, sink in ((out_fd, sys.stdout.buffer), (err_fd, sys.stderr.buffer)):
                    relay = LineRelay(fd, prefix, sink, logs.get(rank))
                    relays.append(relay)
                    selector.register(fd, selectors.EVENT_READ, _pump_callback(selector, relay))
            files = {w.rank: RankFiles.for_rank(run_dir, w.rank) for w in workers}
            self._supervisor = Supervisor(
                workers, files, grace_period=plan.grace_period, timeout=timeout, selector=selector
            )
            if self.signals.pending:
                self._on_signal()
            outcome = self._supervisor.run()
            _drain(selector, relays)
            return outcome
        finally:
            self._supervisor = None
            for worker in workers:
                _kill_if_alive(worker)
            if spawner is not None:
                spawner.close()
            for relay in relays:
                relay.close()
            for log in logs.values():
                log.close()
            for worker in workers:
                close = getattr(worker, "close", None)
                if close is not None:
                    close()
            selector.close()
            shutil.rmtree(run_dir, ignore_errors=True)


def _pump_callback(selector: selectors.BaseSelector, relay: LineRelay) -> object:
    def pump() -> None:
        if not relay.pump():
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(relay.fd)

    return pump


def _drain(selector: selectors.BaseSelector, relays: list[LineRelay]) -> None:
    """Passes on what the ended workers left in their pipes (bounded)."""
    deadline = time.monotonic() + DRAIN_SECONDS
    while any(not relay.closed for relay in relays):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        for key, _ in selector.select(remaining):
            if callable(key.data) and any(key.fd == relay.fd for relay in relays):
                key.data()


def _kill_if_alive(worker: Worker) -> None:
    if worker.returncode() is None and worker.pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker.pid, signal.SIGKILL)


def _one_line_cause(outcome: GroupOutcome) -> str:
    from dist_launch.report import describe_returncode  # noqa: PLC0415

    root = outcome.root_cause
    if root is None:
        return outcome.status
    what = f"rank {root.rank} failed with {describe_returncode(root.returncode)}"
    if root.record is not None:
        what += f" ({root.record.summary})"
    return what


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dist-launch`` and ``python -m dist_launch``; returns the exit status."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    package_logger = logging.getLogger("dist_launch")
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    try:
        plan = plan_from_args(argv)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return USAGE_EXIT_STATUS
    return Launcher(plan).run()
