"""Job-wide progress: each node's latest progress, shared through the rendezvous store.

A node whose ranks all wait for another node (rank 0 evaluating on node 0, node 1's
ranks in a barrier) is not hung while that other node's ranks make progress. With the
c10d rendezvous every node's agent publishes, every look, the wall-clock time of its
group's latest progress under ``dist_launch/progress/<node>`` in the round's store,
and reads the others'; the hang watch (:mod:`dist_launch.watch.hang_watch`) counts a later
progress elsewhere as progress here. Clocks of different hosts may differ by a little;
a timeout is minutes, or seconds in tests on one host.

The store is used from a thread of its own, so that a slow store never delays the
launcher's loop; a store that does not answer leaves the node judging its own ranks.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

logger = logging.getLogger(__name__)


class ProgressStore(Protocol):
    """What the board needs of a store (torch's ``Store`` has it)."""

    def set(self, key: str, value: str) -> None:
        """Sets ``key``."""

    def check(self, keys: list[str]) -> bool:
        """True when every key exists."""

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``."""


def progress_key(node: int) -> str:
    """The key of node ``node``'s latest progress in the round's store."""
    return f"dist_launch/progress/{node}"


class ProgressBoard:
    """This node's side of the job's progress board.

    Args:
        store: The round's store.
        node: This node's rank in the round.
        nodes: The round's node count.
        period: Seconds between two exchanges.
    """

    def __init__(self, store: ProgressStore, node: int, nodes: int, period: float) -> None:
        self._store = store
        self._key = progress_key(node)
        self._others = [progress_key(other) for other in range(nodes) if other != node]
        self._period = period
        self._local = time.time()
        self._elsewhere: float | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="progress-board", daemon=True)
        self._thread.start()

    def publish(self, wall_time: float) -> None:
        """This node's latest progress (wall clock), sent at the next exchange."""
        self._local = wall_time

    def latest_elsewhere(self) -> float | None:
        """The latest progress of any other node (wall clock), once one was read."""
        return self._elsewhere

    def _exchange(self) -> None:
        self._store.set(self._key, repr(self._local))
        if self._others and self._store.check(self._others):
            values = self._store.multi_get(self._others)
            self._elsewhere = max(float(value) for value in values)

    def _run(self) -> None:
        while not self._stopped.wait(self._period):
            try:
                self._exchange()
            except Exception:
                logger.debug("progress board: the store did not answer", exc_info=True)

    def stop(self) -> None:
        """Stops exchanging (bounded)."""
        self._stopped.set()
        self._thread.join(timeout=5.0)
