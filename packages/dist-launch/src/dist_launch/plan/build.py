"""What one ``dist-launch`` run does, resolved from flags, ``PET_*`` variables and SLURM.

Each setting comes from the first of these that has it:

1. the command-line flag (either spelling, ``--nproc-per-node`` or ``--nproc_per_node``);
2. its ``PET_<FLAG>`` variable (``PET_NPROC_PER_NODE``, ``PET_RDZV_ENDPOINT``, ...), as
   torchrun reads them, which is how Kubeflow's PyTorchJob configures a pod;
3. under ``srun`` (``SLURM_JOB_ID`` and ``SLURM_NODEID`` set, and ``SLURM_STEP_ID`` or
   ``SLURM_PROCID``), the node settings: ``--nnodes`` from ``SLURM_NNODES`` (or
   ``SLURM_JOB_NUM_NODES``), ``--node-rank`` from ``SLURM_NODEID``, the master (or
   rendezvous endpoint) host from the first host of ``SLURM_JOB_NODELIST``, and its
   port from ``SLURM_JOB_ID`` (:func:`~dist_launch.plan.slurm.slurm_port`: dist-core's
   rule, the one ``DistEnv`` uses), so that two jobs sharing a node do not collide;
4. the default, torchrun's except where this module says otherwise.

:attr:`~dist_launch.plan.launch_plan.LaunchPlan.sources` records where each of the node
settings came from; the launcher prints it in its first line.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping

from dist_launch.output.routing import OutputRouting, parse_local_ranks_filter
from dist_launch.plan.hang_policy import DEFAULT_HANG_TIMEOUT, parse_hang_timeout
from dist_launch.plan.launch_plan import LaunchPlan, UsageError, WorkerTarget
from dist_launch.plan.slurm import slurm_defaults
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

RDZV_BACKENDS = ("static", "c10d")
DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def _refuse(flag: str, reason: str) -> UsageError:
    return UsageError(f"{flag} is not supported: {reason}")


def build_plan(
    values: Mapping[str, object], environ: Mapping[str, str] | None = None
) -> LaunchPlan:
    """Resolves parsed flag values (None = not given) against ``PET_*`` and SLURM.

    Args:
        values: The parser's values by destination name; ``None`` where a flag was not
            on the command line.
        environ: The environment to read (``os.environ`` by default): ``PET_<FLAG>``
            for every flag, the SLURM variables of :func:`slurm_defaults`, and
            ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` and
            ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` as torchrun does.

    Raises:
        UsageError: A value is malformed or out of range, or a flag cannot be honoured;
            the message names the flag (and the variable it came from).
    """
    env = os.environ if environ is None else environ
    slurm = slurm_defaults(env)
    sources: dict[str, str] = {}

    def get(name: str, default: str | None = None) -> str | None:
        given = values.get(name)
        if given is not None:
            sources[name] = "flag"
            return str(given)
        variable = f"PET_{name.upper()}"
        if env.get(variable):
            sources[name] = variable
            return env[variable]
        if name in slurm:
            value, source = slurm[name]
            sources[name] = source
            return value
        sources[name] = "default"
        return default

    def flag(name: str) -> bool:
        given = values.get(name)
        if given:
            return True
        raw = env.get(f"PET_{name.upper()}", "0").strip()
        return raw not in ("", "0", "false", "False")

    standalone = flag("standalone")
    min_nodes, max_nodes = parse_nnodes(get("nnodes", "1") or "1")
    nproc = parse_nproc(get("nproc_per_node", "1") or "1")
    rdzv_backend = (get("rdzv_backend", "static") or "static").strip().lower()
    if rdzv_backend in ("etcd", "etcd-v2"):
        raise UsageError(
            f"--rdzv-backend={rdzv_backend}: etcd rendezvous is deprecated in torch and not "
            "supported; use --rdzv-backend c10d (an endpoint any node can reach) or static"
        )
    if rdzv_backend not in RDZV_BACKENDS:
        raise UsageError(
            f"--rdzv-backend={rdzv_backend!r} is not one of {', '.join(RDZV_BACKENDS)}"
        )
    rdzv_endpoint = get("rdzv_endpoint", "") or ""
    rdzv_id = get("rdzv_id", "none") or "none"
    rdzv_conf = parse_rdzv_conf(get("rdzv_conf", "") or "")
    node_rank = parse_int(get("node_rank", "0") or "0", "--node-rank", minimum=0)
    master_addr = get("master_addr", "127.0.0.1") or "127.0.0.1"
    raw_port = get("master_port")
    master_port = None if raw_port is None else parse_int(raw_port, "--master-port", minimum=1)
    if master_port is not None and master_port > 65535:
        raise UsageError(f"--master-port={master_port} is not a TCP port (1-65535)")
    if standalone:
        # torchrun --standalone: one node, its own rendezvous; the node flags are moot.
        min_nodes = max_nodes = 1
        rdzv_backend, node_rank = "static", 0
        rdzv_endpoint = ""
        sources["nnodes"] = sources["rdzv_backend"] = "--standalone"
    if rdzv_backend == "static":
        # torchrun's static rendezvous waits for MAX nodes; MIN means nothing to it.
        min_nodes = max_nodes
        if node_rank >= min_nodes:
            raise UsageError(f"--node-rank={node_rank}: must lie in [0, --nnodes={min_nodes})")
        if rdzv_endpoint and sources.get("master_addr") == "default":
            # torchrun's static rendezvous serves its store at the endpoint, and its
            # workers get that address and port, on one node as on many.
            host, _, port = rdzv_endpoint.rpartition(":")
            master_addr = host or master_addr
            if port and master_port is None:
                master_port = parse_int(port, "--rdzv-endpoint port")
                sources["master_port"] = "--rdzv-endpoint"
    elif not rdzv_endpoint:
        if "master_addr" in slurm:
            rdzv_endpoint = f"{slurm['master_addr'][0]}:{slurm['master_port'][0]}"
            sources["rdzv_endpoint"] = "SLURM_JOB_NODELIST, SLURM_JOB_ID"
        else:
            raise UsageError(
                "--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT (the host of one node, "
                "which serves the rendezvous store)"
            )
    max_restarts = parse_int(get("max_restarts", "0") or "0", "--max-restarts", minimum=0)
    monitor_interval = parse_positive_float(
        get("monitor_interval", "0.1") or "0.1", "--monitor-interval"
    )
    start_method = (get("start_method", "forkserver") or "forkserver").strip()
    if start_method not in ("forkserver", "spawn", "fork"):
        raise UsageError(f"--start-method={start_method!r} is not one of forkserver, spawn, fork")
    if start_method == "fork":
        # The launcher never imports torch; forking it would give each worker torch's
        # import to pay. Workers forked from the fork server are what fork means here.
        start_method = "forkserver"
    event_log_handler = get("event_log_handler", "null") or "null"
    if event_log_handler != "null":
        raise _refuse(
            "--event-log-handler",
            f"{event_log_handler!r}: dist-launch has no event handler registry; its log "
            "lines and the error.json files under --log-dir carry the events",
        )
    for name in ("duplicate_stdout_filters", "duplicate_stderr_filters"):
        if (get(name, "") or "").strip():
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
    module = flag("module")
    no_python = flag("no_python")
    run_path = flag("run_path")
    if run_path:
        no_python = False  # torchrun: --run-path takes precedence over --no-python
    if module and no_python:
        raise UsageError("--no-python and -m/--module exclude each other")
    target_name = str(values["target"])
    if not module and not no_python and not os.path.isfile(target_name):
        raise UsageError(f"script {target_name!r} does not exist (use -m for a module name)")
    raw_args = values.get("target_args") or []
    assert isinstance(raw_args, list)
    target = WorkerTarget(target_name, tuple(str(a) for a in raw_args), module, no_python)
    shutdown = get("shutdown_timeout")
    grace_given = values.get("grace_period")
    if grace_given is not None:
        grace_period = parse_positive_float(str(grace_given), "--grace-period")
    elif shutdown is not None:
        grace_period = parse_positive_float(shutdown, "--shutdown-timeout")
    elif env.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        grace_period = parse_positive_float(
            env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"], "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
        )
    else:
        grace_period = 5.0
    try:
        hang_policy = parse_hang_timeout(get("hang_timeout", DEFAULT_HANG_TIMEOUT) or "auto")
    except ValueError as error:
        source = sources.get("hang_timeout", "flag")
        where = "" if source == "flag" else f" (from {source})"
        raise UsageError(f"{error}{where}") from None
    slow_given = get("slow_ranks", None)
    slow_where = "--slow-ranks"
    if sources.get("slow_ranks", "flag") != "flag":
        slow_where = f"--slow-ranks (from {sources['slow_ranks']})"
    slow_ranks = (
        DEFAULT_SLOW_RANKS_WINDOW
        if slow_given is None
        else parse_slow_ranks(str(slow_given), slow_where)
    )
    raw_timeout = values.get("timeout")
    timeout = None if raw_timeout is None else parse_positive_float(str(raw_timeout), "--timeout")
    run_id = str(values.get("run_id") or "")
    if not run_id:
        run_id = rdzv_id if rdzv_id != "none" else ""
    if not run_id:
        run_id = uuid.uuid4().hex if max_nodes == 1 and not rdzv_endpoint else "none"
    if rdzv_backend == "c10d" and rdzv_id == "none":
        rdzv_id = run_id
    log_dir = get("log_dir")
    try:
        routing = OutputRouting.for_flags(
            get("redirects", "0") or "0",
            get("tee", "0") or "0",
            parse_local_ranks_filter(get("local_ranks_filter", "") or ""),
            has_log_dir=log_dir is not None,
            prefix_template=get("log_line_prefix_template")
            or env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    return LaunchPlan(
        target=target,
        nproc=nproc,
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        node_rank=node_rank,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        rdzv_conf=rdzv_conf,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=get("local_addr"),
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method=start_method,
        role=get("role", "default") or "default",
        log_dir=log_dir,
        routing=routing,
        signals_to_handle=parse_signals(get("signals_to_handle", DEFAULT_SIGNALS) or ""),
        grace_period=grace_period,
        timeout=timeout,
        run_id=run_id,
        virtual_local_rank=flag("virtual_local_rank"),
        standalone=standalone,
        sources=sources,
        hang_policy=hang_policy,
        slow_ranks=slow_ranks,
    )
