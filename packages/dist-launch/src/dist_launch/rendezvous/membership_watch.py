"""A thread that polls an elastic rendezvous while the workers run, for a reason to re-form.

It reports, once, the first of: the job was closed by a node; the store stopped
answering; nodes are waiting to join; nodes of the round stopped sending heartbeats
for long enough (torch's keep-alive may drop a node whose first heartbeat after a
round formed is late, so a single sighting is not enough).

Waiting or lost nodes do not end a round that is finishing: once a node's workers all
succeeded, re-forming would stop ranks that are done and run the job again, and the
exit barrier (or the ranks' own failure) settles how it ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol

from dist_launch.rendezvous.protocol import RoundChange


class Membership(Protocol):
    """What the watch reads of a rendezvous; each call may block for the store."""

    def is_closed(self) -> bool:
        """True once a node closed the job."""

    def nodes_waiting(self) -> int:
        """Nodes waiting to join a next round."""

    def lost_nodes(self) -> int:
        """Nodes of the current round since declared dead."""

    def nodes_finished(self) -> int:
        """Nodes of the current round whose workers all succeeded."""

    def lost_store(self, error: Exception, since: float) -> str:
        """Why the round ends when the store stopped answering at ``since`` (wall clock)."""


class MembershipWatch:
    """Polls ``membership`` every ``interval`` seconds on a daemon thread.

    Args:
        membership: The rendezvous to poll.
        interval: Seconds between polls (``--monitor-interval``).
        on_change: Called once, from the thread, with why the round must end.
        lost_after: Seconds a node must stay lost before it counts (a heartbeat
            interval: a node gone for good stays gone that long).
    """

    def __init__(
        self,
        membership: Membership,
        interval: float,
        on_change: Callable[[RoundChange], None],
        lost_after: float,
    ) -> None:
        self._membership = membership
        self._interval = interval
        self._lost_after = lost_after
        self._lost_since: float | None = None
        self._on_change = on_change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _poll(self) -> RoundChange | None:
        membership = self._membership
        try:
            if membership.is_closed():
                return RoundChange("closed")
            waiting = membership.nodes_waiting()
            lost = membership.lost_nodes()
            finishing = (waiting > 0 or lost > 0) and membership.nodes_finished() > 0
        except Exception as error:  # torch's store errors vary
            # Each store operation already waited torch's read_timeout: the store's
            # node is gone, or this node's network is.
            return RoundChange("unreachable", membership.lost_store(error, time.time()))
        if finishing:
            return None
        if waiting > 0:
            return RoundChange("membership", f"{waiting} node(s) waiting to join")
        if lost == 0:
            self._lost_since = None
            return None
        now = time.monotonic()
        if self._lost_since is None:
            self._lost_since = now
        if now - self._lost_since >= self._lost_after:
            return RoundChange("membership", f"{lost} node(s) stopped sending heartbeats")
        return None

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            change = self._poll()
            if change is not None:
                self._on_change(change)
                return

    def stop(self) -> None:
        """Stops polling (bounded: one interval and one poll's store wait at most)."""
        self._stop.set()
        self._thread.join(self._interval + 5.0)
