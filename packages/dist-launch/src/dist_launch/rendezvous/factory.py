"""The one place that picks the rendezvous of a plan (``--rdzv-backend``)."""

from __future__ import annotations

from dist_launch.plan.launch_plan import LaunchPlan
from dist_launch.rendezvous.c10d import connect_c10d
from dist_launch.rendezvous.protocol import Rendezvous
from dist_launch.rendezvous.static import StaticRendezvous


def open_rendezvous(plan: LaunchPlan) -> Rendezvous:
    """The plan's rendezvous, ready for its first round.

    c10d imports torch and may wait for the endpoint's node (torch's
    ``read_timeout``); the agent calls this on a thread.

    Raises:
        RendezvousUsageError: A static job's master port is taken on node 0.
        Exception: torch's errors when the c10d store cannot be reached or served.
    """
    if plan.elastic:
        return connect_c10d(plan)
    return StaticRendezvous.open(plan)
