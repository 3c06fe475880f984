"""A cut cable, told as what it is: which nodes this node cannot reach, and which side stops.

Pure functions over what the job board saw (:mod:`dist_launch.rendezvous.job_board`):
when this node last heard the store answer, and when each other node of the round last
wrote its heartbeat there. A node whose heartbeat is older than the silence bound is
*unreachable from this node* since its last heartbeat; when the store itself is silent,
every other node is, since the store last answered.

The side that cannot reach the store, or (without a store) a majority of the last
round's nodes, stops its workers at once and ends as ``INFRASTRUCTURE`` (137): two halves
of a cut job never both go on, and never both checkpoint to one path.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from dist_launch.diagnostics.verdict import ranks_phrase


@dataclass(frozen=True)
class PeerNode:
    """One node of the round, as its own heartbeat describes it.

    Attributes:
        node: Its rank in the round (group rank).
        host: Its host name.
        address: The address its peers reach it at.
        ranks: Its global ranks.
    """

    node: int
    host: str
    address: str
    ranks: tuple[int, ...]

    def describe(self) -> str:
        """``node2 (10.0.0.2)``."""
        return f"{self.host} ({self.address})" if self.address else self.host


@dataclass(frozen=True)
class Unreachable:
    """A node this node cannot reach, and since when (wall clock)."""

    peer: PeerNode
    since: float
    seen_from: str

    def describe(self) -> str:
        """``node2 (10.0.0.2) unreachable from node1 since 12:00:03; ranks 2-3``."""
        at = time.strftime("%H:%M:%S", time.localtime(self.since))
        ranks = ranks_phrase(self.peer.ranks) if self.peer.ranks else "its ranks not known here"
        return f"{self.peer.describe()} unreachable from {self.seen_from} since {at}; {ranks}"

    def to_json(self) -> dict[str, object]:
        """The entry of ``hang.json``'s ``unreachable`` list."""
        return {
            "node": self.peer.node,
            "host": self.peer.host,
            "address": self.peer.address,
            "ranks": list(self.peer.ranks),
            "since": self.since,
            "seen_from": self.seen_from,
        }


def unreachable_nodes(
    peers: Sequence[PeerNode],
    heartbeats: Mapping[int, float],
    store_answered_at: float | None,
    *,
    now: float,
    silent_after: float,
    seen_from: str,
    listening_since: float | None = None,
) -> list[Unreachable]:
    """The other nodes this node cannot reach, by node rank.

    Args:
        peers: The other nodes of the round (not this one).
        heartbeats: Each peer's latest heartbeat this node read (wall clock).
        store_answered_at: When the store last answered this node; None if never.
        now: The wall clock now.
        silent_after: Seconds without a heartbeat (or an answer) that make a node
            unreachable; a few exchange periods, so that one late beat is no cut.
        seen_from: How this node names itself (``node1``).
        listening_since: When this node started reading the peers' heartbeats (its
            round's start): a peer never heard from is silent since then. A cable cut
            before a peer's first beat was read is a cut all the same (None: such a
            peer is not counted).

    Returns:
        Every peer silent for longer than ``silent_after``: all of them, since the
        store's last answer, when the store is silent; else those whose heartbeat is.
    """
    if store_answered_at is None or now - store_answered_at > silent_after:
        since = now if store_answered_at is None else store_answered_at
        return [Unreachable(peer, since, seen_from) for peer in peers]
    found = []
    for peer in peers:
        beat = heartbeats.get(peer.node, listening_since)
        if beat is not None and now - beat > silent_after:
            found.append(Unreachable(peer, beat, seen_from))
    return found


Side = Literal["go_on", "fence"]


@dataclass(frozen=True)
class SideDecision:
    """What this side of a cut does: ``go_on``, or ``fence`` (stop its workers, 137)."""

    side: Side
    why: str


def decide_side(
    *, has_store: bool, store_reachable: bool, reachable_nodes: int, round_nodes: int
) -> SideDecision:
    """Whether this node's side of a cut may go on.

    With a store every node shares (c10d's, the static master's), the store is the
    arbiter: only nodes that reach it go on, and there is one store. Without one, only
    a strict majority of the last round's nodes goes on: of two halves neither does.

    Args:
        has_store: The nodes share a store.
        store_reachable: This node's store answers.
        reachable_nodes: Nodes of the last round this node reaches, itself included.
        round_nodes: Nodes of the last round.
    """
    if has_store:
        if store_reachable:
            return SideDecision("go_on", "this node reaches the rendezvous store")
        return SideDecision("fence", "this node cannot reach the rendezvous store")
    if 2 * reachable_nodes > round_nodes:
        return SideDecision(
            "go_on", f"this node reaches {reachable_nodes} of the last round's {round_nodes} nodes"
        )
    return SideDecision(
        "fence",
        f"this node reaches only {reachable_nodes} of the last round's {round_nodes} nodes, "
        "no majority",
    )
