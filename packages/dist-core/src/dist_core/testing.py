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
forkserver, which dies with the pytest process. They are watched and stopped by the
same :class:`~dist_core.supervisor.Supervisor` as dist-launch's workers, and report
their failures through the same files (:mod:`dist_core.rank_files`).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from dist_core.callables import CallableRef
from dist_core.lock_files import OwnedDir, sweep_dead_dirs
from dist_core.proc import close_inherited_forkserver_fd, describe_exit
from dist_core.rank_files import RankFiles, write_error_record
from dist_core.supervisor import GroupOutcome, ProcessWorker, RankOutcome, Supervisor
from dist_core.worker_guards import install_worker_guards

# After the first failure, how long the other ranks may take to report before they
# are stopped. Short: a rank blocked in a collective would otherwise wait for the
# group's timeout.
FAILURE_GRACE_SECONDS = 2.0
# Between SIGTERM and SIGKILL when stopping ranks.
_TERMINATE_SECONDS = 2.0
_SCRATCH_PREFIX = "dist-core-run-ranks-"  # the rank files of one call, under TMPDIR


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
    run_dir: str


def _function_ref(fn: Callable[..., Any]) -> CallableRef:
    ref = CallableRef.of(fn)
    if ref is None:
        raise TypeError(
            f"run_ranks needs a module-level function, got {fn!r}; define it at the top "
            "level of the test file or of an importable module"
        )
    return ref


def _result_path(run_dir: str | os.PathLike[str], rank: int) -> Path:
    return Path(run_dir, f"rank{rank}.result")


def _worker_main(spec: _WorkerSpec) -> None:
    """Body of one rank: set up, run, report. Runs in the child process."""
    close_inherited_forkserver_fd()  # so that a SIGKILLed pytest takes the workers down
    files = RankFiles.for_rank(spec.run_dir, spec.rank)
    install_worker_guards(files, parent_pid=None)
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
        result = pickle.dumps(fn(*args, **kwargs))
        path = _result_path(spec.run_dir, spec.rank)
        partial = path.with_name(path.name + ".partial")
        partial.write_bytes(result)
        os.replace(partial, path)  # the caller never reads half a result
        _wait_for_every_rank_to_finish(spec)
    except BaseException as error:  # every failure, even SystemExit, is reported
        write_error_record(files.error, spec.rank, error)
        os._exit(1)  # skip destroy: peers may be gone, and it could block
    destroy_dist()


def _wait_for_every_rank_to_finish(spec: _WorkerSpec) -> None:
    """Rank 0 serves the group's store: it stays until every rank's ``fn`` returned.

    Otherwise rank 0, done first, took the store away while a peer still read from it
    (a value another rank wrote, a verdict), and that peer failed with a connection
    error that was not its test's. Each rank marks its end in the store; rank 0 waits
    for every mark, bounded by the call's timeout. A peer that failed instead ends the
    call through its error record, and the supervisor stops rank 0's wait. Nothing is
    waited for when ``fn`` destroyed the group itself.
    """
    import torch.distributed as dist  # noqa: PLC0415 - the worker has imported it already
    from torch.distributed.distributed_c10d import _get_default_store  # noqa: PLC0415

    if not dist.is_initialized():
        return
    store = _get_default_store()
    store.set(f"dist_core/run_ranks/finished/{spec.rank}", "")
    if spec.rank == 0:
        marks = [f"dist_core/run_ranks/finished/{rank}" for rank in range(spec.world_size)]
        store.wait(marks, timedelta(seconds=spec.timeout))


def _context() -> Any:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["torch", "torch.distributed", "dist_core.testing"])
    return context


def _format_failure(outcome: GroupOutcome, timeout: float) -> str:
    world = len(outcome.ranks)
    root = outcome.root_cause
    lines: list[str] = []
    if root is None:
        lines.append(f"timed out after {timeout:g} s; no rank failed")
    elif root.record is not None:
        lines.append(f"rank {root.rank} of {world} failed first:\n{root.record.traceback.rstrip()}")
    else:
        lines.append(
            f"rank {root.rank} of {world} failed first: its process ended with "
            f"{describe_exit(root.returncode)} without reporting a result"
        )
        if root.crash_stack:
            lines.append(f"Python stack at the crash (faulthandler):\n{root.crash_stack}")
    lines.append("other ranks:")
    lines.extend(
        f"  rank {rank.rank}: {_what_became_of(rank, root)}"
        for rank in outcome.ranks
        if rank is not root
    )
    return "\n".join(lines)


def _what_became_of(rank: RankOutcome, root: RankOutcome | None) -> str:
    if rank.status == "succeeded":
        return "finished"
    if rank.status == "failed":
        if rank.record is None:
            return f"died with {describe_exit(rank.returncode)}"
        last = rank.record.traceback.strip().splitlines()[-1] if rank.record.traceback else ""
        return f"failed too: {last or rank.record.summary}"
    when = "after the failure" if root is not None else "at the timeout"
    stack = rank.live_stack or "(no stack received)"
    return f"still running {when}, stopped; it was at:\n{stack}"


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
    group initialized with ``backend`` before ``fn`` runs and destroyed after. The
    ranks' files go to a ``dist-core-run-ranks-*`` directory under ``TMPDIR``, removed
    at the end; one that a SIGKILLed caller left is removed by the next call.

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
    sweep_dead_dirs(_SCRATCH_PREFIX)  # left by callers that were SIGKILLed
    with OwnedDir(_SCRATCH_PREFIX) as owned:
        scratch = owned.path
        try:
            with Supervisor(
                grace_period=_TERMINATE_SECONDS, report_window=FAILURE_GRACE_SECONDS
            ) as supervisor:
                for rank in range(world_size):
                    spec = _WorkerSpec(
                        function=ref,
                        payload=payload,
                        rank=rank,
                        world_size=world_size,
                        master_port=port,
                        backend=backend,
                        timeout=timeout,
                        environ=dict(os.environ),
                        run_dir=scratch,
                    )
                    process = context.Process(
                        target=_worker_main, args=(spec,), name=f"run_ranks-rank{rank}"
                    )
                    process.start()
                    supervisor.add(ProcessWorker(process, rank), RankFiles.for_rank(scratch, rank))
                # The timeout covers the start too (the fork server imports torch).
                supervisor.timeout = max(0.0, deadline - time.monotonic())
                outcome = supervisor.run()
        finally:
            release_port(port)
        if outcome.status == "succeeded":
            return [pickle.loads(_result_path(scratch, r).read_bytes()) for r in range(world_size)]
        root = outcome.root_cause
        message = _format_failure(outcome, timeout)
        raise RankFailedError(message, None if root is None else root.rank)
