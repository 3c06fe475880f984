"""Each launcher's heartbeat in the launchers' store, and who has stopped beating.

A counter per node (``alive/<node>``), raised every ``period`` seconds by a daemon
thread, tells node 0 which launchers still live, without comparing the clocks of two
hosts: node 0 notes, on its own monotonic clock, when each counter last moved.
"""

from __future__ import annotations

import logging
import threading
import time

from dist_launch.rendezvous.job_board import marked_unreachable
from dist_launch.rendezvous.store_deadline import RendezvousStore

logger = logging.getLogger(__name__)

# Seconds between two beats.
BEAT_SECONDS = 0.5
# A launcher whose counter has not moved for this long is gone (6 beats).
SILENT_AFTER_SECONDS = 3.0


def alive_key(node: int) -> str:
    """The key of node ``node``'s heartbeat counter."""
    return f"alive/{node}"


class Heartbeat:
    """Raises this node's counter every ``period`` seconds until :meth:`stop`.

    Args:
        store: The launchers' store (every call bounded by the caller's wrapper).
        node: This node's rank.
        period: Seconds between two beats.
    """

    def __init__(self, store: RendezvousStore, node: int, period: float = BEAT_SECONDS) -> None:
        self._store = store
        self._key = alive_key(node)
        self._period = period
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self._store.add(self._key, 1)
            except Exception:
                logger.debug("heartbeat: the launchers' store did not answer", exc_info=True)
            if self._stopped.wait(self._period):
                return

    def stop(self) -> None:
        """Stops beating (bounded); calling it again does nothing."""
        self._stopped.set()
        self._thread.join(timeout=self._period + 5.0)


class Pulse:
    """Node 0's view of the other launchers' heartbeats.

    Args:
        store: The launchers' store.
        nodes: The nodes to follow.
        silent_after: Seconds without a beat after which a node is gone.
    """

    def __init__(
        self, store: RendezvousStore, nodes: list[int], silent_after: float = SILENT_AFTER_SECONDS
    ) -> None:
        self._store = store
        self._silent_after = silent_after
        now = time.monotonic()
        self._seen: dict[int, tuple[int, float]] = {node: (-1, now) for node in nodes}

    def gone(self) -> set[int]:
        """The nodes whose counter has not moved for ``silent_after`` s (reads each once)."""
        now = time.monotonic()
        for node, (count, _) in list(self._seen.items()):
            latest = int(self._store.add(alive_key(node), 0))
            if latest != count:
                self._seen[node] = (latest, now)
        return {
            node for node, (_, since) in self._seen.items() if now - since >= self._silent_after
        }

    def gone_or_cut_off(self, round_store: RendezvousStore | None) -> set[int]:
        """:meth:`gone`, and the followed nodes a job board marked unreachable.

        A heartbeat is known to have stopped only once it stood still for a few beats
        after the first look; a node the round's job board marked unreachable at a hang
        (its heartbeats were silent for seconds already) is gone at once.
        """
        gone = self.gone()
        if round_store is not None:
            gone |= marked_unreachable(round_store, sorted(set(self._seen) - gone))
        return gone
