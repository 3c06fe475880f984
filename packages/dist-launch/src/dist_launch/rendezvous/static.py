"""Static rendezvous (``--rdzv-backend static``): every node is told its place.

The node rank, the master's address and the node count come from the plan, and the
master port from the plan or, on one node, from :func:`dist_core.get_unused_port`.

One node needs no torch (the launcher stays fast to start) and no store: restarts are
counted for the node, as torchrun counts them.

Several nodes share the launchers' store that node 0 serves beside the master port
(:mod:`dist_launch.rendezvous.launchers_store`), as the c10d rendezvous shares its
round's store: a failed round's records and one job-wide restart count
(:mod:`dist_launch.rendezvous.failure_ledger`), the closing reason, the job board, and
a barrier at the start of each round, so that no node starts a round's workers while
another's workers of the round before still run. While the workers run, each node
polls the store every ``--monitor-interval``: a node that counted a failed round
within ``--max-restarts`` restarts every node's workers; one that closed the job (its
budget spent, a deterministic failure, a stopping signal, ``--timeout``) ends every
node's run, each naming the same first failure. A node that cannot reach the store
stops (``rendezvous_failed``), naming node 0.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from dist_core.ports import DEFAULT_PORT, get_unused_port, port_is_free, release_port
from dist_launch.plan.launch_plan import LaunchPlan
from dist_launch.rendezvous.c10d import (
    CAUSE_WAIT_SECONDS,
    ENDED_WAIT_SECONDS,
    EXIT_BARRIER_SECONDS,
)
from dist_launch.rendezvous.failure_ledger import count_round_failure
from dist_launch.rendezvous.job_board import JobBoard
from dist_launch.rendezvous.launcher_heartbeat import Heartbeat, Pulse
from dist_launch.rendezvous.launchers_store import (
    PrefixedStore,
    launchers_store_port,
    open_launchers_store,
)
from dist_launch.rendezvous.node_barrier import every_node
from dist_launch.rendezvous.polling_watch import PollingWatch
from dist_launch.rendezvous.protocol import (
    Assignment,
    FailureCount,
    FailureRecord,
    NoWatch,
    RendezvousUsageError,
    RoundChange,
    RoundWatch,
)
from dist_launch.rendezvous.store_deadline import BoundedStore, RendezvousStore, StoreDeadline

logger = logging.getLogger(__name__)

# The launchers' keys, beneath which each round has its own.
STORE_PREFIX = "dist_launch/static/"
# How often a node waiting for the others at the start of a round looks.
JOIN_POLL_SECONDS = 0.05


@dataclass(frozen=True)
class SharedStore:
    """The launchers' store of a multi-node static job, and its calls' deadlines."""

    store: RendezvousStore
    deadline: StoreDeadline

    def view(self, prefix: str) -> BoundedStore:
        """The keys beneath ``prefix``, every call bounded."""
        return BoundedStore(PrefixedStore(self.store, STORE_PREFIX + prefix), self.deadline)


class StaticRendezvous:
    """The :class:`~dist_launch.rendezvous.protocol.Rendezvous` of a static job.

    Args:
        plan: The launch plan; reads no environment variable.
        shared: The launchers' store of a multi-node job (:meth:`open` connects it);
            None: this node counts its own restarts and shares nothing.
    """

    def __init__(self, plan: LaunchPlan, shared: SharedStore | None = None) -> None:
        self.plan = plan
        self.auto_port = plan.master_port is None
        self._port: int | None = None
        self._restarts = 0
        self.shared = shared
        self._job_store = None if shared is None else shared.view("")
        self._round_store: BoundedStore | None = None
        self._rounds = 0
        self.cause_wait_seconds = CAUSE_WAIT_SECONDS
        self._heartbeat = (
            None if self._job_store is None else Heartbeat(self._job_store, plan.node_rank)
        )
        # The other launchers' heartbeats, followed from the first failure on: the wait
        # for a failure's cause and node 0's wait at the end share what it saw.
        self._pulse: Pulse | None = None

    def _gone(self) -> set[int]:
        """The other nodes whose launchers stopped beating or were found cut off."""
        assert self._job_store is not None
        if self._pulse is None:
            others = [n for n in range(self.plan.nnodes) if n != self.plan.node_rank]
            self._pulse = Pulse(self._job_store, others)
        return self._pulse.gone_or_cut_off(self._round_store)

    @classmethod
    def open(cls, plan: LaunchPlan) -> StaticRendezvous:
        """The rendezvous, its master port chosen and, on node 0, checked free.

        With several nodes, node 0 serves the launchers' store and the others connect
        to it, waiting up to ``join_timeout`` for node 0; this imports torch.

        Raises:
            RendezvousUsageError: Node 0's master port, or the launchers' store port, is
                taken on this host, or ``--rdzv-conf store_port`` is not a port.
            ConnectionError: Node 0's launchers' store could not be reached in time.
        """
        rdzv = cls(plan)
        if plan.node_rank == 0 and not port_is_free(rdzv.port):
            how = "the default master port" if rdzv.auto_port else "--master-port"
            rdzv.close()
            raise RendezvousUsageError(
                f"{how} {rdzv.port} is already in use on this host; choose a free "
                "port or leave --master-port out to get one"
            )
        if plan.nnodes == 1:
            return rdzv
        port = launchers_store_port(plan, rdzv.port)
        deadline = StoreDeadline(f"{plan.master_addr}:{port}", plan.rdzv_timeouts.read)
        store = open_launchers_store(plan, port, deadline)
        return cls(plan, SharedStore(store, deadline))

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
        """This node's assignment: the same every round, but for the restart count.

        With several nodes, first waits (up to ``join_timeout``) until every node has
        joined the round: their workers of the round before are stopped by then.

        Raises:
            RuntimeError: A node closed the job meanwhile.
            TimeoutError: Not every node joined in time; names the missing ones.
            StoreDeadlineError: The launchers' store stopped answering.
        """
        plan = self.plan
        if self._job_store is not None:
            self._restarts = self._join_all()
        return Assignment(
            group_rank=plan.node_rank,
            group_world_size=plan.nnodes,
            base_rank=plan.node_rank * plan.nproc,
            world_size=plan.world_size,
            master_addr=plan.master_addr,
            master_port=self.port,
            restart_count=self._restarts,
        )

    def _join_all(self) -> int:
        """Joins the next round with every node; the job's restart count."""
        assert self.shared is not None and self._job_store is not None
        plan, job = self.plan, self._job_store
        round_store = self.shared.view(f"round/{self._rounds}/")
        self._round_store = round_store
        self._rounds += 1
        round_store.set(f"dist_launch/joined/{plan.node_rank}", "1")
        if int(round_store.add("dist_launch/joined", 1)) >= plan.nnodes:
            round_store.set("dist_launch/all_joined", "1")
        join = plan.rdzv_timeouts.join
        deadline = time.monotonic() + join
        while not round_store.check(["dist_launch/all_joined"]):
            if job.check(["closed"]):
                raise RuntimeError(f"the job was closed: {self.closing_reason()}")
            if time.monotonic() >= deadline:
                missing = [
                    str(node)
                    for node in range(plan.nnodes)
                    if not round_store.check([f"dist_launch/joined/{node}"])
                ]
                raise TimeoutError(
                    f"node(s) {', '.join(missing)} did not join round {self._rounds - 1} "
                    f"within join_timeout ({join:g} s)"
                )
            time.sleep(JOIN_POLL_SECONDS)
        return int(job.add("restarts", 0))

    def watch(self, interval: float, on_change: Callable[[RoundChange], None]) -> RoundWatch:
        """With several nodes, polls the launchers' store for the round's end; else none."""
        if self._job_store is None:
            return NoWatch()
        return PollingWatch(self._round_change, interval, on_change)

    def _round_change(self) -> RoundChange | None:
        """Why this round ends although no rank here failed: see the module docstring."""
        job, round_store = self._job_store, self._round_store
        assert job is not None and round_store is not None
        try:
            if job.check(["closed"]):
                return RoundChange("closed")
            if not round_store.check(["dist_launch/counted"]):
                return None
            total = int(round_store.get("dist_launch/counted"))
        except Exception as error:  # torch's store errors vary
            return RoundChange("unreachable", self.lost_store(error, time.time()))
        if total > self.plan.max_restarts:
            return None  # the counting node closes the job: its reason comes next
        return RoundChange(
            "membership",
            f"another node's round failed (restart {total} of {self.plan.max_restarts}, job-wide)",
        )

    def lost_store(self, error: Exception, since: float) -> str:
        """Names node 0, which serves the launchers' store, and when it stopped answering."""
        assert self.shared is not None
        at = time.strftime("%H:%M:%S", time.localtime(since))
        return (
            f"node 0 ({self.shared.deadline.address}), which serves the launchers' store, "
            f"stopped answering at {at} ({error})"
        )

    def count_failure(self, record: FailureRecord) -> FailureCount:
        """Counts the failure: job-wide with several nodes (shared), else this node's.

        Raises:
            StoreDeadlineError: The launchers' store did not answer in time.
            Exception: torch's store errors (node 0 is gone).
        """
        if self._round_store is None or self._job_store is None:
            self._restarts += 1
            return FailureCount(self._restarts, "node", record.summary)
        return count_round_failure(
            record,
            self._round_store,
            (self._job_store, "restarts"),
            self.plan.nnodes,
            (self.plan.rdzv_timeouts.read, self.cause_wait_seconds),
            self._gone,
        )

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
        """Stops every node, saying ``why`` (with several nodes); never raises."""
        if self._job_store is not None:
            with contextlib.suppress(Exception):
                self._job_store.set("closed", why)
        if self._round_store is not None:
            # Wakes nodes already waiting in the exit barrier.
            with contextlib.suppress(Exception):
                self._round_store.set("dist_launch/all_succeeded", "closed")

    def can_leave(self) -> bool:
        """False: a static job has a fixed set of nodes."""
        return False

    def leave(self, why: str) -> None:
        """Nothing to leave: the other nodes' ranks lose their peers and fail."""

    def closing_reason(self) -> str | None:
        """What the node that closed the job said (several nodes), if one did."""
        if self._job_store is None:
            return None
        with contextlib.suppress(Exception):
            if self._job_store.check(["closed"]):
                return bytes(self._job_store.get("closed")).decode(errors="replace")
        return None

    def job_board(self, period: float) -> JobBoard | None:
        """The round's job board in the launchers' store; None for one node."""
        if self._round_store is None:
            return None
        return JobBoard(self._round_store, self.plan.node_rank, self.plan.nnodes, period)

    def exit_barrier(self) -> None:
        """After success, waits (bounded) until every node finished (several nodes).

        Node 0 serves the launchers' store: it must outlive the others' last use of it.
        """
        if self._round_store is None:
            return
        waited = every_node(self._round_store, "succeeded", self.plan.nnodes, EXIT_BARRIER_SECONDS)
        if waited is not None:
            logger.warning("not every node finished within %.0f s of this one (%s)", *waited)

    def close(self) -> None:
        """Says this node has ended (node 0: waits, bounded, for the others); releases the port.

        With several nodes, node 0 takes the launchers' store away when it exits: every
        node marks its end, and node 0 waits until every other node has ended or its
        launcher's heartbeat stopped, at most ``ENDED_WAIT_SECONDS``, so that the
        others can still read why the job ended. The other nodes serve nothing and do
        not wait.
        """
        if self._round_store is not None:
            with contextlib.suppress(Exception):
                self._round_store.set(f"dist_launch/ended/{self.plan.node_rank}", "1")
            if self.plan.node_rank == 0:
                self._wait_for_the_others_to_end(self._round_store)
            self._round_store = None
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self.auto_port and self._port is not None:
            release_port(self._port)

    def _wait_for_the_others_to_end(self, store: BoundedStore) -> None:
        """Until every other node ended or stopped beating (bounded); never raises."""
        assert self._job_store is not None
        pending = set(range(1, self.plan.nnodes))
        started = time.monotonic()
        try:
            while True:
                pending = {n for n in pending if not store.check([f"dist_launch/ended/{n}"])}
                gone = self._gone()
                if pending <= gone:
                    break
                if time.monotonic() - started >= ENDED_WAIT_SECONDS:
                    logger.info(
                        "node(s) %s had not ended %.0f s after this one",
                        sorted(pending),
                        ENDED_WAIT_SECONDS,
                    )
                    return
                time.sleep(JOIN_POLL_SECONDS)
        except Exception as error:  # torch raises several kinds
            logger.info("could not wait for the other nodes to end: %s", error)
            return
        if pending:
            logger.info("node(s) %s stopped beating before they ended", sorted(pending))
