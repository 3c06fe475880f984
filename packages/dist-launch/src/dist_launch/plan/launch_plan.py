"""The validated settings of one ``dist-launch`` run, and the error a bad value raises."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dist_launch.output.routing import OutputRouting
from dist_launch.plan.hang_policy import DEFAULT_HANG_TIMEOUT, HangPolicy, parse_hang_timeout
from dist_launch.plan.rdzv_timeouts import RendezvousTimeouts


class UsageError(Exception):
    """A command-line value (or its ``PET_`` or SLURM variable) is wrong; says which."""


@dataclass(frozen=True)
class WorkerTarget:
    """What each worker runs: a script path or a module name, and its arguments.

    ``no_python`` runs ``name`` itself as a program (torchrun's ``--no-python``).
    """

    name: str
    args: tuple[str, ...]
    is_module: bool = False
    no_python: bool = False

    def bootstrap_argv(self) -> list[str]:
        """The arguments of :mod:`dist_launch.in_worker.bootstrap` for this target."""
        head = ["-m", self.name] if self.is_module else [self.name]
        return [*head, *self.args]

    def display(self) -> str:
        """The command line as a user would type it (for logs and process titles)."""
        head = ["-m", self.name] if self.is_module else [self.name]
        return " ".join([*head, *self.args])


@dataclass(frozen=True)
class LaunchPlan:
    """The validated settings of one ``dist-launch`` run."""

    target: WorkerTarget
    nproc: int
    min_nodes: int
    max_nodes: int
    node_rank: int
    rdzv_backend: str
    rdzv_endpoint: str
    rdzv_id: str
    rdzv_conf: Mapping[str, str]
    master_addr: str
    master_port: int | None
    local_addr: str | None
    max_restarts: int
    monitor_interval: float
    start_method: str
    role: str
    log_dir: str | None
    routing: OutputRouting  # -r/--redirects, -t/--tee, --local-ranks-filter, --log-dir
    signals_to_handle: tuple[int, ...]
    grace_period: float
    timeout: float | None
    run_id: str
    virtual_local_rank: bool
    standalone: bool
    sources: Mapping[str, str] = field(default_factory=dict)
    # --hang-timeout (dist_launch.plan.hang_policy).
    hang_policy: HangPolicy = field(
        default_factory=lambda: parse_hang_timeout(DEFAULT_HANG_TIMEOUT)
    )
    # --signals-to-forward: passed on to every worker, stopping nothing.
    signals_to_forward: tuple[int, ...] = ()
    # Restarts before this launcher started (a requeued SLURM job's SLURM_RESTART_COUNT):
    # the workers' TORCHELASTIC_RESTART_COUNT counts on from it.
    restart_base: int = 0
    # --slow-ranks: the slow-rank report's window in seconds; None when off.
    slow_ranks: float | None = 60.0
    # torch's rendezvous timeouts (--rdzv-conf), its defaults where not given.
    rdzv_timeouts: RendezvousTimeouts = field(default_factory=RendezvousTimeouts)
    # --verbose: the timeout budget at start.
    verbose: bool = False

    @property
    def nnodes(self) -> int:
        """The node count of a static job (``MIN`` of ``MIN:MAX``)."""
        return self.min_nodes

    @property
    def world_size(self) -> int:
        """Ranks over all nodes of a static job."""
        return self.nproc * self.min_nodes

    @property
    def elastic(self) -> bool:
        """True when nodes meet through torch elastic's dynamic rendezvous (c10d, etcd)."""
        return self.rdzv_backend != "static"

    @property
    def on_etcd(self) -> bool:
        """True when the rendezvous lives in etcd (``etcd``, or torchrun's ``etcd-v2``)."""
        return self.rdzv_backend in ("etcd", "etcd-v2")


def describe_sources(plan: LaunchPlan) -> str:
    """One line saying the node settings and where each came from."""
    s = plan.sources
    nodes = (
        str(plan.min_nodes)
        if plan.min_nodes == plan.max_nodes
        else (f"{plan.min_nodes}:{plan.max_nodes}")
    )
    parts = [
        f"nnodes={nodes} ({s.get('nnodes', 'default')})",
        f"nproc_per_node={plan.nproc} ({s.get('nproc_per_node', 'default')})",
    ]
    if plan.elastic:
        parts.append(
            f"rdzv={plan.rdzv_backend} at {plan.rdzv_endpoint} ({s.get('rdzv_endpoint', 'flag')}), "
            f"id {plan.rdzv_id}"
        )
    else:
        port = "auto" if plan.master_port is None else str(plan.master_port)
        parts.append(f"node_rank={plan.node_rank} ({s.get('node_rank', 'default')})")
        parts.append(
            f"master={plan.master_addr}:{port} ({s.get('master_addr', 'default')}; "
            f"port {s.get('master_port', 'default')})"
        )
    if plan.max_nodes > 1:
        parts.append(f"run_id={plan.run_id} ({s.get('run_id', 'default')})")
    if plan.restart_base:
        parts.append(f"restarts so far={plan.restart_base} ({s.get('restart_base', 'default')})")
    return ", ".join(parts)
