"""One round's cut watch: tells, from the job board's heartbeats, which nodes are cut off.

Looked at from the supervisor's loop (a timer, as the hang watch is). It reads when the
round's store last answered this node and each other node's latest heartbeat, and asks
:mod:`dist_launch.watch.partition` which nodes this node cannot reach and whether its
side may go on. A side that may not (it cannot reach the store) is *fenced* once:
``on_fence`` gets why, and the round stops its workers at once and ends as
``INFRASTRUCTURE`` (137). The other side goes on: its hang watch or torch's keep-alive
ends the round, and its reports name the unreachable nodes (:meth:`CutWatch.unreachable`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable

from dist_launch.plan.launch_plan import LaunchPlan
from dist_launch.rendezvous.c10d import route_address
from dist_launch.rendezvous.factory import store_stall_seconds
from dist_launch.rendezvous.job_board import JobBoard
from dist_launch.rendezvous.protocol import Assignment
from dist_launch.watch.partition import PeerNode, Unreachable, decide_side, unreachable_nodes

logger = logging.getLogger(__name__)

# Seconds between two looks: the board exchanges every look period of the hang watch.
LOOK_SECONDS = 0.5
# The least store silence that fences a node: a loaded host's board may lag a second or two.
MIN_SILENCE_SECONDS = 5.0
# At a hang (no rank progressed for --hang-timeout), a heartbeat this old marks a cut:
# six exchanges missed while every other beat is fresh.
HANG_SILENCE_SECONDS = 3.0


class CutWatch:
    """The cut watch of one round on this node.

    Args:
        board: The round's job board.
        seen_from: How the reports name this node (its host name).
        node_ranks: Every node's global ranks, by node (the round's assignment).
        silent_after: Seconds of silence that make a node (or the store) unreachable.
        on_fence: Called once, on the loop, with the fencing message.
        store_node: How the messages name the store's node, when the store is silent.
        stall_seconds: How long a healthy store may leave a node without an answer
            (etcd electing a leader): added to the silence that fences at a hang too.
    """

    def __init__(
        self,
        board: JobBoard,
        seen_from: str,
        node_ranks: dict[int, tuple[int, ...]],
        silent_after: float,
        on_fence: Callable[[str], None],
        store_node: Callable[[float], str],
        stall_seconds: float = 0.0,
    ) -> None:
        self.board = board
        self.stall_seconds = stall_seconds
        self.seen_from = seen_from
        self.node_ranks = node_ranks
        self.silent_after = silent_after
        self._on_fence = on_fence
        self._store_node = store_node
        self.fenced: str | None = None
        self._started = time.time()

    def peers(self) -> list[PeerNode]:
        """The other nodes, as their heartbeats introduced them (node rank when not yet)."""
        whos = self.board.introductions()
        found = []
        for node, ranks in sorted(self.node_ranks.items()):
            if node == self.board.node:
                continue
            who = whos.get(node, {})
            said = who.get("ranks")
            if isinstance(said, list):
                ranks = tuple(int(rank) for rank in said)
            host, address = str(who.get("host", f"node {node}")), str(who.get("address", ""))
            found.append(PeerNode(node, host, address, ranks))
        return found

    def unreachable(
        self, now: float | None = None, silent_after: float | None = None
    ) -> list[Unreachable]:
        """The other nodes this node cannot reach now.

        Args:
            now: The wall clock; now when None.
            silent_after: The silence that counts; the watch's own bound when None.
        """
        return unreachable_nodes(
            self.peers(),
            self.board.heartbeats(),
            self._store_answered_at(),
            now=time.time() if now is None else now,
            silent_after=self.silent_after if silent_after is None else silent_after,
            seen_from=self.seen_from,
            listening_since=self._started,
        )

    def at_hang(self) -> list[Unreachable]:
        """At a hang, the nodes cut off from this one; fences this side if the store is.

        The bound is shorter than the watch's own: the ranks are quiet already.
        """
        lost = self.unreachable(silent_after=HANG_SILENCE_SECONDS)
        if time.time() - self._store_answered_at() > HANG_SILENCE_SECONDS + self.stall_seconds:
            self._fence(
                self._store_answered_at(), lost, "this node cannot reach the rendezvous store"
            )
        else:
            self.board.mark_unreachable([node.peer.node for node in lost])
        return lost

    def _store_answered_at(self) -> float:
        answered = self.board.store_answered_at
        return self._started if answered is None else answered

    def due(self, now: float) -> float | None:
        """The loop's timer: fences this side once it cannot reach the store."""
        if self.fenced is not None:
            return None
        wall = time.time()
        silent_since = self._store_answered_at()
        store_reachable = wall - silent_since <= self.silent_after
        lost = self.unreachable(wall)
        decision = decide_side(
            has_store=True,
            store_reachable=store_reachable,
            reachable_nodes=1 + len(self.node_ranks) - 1 - len(lost),
            round_nodes=len(self.node_ranks),
        )
        if decision.side == "go_on":
            return now + LOOK_SECONDS
        self._fence(silent_since, lost, decision.why)
        return None

    def _fence(self, silent_since: float, lost: list[Unreachable], why: str) -> None:
        if self.fenced is not None:
            return
        self.fenced = (
            f"{why}: {self._store_node(silent_since)}; this node stops its workers "
            "(fenced off: the side that reaches the store may go on)"
            + "".join(f"\n  {u.describe()}" for u in lost)
        )
        self.board.fence(why)
        logger.warning("%s", self.fenced)
        self._on_fence(self.fenced)


def silence_bound(
    hang_seconds: float | None, node_dead_after: float, stall_seconds: float = 0.0
) -> float:
    """Seconds of store silence that fence a node: torch's keep-alive bound, or less.

    A node's peers drop it after ``keep_alive_interval * keep_alive_max_attempt`` of
    missed heartbeats; a node that has heard nothing from the store for as long is cut
    off. With a fixed ``--hang-timeout`` shorter than that, the hang timeout bounds it,
    so that a cut-off node ends as soon as its peers' hang report does.

    Args:
        hang_seconds: ``--hang-timeout`` when fixed, else None.
        node_dead_after: torch's keep-alive bound.
        stall_seconds: How long a store that is healthy may leave a node without an
            answer (etcd electing a new leader), added on top.
    """
    bound = node_dead_after if hang_seconds is None else min(hang_seconds, node_dead_after)
    return max(MIN_SILENCE_SECONDS, bound) + stall_seconds


def fencing_bound(plan: LaunchPlan) -> float:
    """:func:`silence_bound` for ``plan``: its fixed ``--hang-timeout``, keep-alive and store."""
    policy = plan.hang_policy
    hang_seconds = policy.seconds if policy.mode == "fixed" else None
    stall_seconds = store_stall_seconds(plan)
    return silence_bound(hang_seconds, plan.rdzv_timeouts.node_dead_after, stall_seconds)


def node_ranks(base_rank: int, nproc: int, nodes: int, own: int) -> dict[int, tuple[int, ...]]:
    """Every node's global ranks, as the round's assignment gives them.

    Nodes run as many ranks each as this one (torchrun's ``--nproc-per-node`` is one
    value for the job); a node's heartbeat corrects it where that is not so.
    """
    first = base_rank - own * nproc
    return {
        node: tuple(range(first + node * nproc, first + (node + 1) * nproc))
        for node in range(nodes)
    }


def start_cut_watch(
    board: JobBoard,
    plan: LaunchPlan,
    assignment: Assignment,
    hostname: str,
    on_fence: Callable[[str], None],
    rdzv: object,
) -> CutWatch:
    """The round's cut watch, this node introduced on the board.

    Args:
        board: The round's job board.
        plan: The launch plan (``--hang-timeout``, ``--rdzv-conf``'s keep-alive).
        assignment: This node's place in the round.
        hostname: This node's host name.
        on_fence: Called once, on the loop, when this side is fenced.
        rdzv: The rendezvous; its ``lost_store(error, since)``, where it has one,
            names the store's node in the fencing message.
    """
    address = route_address(assignment.master_addr, assignment.master_port) or ""
    if address.startswith("127.") or address == "::1":
        with contextlib.suppress(OSError):
            address = socket.gethostbyname(hostname)
    ranks = list(range(assignment.base_rank, assignment.base_rank + plan.nproc))
    board.introduce({"host": hostname, "address": address, "ranks": ranks})
    lost_store = getattr(rdzv, "lost_store", None)

    def store_node(since: float) -> str:
        silent = TimeoutError(f"no answer for {time.time() - since:.0f} s")
        if lost_store is None:
            return f"the store at {assignment.master_addr} stopped answering ({silent})"
        return str(lost_store(silent, since))

    return CutWatch(
        board,
        hostname,
        node_ranks(
            assignment.base_rank, plan.nproc, assignment.group_world_size, assignment.group_rank
        ),
        fencing_bound(plan),
        on_fence,
        store_node,
        store_stall_seconds(plan),
    )
