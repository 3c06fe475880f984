"""torch elastic's c10d rendezvous (``--rdzv-backend c10d``), with a job-wide restart budget.

:class:`C10dRendezvous` wraps torch.distributed.elastic's own c10d rendezvous (the
TCPStore-backed ``DynamicRendezvousHandler`` torchrun uses), not a re-implementation:
nodes join in any order, ``--nnodes MIN:MAX`` admits late nodes, node ranks come from
the rendezvous. On top of it, the job shares, in the rendezvous store:

- a job-wide restart count (``--max-restarts`` is a budget for the whole job, not per
  node as in torchrun, pytorch issue 108158): the first node to report a failed round
  counts it, once;
- each node's failure record of the round, so that every node's report names the node
  and rank that failed first;
- a closing record when the budget is spent, which stops the other nodes at once.

:func:`connect_c10d` makes torch's handler from the plan; tests give the class a fake
handler and store instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from dist_launch.plan.launch_plan import LaunchPlan
from dist_launch.rendezvous.failure_ledger import count_round_failure, round_failures
from dist_launch.rendezvous.job_board import JobBoard
from dist_launch.rendezvous.launcher_heartbeat import Heartbeat, Pulse
from dist_launch.rendezvous.membership_watch import MembershipWatch
from dist_launch.rendezvous.node_barrier import every_node
from dist_launch.rendezvous.protocol import (
    Assignment,
    FailureCount,
    FailureRecord,
    RoundChange,
    RoundWatch,
)
from dist_launch.rendezvous.store_deadline import BoundedStore, RendezvousStore, StoreDeadline

logger = logging.getLogger(__name__)

# torch elastic's own default; a node that finished waits this long for the others.
EXIT_BARRIER_SECONDS = 300.0
# How long a node waits at exit for the others to have read how the job ended.
ENDED_WAIT_SECONDS = 15.0
# How long a node whose failure is a consequence (its ranks lost, or wait on, a peer)
# waits for another node's record of the cause before it describes the round's failure.
# Nodes that see one hang find it within a progress period of each other; a node whose
# rank failed reports once its other ranks are stopped.
CAUSE_WAIT_SECONDS = 5.0
# How long a leaving node may take to take itself out of torch's rendezvous state.
LEAVE_SECONDS = 10.0
# How much longer than torch's read_timeout connecting to the store may take.
CONNECT_SLACK_SECONDS = 10.0
# What bounds closing torch's rendezvous (it waits up to close_timeout itself).
CLOSING_DEADLINE = "close_timeout + read_timeout"


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


def connect_c10d(plan: LaunchPlan) -> C10dRendezvous:
    """Joins torch's c10d rendezvous of ``plan`` (serving its store when this host is it).

    Reads no variable itself; sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the
    launcher's own environment so that rank 0's worker hosts the workers' store (as
    with ``env://``) instead of the agent, whose store outlives the workers.

    Connecting may wait for the endpoint's node (torch's ``read_timeout``, and
    :data:`CONNECT_SLACK_SECONDS` more at most).

    Raises:
        ConnectionError: The store cannot be reached or served; the message names the
            endpoint and torch's error.
    """
    timeouts = plan.rdzv_timeouts
    connecting = StoreDeadline(plan.rdzv_endpoint, timeouts.read)
    try:
        # torch retries a refused connection for read_timeout itself, with a clearer
        # error than ours: the deadline only ends a connection that stays silent.
        handler = connecting.run(
            "the connection",
            lambda: _torch_handler(plan),
            timeouts.read + CONNECT_SLACK_SECONDS,
            f"read_timeout + {CONNECT_SLACK_SECONDS:g} s",
        )
        return C10dRendezvous(plan, handler)
    except Exception as error:
        raise ConnectionError(
            f"cannot reach the rendezvous at {plan.rdzv_endpoint}: {error}"
        ) from error


def _torch_handler(plan: LaunchPlan) -> Any:
    """The c10d ``RendezvousHandler`` of torch elastic for ``plan``."""
    from torch.distributed.elastic.rendezvous import (  # noqa: PLC0415 - torch only for c10d
        RendezvousParameters,
    )
    from torch.distributed.elastic.rendezvous.registry import (  # noqa: PLC0415
        get_rendezvous_handler,
    )

    host, port = c10d_host_and_port(plan.rdzv_endpoint)
    conf: dict[str, Any] = dict(plan.rdzv_conf)
    # torch decides who serves the store by host name; inside network namespaces
    # and on multi-homed hosts an address bound here is the better test.
    guessed = "is_host" not in conf
    if guessed:
        conf["is_host"] = "1" if is_local_address(host) else "0"
    local_addr = plan.local_addr or route_address(host, port) or socket.getfqdn()
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"

    def handler_for(conf: dict[str, Any]) -> Any:
        params = RendezvousParameters(
            backend="c10d",
            endpoint=f"{host}:{port}",
            run_id=plan.rdzv_id,
            min_nodes=plan.min_nodes,
            max_nodes=plan.max_nodes,
            local_addr=local_addr,
            **conf,
        )
        return get_rendezvous_handler(params)

    try:
        handler = handler_for(conf)
    except Exception:
        if not (guessed and conf["is_host"] == "1"):
            raise
        # Another agent on this host serves the store already: join it as a client.
        handler = handler_for({**conf, "is_host": "0"})
    return handler


class C10dRendezvous:
    """The :class:`~dist_launch.rendezvous.protocol.Rendezvous` of an elastic job.

    Every call to the store, and to torch's handler (which calls the store), has a
    deadline (:mod:`dist_launch.rendezvous.store_deadline`): torch's ``read_timeout``
    for one operation, the round's join and last call for :meth:`next_round`, the
    close timeout for closing. A store that stops answering ends each of them with a
    :class:`~dist_launch.rendezvous.store_deadline.StoreDeadlineError` naming its
    address.

    Args:
        plan: The launch plan; reads no environment variable.
        handler: torch elastic's ``RendezvousHandler`` (:func:`connect_c10d`), or a
            fake with the same methods.
    """

    def __init__(self, plan: LaunchPlan, handler: Any) -> None:
        self.plan = plan
        self.handler = handler
        self.timeouts = plan.rdzv_timeouts
        self.deadline = StoreDeadline(plan.rdzv_endpoint, self.timeouts.read)
        self._round_store: RendezvousStore | None = None
        self._job_store: RendezvousStore | None = None
        self.assignment: Assignment | None = None
        self._prefix = f"dist_launch/{plan.rdzv_id}/"
        self._rounds = 0
        self.cause_wait_seconds = CAUSE_WAIT_SECONDS
        self._left = False  # this node left the job (preempted): close() closes nothing
        # This launcher's heartbeat in the round's store, and its view of the others':
        # a node that died reports nothing, and torch's keep-alive notices it only after
        # keep_alive_interval x keep_alive_max_attempt (15 s by default).
        self._heartbeat: Heartbeat | None = None
        self._pulse: Pulse | None = None

    # -- rounds -----------------------------------------------------------------------

    def next_round(self) -> Assignment:
        """Joins the next round; returns this node's ranks in it.

        Raises:
            torch's RendezvousClosedError: The job was closed (its budget spent, or a
                node stopped it).
            torch's RendezvousTimeoutError: Too few nodes joined within join_timeout.
            StoreDeadlineError: The store stopped answering.
        """
        info = self.deadline.run(
            "joining the next round",
            self.handler.next_rendezvous,
            self.timeouts.round_forms_within + self.timeouts.read,
            "join_timeout + last_call_timeout + read_timeout",
        )
        store = BoundedStore(info.store, self.deadline)
        self._round_store = store
        self._stop_heartbeat()
        self._heartbeat, self._pulse = Heartbeat(store, info.rank), None
        # torch hands out the round's PrefixStore; the job's counters live beneath it.
        job_store = BoundedStore(getattr(info.store, "underlying_store", info.store), self.deadline)
        self._job_store = job_store
        group_rank, nodes = info.rank, info.world_size
        counts = self._worker_counts(store, info)
        bootstrap = info.bootstrap_store_info
        assert bootstrap is not None
        restarts = int(job_store.add(self._prefix + "restarts", 0))
        assignment = Assignment(
            group_rank=group_rank,
            group_world_size=nodes,
            base_rank=sum(counts[:group_rank]),
            world_size=sum(counts),
            master_addr=bootstrap.master_addr,
            master_port=bootstrap.master_port,
            restart_count=restarts,
        )
        self.assignment = assignment
        logger.info(
            "round %d: node %d of %d, ranks %d-%d of %d, master %s:%d, restarts %d of %d",
            self._rounds,
            assignment.group_rank,
            assignment.group_world_size,
            assignment.base_rank,
            assignment.base_rank + self.plan.nproc - 1,
            assignment.world_size,
            assignment.master_addr,
            assignment.master_port,
            restarts,
            self.plan.max_restarts,
        )
        self._rounds += 1
        return assignment

    def _worker_counts(self, store: RendezvousStore, info: Any) -> list[int]:
        """Each node's worker count in the round ``info`` formed: each shares its own."""
        store.set(f"dist_launch/nproc/{info.rank}", str(self.plan.nproc))
        keys = [f"dist_launch/nproc/{rank}" for rank in range(info.world_size)]
        return [int(value) for value in store.multi_get(keys)]

    def watch(self, interval: float, on_change: Callable[[RoundChange], None]) -> RoundWatch:
        """Polls for closing, waiting or lost nodes and an unreachable store."""
        return MembershipWatch(self, interval, on_change, self.keep_alive_interval)

    def membership_changing(self) -> bool:
        """True when nodes wait to join, left or were lost (False when the store is silent)."""
        try:
            return self.nodes_left() > 0 or self.nodes_waiting() > 0 or self.lost_nodes() > 0
        except Exception:
            return False

    def nodes_left(self) -> int:
        """Nodes of the current round that left the job (:meth:`leave`)."""
        if self._round_store is None:
            return 0
        return int(self._round_store.add("dist_launch/left", 0))

    def replace_master_port(self) -> tuple[int, int] | None:
        """None: torch's rendezvous chose the master port, not this launcher."""
        return None

    def lost_store(self, error: Exception, since: float) -> str:
        """Names the node that served the store, when it stopped answering, and the way out.

        ``node0 (10.0.0.1:29400), which served the rendezvous, stopped answering at
        12:00:03 (...); a job survives the loss of any node with --rdzv-backend etcd``.
        """
        host, port = c10d_host_and_port(self.plan.rdzv_endpoint)
        address = host
        with contextlib.suppress(OSError):
            address = socket.gethostbyname(host)
        where = host if address == host else f"{host} ({address}:{port})"
        at = time.strftime("%H:%M:%S", time.localtime(since))
        return (
            f"{where}, which served the rendezvous, stopped answering at {at} ({error}); "
            "a job survives the loss of any node with --rdzv-backend etcd"
        )

    def nodes_waiting(self) -> int:
        """Nodes waiting to join a next round (late or restarted ones)."""
        return int(self.deadline.run("num_nodes_waiting", self.handler.num_nodes_waiting))

    def nodes_finished(self) -> int:
        """Nodes of the current round whose workers all succeeded (in the exit barrier)."""
        if self._round_store is None:
            return 0
        return int(self._round_store.add("dist_launch/succeeded", 0))

    @property
    def keep_alive_interval(self) -> float:
        """Seconds between torch's heartbeats (``--rdzv-conf keep_alive_interval``, 5)."""
        return self.timeouts.keep_alive_interval

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
        return bool(self.deadline.run("is_closed", self.handler.is_closed))

    # -- failures ---------------------------------------------------------------------

    def count_failure(self, record: FailureRecord) -> FailureCount:
        """Shares this node's failure and counts the round once, job-wide.

        A record that is a consequence (see :class:`FailureRecord`) waits up to
        ``cause_wait_seconds`` for another node's record of the cause, so that every
        node's log names the same first failure.

        Raises:
            StoreDeadlineError: The store did not answer a call within
                ``read_timeout``; names the store's address.
            Exception: torch's store errors (the store's node is gone).
        """
        assert self._round_store is not None and self._job_store is not None
        assert self.assignment is not None
        return count_round_failure(
            record,
            self._round_store,
            (self._job_store, self._prefix + "restarts"),
            self.assignment.group_world_size,
            (self.timeouts.read, self.cause_wait_seconds),
            self._gone,
        )

    def _gone(self) -> set[int]:
        """The round's other nodes whose launchers stopped beating or were found cut off."""
        store, assignment = self._round_store, self.assignment
        if store is None or assignment is None:
            return set()
        if self._pulse is None:
            others = [n for n in range(assignment.group_world_size) if n != assignment.group_rank]
            self._pulse = Pulse(store, others)
        return self._pulse.gone_or_cut_off(store)

    def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None

    def failures(self) -> list[FailureRecord]:
        """The failure records of the current round: causes first, then earliest."""
        if self._round_store is None or self.assignment is None:
            return []
        return round_failures(self._round_store, self.assignment.group_world_size)

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
            self.deadline.run(
                "set_closed", self.handler.set_closed, self._closing_seconds, CLOSING_DEADLINE
            )

    @property
    def _closing_seconds(self) -> float:
        """The deadline of closing torch's rendezvous: its close timeout, then a read."""
        return self.timeouts.close + self.timeouts.read

    def can_leave(self) -> bool:
        """True when the job is elastic and its round keeps ``MIN`` nodes without this one."""
        assignment = self.assignment
        return (
            self.plan.min_nodes < self.plan.max_nodes
            and assignment is not None
            and assignment.group_world_size - 1 >= self.plan.min_nodes
        )

    def leave(self, why: str) -> None:
        """Takes this node out of torch's rendezvous at once, closing nothing.

        torch's own exit operation (the one a node runs before it joins the next round)
        removes it from the round's participants, so the others' membership watch sees
        it gone within its interval instead of after the keep-alive
        (``keep_alive_interval * keep_alive_max_attempt``); its heartbeats stop. The
        others re-form without it and count nothing. Where torch's private API moved,
        the keep-alive drops the node all the same, later.
        """
        self._left = True
        logger.info("leaving the job: %s", why)
        if self._round_store is not None:
            # First, in one store call: the others may look before torch's exit is done.
            with contextlib.suppress(Exception):
                self._round_store.add("dist_launch/left", 1)
        try:
            self._exit_rendezvous()
        except Exception as error:
            logger.warning(
                "could not take this node out of the rendezvous (%s: %s): the other nodes "
                "drop it once its heartbeats are missed",
                type(error).__name__,
                error,
            )

    def _exit_rendezvous(self) -> None:
        """Torch's exit operation: takes this node out of the round's participants."""
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: PLC0415
            _RendezvousExitOp,
        )

        self.handler._stop_heartbeats()
        self.handler._op_executor.run(_RendezvousExitOp(), time.monotonic() + LEAVE_SECONDS)

    def closing_reason(self) -> str | None:
        """What the node that closed the job said, if it said anything."""
        if self._job_store is None:
            return None
        key = self._prefix + "closed"
        with contextlib.suppress(Exception):
            if self._job_store.check([key]):
                return bytes(self._job_store.get(key)).decode(errors="replace")
        return None

    def job_board(self, period: float) -> JobBoard | None:
        """The round's job board in its store; None for a round of one node."""
        assignment = self.assignment
        if self._round_store is None or assignment is None or assignment.group_world_size < 2:
            return None
        return JobBoard(
            self._round_store, assignment.group_rank, assignment.group_world_size, period
        )

    # -- the end ----------------------------------------------------------------------

    def exit_barrier(self) -> None:
        """After success, waits (bounded) until every node of the round finished.

        The node serving the rendezvous store must outlive the others' last use of it.
        """
        waited = self._every_node("succeeded", EXIT_BARRIER_SECONDS)
        if waited is not None:
            logger.warning("not every node finished within %.0f s of this one (%s)", *waited)

    def close(self) -> None:
        """Says this node has ended, waits (bounded) for the others, stops heartbeats.

        Called once the node's report is out. The node that serves the rendezvous store
        takes it away when its process exits; if it ended first (its own rank failed
        on every attempt), the other nodes could no longer read why the job ended. So
        every node of the last round marks its end and waits until all have, at most
        :data:`ENDED_WAIT_SECONDS`; a node whose store is already gone stops waiting at
        once.
        """
        if self._left:
            self._stop_heartbeat()
            # torch's shutdown() would close the rendezvous for the nodes that go on.
            with contextlib.suppress(Exception):
                self.handler._stop_heartbeats()
            return
        waited = self._every_node("ended", ENDED_WAIT_SECONDS)
        self._stop_heartbeat()
        if waited is not None:
            logger.info("not every node had ended %.1f s after this one (%s)", *waited)
        with contextlib.suppress(Exception):
            self.deadline.run(
                "shutdown", self.handler.shutdown, self._closing_seconds, CLOSING_DEADLINE
            )

    def _every_node(self, event: str, seconds: float) -> tuple[float, Exception] | None:
        """Counts ``event`` for this node; waits until every node of the round has.

        Returns:
            None once all have, else how long this node waited and why it stopped (a
            node never came, or the store is gone); None too without a round.
        """
        store, assignment = self._round_store, self.assignment
        if store is None or assignment is None:
            return None
        return every_node(
            store,
            event,
            assignment.group_world_size,
            seconds,
            node=assignment.group_rank,
            gone=self._gone,
        )
