"""Run a function on N real processes from a pytest test.

:func:`run_ranks` starts ``world_size`` processes, joins them in a real gloo process
group on loopback, calls ``fn(*args, **kwargs)`` on every rank and returns each rank's
result in rank order. When a rank fails it raises :class:`RankFailedError` with that
rank's own traceback, captured inside the worker, and stops the other ranks even
when they are blocked in a collective. When the time runs out it raises with the
Python stack of every rank that was still running.

Where worker functions must live:
    ``fn`` must be a module-level function (no lambda, no closure, no nested
    function). Each worker imports ``fn``'s module by name, or, when that name is not
    importable (pytest's ``--import-mode=importlib`` gives test files names that are
    not on ``sys.path``), loads it again from its file. The test module is therefore
    executed once more in every worker: keep its module level free of side effects,
    and do not rely on fixtures, ``conftest.py`` globals or relative imports from
    inside ``fn``. Arguments and results must be picklable; arguments are unpickled
    after the module is loaded, so they may be instances of classes from the test
    file.

Workers start through a ``forkserver`` that has imported torch once, so a test pays
torch's import once per pytest process, not once per rank. Workers die with the
forkserver, which dies with the pytest process.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from dist_core.callables import CallableRef
from dist_core.proc import (
    close_inherited_forkserver_fd,
    describe_exit,
    is_peer_failure,
    set_parent_death_signal,
)

logger = logging.getLogger(__name__)

# After the first failure, how long the other ranks may take to report before they
# are stopped. Short: a rank blocked in a collective would otherwise wait for the
# group's timeout.
FAILURE_GRACE_SECONDS = 2.0
_TERMINATE_SECONDS = 2.0


class RankFailedError(RuntimeError):
    """A rank raised, exited or timed out; the message holds its traceback first."""

    def __init__(self, message: str, rank: int | None) -> None:
        super().__init__(message)
        self.rank = rank


@dataclasses.dataclass(frozen=True)
class _WorkerSpec:
    function: CallableRef
    payload: bytes
    rank: int
    world_size: int
    master_port: int
    backend: str
    timeout: float
    environ: dict[str, str]
    stack_file: str


def _function_ref(fn: Callable[..., Any]) -> CallableRef:
    ref = CallableRef.of(fn)
    if ref is None:
        raise TypeError(
            f"run_ranks needs a module-level function, got {fn!r}; define it at the top "
            "level of the test file or of an importable module"
        )
    return ref


def _worker_main(spec: _WorkerSpec, conn: mp_connection.Connection) -> None:
    """Body of one rank: set up, run, report. Runs in the child process."""
    close_inherited_forkserver_fd()  # so that a SIGKILLed pytest takes the workers down
    set_parent_death_signal(signal.SIGKILL)
    stack_file = open(spec.stack_file, "w")  # noqa: SIM115 - open for the process's life
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.clear()
    os.environ.update(spec.environ)
    os.environ.update(
        {
            "RANK": str(spec.rank),
            "LOCAL_RANK": str(spec.rank),
            "WORLD_SIZE": str(spec.world_size),
            "LOCAL_WORLD_SIZE": str(spec.world_size),
            "NODE_RANK": "0",
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(spec.master_port),
            "INIT_METHOD": "env://",
        }
    )
    from dist_core.backend import destroy_dist, init_process_group_from_backend  # noqa: PLC0415

    try:
        fn = spec.function.resolve()
        args, kwargs = pickle.loads(spec.payload)
        init_process_group_from_backend(spec.backend, timeout=timedelta(seconds=spec.timeout))
        result = fn(*args, **kwargs)
        conn.send(("ok", time.time(), pickle.dumps(result)))
    except BaseException as error:  # every failure, even SystemExit, is reported
        conn.send(("error", time.time(), traceback.format_exc(), f"{type(error).__name__}"))
        conn.close()
        os._exit(1)  # skip destroy: peers may be gone, and it could block
    try:
        destroy_dist()
    finally:
        conn.close()


@dataclasses.dataclass
class _RankState:
    process: Any
    conn: mp_connection.Connection
    stack_file: Path
    status: str = "running"  # running | ok | error | died
    result: Any = None
    failed_at: float = float("inf")
    traceback: str = ""
    stopped: bool = False


def _context() -> Any:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "dist_core.testing"])
    return context


def _receive(state: _RankState) -> None:
    try:
        message = state.conn.recv()
    except (EOFError, OSError):
        return
    if message[0] == "ok":
        state.status = "ok"
        state.result = pickle.loads(message[2])
    else:
        state.status = "error"
        state.failed_at = message[1]
        state.traceback = message[2]


def _stop(states: list[_RankState]) -> None:
    live = [state for state in states if state.process.is_alive()]
    for state in live:
        state.stopped = True
        state.process.terminate()
    deadline = time.monotonic() + _TERMINATE_SECONDS
    for state in live:
        state.process.join(max(0.0, deadline - time.monotonic()))
        if state.process.is_alive():
            state.process.kill()
            state.process.join(_TERMINATE_SECONDS)


def _dump_stacks(states: list[_RankState]) -> dict[int, str]:
    """Asks every live rank for its Python stack (faulthandler on SIGUSR1)."""
    live = [rank for rank, state in enumerate(states) if state.process.is_alive()]
    for rank in live:
        try:
            os.kill(states[rank].process.pid, signal.SIGUSR1)
        except ProcessLookupError:
            continue
    stacks: dict[int, str] = {}
    deadline = time.monotonic() + 2.0
    for rank in live:
        previous = -1
        text = ""
        # The child writes from its signal handler; the text is complete once its size
        # stops changing. Bounded by the deadline.
        while time.monotonic() < deadline:
            text = states[rank].stack_file.read_text(errors="replace")
            if text and len(text) == previous:
                break
            previous = len(text)
            time.sleep(0.05)
        stacks[rank] = text.rstrip() or "(no stack received)"
    return stacks


def _wait(states: list[_RankState], deadline: float) -> None:
    first_failure_seen: float | None = None
    while True:
        pending = [state for state in states if state.status == "running"]
        if not pending:
            return
        now = time.monotonic()
        limit = deadline
        if first_failure_seen is not None:
            limit = min(limit, first_failure_seen + FAILURE_GRACE_SECONDS)
        if now >= limit:
            return
        waitables: list[Any] = [state.conn for state in pending]
        waitables += [state.process.sentinel for state in pending]
        ready = mp_connection.wait(waitables, timeout=limit - now)
        for state in pending:
            if state.conn in ready:
                _receive(state)
            if state.status == "running" and state.process.sentinel in ready:
                if state.conn.poll(0):
                    _receive(state)
                if state.status == "running":
                    state.process.join(1.0)
                    state.status = "died"
                    state.failed_at = time.time()
            if state.status in ("error", "died") and first_failure_seen is None:
                first_failure_seen = time.monotonic()


def _root_cause(states: list[_RankState]) -> int | None:
    """The rank whose failure caused the others.

    That is the earliest failure by the workers' clocks, preferring ranks that did not
    merely see a peer vanish (see :func:`dist_core.proc.is_peer_failure`).
    """
    failed = [rank for rank, state in enumerate(states) if state.status in ("error", "died")]
    if not failed:
        return None
    primary = [
        rank
        for rank in failed
        if states[rank].status == "died" or not is_peer_failure(states[rank].traceback)
    ]
    return min(primary or failed, key=lambda rank: states[rank].failed_at)


def _format_failure(states: list[_RankState], stacks: dict[int, str], timeout: float) -> str:
    world = len(states)
    lines: list[str] = []
    first = _root_cause(states)
    if first is not None:
        state = states[first]
        if state.status == "error":
            lines.append(f"rank {first} of {world} failed first:\n{state.traceback.rstrip()}")
        else:
            lines.append(
                f"rank {first} of {world} failed first: its process ended with "
                f"{describe_exit(state.process.exitcode)} without reporting a result"
            )
    else:
        lines.append(f"timed out after {timeout:g} s; no rank failed")
    lines.append("other ranks:")
    for rank, state in enumerate(states):
        if rank == first:
            continue
        if state.status == "ok":
            what = "finished"
        elif state.status == "error":
            last = state.traceback.strip().splitlines()[-1] if state.traceback else "error"
            what = f"failed too: {last}"
        elif state.status == "died":
            what = f"died with {describe_exit(state.process.exitcode)}"
        else:
            when = "after the failure" if first is not None else "at the timeout"
            stack = stacks.get(rank, "(no stack received)")
            what = f"still running {when}, stopped; it was at:\n{stack}"
        lines.append(f"  rank {rank}: {what}")
    return "\n".join(lines)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``world_size`` real processes in one group.

    Each worker sees ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` (127.0.0.1) and ``MASTER_PORT`` (a free port), plus a copy of the
    caller's ``os.environ`` at the time of the call, and has its default process
    group initialized with ``backend`` before ``fn`` runs and destroyed after.

    Args:
        fn: A module-level function (see the module docstring for where it must live).
        world_size: Number of ranks, at least 1.
        *args: Positional arguments for ``fn`` (picklable).
        timeout: Seconds for the whole run, process start included; also the
            process group's timeout.
        backend: The process-group backend; gloo runs on CPU anywhere.
        **kwargs: Keyword arguments for ``fn`` (picklable).

    Returns:
        The value ``fn`` returned on each rank, in rank order.

    Raises:
        RankFailedError: A rank raised or died (its traceback first, then what became
            of the others), or the timeout expired (every live rank's stack).
        TypeError: ``fn`` is not a module-level function.
        ValueError: ``world_size`` is below 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: run_ranks needs at least 1 rank")
    from dist_core.ports import get_unused_port, release_port  # noqa: PLC0415

    ref = _function_ref(fn)
    payload = pickle.dumps((args, kwargs))
    context = _context()
    port = get_unused_port()
    deadline = time.monotonic() + timeout
    states: list[_RankState] = []
    with tempfile.TemporaryDirectory(prefix="dist-core-run-ranks-") as scratch:
        try:
            for rank in range(world_size):
                stack_file = Path(scratch) / f"rank{rank}.stack"
                stack_file.touch()
                spec = _WorkerSpec(
                    function=ref,
                    payload=payload,
                    rank=rank,
                    world_size=world_size,
                    master_port=port,
                    backend=backend,
                    timeout=timeout,
                    environ=dict(os.environ),
                    stack_file=str(stack_file),
                )
                receiver, sender = context.Pipe(duplex=False)
                process = context.Process(
                    target=_worker_main, args=(spec, sender), name=f"run_ranks-rank{rank}"
                )
                process.start()
                sender.close()
                states.append(_RankState(process, receiver, stack_file))
            _wait(states, deadline)
            if all(state.status == "ok" for state in states):
                return [state.result for state in states]
            stacks = _dump_stacks(states)
            raise RankFailedError(_format_failure(states, stacks, timeout), _root_cause(states))
        finally:
            _stop(states)
            for state in states:
                state.conn.close()
            release_port(port)
