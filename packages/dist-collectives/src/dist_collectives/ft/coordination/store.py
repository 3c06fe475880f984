"""Store addresses of the form ``host:port/prefix`` and clients for them.

Every configuration of a reconfigurable group rendezvouses on its own key prefix of one
TCPStore that runs inside the job (the one ``torchrun`` or ``dist-launch`` hosts at
``MASTER_ADDR:MASTER_PORT``, or any ``TCPStore(is_master=True)``). Opening a TCP
connection per configuration costs a connect and a handshake each time, so clients are
cached per ``(host, port, process)`` and only the cheap :class:`~torch.distributed.PrefixStore`
is new.

Addresses follow torchft's forms: ``host:port/prefix``, ``[v6addr]:port/prefix``, and a
bare IPv6 address whose port is the field after its last colon
(``fdaa:0:1:2:3:4:5:6:29521/prefix``, ``::1:29521/prefix``). Clients are built with
keyword arguments (``TCPStore(host_name=..., port=..., ...)``), looked up in this
module, so a test that patches ``TCPStore`` here sees every client that is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

from torch.distributed import DistNetworkError, PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # public, not re-exported in the stubs

from dist_collectives.ft.errors import FTError, timed_out_after_ms

logger = logging.getLogger(__name__)

DEFAULT_STORE_TIMEOUT = timedelta(seconds=60)

_lock = threading.Lock()
# (host, port, pid) -> (the factory that built it, client); the pid keeps a forked child
# from sharing its parent's socket, the factory keeps a patched TCPStore from being
# answered with a client the real one built (and the other way round).
_clients: dict[tuple[str, int, int], tuple[object, TCPStore]] = {}
# (host, port, pid) -> held while a rendezvous uses the shared client.
_leases: dict[tuple[str, int, int], threading.Lock] = {}


class StoreAddressError(FTError, ValueError):
    """A store address is not of the form ``host:port/prefix``."""


class RendezvousTimeoutError(FTError, TimeoutError, RuntimeError):
    """Some ranks of a new configuration did not arrive at its store address in time.

    A ``TimeoutError``, and a ``RuntimeError`` as torch's own store timeouts are (the
    message starts like theirs: ``... timed out after 10ms``).

    Attributes:
        store_addr: The configuration's ``host:port/prefix``.
        missing: The ranks that did not arrive, in order; empty when the store itself
            could not be reached.
    """

    def __init__(self, message: str, store_addr: str, missing: list[int]) -> None:
        super().__init__(message)
        self.store_addr = store_addr
        self.missing = missing


ARRIVAL_KEY = "dist_collectives/arrived/"


@dataclasses.dataclass(frozen=True)
class StoreAddress:
    """A parsed ``host:port/prefix`` store address."""

    host: str
    port: int
    prefix: str

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}/{self.prefix}"


def parse_store_addr(store_addr: str) -> StoreAddress:
    """Splits ``host:port/prefix`` into its parts.

    IPv6 hosts come bracketed (``[fdaa::1]:29521/prefix``) or bare
    (``fdaa:0:1:2:3:4:5:6:29521/prefix``): the port is always the field after the last
    colon, and brackets are stripped from the host.

    Raises:
        StoreAddressError: the address has no prefix, no port, or a port that is not an
            integer in 1..65535.
    """
    location, sep, prefix = store_addr.partition("/")
    if not sep or not prefix:
        raise StoreAddressError(
            f"store address {store_addr!r} has no prefix; expected 'host:port/prefix' "
            "with a prefix unique to this configuration"
        )
    host, colon, port_text = location.rpartition(":")
    if not colon or not host:
        raise StoreAddressError(
            f"store address {store_addr!r} has no host:port part; expected 'host:port/prefix'"
        )
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise StoreAddressError(
            f"store address {store_addr!r}: port {port_text!r} is not an integer"
        ) from None
    if not 0 < port < 65536:
        raise StoreAddressError(f"store address {store_addr!r}: port {port} is out of range")
    return StoreAddress(host, port, prefix)


def connect_tcp_store(
    host: str, port: int, timeout: timedelta = DEFAULT_STORE_TIMEOUT, *, shared: bool = True
) -> TCPStore:
    """A TCPStore client connected to a server that already runs at ``host:port``.

    Args:
        host: Where the store server runs.
        port: Its port.
        timeout: How long a blocking ``get``/``wait`` may take, and how long to try
            connecting.
        shared: Reuse this process's connection to ``host:port`` when one exists. A
            shared client serialises its callers, so a thread that blocks in ``wait``
            (a heartbeat or error watcher) wants its own connection: pass False.
    """
    if not shared:
        return _new_client(host, port, timeout)
    key = (host, port, os.getpid())
    with _lock:
        cached = _clients.get(key)
    if cached is not None and cached[0] is TCPStore:
        if _answers(cached[1]):
            return cached[1]
        # The server this connection reached is gone (a job's store restarted on the
        # same port, a test's store closed): its socket would fail every call.
        logger.debug("the store connection to %s:%d is closed; reconnecting", host, port)
    with _lock:
        current = _clients.get(key)
        if current is not None and current is not cached and current[0] is TCPStore:
            return current[1]  # another thread reconnected meanwhile
        logger.debug("connecting to the store at %s:%d", host, port)
        client = _new_client(host, port, timeout)
        _clients[key] = (TCPStore, client)
        return client


def _answers(client: TCPStore) -> bool:
    """Whether ``client``'s connection still reaches a live server (one round trip)."""
    try:
        client.num_keys()
    except (DistNetworkError, RuntimeError):
        return False
    return True


def _new_client(host: str, port: int, timeout: timedelta) -> TCPStore:
    return TCPStore(
        host_name=host, port=port, is_master=False, timeout=timeout, wait_for_workers=False
    )


@contextlib.contextmanager
def rendezvous_store(
    store_addr: str, timeout: timedelta = DEFAULT_STORE_TIMEOUT, who: str = "configure"
) -> Iterator[PrefixStore]:
    """A store client for one rendezvous: the shared connection when it is free.

    A TCPStore client holds its lock while it blocks in ``wait``, so a rendezvous stuck
    on a peer that died would hold up every other user of the shared connection until
    its timeout. While one rendezvous holds the shared connection, another one in this
    process gets a connection of its own.

    Args:
        store_addr: ``host:port/prefix``.
        timeout: How long connecting and each blocking store call may take.
        who: What rendezvouses, for the timeout's message (``ProcessGroupGloo.configure``).

    Raises:
        StoreAddressError: ``store_addr`` is malformed.
        RendezvousTimeoutError: the store could not be reached within ``timeout``.
    """
    address = parse_store_addr(store_addr)
    key = (address.host, address.port, os.getpid())
    with _lock:
        lease = _leases.setdefault(key, threading.Lock())
    if lease.acquire(blocking=False):
        try:
            client = _connect_for(who, store_addr, address, timeout)
            yield PrefixStore(address.prefix, client)
        finally:
            lease.release()
    else:
        logger.debug("the shared store connection is busy; opening another for %s", store_addr)
        client = _connect_for(who, store_addr, address, timeout, shared=False)
        yield PrefixStore(address.prefix, client)


def _connect_for(
    who: str, store_addr: str, address: StoreAddress, timeout: timedelta, *, shared: bool = True
) -> TCPStore:
    """:func:`connect_tcp_store` for a rendezvous: a store not reached in time is its timeout."""
    try:
        return connect_tcp_store(address.host, address.port, timeout, shared=shared)
    except DistNetworkError as error:
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise RendezvousTimeoutError(
            f"{who} {timed_out_after_ms(timeout)}: could not reach the store of {store_addr} "
            f"({cause})",
            store_addr,
            [],
        ) from None


def create_store_client(store_addr: str, timeout: timedelta = DEFAULT_STORE_TIMEOUT) -> PrefixStore:
    """A :class:`~torch.distributed.PrefixStore` for ``host:port/prefix``.

    The TCP connection underneath is shared by every client of the same ``host:port``
    in this process; its timeout is the one of the first caller.

    Raises:
        StoreAddressError: ``store_addr`` is malformed.
        RuntimeError: torch could not reach the store within ``timeout``.
    """
    address = parse_store_addr(store_addr)
    client = connect_tcp_store(address.host, address.port, timeout)
    return PrefixStore(address.prefix, client)


def wait_for_arrivals(
    store: Store,
    store_addr: str,
    rank: int,
    world_size: int,
    timeout: timedelta,
    who: str = "configure",
) -> None:
    """Marks ``rank`` as arrived under the configuration's prefix and waits for the others.

    Runs before a backend is built, so that a peer that never comes fails the
    configuration within ``timeout`` with the ranks it waited for, whatever the
    backend would do (NCCL's connect waits for ever). Backend-independent: every
    reconfigurable group calls it on the :class:`~torch.distributed.PrefixStore` of
    its new configuration. A group of one member waits for nobody and touches no key.

    Raises:
        RendezvousTimeoutError: some ranks did not arrive within ``timeout``; the
            message names the store address and those ranks.
    """
    if world_size <= 1:
        return
    started = time.monotonic()
    store.set(f"{ARRIVAL_KEY}{rank}", "1")
    others = [f"{ARRIVAL_KEY}{peer}" for peer in range(world_size) if peer != rank]
    try:
        store.wait(others, timeout)
        return
    except Exception as error:
        failure: Exception = error
    try:
        missing = [
            peer
            for peer in range(world_size)
            if peer != rank and not store.check([f"{ARRIVAL_KEY}{peer}"])
        ]
    except Exception:
        raise failure from None
    if not missing:  # they all came just as the wait gave up
        return
    waited = time.monotonic() - started
    raise RendezvousTimeoutError(
        f"{who} {timed_out_after_ms(timeout)}: rank(s) {missing} of "
        f"world_size={world_size} did not arrive at store address {store_addr} (waited "
        f"{waited:.1f} s as rank {rank}; the store said: {failure}); check that every "
        "member calls configure with the same address, and that the missing ones are alive",
        store_addr,
        missing,
    ) from None
