"""The one place that picks the rendezvous of a plan (``--rdzv-backend``)."""

from __future__ import annotations

from dist_launch.plan.launch_plan import LaunchPlan
from dist_launch.rendezvous.c10d import connect_c10d
from dist_launch.rendezvous.etcd_http import STALL_SECONDS
from dist_launch.rendezvous.host_names import is_literal_address, wait_until_resolvable
from dist_launch.rendezvous.protocol import Rendezvous
from dist_launch.rendezvous.static import StaticRendezvous


def rendezvous_host(plan: LaunchPlan) -> tuple[str, str]:
    """The host every node must reach (c10d's endpoint, static's master) and its source."""
    if not plan.elastic:
        return plan.master_addr, plan.sources.get("master_addr", "default")
    endpoint = plan.rdzv_endpoint
    if plan.on_etcd:
        # Any member will do; the client moves on from one that does not answer.
        return "", plan.sources.get("rdzv_endpoint", "flag")
    host, sep, port = endpoint.rpartition(":")
    if is_literal_address(endpoint) or not sep or not port.isdigit():
        host = endpoint  # no port, or an IPv6 address without one
    return host.strip("[]"), plan.sources.get("rdzv_endpoint", "flag")


def store_stall_seconds(plan: LaunchPlan) -> float:
    """How long the plan's rendezvous store may leave a healthy node's call unanswered.

    etcd's, while it elects a new leader (:data:`~dist_launch.rendezvous.etcd_http.
    STALL_SECONDS`); none for a TCPStore. The silence that fences a node cut off from
    the store is this much longer.
    """
    return STALL_SECONDS if plan.on_etcd else 0.0


def join_timeout(plan: LaunchPlan) -> float:
    """``--rdzv-conf join_timeout`` (seconds), torchrun's 600 when not given."""
    return plan.rdzv_timeouts.join


def open_rendezvous(plan: LaunchPlan) -> Rendezvous:
    """The plan's rendezvous, ready for its first round.

    First waits, up to ``join_timeout``, until the rendezvous host's name resolves (a
    pod's headless-service record appears after the pod starts). c10d imports torch and
    may wait for the endpoint's node (torch's ``read_timeout``); etcd's is reached at
    once or not at all. The agent calls this on a thread.

    Raises:
        RendezvousUsageError: A static job's master port is taken on node 0.
        UnresolvableHostError: The host's name did not resolve in time.
        Exception: torch's errors when the c10d store cannot be reached or served.
        ConnectionError: No etcd member answered (the message says what to install).
    """
    host, source = rendezvous_host(plan)
    if host:
        wait_until_resolvable(host, source, join_timeout(plan))
    if plan.on_etcd:
        # Imported here: it subclasses torch's Store, and only etcd jobs need torch now.
        from dist_launch.rendezvous.etcd import connect_etcd  # noqa: PLC0415

        return connect_etcd(plan)
    if plan.elastic:
        return connect_c10d(plan)
    return StaticRendezvous.open(plan)
