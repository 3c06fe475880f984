"""The launchers' store of a multi-node static job: served by node 0's launcher.

A static job's only store used to be the workers' (rank 0's, at the master port), which
the launchers cannot use: it lives and dies with the workers. So node 0's launcher
serves a torch ``TCPStore`` of its own beside the master port, at ``--rdzv-conf
store_port`` (default: the master port + 1), and every node's launcher connects to it.
The launchers share the failed round's records, the restart count, the job board and
the closing reason through it, as with the c10d rendezvous.

torch is imported only here, only for a job of several nodes: a one-node static job
starts without it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from dist_launch.plan.launch_plan import LaunchPlan
from dist_launch.rendezvous.protocol import RendezvousUsageError
from dist_launch.rendezvous.store_deadline import RendezvousStore, StoreDeadline

# How much longer than the join timeout connecting to node 0's store may take.
CONNECT_SLACK_SECONDS = 10.0


def launchers_store_port(plan: LaunchPlan, master_port: int) -> int:
    """``--rdzv-conf store_port``, else the master port + 1.

    Raises:
        RendezvousUsageError: ``store_port`` is not a TCP port, or is the master port.
    """
    raw = plan.rdzv_conf.get("store_port")
    if raw is None:
        return master_port + 1
    try:
        port = int(raw)
    except ValueError:
        port = -1
    if not 0 < port < 65536 or port == master_port:
        raise RendezvousUsageError(
            f"--rdzv-conf store_port={raw}: not a TCP port other than the master port {master_port}"
        )
    return port


def open_launchers_store(plan: LaunchPlan, port: int, deadline: StoreDeadline) -> Any:
    """The launchers' torch ``TCPStore``: served here on node 0, else reached.

    Every node but 0 waits up to ``join_timeout`` (and :data:`CONNECT_SLACK_SECONDS`)
    for node 0 to serve it; each call then waits at most torch's ``read_timeout`` for
    a key.

    Raises:
        RendezvousUsageError: Node 0 cannot serve the store (its port is taken).
        ConnectionError: The store of node 0 could not be reached in time; the message
            names its address.
    """
    from torch._C._distributed_c10d import TCPStore  # noqa: PLC0415 - torch: several nodes

    timeouts = plan.rdzv_timeouts
    where = f"{plan.master_addr}:{port}"
    if plan.node_rank == 0:
        try:
            return TCPStore(
                plan.master_addr,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeouts.read),
            )
        except Exception as error:
            raise RendezvousUsageError(
                f"node 0 cannot serve the launchers' store on port {port} (the master "
                f"port + 1 unless --rdzv-conf store_port says otherwise): {error}"
            ) from error

    def connect() -> Any:
        # torch retries a refused connection until the timeout: node 0 may start later.
        store = TCPStore(
            plan.master_addr, port, is_master=False, timeout=timedelta(seconds=timeouts.join)
        )
        store.set_timeout(timedelta(seconds=timeouts.read))
        return store

    try:
        return deadline.run(
            "the connection",
            connect,
            timeouts.join + CONNECT_SLACK_SECONDS,
            f"join_timeout + {CONNECT_SLACK_SECONDS:g} s",
        )
    except Exception as error:
        raise ConnectionError(
            f"cannot reach the launchers' store of node 0 at {where}: {error}"
        ) from error


class PrefixedStore:
    """A view of ``store`` whose every key starts with ``prefix`` (as torch's PrefixStore).

    Args:
        store: The store (torch's, or a test's dict-backed one).
        prefix: Put before every key.
    """

    def __init__(self, store: RendezvousStore, prefix: str) -> None:
        self.store = store
        self.prefix = prefix

    def set(self, key: str, value: str) -> None:
        """Sets ``key``."""
        self.store.set(self.prefix + key, value)

    def get(self, key: str) -> bytes:
        """The value of ``key``."""
        return self.store.get(self.prefix + key)

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the counter ``key``; returns its new value."""
        return self.store.add(self.prefix + key, amount)

    def check(self, keys: list[str]) -> bool:
        """True when every key is set."""
        return self.store.check([self.prefix + key for key in keys])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``."""
        return self.store.multi_get([self.prefix + key for key in keys])

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        """Waits until every key is set, at most ``timeout``."""
        self.store.wait([self.prefix + key for key in keys], timeout)
