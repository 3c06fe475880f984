"""The nodes' end barrier, without a process: a dead node is not waited for."""

from __future__ import annotations

import threading
import time

from fake_rendezvous import FakeStore

from dist_launch.rendezvous.node_barrier import every_node


def test_a_node_whose_launcher_stopped_beating_is_not_waited_for() -> None:
    # Node 1 died: it never ends, and its heartbeat has stopped (c10d waited 15 s).
    store = FakeStore()
    started = time.monotonic()
    waited = every_node(store, "ended", 2, 15.0, node=0, gone=lambda: {1})
    assert waited is not None and "node(s) [1] stopped beating" in str(waited[1])
    assert time.monotonic() - started < 5.0


def test_a_live_node_that_ends_late_is_waited_for() -> None:
    # The false alarm beside it: a node still beating is waited for until it ends.
    store = FakeStore()
    ends = threading.Timer(0.3, every_node, (store, "ended", 2, 15.0), {"node": 1})
    ends.start()
    try:
        assert every_node(store, "ended", 2, 15.0, node=0, gone=set) is None
        assert store.check(["dist_launch/ended/1"])
    finally:
        ends.join(timeout=15.0)
