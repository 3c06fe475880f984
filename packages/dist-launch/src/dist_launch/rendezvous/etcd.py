"""The etcd rendezvous (``--rdzv-backend etcd``): c10d's protocol, its state in etcd.

The rounds form on etcd (:class:`~dist_launch.rendezvous.etcd_rounds.EtcdRounds`: each
node's join is a key of its own, so a node's cost does not grow with the job), and the
rounds' store lives in etcd too (:class:`~dist_launch.rendezvous.etcd_store.EtcdStore`).
The rest (the job-wide restart budget, failure records, closing, the job board) is
c10d's own code (:class:`~dist_launch.rendezvous.c10d.C10dRendezvous`), and no node is
special: the job survives the loss of any node (the workers' store is made anew each
round by the round's rank 0) and of a minority of etcd members.

Each node holds a lease (:class:`~dist_launch.rendezvous.etcd_lease.NodeLease`) bound
to its join and to its mark in the current round, so a lost node is seen as soon as
etcd drops its lease.

Keys, all under ``dist-launch/<rdzv-id>/``: ``rounds/...`` (joins, formed rounds, the
job's closing), ``store/...`` (the rounds' stores and the job's counters),
``alive/<round>/<node>``.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

from dist_launch.plan.launch_plan import LaunchPlan
from dist_launch.rendezvous.c10d import C10dRendezvous, route_address
from dist_launch.rendezvous.etcd_gateway import DEFAULT_ETCD_PORT, EtcdGateway, EtcdTls
from dist_launch.rendezvous.etcd_http import REQUEST_SECONDS
from dist_launch.rendezvous.etcd_lease import NodeLease
from dist_launch.rendezvous.etcd_rounds import EtcdRounds, FormedRound
from dist_launch.rendezvous.etcd_store import EtcdStore
from dist_launch.rendezvous.protocol import Assignment, RendezvousUsageError
from dist_launch.rendezvous.rdzv_conf import conf_seconds
from dist_launch.rendezvous.store_deadline import RendezvousStore

logger = logging.getLogger(__name__)

# torch's c10d defaults, kept for etcd: the store's waits, and the keep-alive.
DEFAULT_READ_TIMEOUT = 60.0
DEFAULT_KEEP_ALIVE_INTERVAL = 5
DEFAULT_KEEP_ALIVE_MAX_ATTEMPT = 3
INSTALL_HINT = (
    "start an etcd server (3.4 or later, v3 API; Debian/Ubuntu: apt-get install "
    "etcd-server) and name its client URLs in --rdzv-endpoint HOST:PORT[,HOST:PORT...]"
)
# --rdzv-conf keys of torchrun's two etcd backends, read as ours: etcd (cacert, cert,
# key) and etcd-v2 (ca_cert, ssl_cert, ssl_cert_key).
TLS_KEYS = {"cacert": "cacert", "ca_cert": "cacert", "cert": "cert", "ssl_cert": "cert"}
TLS_KEYS |= {"key": "key", "ssl_cert_key": "key"}


@dataclass(frozen=True)
class EtcdSettings:
    """How to reach etcd, from ``--rdzv-endpoint`` and ``--rdzv-conf``."""

    endpoints: list[tuple[str, int]]
    protocol: str
    tls: EtcdTls
    read_timeout: float
    keep_alive_interval: int
    keep_alive_max_attempt: int

    @property
    def lease_ttl(self) -> int:
        """A node's lease: as long as torch's keep-alive gives a node (15 s by default)."""
        return max(2, self.keep_alive_interval * self.keep_alive_max_attempt)


def etcd_endpoints(endpoint: str) -> list[tuple[str, int]]:
    """``host:port[,host:port...]`` as ``(host, port)`` pairs.

    ``http://`` and ``[IPv6]`` are allowed; the port is 2379 when left out.

    Raises:
        RendezvousUsageError: No endpoint, or a port that is not a number.
    """
    pairs: list[tuple[str, int]] = []
    for item in filter(None, (part.strip() for part in endpoint.split(","))):
        bare = item.split("://", 1)[-1].rstrip("/")
        host, sep, port = bare.rpartition(":")
        if not sep or (host.count(":") and not host.endswith("]")):
            host, port = bare, str(DEFAULT_ETCD_PORT)  # no port, or a bare IPv6 address
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise RendezvousUsageError(f"--rdzv-endpoint {item}: {port!r} is not a TCP port")
        pairs.append((host.strip("[]"), int(port)))
    if not pairs:
        raise RendezvousUsageError("--rdzv-backend etcd needs --rdzv-endpoint HOST:PORT[,...]")
    return pairs


def etcd_settings(plan: LaunchPlan) -> EtcdSettings:
    """The plan's etcd endpoints, protocol, certificates and timeouts.

    ``protocol`` is ``http`` unless given, or ``https`` when a certificate is.

    Raises:
        RendezvousUsageError: A malformed endpoint, protocol or number.
    """
    conf = plan.rdzv_conf
    tls_files = {ours: conf[key] for key, ours in TLS_KEYS.items() if conf.get(key)}
    tls = EtcdTls(**tls_files)
    protocol = conf.get("protocol", "https" if tls_files else "http").strip().lower()
    if protocol not in ("http", "https"):
        raise RendezvousUsageError(f"--rdzv-conf protocol={protocol}: http or https")
    return EtcdSettings(
        endpoints=etcd_endpoints(plan.rdzv_endpoint),
        protocol=protocol,
        tls=tls,
        read_timeout=conf_seconds(conf, "read_timeout", DEFAULT_READ_TIMEOUT),
        keep_alive_interval=int(
            conf_seconds(conf, "keep_alive_interval", DEFAULT_KEEP_ALIVE_INTERVAL)
        ),
        keep_alive_max_attempt=int(
            conf_seconds(conf, "keep_alive_max_attempt", DEFAULT_KEEP_ALIVE_MAX_ATTEMPT)
        ),
    )


def job_prefix(rdzv_id: str) -> str:
    """Where a job's keys live in etcd."""
    return f"dist-launch/{rdzv_id}/"


class EtcdRendezvous(C10dRendezvous):
    """c10d's :class:`~dist_launch.rendezvous.c10d.C10dRendezvous` on etcd, with a lease.

    Args:
        plan: The launch plan; reads no environment variable.
        handler: The job's rounds on etcd (:func:`connect_etcd`).
        gateway: The etcd client.
        lease: This node's lease.
    """

    handler: EtcdRounds

    def __init__(
        self, plan: LaunchPlan, handler: EtcdRounds, gateway: EtcdGateway, lease: NodeLease
    ) -> None:
        super().__init__(plan, handler)
        self._gateway = gateway
        self.lease = lease
        self._alive_prefix: str | None = None

    def lost_store(self, error: Exception, since: float) -> str:
        """No etcd member answered: names the members and when they stopped."""
        at = time.strftime("%H:%M:%S", time.localtime(since))
        return (
            f"no etcd member of {self.plan.rdzv_endpoint} answered since {at} ({error}); "
            "this node is cut off from the job's majority and stops its workers"
        )

    def next_round(self) -> Assignment:
        """Joins the next round and marks this node alive in it, bound to its lease."""
        self.handler.lease = self.lease  # a lapsed one is replaced at the join's write
        assignment = super().next_round()
        round_number = self.handler.round
        self._alive_prefix = f"{job_prefix(self.plan.rdzv_id)}alive/{round_number}/"
        alive = self._alive_prefix + str(assignment.group_rank)
        self.lease.put(alive.encode(), socket.gethostname().encode())
        return assignment

    def _worker_counts(self, store: RendezvousStore, info: FormedRound) -> list[int]:
        """Each node's worker count, as the round's formed record holds it (no request)."""
        return list(info.nprocs)

    def _exit_rendezvous(self) -> None:
        """Nothing more: the others see this node's leaving on the round's store."""

    def lost_nodes(self) -> int:
        """Nodes of the round whose lease ended (their mark in the round went with it)."""
        if self.assignment is None or self._alive_prefix is None:
            return 0
        alive = self._gateway.count_prefix(self._alive_prefix.encode())
        return max(0, self.assignment.group_world_size - alive)

    def close(self) -> None:
        """c10d's ending (every node marks its end), then this node's lease ends.

        A node fenced off a cut (its store given up) leaves its lease to lapse instead
        of revoking it (each try would wait on members it cannot reach), and stops its
        calls to etcd that are still under way, waiting at most one request's timeout
        for them: they run on threads that torch's C++ store calls into, which must
        not be left inside etcd calls when the interpreter exits.
        """
        super().close()
        fenced = self.deadline.silenced is not None
        self.lease.end(revoke=not fenced)
        if fenced:
            self._gateway.stop(self._gateway.timeout + 1.0)


def _rounds(plan: LaunchPlan, settings: EtcdSettings, gateway: EtcdGateway) -> EtcdRounds:
    """The job's rounds on etcd, and the rounds' store beside them."""
    prefix = job_prefix(plan.rdzv_id)
    store = EtcdStore(gateway, prefix + "store/", timedelta(seconds=settings.read_timeout))
    host, port = settings.endpoints[0]
    timeouts = plan.rdzv_timeouts
    return EtcdRounds(
        gateway,
        prefix,
        store,
        (plan.min_nodes, plan.max_nodes),
        (timeouts.join, timeouts.last_call),
        plan.local_addr or route_address(host, port) or socket.getfqdn(),
        plan.nproc,
    )


def connect_etcd(plan: LaunchPlan) -> EtcdRendezvous:
    """Joins the etcd rendezvous of ``plan``.

    Reads no variable itself; sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the
    launcher's own environment, as :func:`~dist_launch.rendezvous.c10d.connect_c10d`
    does (the workers' store is the round's rank 0 worker's).

    Raises:
        RendezvousUsageError: A malformed endpoint or ``--rdzv-conf``, or a
            ``--rdzv-id`` whose earlier job closed its rendezvous.
        ConnectionError: No etcd member answered; the message says what to install.
    """
    settings = etcd_settings(plan)
    if plan.rdzv_backend == "etcd-v2":
        logger.info(
            "--rdzv-backend etcd-v2 runs on etcd's v3 API (etcd 3.4 turns v2 off, 3.6 "
            "removed it); its keys are not torchrun's"
        )
    gateway = EtcdGateway(settings.endpoints, settings.protocol, settings.tls, REQUEST_SECONDS)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    try:
        handler = _rounds(plan, settings, gateway)
        closed = handler.is_closed()  # the first read of etcd
        lease = NodeLease(gateway, settings.lease_ttl, settings.keep_alive_interval / 3)
    except Exception as error:  # EtcdError, a usage error of the plan's timeouts
        raise ConnectionError(
            f"cannot reach etcd at {plan.rdzv_endpoint}: {error}; {INSTALL_HINT}"
        ) from error
    if closed:
        raise RendezvousUsageError(
            f"--rdzv-id {plan.rdzv_id}: an earlier job with this id closed its rendezvous "
            f"in etcd; give this job an id of its own, or remove the old one's keys "
            f"(etcdctl del --prefix {job_prefix(plan.rdzv_id)})"
        )
    return EtcdRendezvous(plan, handler, gateway, lease)
