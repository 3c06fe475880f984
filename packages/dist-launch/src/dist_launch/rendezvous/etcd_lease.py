"""This node's etcd lease: alive while the node is, gone (with its keys) soon after.

A node's launcher grants one lease and renews it on a thread. Keys bound to it (the
node's mark in the current round) vanish when the launcher dies or its network is cut
for longer than the lease's time to live, so the other nodes learn it is gone from
etcd itself, not only from the missing heartbeats of torch's rendezvous state.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from dist_launch.rendezvous.etcd_gateway import EtcdGateway

logger = logging.getLogger(__name__)


class NodeLease:
    """A lease of ``ttl`` seconds, renewed every ``interval`` seconds on a daemon thread.

    Args:
        gateway: The etcd client.
        ttl: Seconds the lease outlives its last renewal.
        interval: Seconds between renewals (below ``ttl``).

    Raises:
        EtcdError: etcd did not grant the lease.
    """

    def __init__(self, gateway: EtcdGateway, ttl: int, interval: float) -> None:
        self._gateway = gateway
        self.ttl = ttl
        self.lease = gateway.grant_lease(ttl)
        self._interval = interval
        self._ended = threading.Event()
        self.lapsed = False  # etcd let the lease end: this node was cut off too long
        self._thread = threading.Thread(target=self._renew, name="etcd-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._ended.wait(self._interval):
            try:
                left = self._gateway.keep_alive(self.lease)
            except Exception:  # etcd unreachable for now: the next renewal may get through
                logger.debug("etcd: lease %x not renewed", self.lease, exc_info=True)
                continue
            if left <= 0:
                logger.warning("etcd: this node's lease %x ended (cut off too long)", self.lease)
                self.lapsed = True
                return

    def renewed(self) -> NodeLease:
        """A new lease like this one (after this one lapsed).

        Raises:
            EtcdError: etcd did not grant it.
        """
        return NodeLease(self._gateway, self.ttl, self._interval)

    def bind(self, key: str, value: str) -> None:
        """Sets ``key`` for as long as the lease lives."""
        self._gateway.put(key.encode(), value.encode(), lease=self.lease)

    def end(self, *, revoke: bool = True) -> None:
        """Stops renewing and ends the lease now (its keys go); idempotent, never raises.

        Args:
            revoke: False for a node that cannot reach etcd (fenced off a cut): it
                waits for nothing, and etcd ends the lease ``ttl`` seconds after its
                last renewal, as it does a dead node's.
        """
        if self._ended.is_set():
            return
        self._ended.set()
        if not revoke:
            return
        self._thread.join(self._gateway.timeout + self._interval)
        with contextlib.suppress(Exception):
            self._gateway.revoke_lease(self.lease)
