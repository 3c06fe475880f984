"""What one ``dist-launch`` run does, from flags, ``PET_*``, SLURM and Kubernetes variables.

Each setting comes from the first of these that has it (:mod:`dist_launch.plan.sources`
reads each source; this module only validates and combines what they found):

1. the command-line flag (either spelling, ``--nproc-per-node`` or ``--nproc_per_node``);
2. its ``PET_<FLAG>`` variable (``PET_NPROC_PER_NODE``, ``PET_RDZV_ENDPOINT``, ...), as
   torchrun reads them, which is how Kubeflow's PyTorchJob configures a pod;
3. under ``srun`` (``SLURM_JOB_ID`` and ``SLURM_NODEID`` set, and ``SLURM_STEP_ID`` or
   ``SLURM_PROCID``), the node settings: ``--nnodes`` from ``SLURM_NNODES`` (or
   ``SLURM_JOB_NUM_NODES``), ``--node-rank`` from ``SLURM_NODEID``, the master (or
   rendezvous endpoint) host from the first host of ``SLURM_JOB_NODELIST``, and its
   port from ``SLURM_JOB_ID`` (:func:`~dist_launch.plan.slurm.slurm_port`: dist-core's
   rule, the one ``DistEnv`` uses), so that two jobs sharing a node do not collide;
4. in a Kubernetes pod, the node settings its operator's variables give
   (:mod:`dist_launch.plan.kubernetes`: PyTorchJob, Indexed Job and JobSet,
   LeaderWorkerSet; Trainer v2 sets ``PET_*``);
5. the default, torchrun's except where this module says otherwise.

In a requeued SLURM job, ``SLURM_RESTART_COUNT`` is where the workers'
``TORCHELASTIC_RESTART_COUNT`` starts (``--max-restarts`` stays this launcher's budget:
a requeue is usually a preemption, not a failure).

:attr:`~dist_launch.plan.launch_plan.LaunchPlan.sources` records where each of the node
settings came from; the launcher prints it in its first line.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from dist_launch.output.routing import OutputRouting, parse_local_ranks_filter
from dist_launch.plan.hang_policy import HangPolicy, parse_hang_timeout
from dist_launch.plan.kubernetes import check_kubernetes_settings, kubernetes_settings
from dist_launch.plan.launch_plan import LaunchPlan, UsageError, WorkerTarget
from dist_launch.plan.rdzv_timeouts import RendezvousTimeouts, parse_rendezvous_timeouts
from dist_launch.plan.run_identity import NO_RDZV_ID, choose_run_id
from dist_launch.plan.slurm import slurm_restart_count, slurm_settings
from dist_launch.plan.sources import Settings, default_settings, flag_settings, pet_settings
from dist_launch.plan.values import (
    DEFAULT_SLOW_RANKS_WINDOW,
    parse_int,
    parse_nnodes,
    parse_nproc,
    parse_positive_float,
    parse_rdzv_conf,
    parse_signals,
    parse_slow_ranks,
)

# etcd-v2 is torchrun's name for its etcd backend: accepted, and run on etcd's v3 API.
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
# Seconds between SIGTERM and SIGKILL when nothing else says: time for a checkpoint,
# below SLURM's KillWait and Kubernetes' terminationGracePeriodSeconds (30 s each, from
# the same SIGTERM), leaving the launcher 5 s to reap, drain output, report and exit
# before the scheduler's own SIGKILL. Ranks without a SIGTERM handler die at once.
DEFAULT_GRACE_PERIOD = 25.0


def _refuse(flag: str, reason: str) -> UsageError:
    return UsageError(f"{flag} is not supported: {reason}")


@dataclass(frozen=True)
class _Nodes:
    """The node settings of a run, validated and combined."""

    min_nodes: int
    max_nodes: int
    node_rank: int
    rdzv_backend: str
    rdzv_endpoint: str
    master_addr: str
    master_port: int | None
    standalone: bool


def _rdzv_backend(settings: Settings) -> str:
    backend = settings.text("rdzv_backend").strip().lower()
    if backend not in RDZV_BACKENDS:
        raise UsageError(f"--rdzv-backend={backend!r} is not one of {', '.join(RDZV_BACKENDS)}")
    return backend


def _master_port(settings: Settings) -> int | None:
    raw = settings.get("master_port")
    port = None if raw is None else parse_int(raw, "--master-port", minimum=1)
    if port is not None and port > 65535:
        raise UsageError(f"--master-port={port} is not a TCP port (1-65535)")
    return port


def _nodes(
    settings: Settings, slurm: Mapping[str, tuple[str, str]], sources: dict[str, str]
) -> _Nodes:
    """Node count, this node's rank, the rendezvous and the master; updates ``sources``."""
    standalone = settings.switch("standalone")
    min_nodes, max_nodes = parse_nnodes(settings.text("nnodes"))
    backend = _rdzv_backend(settings)
    endpoint = settings.text("rdzv_endpoint")
    node_rank = parse_int(settings.text("node_rank"), "--node-rank", minimum=0)
    master_addr = settings.text("master_addr")
    master_port = _master_port(settings)
    if standalone:
        # torchrun --standalone: one node, its own rendezvous; the node flags are moot.
        min_nodes = max_nodes = 1
        backend, node_rank, endpoint = "static", 0, ""
        sources["nnodes"] = sources["rdzv_backend"] = "--standalone"
    if backend == "static":
        # torchrun's static rendezvous waits for MAX nodes; MIN means nothing to it.
        min_nodes = max_nodes
        if node_rank >= min_nodes:
            raise UsageError(f"--node-rank={node_rank}: must lie in [0, --nnodes={min_nodes})")
        if endpoint and settings.source("master_addr") == "default":
            # torchrun's static rendezvous serves its store at the endpoint, and its
            # workers get that address and port, on one node as on many.
            host, _, port = endpoint.rpartition(":")
            master_addr = host or master_addr
            if port and master_port is None:
                master_port = parse_int(port, "--rdzv-endpoint port")
                sources["master_port"] = "--rdzv-endpoint"
    elif not endpoint and backend != "c10d":
        raise UsageError(
            f"--rdzv-backend {backend} needs --rdzv-endpoint HOST:PORT[,HOST:PORT...] "
            "(the client URLs of the etcd cluster's members)"
        )
    elif not endpoint:
        if "master_addr" not in slurm:
            raise UsageError(
                "--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT (the host of one node, "
                "which serves the rendezvous store)"
            )
        endpoint = f"{slurm['master_addr'][0]}:{slurm['master_port'][0]}"
        sources["rdzv_endpoint"] = "SLURM_JOB_NODELIST, SLURM_JOB_ID"
    return _Nodes(
        min_nodes, max_nodes, node_rank, backend, endpoint, master_addr, master_port, standalone
    )


def _start_method(settings: Settings) -> str:
    method = settings.text("start_method").strip()
    if method not in ("forkserver", "spawn", "fork"):
        raise UsageError(f"--start-method={method!r} is not one of forkserver, spawn, fork")
    # The launcher never imports torch; forking it would give each worker torch's
    # import to pay. Workers forked from the fork server are what fork means here.
    return "forkserver" if method == "fork" else method


def _refuse_unsupported(values: Mapping[str, object], settings: Settings) -> None:
    """Raises for a torchrun flag dist-launch cannot honour, saying what to use instead."""
    handler = settings.text("event_log_handler")
    if handler != "null":
        raise _refuse(
            "--event-log-handler",
            f"{handler!r}: dist-launch has no event handler registry; its log "
            "lines and the error.json files under --log-dir carry the events",
        )
    for name in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
        if settings.text(name).strip():
            raise _refuse(
                "--" + name.replace("_", "-"),
                "use --log-dir (every rank's full output) and grep the files",
            )
    if values.get("logs_specs"):
        raise _refuse(
            "--logs-specs",
            "torchrun's LogsSpecs plugins are not loaded; --log-dir gives torchrun's layout",
        )
    if values.get("numa_binding"):
        raise _refuse(
            "--numa-binding",
            "bind workers yourself (numactl in a --no-python wrapper) for now",
        )


def _target(values: Mapping[str, object], settings: Settings) -> WorkerTarget:
    module = settings.switch("module")
    no_python = settings.switch("no_python")
    if settings.switch("run_path"):
        no_python = False  # torchrun: --run-path takes precedence over --no-python
    if module and no_python:
        raise UsageError("--no-python and -m/--module exclude each other")
    name = str(values["target"])
    if not module and not no_python and not os.path.isfile(name):
        raise UsageError(f"script {name!r} does not exist (use -m for a module name)")
    raw_args = values.get("target_args") or []
    assert isinstance(raw_args, list)
    return WorkerTarget(name, tuple(str(a) for a in raw_args), module, no_python)


def _grace_period(
    values: Mapping[str, object], settings: Settings, env: Mapping[str, str]
) -> tuple[float, str]:
    """``--grace-period`` > ``--shutdown-timeout`` (or its PET_) > torch elastic's variable.

    Returns:
        The seconds, and where they came from (``default`` when nothing said).
    """
    given = values.get("grace_period")
    if given is not None:
        return parse_positive_float(str(given), "--grace-period"), "--grace-period"
    shutdown = settings.get("shutdown_timeout")
    if shutdown is not None:
        source = settings.source("shutdown_timeout")
        where = "--shutdown-timeout" if source == "flag" else source
        return parse_positive_float(shutdown, "--shutdown-timeout"), where
    if env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        seconds = parse_positive_float(
            env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"], "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
        )
        return seconds, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
    return DEFAULT_GRACE_PERIOD, "default"


# Signals a worker cannot be sent to notify it: uncatchable, or the launcher's own.
_NOT_FORWARDED: dict[int, str] = {
    signal.SIGKILL: "it cannot be caught",
    signal.SIGSTOP: "it cannot be caught",
    signal.SIGCHLD: "the launcher learns of its workers' ends by it",
    signal.SIGQUIT: "it dumps every rank's stack (stopping nothing)",
    signal.SIGWINCH: "the workers' terminals follow the launcher's size by it",
}


def _signals(settings: Settings) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``--signals-to-handle`` and ``--signals-to-forward``; a signal is in one at most."""
    handle = parse_signals(settings.text("signals_to_handle"))
    forward = parse_signals(settings.text("signals_to_forward"), "--signals-to-forward")
    for signum in forward:
        name = signal.Signals(signum).name
        if signum in _NOT_FORWARDED:
            why = _NOT_FORWARDED[signum]
            raise UsageError(f"--signals-to-forward: {name} cannot be forwarded: {why}")
        if signum in handle:
            raise UsageError(
                f"--signals-to-forward: {name} is also in --signals-to-handle "
                f"({settings.text('signals_to_handle')}), which stops the workers with it; "
                "leave it out of one of the two"
            )
    return handle, forward


def _hang_policy(settings: Settings) -> HangPolicy:
    try:
        return parse_hang_timeout(settings.text("hang_timeout"))
    except ValueError as error:
        source = settings.source("hang_timeout")
        where = "" if source == "flag" else f" (from {source})"
        raise UsageError(f"{error}{where}") from None


def _slow_ranks(settings: Settings) -> float | None:
    """The slow-rank report's window (``--slow-ranks``); None when off."""
    given = settings.get("slow_ranks")
    if given is None:
        return DEFAULT_SLOW_RANKS_WINDOW
    source = settings.source("slow_ranks")
    where = "--slow-ranks" if source == "flag" else f"--slow-ranks (from {source})"
    return parse_slow_ranks(given, where)


def _run_and_rdzv_ids(
    values: Mapping[str, object],
    settings: Settings,
    nodes: _Nodes,
    env: Mapping[str, str],
    sources: dict[str, str],
) -> tuple[str, str]:
    """``TORCHELASTIC_RUN_ID`` and the rendezvous id; records the run id's source."""
    rdzv_id = settings.text("rdzv_id")
    run_id, source = choose_run_id(
        given=str(values.get("run_id") or ""),
        rdzv_id=rdzv_id,
        several_nodes=nodes.max_nodes > 1 or bool(nodes.rdzv_endpoint),
        environ=env,
        elastic=nodes.rdzv_backend != "static",
        master_addr=nodes.master_addr,
        rdzv_endpoint=nodes.rdzv_endpoint,
    )
    sources["run_id"] = source
    if nodes.rdzv_backend != "static" and rdzv_id == NO_RDZV_ID:
        rdzv_id = run_id
    return run_id, rdzv_id


def _rdzv_timeouts(rdzv_conf: Mapping[str, str]) -> RendezvousTimeouts:
    try:
        return parse_rendezvous_timeouts(rdzv_conf)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _routing(settings: Settings, env: Mapping[str, str]) -> OutputRouting:
    try:
        return OutputRouting.for_flags(
            settings.text("redirects"),
            settings.text("tee"),
            parse_local_ranks_filter(settings.text("local_ranks_filter")),
            has_log_dir=settings.get("log_dir") is not None,
            prefix_template=settings.get("log_line_prefix_template")
            or env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        )
    except ValueError as error:
        raise UsageError(str(error)) from None


def build_plan(
    values: Mapping[str, object], environ: Mapping[str, str] | None = None
) -> LaunchPlan:
    """Resolves parsed flag values (None = not given) against the environment's sources.

    Args:
        values: The parser's values by destination name; ``None`` where a flag was not
            on the command line.
        environ: The environment to read (``os.environ`` by default): ``PET_<FLAG>``
            for every flag, the SLURM variables of
            :func:`~dist_launch.plan.slurm.slurm_settings`, a pod's of
            :func:`~dist_launch.plan.kubernetes.kubernetes_settings`, and
            ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` and
            ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` as torchrun does, and for the run
            id ``SLURM_JOB_ID``, ``SLURM_STEP_ID`` and ``KUBERNETES_SERVICE_HOST``
            (:func:`~dist_launch.plan.run_identity.choose_run_id`).

    Raises:
        UsageError: A value is malformed or out of range, or a flag cannot be honoured;
            the message names the flag (and the variable it came from).
    """
    env = os.environ if environ is None else environ
    slurm = slurm_settings(env)
    settings = Settings.merge(
        flag_settings(values),
        pet_settings(env),
        slurm,
        kubernetes_settings(env),
        default_settings(),
    )
    check_kubernetes_settings(settings)
    sources = settings.sources()
    nodes = _nodes(settings, slurm, sources)
    _refuse_unsupported(values, settings)
    target = _target(values, settings)
    raw_timeout = values.get("timeout")
    run_id, rdzv_id = _run_and_rdzv_ids(values, settings, nodes, env, sources)
    handle, forward = _signals(settings)
    rdzv_conf = parse_rdzv_conf(settings.text("rdzv_conf"))
    grace_period, sources["grace_period"] = _grace_period(values, settings, env)
    restart_base = slurm_restart_count(env)
    if restart_base:
        sources["restart_base"] = "SLURM_RESTART_COUNT"
    return LaunchPlan(
        target=target,
        nproc=parse_nproc(settings.text("nproc_per_node")),
        min_nodes=nodes.min_nodes,
        max_nodes=nodes.max_nodes,
        node_rank=nodes.node_rank,
        rdzv_backend=nodes.rdzv_backend,
        rdzv_endpoint=nodes.rdzv_endpoint,
        rdzv_id=rdzv_id,
        rdzv_conf=rdzv_conf,
        rdzv_timeouts=_rdzv_timeouts(rdzv_conf),
        master_addr=nodes.master_addr,
        master_port=nodes.master_port,
        local_addr=settings.get("local_addr"),
        max_restarts=parse_int(settings.text("max_restarts"), "--max-restarts", minimum=0),
        monitor_interval=parse_positive_float(
            settings.text("monitor_interval"), "--monitor-interval"
        ),
        start_method=_start_method(settings),
        role=settings.text("role"),
        log_dir=settings.get("log_dir"),
        routing=_routing(settings, env),
        signals_to_handle=handle,
        signals_to_forward=forward,
        restart_base=restart_base,
        grace_period=grace_period,
        timeout=None
        if raw_timeout is None
        else parse_positive_float(str(raw_timeout), "--timeout"),
        run_id=run_id,
        virtual_local_rank=settings.switch("virtual_local_rank"),
        standalone=nodes.standalone,
        sources=sources,
        hang_policy=_hang_policy(settings),
        slow_ranks=_slow_ranks(settings),
        verbose=settings.switch("verbose"),
    )
