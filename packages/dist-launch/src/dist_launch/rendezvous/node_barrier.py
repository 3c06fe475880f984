"""A bounded barrier of a round's nodes in its store (exit barrier, end of the job)."""

from __future__ import annotations

import time
from datetime import timedelta

from dist_launch.rendezvous.store_deadline import RendezvousStore


def every_node(
    store: RendezvousStore, event: str, nodes: int, seconds: float
) -> tuple[float, Exception] | None:
    """Counts ``event`` for this node; waits until every one of ``nodes`` has.

    Args:
        store: The round's store (its calls bounded by the caller's wrapper).
        event: What the nodes count (``succeeded``, ``ended``).
        nodes: The round's node count.
        seconds: How long to wait for the others.

    Returns:
        None once all have, else how long this node waited and why it stopped (a
        node never came, or the store is gone).
    """
    started = time.monotonic()
    try:
        if int(store.add(f"dist_launch/{event}", 1)) >= nodes:
            store.set(f"dist_launch/all_{event}", "1")
        store.wait([f"dist_launch/all_{event}"], timedelta(seconds=seconds))
    except Exception as error:  # torch raises several kinds
        return time.monotonic() - started, error
    return None
