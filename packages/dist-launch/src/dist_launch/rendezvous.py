"""How this node learns its place in the job: a static plan, or torch elastic's c10d rendezvous.

:class:`StaticRendezvous` needs no torch (the launcher stays fast to start): every node
is told its rank, the master's address and the node count. :class:`ElasticRendezvous`
is torch.distributed.elastic's own c10d rendezvous (the TCPStore-backed
``DynamicRendezvousHandler`` torchrun uses), not a re-implementation: nodes join in any
order, ``--nnodes MIN:MAX`` admits late nodes, node ranks come from the rendezvous.

On top of torch's rendezvous, the job shares, in the rendezvous store:

- a job-wide restart count (``--max-restarts`` is a budget for the whole job, not per
  node as in torchrun, pytorch issue 108158): the first node to report a failed round
  counts it, once;
- each node's failure record of the round, so that every node's report names the node
  and rank that failed first;
- a closing record when the budget is spent, which stops the other nodes at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from dist_core.ports import DEFAULT_PORT, get_unused_port, release_port
from dist_launch.plan import LaunchPlan

if TYPE_CHECKING:
    from torch.distributed import Store  # type: ignore[attr-defined]  # public, not re-exported in the stubs

logger = logging.getLogger(__name__)

# torch elastic's own default; a node that finished waits this long for the others.
EXIT_BARRIER_SECONDS = 300.0


@dataclass(frozen=True)
class Assignment:
    """This node's place in one round of the job."""

    group_rank: int
    group_world_size: int
    base_rank: int  # the global rank of local rank 0
    world_size: int
    master_addr: str
    master_port: int
    restart_count: int  # failed rounds so far, job-wide


@dataclass(frozen=True)
class FailureRecord:
    """One node's first failure of a round, as shared with the other nodes."""

    node: str
    group_rank: int
    rank: int
    timestamp: float
    summary: str

    def describe(self) -> str:
        """``rank 5 on node 1 (host-b): ValueError: ...``."""
        return f"rank {self.rank} on node {self.group_rank} ({self.node}): {self.summary}"


class StaticRendezvous:
    """Every node is told its rank; the master's port is chosen here on one node.

    Restarts are per node: without an agent store nodes cannot agree on a budget.
    """

    elastic = False

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.auto_port = plan.master_port is None
        self._port: int | None = None

    def _choose_port(self, avoid: int | None) -> int:
        if self.plan.master_port is not None:
            return self.plan.master_port
        if self.plan.nnodes > 1:
            return DEFAULT_PORT  # every node must agree without talking
        return get_unused_port(DEFAULT_PORT if avoid is None else 0)

    @property
    def port(self) -> int:
        """The master port of the current round."""
        if self._port is None:
            self._port = self._choose_port(None)
        return self._port

    def replace_port(self) -> tuple[int, int]:
        """After EADDRINUSE from an automatic port: (old, new)."""
        old = self.port
        release_port(old)
        self._port = self._choose_port(old)
        return old, self._port

    def next_round(self, restart_count: int) -> Assignment:
        """This node's assignment (the same every round)."""
        plan = self.plan
        return Assignment(
            group_rank=plan.node_rank,
            group_world_size=plan.nnodes,
            base_rank=plan.node_rank * plan.nproc,
            world_size=plan.world_size,
            master_addr=plan.master_addr,
            master_port=self.port,
            restart_count=restart_count,
        )

    def close(self) -> None:
        """Releases an automatically chosen port."""
        if self.auto_port and self._port is not None:
            release_port(self._port)


def is_local_address(host: str) -> bool:
    """True when ``host`` names an address of this network namespace (bindable here)."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
            except OSError:
                continue
            return True
    return False


def route_address(host: str, port: int) -> str | None:
    """The address of the interface that routes to ``host`` (what peers reach us at)."""
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(address)  # UDP: no packet is sent
            except OSError:
                continue
            local = str(probe.getsockname()[0])
            return local
    return None


def c10d_host_and_port(endpoint: str) -> tuple[str, int]:
    """``HOST[:PORT]`` (``[IPv6]:PORT`` too) of a c10d rendezvous, split by torch itself.

    A missing port is torch's c10d default, 29400, as with torchrun (``--master-port``'s
    29500 is static rendezvous's, not c10d's).
    """
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (  # noqa: PLC0415
        DEFAULT_PORT as C10D_DEFAULT_PORT,
    )
    from torch.distributed.elastic.rendezvous.utils import (  # noqa: PLC0415
        parse_rendezvous_endpoint,
    )

    return parse_rendezvous_endpoint(endpoint, default_port=C10D_DEFAULT_PORT)


class ElasticRendezvous:
    """torch elastic's c10d rendezvous, with a job-wide restart budget on its store.

    Reads no variable itself; sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the
    launcher's own environment so that rank 0's worker hosts the workers' store (as
    with ``env://``) instead of the agent, whose store outlives the workers.
    """

    elastic = True

    def __init__(self, plan: LaunchPlan) -> None:
        from torch.distributed.elastic.rendezvous import (  # noqa: PLC0415 - torch only for c10d
            RendezvousParameters,
        )
        from torch.distributed.elastic.rendezvous.registry import (  # noqa: PLC0415
            get_rendezvous_handler,
        )

        self.plan = plan
        host, port = c10d_host_and_port(plan.rdzv_endpoint)
        conf: dict[str, Any] = dict(plan.rdzv_conf)
        # torch decides who serves the store by host name; inside network namespaces
        # and on multi-homed hosts an address bound here is the better test.
        guessed = "is_host" not in conf
        if guessed:
            conf["is_host"] = "1" if is_local_address(host) else "0"
        self.local_addr = plan.local_addr or route_address(host, port) or socket.getfqdn()
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"

        def handler_for(conf: dict[str, Any]) -> Any:
            params = RendezvousParameters(
                backend="c10d",
                endpoint=f"{host}:{port}",
                run_id=plan.rdzv_id,
                min_nodes=plan.min_nodes,
                max_nodes=plan.max_nodes,
                local_addr=self.local_addr,
                **conf,
            )
            return get_rendezvous_handler(params)

        try:
            self.handler = handler_for(conf)
        except Exception:
            if not (guessed and conf["is_host"] == "1"):
                raise
            # Another agent on this host serves the store already: join it as a client.
            self.handler = handler_for({**conf, "is_host": "0"})
        self._round_store: Store | None = None
        self._job_store: Store | None = None
        self.assignment: Assignment | None = None
        self._prefix = f"dist_launch/{plan.rdzv_id}/"

    # -- rounds -----------------------------------------------------------------------

    def next_round(self, restart_count: int) -> Assignment:
        """Joins the next round; returns this node's ranks in it.

        Raises:
            torch's RendezvousClosedError: The job was closed (its budget spent, or a
                node stopped it).
            torch's RendezvousTimeoutError: Too few nodes joined within join_timeout.
        """
        from torch.distributed import PrefixStore  # type: ignore[attr-defined]  # noqa: PLC0415

        info = self.handler.next_rendezvous()
        store = info.store
        self._round_store = store
        self._job_store = store.underlying_store if isinstance(store, PrefixStore) else store
        group_rank, nodes = info.rank, info.world_size
        store.set(f"dist_launch/nproc/{group_rank}", str(self.plan.nproc))
        counts = [
            int(value)
            for value in store.multi_get([f"dist_launch/nproc/{r}" for r in range(nodes)])
        ]
        bootstrap = info.bootstrap_store_info
        assert bootstrap is not None
        restarts = int(self._job_store.add(self._prefix + "restarts", 0))
        self.assignment = Assignment(
            group_rank=group_rank,
            group_world_size=nodes,
            base_rank=sum(counts[:group_rank]),
            world_size=sum(counts),
            master_addr=bootstrap.master_addr,
            master_port=bootstrap.master_port,
            restart_count=restarts,
        )
        return self.assignment

    def nodes_waiting(self) -> int:
        """Nodes waiting to join a next round (late or restarted ones)."""
        return int(self.handler.num_nodes_waiting())

    @property
    def keep_alive_interval(self) -> float:
        """Seconds between torch's heartbeats (``--rdzv-conf keep_alive_interval``, 5)."""
        try:
            return float(self.plan.rdzv_conf.get("keep_alive_interval", "5"))
        except ValueError:
            return 5.0

    def lost_nodes(self) -> int:
        """Nodes of the current round that torch's keep-alive has since declared dead.

        Read from the rendezvous state torch synced during :meth:`nodes_waiting` (its
        ``_state_holder``; 0 when a torch version keeps it elsewhere): a node whose
        network was cut sends no heartbeat, and its peers' collectives may wait for it
        much longer than ``keep_alive_interval * keep_alive_max_attempt``.
        """
        if self.assignment is None:
            return 0
        holder = getattr(self.handler, "_state_holder", None)
        participants = getattr(getattr(holder, "state", None), "participants", None)
        if not isinstance(participants, dict):
            return 0
        return max(0, self.assignment.group_world_size - len(participants))

    def is_closed(self) -> bool:
        """True once a node closed the job."""
        return bool(self.handler.is_closed())

    # -- failures ---------------------------------------------------------------------

    def report_failure(self, record: FailureRecord) -> int:
        """Shares this node's failure; counts the round once, job-wide; returns the count."""
        assert self._round_store is not None and self._job_store is not None
        store = self._round_store
        store.set(f"dist_launch/failure/{record.group_rank}", json.dumps(record.__dict__))
        if int(store.add("dist_launch/failed", 1)) == 1:
            return int(self._job_store.add(self._prefix + "restarts", 1))
        # Another node counted this round already; it did so before its own report.
        return int(self._job_store.add(self._prefix + "restarts", 0))

    def failures(self) -> list[FailureRecord]:
        """The failure records of the current round, earliest first."""
        if self._round_store is None or self.assignment is None:
            return []
        keys = [f"dist_launch/failure/{r}" for r in range(self.assignment.group_world_size)]
        records: list[FailureRecord] = []
        for key in keys:
            with contextlib.suppress(Exception):
                if self._round_store.check([key]):
                    records.append(FailureRecord(**json.loads(self._round_store.get(key))))
        return sorted(records, key=lambda r: (r.timestamp, r.rank))

    def close_job(self, why: str) -> None:
        """Stops every node: records ``why`` and closes torch's rendezvous."""
        if self._job_store is not None:
            with contextlib.suppress(Exception):
                self._job_store.set(self._prefix + "closed", why)
        if self._round_store is not None:
            # Wakes nodes already waiting in the exit barrier.
            with contextlib.suppress(Exception):
                self._round_store.set("dist_launch/all_succeeded", "closed")
        with contextlib.suppress(Exception):
            self.handler.set_closed()

    def closing_reason(self) -> str | None:
        """What the node that closed the job said, if it said anything."""
        if self._job_store is None:
            return None
        key = self._prefix + "closed"
        with contextlib.suppress(Exception):
            if self._job_store.check([key]):
                return bytes(self._job_store.get(key)).decode(errors="replace")
        return None

    # -- the end ----------------------------------------------------------------------

    def exit_barrier(self) -> None:
        """After success, waits (bounded) until every node of the round finished.

        The node serving the rendezvous store must outlive the others' last use of it.
        """
        store, assignment = self._round_store, self.assignment
        if store is None or assignment is None:
            return
        done = int(store.add("dist_launch/succeeded", 1))
        if done >= assignment.group_world_size:
            store.set("dist_launch/all_succeeded", "1")
        started = time.monotonic()
        try:
            store.wait(["dist_launch/all_succeeded"], timedelta(seconds=EXIT_BARRIER_SECONDS))
        except Exception as error:  # torch raises several kinds
            logger.warning(
                "not every node finished within %.0f s of this one (%s)",
                time.monotonic() - started,
                error,
            )

    def close(self) -> None:
        """Stops torch's heartbeats (and closes the rendezvous, as torchrun does)."""
        with contextlib.suppress(Exception):
            self.handler.shutdown()
