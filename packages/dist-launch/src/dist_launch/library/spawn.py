"""Run a function on N processes of this node, each in the process group.

:func:`launch_subprocesses` is the library form of the launcher: it starts
``cfg.local_world_size`` processes with ``multiprocessing`` (start method
``cfg.launch_method``), each calls :func:`init_and_run`, and when one fails the others
are stopped and :class:`~dist_launch.errors.LaunchError` is raised with the failing
rank's traceback first.

What must be picklable:

- ``forkserver`` (the default) and ``spawn``: ``cfg``, ``*args`` and ``**kwargs``, and
  ``func`` and ``setup``. Module-level functions travel by reference
  (:class:`~dist_core.callables.CallableRef`): the worker imports their module by
  name, or loads it from its file when the name is not importable (a test file under
  pytest's importlib mode, a script run by path), so that file's module level runs
  again in each worker. Other callables (``functools.partial``, instances with
  ``__call__``) are pickled as they are.
- ``fork``: nothing; the child is a copy of the caller. Do not use it after CUDA or
  threads were started in the caller.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from dist_core.callables import CallableRef
from dist_core.config import MultiprocessConfig, is_missing, resolved
from dist_core.ports import release_port
from dist_core.proc import close_inherited_forkserver_fd
from dist_core.rank_files import RankFiles
from dist_core.supervisor import ProcessWorker, Supervisor
from dist_core.worker_guards import die_quietly_of_sigint, install_worker_guards, record_and_print
from dist_launch.diagnostics.failure_report import format_report, group_exit_status
from dist_launch.errors import LaunchError
from dist_launch.output.scratch import ScratchDir, sweep_dead_scratch_dirs

logger = logging.getLogger(__name__)

START_METHODS = ("forkserver", "spawn", "fork")
DEFAULT_GRACE_PERIOD = 5.0
GRACE_PERIOD_VARIABLE = "DIST_LAUNCH_GRACE_PERIOD"
TIMEOUT_VARIABLE = "DIST_LAUNCH_TIMEOUT"


def _seconds_from_env(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw} is not a number of seconds") from None
    if value <= 0:
        raise LaunchError(f"{name}={raw} must be a positive number of seconds")
    return value


def init_and_run(
    func: Callable[..., Any], cfg: MultiprocessConfig, *args: Any, **kwargs: Any
) -> Any:
    """Initializes the process group from ``cfg``, then parallel groups, then runs ``func``.

    The default group comes from :func:`dist_core.init_dist` (which writes ``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``, ... to ``os.environ``; the backend is
    ``cfg.backend``, else ``TORCH_DISTRIBUTED_BACKEND``, else the devices' default).
    When ``cfg.model_parallelism`` or ``cfg.pipeline_parallelism`` is above 1, the
    model, pipeline and data parallel groups come from
    ``dist_collectives.init_parallelism``; dist-collectives is then required. The group
    is destroyed after ``func`` returns.

    Returns:
        What ``func`` returned.

    Raises:
        LaunchError: Parallelism was asked for and dist-collectives is not installed.
    """
    from dist_core.backend import destroy_dist, init_dist_env  # noqa: PLC0415 - imports torch

    wants_parallelism = cfg.model_parallelism > 1 or cfg.pipeline_parallelism > 1
    init_parallelism: Callable[..., Any] | None = None
    destroy_parallelism: Callable[[], Any] | None = None
    if wants_parallelism:
        try:
            # An optional sibling: imported by name so that dist-launch never needs it.
            collectives = import_module("dist_collectives")
            init_parallelism = collectives.init_parallelism
            destroy_parallelism = getattr(collectives, "destroy_parallelism", None)
        except (ImportError, AttributeError) as error:
            raise LaunchError(
                f"model_parallelism={cfg.model_parallelism} and pipeline_parallelism="
                f"{cfg.pipeline_parallelism} need the dist-collectives package, which is not "
                "installed: pip install dist-collectives (or set both to 1)"
            ) from error
    if any(is_missing(cfg, name) for name in ("world_size", "local_world_size", "master_port")):
        cfg = resolved(cfg)  # called directly with an unresolved config
    init_dist_env(cfg.dist_env(), init_method=cfg.init_method, backend=cfg.backend)
    if init_parallelism is not None:
        init_parallelism(
            model_parallelism=cfg.model_parallelism,
            pipeline_parallelism=cfg.pipeline_parallelism,
            mp_backend=cfg.model_parallel_backend,
            pp_backend=cfg.pipeline_parallel_backend,
            dp_backend=cfg.data_parallel_backend,
        )
    result = func(*args, **kwargs)
    if destroy_parallelism is not None:
        destroy_parallelism()
    destroy_dist()
    return result


def _worker_main(
    task: _Task | bytes,
    cfg: MultiprocessConfig,
    run_dir: str,
    parent_pid: int | None,
) -> None:
    """Body of one worker process: guards, ``setup``, :func:`init_and_run`, report."""
    files = RankFiles.for_rank(run_dir, cfg.rank)
    if parent_pid is None:  # a forkserver worker
        close_inherited_forkserver_fd()
    install_worker_guards(files, parent_pid)
    try:
        func, setup, args, kwargs = _unpack(task)
        if setup is not None:
            setup()
        init_and_run(func, cfg, *args, **kwargs)
    except KeyboardInterrupt:
        die_quietly_of_sigint()
    except BaseException as error:
        if isinstance(error, SystemExit) and error.code in (None, 0):
            return
        status = record_and_print(files, cfg.rank, error)
        sys.stdout.flush()
        # Skip interpreter teardown: peers may be gone and a destructor could block.
        os._exit(status or 1)


@dataclass(frozen=True)
class _Task:
    """What a worker runs, as sent by ``fork`` (objects, nothing is pickled)."""

    func: Callable[..., Any]
    setup: Callable[[], Any] | None
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def _pack(
    func: Callable[..., Any],
    setup: Callable[[], Any] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> bytes:
    """The task as bytes: callables by reference where possible, then the arguments."""
    refs = [CallableRef.of(item) if item is not None else None for item in (func, setup)]
    callables = [
        ref if ref is not None else item for ref, item in zip(refs, (func, setup), strict=True)
    ]
    return pickle.dumps((callables, pickle.dumps((args, kwargs))))


def _unpack(
    task: _Task | bytes,
) -> tuple[Callable[..., Any], Callable[[], Any] | None, tuple[Any, ...], dict[str, Any]]:
    if isinstance(task, _Task):
        return task.func, task.setup, task.args, task.kwargs
    callables, payload = pickle.loads(task)  # our own bytes, from the parent process
    func, setup = (item.resolve() if isinstance(item, CallableRef) else item for item in callables)
    args, kwargs = pickle.loads(payload)  # after the callables' modules are loaded
    return func, setup, args, kwargs


def _cuda_initialised_here() -> bool:
    """Whether this process initialised CUDA (asked without initialising it)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    return bool(torch.cuda.is_initialized())


def _context(method: str, func: Callable[..., Any]) -> Any:
    if method not in START_METHODS:
        raise LaunchError(
            f"launch_method={method!r} is not a start method; use one of {', '.join(START_METHODS)}"
        )
    if method == "fork" and _cuda_initialised_here():
        raise LaunchError(
            "launch_method='fork': this process already initialised CUDA, and a forked "
            "worker cannot use it again (torch: 'Cannot re-initialize CUDA in forked "
            "subprocess'); use launch_method='forkserver' (the default) or 'spawn', or "
            "start the workers before anything touches CUDA"
        )
    context = mp.get_context(method)
    if method == "forkserver":
        preload = ["torch", "torch.distributed", "dist_launch.library.spawn"]
        module = getattr(func, "__module__", None)
        if module and module != "__main__":
            preload.append(module)
        # Applies when this process starts its fork server; one already running (for
        # instance dist_core.testing's) keeps its own preloads.
        context.set_forkserver_preload(preload)
    return context


def _run_in_this_process(
    func: Callable[..., Any],
    cfg: MultiprocessConfig,
    setup: Callable[[], Any] | None,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """The one-rank case: no child process, same contract (LaunchError on failure).

    The process group's variables that :func:`init_and_run` writes to ``os.environ``
    (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT``, ...) are put back as they were at the end,
    as a child process's would vanish with it: a later launch or
    ``DistEnv.from_environ()`` in the caller does not find a job of one rank.
    """
    from dist_core.backend import destroy_dist  # noqa: PLC0415 - imports torch

    cfg.rank = 0
    cfg.local_rank = 0
    environ_before = dict(os.environ)
    try:
        if setup is not None:
            setup()
        init_and_run(func, cfg, *args, **kwargs)
    except LaunchError:
        raise
    except Exception as error:
        text = "".join(traceback.format_exception(error)).rstrip()
        raise LaunchError(
            f"launch_subprocesses: rank 0 of 1 (in this process) failed:\n{text}",
            rank=0,
            exitcode=1,
        ) from error
    finally:
        destroy_dist()
        _restore_environ(environ_before)


def _restore_environ(before: dict[str, str]) -> None:
    """Puts ``os.environ`` back to ``before``: only the variables that changed."""
    for name in [name for name in os.environ if name not in before]:
        del os.environ[name]
    for name, value in before.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}-{last}"


def _waiting_for_other_nodes(cfg: MultiprocessConfig, timeout: float | None) -> str:
    """The line rank 0's node logs when ranks of the job run on other nodes."""
    local = cfg.local_world_size
    how_long = (
        f"{timeout:.0f} s ({TIMEOUT_VARIABLE})"
        if timeout is not None
        else "the process group's timeout (torch's default: 30 min; set "
        f"{TIMEOUT_VARIABLE} to bound it)"
    )
    return (
        f"starting ranks {_span(0, local - 1)} of {cfg.world_size} on this node; waiting "
        f"for ranks {_span(local, cfg.world_size - 1)} from other nodes at "
        f"{cfg.master_addr}:{cfg.master_port} for up to {how_long}"
    )


def launch_subprocesses(
    func: Callable[..., Any],
    cfg: MultiprocessConfig,
    setup: Callable[[], Any] | None = None,
    rank_offset: int = 0,
    *args: Any,
    **kwargs: Any,
) -> None:
    """Runs ``func(*args, **kwargs)`` on this node's ranks, each in the process group.

    Resolves a copy of ``cfg`` (:func:`dist_core.config.resolved`), then starts
    ``cfg.local_world_size`` processes with global ranks ``rank_offset + i`` and
    local ranks ``i``; ``cfg.world_size`` is the total over all nodes. Left unset,
    ``local_world_size`` is ``world_size``: all ranks on this node. A multi-node launch
    names ``local_world_size`` and ``rank_offset`` on each node, and the node of rank 0
    logs one line naming the ranks it waits for from other nodes and for how long. Each process
    runs ``setup()`` (when given), then :func:`init_and_run`. With
    ``cfg.world_size <= 1`` everything runs in this process (``setup``, then
    :func:`init_and_run` with a group of one, destroyed afterwards; an exception of
    ``func`` is raised as a :class:`LaunchError` whose ``__cause__`` is the original).

    When a rank fails, the others are asked for their stacks, sent SIGTERM, and after
    the grace period SIGKILL; this raises within the grace period plus a few seconds.
    Workers are tied to this process (``PR_SET_PDEATHSIG``): none outlives it, even
    when it is killed.

    Reads ``DIST_LAUNCH_GRACE_PERIOD`` (seconds between SIGTERM and SIGKILL, default
    5) and ``DIST_LAUNCH_TIMEOUT`` (seconds the whole group may run, default none):
    environment variables rather than parameters, so that every keyword argument
    still reaches ``func`` as in the seed's signature.

    Args:
        func: The function each rank runs (picklable: see the module docstring).
        cfg: The configuration; the launch uses a copy with the missing fields
            filled (:func:`dist_core.config.resolved`) and leaves ``cfg`` as it was.
        setup: Run first in each worker, before the process group exists.
        rank_offset: Added to every local index to form the global rank.
        *args: Positional arguments of ``func``.
        **kwargs: Keyword arguments of ``func``.

    Raises:
        LaunchError: A rank failed (its traceback first, then the other ranks), the
            timeout expired (every rank's stack), or the configuration is invalid.
        KeyboardInterrupt: Ctrl-C; the workers were stopped first.
    """
    # The caller's config is left as it was; the launch works on a resolved copy.
    cfg = resolved(cfg)
    if cfg.world_size <= 1:
        _run_in_this_process(func, cfg, setup, args, kwargs)
        return
    local = cfg.local_world_size
    if local < 1 or rank_offset < 0 or rank_offset + local > cfg.world_size:
        raise LaunchError(
            f"cannot place local_world_size={local} ranks at rank_offset={rank_offset} in "
            f"world_size={cfg.world_size}: the global ranks must lie in [0, world_size)"
        )
    grace_period = _seconds_from_env(GRACE_PERIOD_VARIABLE, DEFAULT_GRACE_PERIOD)
    timeout = _seconds_from_env(TIMEOUT_VARIABLE, None)
    if local < cfg.world_size and rank_offset == 0:
        logger.info("%s", _waiting_for_other_nodes(cfg, timeout))
    context = _context(cfg.launch_method, func)
    task: _Task | bytes = (
        _Task(func, setup, args, kwargs)
        if cfg.launch_method == "fork"
        else _pack(func, setup, args, kwargs)
    )
    parent_pid = None if cfg.launch_method == "forkserver" else os.getpid()
    sweep_dead_scratch_dirs()
    scratch = ScratchDir()
    run_dir = scratch.path
    try:
        # The supervisor kills and reaps every worker it holds when the block ends, a
        # failed start or a Ctrl-C (forwarded as SIGINT first) included.
        with Supervisor(
            grace_period=grace_period or DEFAULT_GRACE_PERIOD, timeout=timeout
        ) as supervisor:
            for local_rank in range(local):
                rank = rank_offset + local_rank
                worker_cfg = cfg.replace(rank=rank, local_rank=local_rank)
                process = context.Process(
                    target=_worker_main,
                    args=(task, worker_cfg, run_dir, parent_pid),
                    name=f"dist-launch-rank{rank}",
                )
                process.start()
                supervisor.add(
                    ProcessWorker(process, rank, local_rank, rank // local),
                    RankFiles.for_rank(run_dir, rank),
                )
            outcome = supervisor.run()
    finally:
        scratch.close()
        release_port(cfg.master_port)
    if outcome.status != "succeeded":
        root = outcome.root_cause
        raise LaunchError(
            format_report(outcome, "launch_subprocesses"),
            rank=None if root is None else root.rank,
            exitcode=group_exit_status(outcome),
        )
