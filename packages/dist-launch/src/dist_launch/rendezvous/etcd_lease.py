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

from dist_launch.rendezvous.etcd_gateway import EtcdGateway, LeaseNotFoundError

logger = logging.getLogger(__name__)


class NodeLease:
    """A lease of ``ttl`` seconds, renewed every ``interval`` seconds on a daemon thread.

    A lease etcd let end (the node was silent for ``ttl`` seconds: cut off, or etcd
    without a leader for that long on a loaded host) is replaced by a new one at the
    node's next write through :meth:`put`, so a node of the majority that lost its lease
    joins the next round like any other; its keys went with the old lease, and the
    other nodes counted it lost meanwhile.

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
        self._interval = interval
        self._lock = threading.Lock()  # the lease's id and whether it lapsed, together
        self.lease = gateway.grant_lease(ttl)
        self.lapsed = False  # etcd let the lease end: this node was silent too long
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="etcd-lease", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        while not self._ended.wait(self._interval):
            with self._lock:
                lease, lapsed = self.lease, self.lapsed
            if lapsed:  # nothing to renew until the next write grants a new one
                continue
            try:
                left = self._gateway.keep_alive(lease)
            except Exception:  # etcd unreachable for now: the next renewal may get through
                logger.debug("etcd: lease %x not renewed", lease, exc_info=True)
                continue
            if left <= 0:
                self._lapse(lease)

    def _lapse(self, lease: int) -> None:
        with self._lock:
            if self.lease != lease or self.lapsed:
                return
            self.lapsed = True
        logger.warning("etcd: this node's lease %x ended (silent too long)", lease)

    def regrant(self) -> None:
        """Replaces a lapsed lease with a new one (the renewals move on to it).

        Raises:
            EtcdError: etcd did not grant it.
        """
        lease = self._gateway.grant_lease(self.ttl)
        with self._lock:
            old, self.lease, self.lapsed = self.lease, lease, False
        logger.info("etcd: lease %x replaces lease %x, which ended", lease, old)

    def put(self, key: bytes, value: bytes) -> None:
        """Sets ``key`` for as long as the lease lives, on a new lease if this one ended.

        Raises:
            EtcdError: etcd did not answer, or refused the write.
        """
        if self.lapsed:
            self.regrant()
        lease = self.lease
        try:
            self._gateway.put(key, value, lease=lease)
        except LeaseNotFoundError:  # ended before a renewal saw it
            self._lapse(lease)
            self.regrant()
            self._gateway.put(key, value, lease=self.lease)

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
