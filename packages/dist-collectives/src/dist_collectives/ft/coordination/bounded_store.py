"""Store calls that return within a bound, even when the store's server stops answering.

torch's TCPStore client bounds only the waits (``wait``, and the wait for a key inside
``get``): every other call (``set``, ``add``, ``compare_set``, ``check``,
``multi_get``, ``append``, ``num_keys``, the reply of ``get``) reads its answer with a
plain blocking ``recv``. A server that is stopped (SIGSTOP, a paused container, a
frozen host) keeps its TCP connections open, so such a call blocks for ever, and every
other user of that connection queues behind it. ``Store.set_timeout`` changes only the
wait bound.

A :class:`BoundedStore` makes each call on a *link*: one TCPStore client, created on
the link's own long-lived thread (``ft-store-<label>``), which makes the calls queued
to it one after the other. The caller waits for the answer up to the call's bound (the
Manager's timeout, a wait's own timeout plus :data:`WAIT_GRACE_SECONDS`); past it the
caller gets a :class:`StoreTimeoutError` naming the call and the store, and the link is
abandoned: its thread ends once the stuck call returns (the server resumed, or the
connection broke), and the next call opens a new link, whose connect is bounded the
same way. At most :data:`MAX_STUCK_LINKS` abandoned links wait at once per store;
beyond that calls fail at once instead of piling up threads.

Threads: each BoundedStore is used by one owning thread (the Manager gives each of its
threads its own); its link threads belong to it. One lock guards which link is current
and how many are stuck.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]  # public, not re-exported in the stubs

from dist_collectives.ft.errors import FTError, timed_out_after_ms

logger = logging.getLogger(__name__)

# How long past a wait's own timeout its caller waits for the server's answer.
WAIT_GRACE_SECONDS = 1.0
# Abandoned links (each a thread blocked in a call) per store, at most.
MAX_STUCK_LINKS = 4

_T = TypeVar("_T")
_Call = tuple[Callable[[Store], Any], concurrent.futures.Future[Any]]


class StoreTimeoutError(FTError, TimeoutError, RuntimeError):
    """A store call did not return within its bound; the message names the call and store.

    A ``TimeoutError``, and a ``RuntimeError`` as torch's own store timeouts are.
    """


class KeyValueStore(Protocol):
    """The store calls the quorum protocol makes: a torch Store, or a :class:`BoundedStore`."""

    def set(self, key: str, value: str) -> None: ...  # noqa: D102

    def get(self, key: str) -> bytes: ...  # noqa: D102

    def add(self, key: str, value: int) -> int: ...  # noqa: D102

    def check(self, keys: list[str]) -> bool: ...  # noqa: D102

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes: ...  # noqa: D102

    def multi_get(self, keys: list[str]) -> list[bytes]: ...  # noqa: D102

    def wait(self, keys: list[str], timeout: timedelta) -> None: ...  # noqa: D102


class _Link:
    """One TCPStore connection and the thread that makes every call on it."""

    def __init__(
        self,
        connect: Callable[[], Store],
        name: str,
        on_exit: Callable[[_Link], None],
    ) -> None:
        self._connect = connect
        self._on_exit = on_exit
        self._calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        # Set by the owner when a call on it timed out: the thread ends after that call.
        self.abandoned = False
        self.dead = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[Store], _T]) -> concurrent.futures.Future[_T]:
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        self._calls.put((call, future))
        return future

    def close(self) -> None:
        self._calls.put(None)

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            store: Store | None = self._connect()
        except Exception as error:
            store, failure = None, error
        try:
            while (item := self._calls.get()) is not None:
                call, future = item
                if not future.set_running_or_notify_cancel():
                    continue
                if store is None:
                    future.set_exception(failure)
                    break
                try:
                    future.set_result(call(store))
                except BaseException as error:  # handed to the caller, whatever it is
                    future.set_exception(error)
                if self.abandoned:
                    break
        finally:
            self.dead = True
            self._fail_queued()
            self._on_exit(self)

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[1].set_running_or_notify_cancel():
                item[1].set_exception(StoreTimeoutError("the store connection was given up"))


class BoundedStore:
    """A client of a TCPStore server whose every call returns within a bound.

    See the module doc. The methods are the store calls of ``dist_collectives.ft``,
    with torch's signatures.

    Args:
        host: Where the store server runs.
        port: Its port.
        prefix: Key prefix of every call ('' for none).
        timeout: The bound of each call (and torch's own wait timeout on the link).
        label: Names the link threads (``ft-store-<label>``) in thread dumps.
    """

    def __init__(
        self, host: str, port: int, *, prefix: str = "", timeout: timedelta, label: str
    ) -> None:
        self._host, self._port, self._prefix = host, port, prefix
        self.timeout = timeout
        self._label = label
        self._lock = threading.Lock()
        # Guarded by _lock: the link calls go to, the abandoned ones still blocked.
        self._link: _Link | None = None
        self._stuck: set[_Link] = set()
        self._closed = False

    @property
    def address(self) -> str:
        """``host:port/prefix``, as the errors name it."""
        return f"{self._host}:{self._port}/{self._prefix}"

    def _connect(self) -> Store:
        client = TCPStore(
            host_name=self._host,
            port=self._port,
            is_master=False,
            timeout=self.timeout,
            wait_for_workers=False,
        )
        return PrefixStore(self._prefix, client) if self._prefix else client

    def _exited(self, link: _Link) -> None:
        with self._lock:
            self._stuck.discard(link)

    def _current(self, what: str) -> _Link:
        with self._lock:
            if self._closed:
                raise StoreTimeoutError(f"store {what} on {self.address}: the client was closed")
            if self._link is None or self._link.dead:
                if len(self._stuck) >= MAX_STUCK_LINKS:
                    raise StoreTimeoutError(
                        f"store {what} on {self.address} not tried: {len(self._stuck)} earlier "
                        "calls are still waiting for the store server to answer (stopped or "
                        "overloaded?)"
                    )
                self._link = _Link(self._connect, f"ft-store-{self._label}", self._exited)
            return self._link

    def _abandon(self, link: _Link) -> None:
        with self._lock:
            link.abandoned = True
            if not link.dead:
                self._stuck.add(link)
            if self._link is link:
                self._link = None
        link.close()

    def submit(self, what: str, call: Callable[[Store], _T]) -> concurrent.futures.Future[_T]:
        """Queues ``call`` on the current link; its future, which the caller bounds itself.

        Raises:
            StoreTimeoutError: too many earlier calls are stuck, or the client is closed.
        """
        return self._current(what).submit(call)

    def call(self, what: str, call: Callable[[Store], _T], bound: timedelta | None = None) -> _T:
        """Makes ``call`` on the current link and waits at most ``bound`` for its answer.

        Args:
            what: The call, for the error (``add('round')``).
            call: The call, given the link's torch store.
            bound: How long to wait (the store's timeout when None).

        Raises:
            StoreTimeoutError: no answer within ``bound``; the message names ``what``.
            Exception: the call's own error (torch's ``DistStoreError``, ...).
        """
        bound = bound if bound is not None else self.timeout
        link = self._current(what)
        future = link.submit(call)
        try:
            return future.result(bound.total_seconds())
        except concurrent.futures.TimeoutError:
            self._abandon(link)
            raise StoreTimeoutError(
                f"store {what} on {self.address} {timed_out_after_ms(bound)}: the store "
                "server did not answer (stopped or overloaded?)"
            ) from None

    def wait_bound(self, timeout: timedelta) -> timedelta:
        """How long a caller waits for the answer of a ``wait`` of ``timeout``."""
        return timeout + timedelta(seconds=WAIT_GRACE_SECONDS)

    # -- torch's Store calls, bounded -----------------------------------------------

    def set(self, key: str, value: str) -> None:  # noqa: D102
        self.call(f"set({key!r})", lambda store: store.set(key, value))

    def get(self, key: str) -> bytes:  # noqa: D102
        return self.call(
            f"get({key!r})", lambda store: bytes(store.get(key)), self.wait_bound(self.timeout)
        )

    def add(self, key: str, value: int) -> int:  # noqa: D102
        return self.call(f"add({key!r})", lambda store: int(store.add(key, value)))

    def append(self, key: str, value: str) -> None:  # noqa: D102
        self.call(f"append({key!r})", lambda store: store.append(key, value))  # type: ignore[attr-defined]  # missing from torch's stubs

    def check(self, keys: list[str]) -> bool:  # noqa: D102
        return self.call(f"check({keys!r})", lambda store: bool(store.check(keys)))

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:  # noqa: D102
        return self.call(
            f"compare_set({key!r})",
            lambda store: bytes(store.compare_set(key, expected_value, desired_value)),
        )

    def multi_get(self, keys: list[str]) -> list[bytes]:  # noqa: D102
        return self.call(
            f"multi_get({len(keys)} keys)",
            lambda store: [bytes(value) for value in store.multi_get(keys)],
            self.wait_bound(self.timeout),
        )

    def num_keys(self) -> int:  # noqa: D102
        return self.call("num_keys()", lambda store: int(store.num_keys()))

    def delete_key(self, key: str) -> bool:  # noqa: D102
        return self.call(f"delete_key({key!r})", lambda store: bool(store.delete_key(key)))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Waits until every key exists; torch's wait error after ``timeout``."""
        timeout = timeout if timeout is not None else self.timeout
        bound = self.wait_bound(timeout)
        self.call(f"wait({keys!r})", lambda store: store.wait(keys, timeout), bound)

    def close(self, timeout: float = 1.0) -> None:
        """Ends the link threads; a link stuck in a call is left to end when it returns."""
        with self._lock:
            self._closed = True
            links = [link for link in (self._link, *self._stuck) if link is not None]
            self._link = None
        for link in links:
            link.close()
        for link in links:
            if not link.join(timeout):
                logger.debug("a store call on %s is still waiting for its answer", self.address)
