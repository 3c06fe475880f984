"""What the nodes of a round share through its store: progress, a hang's alarm, reports.

With the c10d rendezvous, one thread per node (this board's) talks to the round's
store, so that a slow store never delays the launcher's loop; a store that does not
answer leaves the node on its own. Three things travel on it:

- *progress*: a node whose ranks all wait for another node (rank 0 evaluating on
  node 0, node 1's ranks in a barrier) is not hung while that other node's ranks make
  progress. Every exchange, each node publishes the wall-clock time of its latest
  progress under ``dist_launch/progress/<node>`` and reads the others'; the hang watch
  (:mod:`dist_launch.watch.hang_watch`) counts a later progress elsewhere as progress
  here. Clocks of different hosts may differ by a little (NTP keeps them within
  milliseconds); a timeout is minutes.
- *the alarm*: the first node that finds the job hung counts itself in
  ``dist_launch/hang/alarms`` and says why under ``dist_launch/hang/first``; every other
  node sees the count at its next exchange and raises its own alarm, so that every
  node collects its ranks' records before any node stops its workers.
- *heartbeats*: every exchange, each node stamps ``dist_launch/alive/<node>`` with the
  wall clock and who it is (host, address, ranks), and reads the others' stamps; with
  the time the store last answered this node, they tell a cut cable from a hang
  (:mod:`dist_launch.watch.partition`).
- *reports*: a node shares a payload under ``dist_launch/share/<topic>/<node>`` (its
  ranks' records for a hang's verdict, its ranks' collective times for a slow-rank
  window) and reads the other nodes' payloads of the same topic once all are there.

Keys live in the round's store (torch's prefix store of the round): a new round starts
clean.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Protocol

logger = logging.getLogger(__name__)

ALARMS_KEY = "dist_launch/hang/alarms"
# How many nodes of the round some node found cut off (each counted once, under
# ``<key>/<node>``): the nodes that end wait for no answer from those.
UNREACHABLE_KEY = "dist_launch/unreachable"
FIRST_ALARM_KEY = "dist_launch/hang/first"


def marked_unreachable(store: BoardStore, nodes: list[int]) -> set[int]:
    """Those of ``nodes`` that a node's job board found cut off (``mark_unreachable``).

    Such a node's launcher may still live, on its side of the cut, but nothing it does
    reaches this store again: the nodes that end wait no longer for it.
    """
    return {node for node in nodes if store.check([f"{UNREACHABLE_KEY}/{node}"])}


class BoardStore(Protocol):
    """What the board needs of a store (torch's ``Store`` has it)."""

    def set(self, key: str, value: str) -> None:
        """Sets ``key``."""

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the counter ``key``; returns its new value."""

    def check(self, keys: list[str]) -> bool:
        """True when every key exists."""

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``."""


def progress_key(node: int) -> str:
    """The key of node ``node``'s latest progress in the round's store."""
    return f"dist_launch/progress/{node}"


def alive_key(node: int) -> str:
    """The key of node ``node``'s heartbeat: ``{"t": wall time, "who": {...}}`` in JSON."""
    return f"dist_launch/alive/{node}"


def share_key(topic: str, node: int) -> str:
    """The key of node ``node``'s payload of ``topic``."""
    return f"dist_launch/share/{topic}/{node}"


class JobBoard:
    """This node's side of the round's board; see the module docstring.

    Every method but :meth:`stop` only reads or sets fields: the thread does the I/O.

    Args:
        store: The round's store.
        node: This node's rank in the round.
        nodes: The round's node count.
        period: Seconds between two exchanges (a request wakes the thread sooner).
    """

    def __init__(self, store: BoardStore, node: int, nodes: int, period: float) -> None:
        self._store = store
        self.node = node
        self.nodes = nodes
        self._others = [other for other in range(nodes) if other != node]
        self._period = period
        self._lock = threading.Lock()
        # Written by the loop's thread, read by the board's.
        self._local = time.time()
        self._alarm: str | None = None
        self._alarm_sent = False
        self._outgoing: dict[str, str] = {}
        self._wanted: set[str] = set()
        self._who: dict[str, object] = {}
        # Written by the board's thread, read by the loop's.
        self._elsewhere: float | None = None
        self._alarm_elsewhere: str | None = None
        self._received: dict[str, dict[int, str]] = {}
        self.store_answered_at: float | None = None  # wall clock of the last full exchange
        self._beats: dict[int, float] = {}
        self._whos: dict[int, dict[str, object]] = {}
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="job-board", daemon=True)
        self._thread.start()

    # -- the loop's side --------------------------------------------------------------

    def publish(self, wall_time: float) -> None:
        """This node's latest progress (wall clock), sent at the next exchange."""
        self._local = wall_time

    def latest_elsewhere(self) -> float | None:
        """The latest progress of any other node (wall clock), once one was read."""
        return self._elsewhere

    def introduce(self, who: dict[str, object]) -> None:
        """Who this node is (host, address, ranks), sent with each heartbeat."""
        self._who = dict(who)

    def heartbeats(self) -> dict[int, float]:
        """Each other node's latest heartbeat read so far (wall clock), by node."""
        with self._lock:
            return dict(self._beats)

    def introductions(self) -> dict[int, dict[str, object]]:
        """Who each other node said it is, by node, once read."""
        with self._lock:
            return dict(self._whos)

    def raise_alarm(self, reason: str) -> None:
        """This node found the job hung: the other nodes are told at once."""
        with self._lock:
            if self._alarm is None:
                self._alarm = reason
        self._wake.set()

    def alarm_elsewhere(self) -> str | None:
        """Why another node found the job hung, once one did (``node 1: ...``)."""
        return self._alarm_elsewhere

    def share(self, topic: str, payload: str) -> None:
        """Sends this node's ``payload`` of ``topic`` and starts reading the others'."""
        with self._lock:
            self._outgoing[topic] = payload
            self._wanted.add(topic)
        self._wake.set()

    def shared(self, topic: str) -> dict[int, str] | None:
        """Every other node's payload of ``topic``, once all arrived; None until then."""
        with self._lock:
            received = self._received.get(topic)
            return dict(received) if received is not None else None

    def forget(self, topic: str) -> None:
        """Stops reading ``topic`` (a node that never shares it leaves it unanswered)."""
        with self._lock:
            self._wanted.discard(topic)
            self._received.pop(topic, None)

    # -- the board's thread -----------------------------------------------------------

    def _exchange(self) -> None:
        store = self._store
        store.set(progress_key(self.node), repr(self._local))
        self._heartbeat()
        others = [progress_key(other) for other in self._others]
        if others and store.check(others):
            self._elsewhere = max(float(value) for value in store.multi_get(others))
        with self._lock:
            alarm = self._alarm if not self._alarm_sent else None
            outgoing, self._outgoing = self._outgoing, {}
            wanted = set(self._wanted) - set(self._received)
        if alarm is not None:
            if store.add(ALARMS_KEY, 1) == 1:
                store.set(FIRST_ALARM_KEY, f"node {self.node}: {alarm}")
            self._alarm_sent = True
        elif (
            self._alarm_elsewhere is None
            and store.add(ALARMS_KEY, 0) > 0
            and store.check([FIRST_ALARM_KEY])  # set just after the count: next time
        ):
            first = store.multi_get([FIRST_ALARM_KEY])[0].decode(errors="replace")
            self._alarm_elsewhere = first
        for topic, payload in outgoing.items():
            store.set(share_key(topic, self.node), payload)
        for topic in wanted:
            keys = [share_key(topic, other) for other in self._others]
            if keys and not store.check(keys):
                continue
            values = store.multi_get(keys) if keys else []
            with self._lock:
                if topic in self._wanted:
                    self._received[topic] = {
                        other: value.decode(errors="replace")
                        for other, value in zip(self._others, values, strict=True)
                    }

    def _heartbeat(self) -> None:
        """Stamps this node's heartbeat; reads the others' that are there.

        Two calls once every node has beaten (a check and one ``multi_get`` of all the
        beats), not two per node: each node's board reads every other node's beat each
        period, so the store's load would grow with the square of the node count.
        """
        store = self._store
        started = time.time()
        store.set(alive_key(self.node), json.dumps({"t": started, "who": self._who}))
        keys = [alive_key(other) for other in self._others]
        if keys and store.check(keys):
            present = self._others
        else:  # the first periods: some nodes have not beaten yet
            present = [o for o, key in zip(self._others, keys, strict=True) if store.check([key])]
        if present:
            beats = store.multi_get([alive_key(other) for other in present])
            with self._lock:
                for other, value in zip(present, beats, strict=True):
                    beat = json.loads(value)
                    self._beats[other] = float(beat["t"])
                    self._whos[other] = dict(beat.get("who") or {})
        self.store_answered_at = started

    def _run(self) -> None:
        while not self._stopped.is_set():
            self._wake.wait(self._period)
            self._wake.clear()
            if self._stopped.is_set():
                return
            try:
                self._exchange()
            except Exception:
                logger.debug("job board: the store did not answer", exc_info=True)

    def mark_unreachable(self, nodes: list[int]) -> None:
        """Counts ``nodes`` as cut off in the round's store, each once (called on the loop).

        Each call has the store's deadline; a store that does not answer is left alone.
        """
        for node in nodes:
            try:
                if self._store.add(f"{UNREACHABLE_KEY}/{node}", 1) == 1:
                    self._store.add(UNREACHABLE_KEY, 1)
            except Exception:
                logger.debug("job board: could not mark node %d unreachable", node, exc_info=True)
                return

    def fence(self, why: str) -> None:
        """This node gives the store up (it cannot reach it): later calls fail at once.

        Only a store with a deadline per call (a
        :class:`~dist_launch.rendezvous.store_deadline.BoundedStore`) can be given up;
        another is left as it is.
        """
        silence = getattr(self._store, "silence", None)
        if silence is not None:
            silence(why)

    def stop(self) -> None:
        """Stops exchanging (bounded)."""
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=5.0)
