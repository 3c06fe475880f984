"""A bounded barrier of a round's nodes in its store (exit barrier, end of the job)."""

from __future__ import annotations

import time
from collections.abc import Callable

from dist_launch.rendezvous.job_board import UNREACHABLE_KEY
from dist_launch.rendezvous.store_deadline import RendezvousStore

# How often a node that ended looks whether the others have (or were found cut off).
EVERY_NODE_POLL_SECONDS = 0.1


def every_node(
    store: RendezvousStore,
    event: str,
    nodes: int,
    seconds: float,
    *,
    node: int | None = None,
    gone: Callable[[], set[int]] | None = None,
) -> tuple[float, Exception] | None:
    """Counts ``event`` for this node; waits until every one of ``nodes`` has.

    Args:
        store: The round's store (its calls bounded by the caller's wrapper).
        event: What the nodes count (``succeeded``, ``ended``).
        nodes: The round's node count.
        seconds: How long to wait for the others.
        node: This node's rank in the round; with ``gone``, each node also marks its
            own ``event`` so that the ones missing are known.
        gone: The other nodes known dead (their launchers stopped beating): once every
            node missing is among them, the wait ends.

    Nodes the job board found cut off (:mod:`dist_launch.watch.cut_watch` counts them
    under ``UNREACHABLE_KEY``) will not come: they are not waited for.

    Returns:
        None once all have, else how long this node waited and why it stopped (a
        node never came, or the store is gone).
    """
    started = time.monotonic()
    try:
        if node is not None:
            store.set(f"dist_launch/{event}/{node}", "1")
        if int(store.add(f"dist_launch/{event}", 1)) >= nodes:
            store.set(f"dist_launch/all_{event}", "1")
        while not store.check([f"dist_launch/all_{event}"]):
            came = int(store.add(f"dist_launch/{event}", 0))
            if came + int(store.add(UNREACHABLE_KEY, 0)) >= nodes:
                return None
            if gone is not None and node is not None:
                missing = {
                    other
                    for other in range(nodes)
                    if other != node and not store.check([f"dist_launch/{event}/{other}"])
                }
                if not missing:  # every node came; the last one sets all_<event> next
                    return None
                dead = gone()
                if missing <= dead:
                    why = f"node(s) {sorted(missing)} stopped beating"
                    return time.monotonic() - started, RuntimeError(why)
            if time.monotonic() - started >= seconds:
                raise TimeoutError(f"{nodes - came} node(s) did not come within {seconds:g} s")
            time.sleep(EVERY_NODE_POLL_SECONDS)
    except Exception as error:  # torch raises several kinds
        return time.monotonic() - started, error
    return None
