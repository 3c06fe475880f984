"""Static rendezvous (``--rdzv-backend static``): every node is told its place.

Needs no torch (the launcher stays fast to start) and no store: the node rank, the
master's address and the node count come from the plan, and the master port from the
plan or, on one node, from :func:`dist_core.get_unused_port`. Restarts are counted per
node, as torchrun counts them: without a store the nodes cannot share a budget.
"""

from __future__ import annotations

from collections.abc import Callable

from dist_core.ports import DEFAULT_PORT, get_unused_port, port_is_free, release_port
from dist_launch.plan.launch_plan import LaunchPlan
from dist_launch.rendezvous.job_board import JobBoard
from dist_launch.rendezvous.protocol import (
    Assignment,
    FailureCount,
    FailureRecord,
    NoWatch,
    RendezvousUsageError,
    RoundChange,
    RoundWatch,
)


class StaticRendezvous:
    """The :class:`~dist_launch.rendezvous.protocol.Rendezvous` of a static job.

    Args:
        plan: The launch plan; reads no environment variable.
    """

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan
        self.auto_port = plan.master_port is None
        self._port: int | None = None
        self._restarts = 0

    @classmethod
    def open(cls, plan: LaunchPlan) -> StaticRendezvous:
        """The rendezvous, its master port chosen and, on node 0, checked free.

        Raises:
            RendezvousUsageError: Node 0's master port is taken on this host.
        """
        rdzv = cls(plan)
        if plan.node_rank == 0 and not port_is_free(rdzv.port):
            how = "the default master port" if rdzv.auto_port else "--master-port"
            rdzv.close()
            raise RendezvousUsageError(
                f"{how} {rdzv.port} is already in use on this host; choose a free "
                "port or leave --master-port out to get one"
            )
        return rdzv

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

    def next_round(self) -> Assignment:
        """This node's assignment: the same every round, but for the restart count."""
        plan = self.plan
        return Assignment(
            group_rank=plan.node_rank,
            group_world_size=plan.nnodes,
            base_rank=plan.node_rank * plan.nproc,
            world_size=plan.world_size,
            master_addr=plan.master_addr,
            master_port=self.port,
            restart_count=self._restarts,
        )

    def watch(self, interval: float, on_change: Callable[[RoundChange], None]) -> RoundWatch:
        """A static round never changes on its own: nothing to watch."""
        return NoWatch()

    def count_failure(self, record: FailureRecord) -> FailureCount:
        """Counts the failure against this node's budget."""
        self._restarts += 1
        return FailureCount(self._restarts, "node", record.summary)

    def membership_changing(self) -> bool:
        """Never: the node count is fixed."""
        return False

    def replace_master_port(self) -> tuple[int, int] | None:
        """A new port when this launcher chose the port alone (one node, no flag)."""
        if not self.auto_port or self.plan.nnodes != 1:
            return None
        old = self.port
        release_port(old)
        self._port = self._choose_port(old)
        return old, self._port

    def close_job(self, why: str) -> None:
        """Nothing to tell: static nodes share no store."""

    def can_leave(self) -> bool:
        """False: a static job has a fixed set of nodes."""
        return False

    def leave(self, why: str) -> None:
        """Nothing to leave: the other nodes' ranks lose their peers and fail."""

    def closing_reason(self) -> str | None:
        """None: no node can close a static job for the others."""
        return None

    def job_board(self, period: float) -> JobBoard | None:
        """None: static nodes share no store, each judges its own ranks."""
        return None

    def exit_barrier(self) -> None:
        """Nothing to wait for: each static node ends on its own."""

    def close(self) -> None:
        """Releases an automatically chosen port."""
        if self.auto_port and self._port is not None:
            release_port(self._port)
