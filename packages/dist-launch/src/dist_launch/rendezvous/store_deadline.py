"""A deadline on every call to the rendezvous store, and to torch's handler that uses it.

torch's ``TCPStore`` client bounds only the wait for a key: against a store whose
process stops answering while its connection stays open (a node cut off from the
network, a stopped process), ``add``, ``check`` and even a ``get`` or ``wait`` past
their own timeout block until TCP gives up, which took 929 s in one try. So each call
runs on a daemon thread of its own and the caller waits at most its deadline, torch's
``read_timeout`` unless the call says otherwise; at the deadline the caller gets a
:class:`StoreDeadlineError` that names the store's address, and the thread is left to
end whenever the socket does.

Once one call has missed its deadline and is still blocked, the store counts as
silent: every later call fails at once with the same kind of error (no new thread,
no new wait), until the blocked call returns.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Generic, Protocol, TypeVar, cast

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RendezvousStore(Protocol):
    """The methods of torch's ``Store`` the launcher uses (tests pass a dict-backed one)."""

    def set(self, key: str, value: str) -> None:
        """Sets ``key``."""

    def get(self, key: str) -> bytes:
        """The value of ``key``; waits for it (bounded by the store's timeout)."""

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the counter ``key`` (0 when new); returns the new value."""

    def check(self, keys: list[str]) -> bool:
        """True when every key is set."""

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``; waits for them."""

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        """Waits until every key is set; raises after ``timeout``."""


class StoreDeadlineError(TimeoutError):
    """A call to the rendezvous store did not return within its deadline."""


class _Call(Generic[T]):
    """One call's result, filled in by its thread."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: T | None = None
        self.error: BaseException | None = None
        self.late = False  # the caller gave up on it
        self.abandoned = False  # the store was given up while the caller waited


class StoreDeadline:
    """Runs calls to one store, each bounded by a deadline; see the module docstring.

    Args:
        address: The store's ``host:port``, for the errors.
        seconds: The deadline of a call that names none (torch's ``read_timeout``).
        setting: How the errors name the setting behind ``seconds``.
    """

    def __init__(self, address: str, seconds: float, setting: str = "read_timeout") -> None:
        self.address = address
        self.seconds = seconds
        self.setting = setting
        self._lock = threading.Lock()
        self._blocked: dict[int, tuple[str, float]] = {}  # id -> (call, started)
        self._silenced: str | None = None
        self._waiting: set[_Call[object]] = set()

    @property
    def silenced(self) -> str | None:
        """Why the store was given up (:meth:`silence`), or None while it is not."""
        with self._lock:
            return self._silenced

    def silence(self, why: str) -> None:
        """Takes the store for silent from now on: every later call fails at once.

        For a node fenced off a cut (:mod:`dist_launch.watch.cut_watch`): its way out
        must not wait a ``read_timeout`` per call on a store it knows it cannot reach.
        """
        with self._lock:
            self._silenced = why
            waiting, self._waiting = self._waiting, set()
        for pending in waiting:  # their callers stop waiting now
            pending.abandoned = True
            pending.done.set()

    def run(
        self, what: str, call: Callable[[], T], seconds: float | None = None, why: str = ""
    ) -> T:
        """``call()``, or :class:`StoreDeadlineError` after ``seconds`` (or the default).

        Args:
            what: The call, as the error names it (``add('dist_launch/failed')``).
            call: The call.
            seconds: Its deadline, when not the default.
            why: Which settings make ``seconds``, as the error names them.

        Raises:
            StoreDeadlineError: The call did not return in time, or an earlier call is
                still blocked past its deadline; the message names the address.
            Exception: What ``call`` raised.
        """
        pending: _Call[T] = _Call()
        with self._lock:
            if self._silenced is not None:
                raise StoreDeadlineError(
                    f"the rendezvous store at {self.address} is out of reach "
                    f"({self._silenced}); {what} not tried"
                )
            if self._blocked:
                stuck, started = next(iter(self._blocked.values()))
                raise StoreDeadlineError(
                    f"the rendezvous store at {self.address} is silent: {stuck} has had no "
                    f"answer for {time.monotonic() - started:.0f} s; {what} not tried"
                )
            self._waiting.add(cast(_Call[object], pending))
        deadline = self.seconds if seconds is None else seconds
        started = time.monotonic()
        thread = threading.Thread(
            target=self._serve, args=(pending, call), name=f"store: {what}", daemon=True
        )
        thread.start()
        answered = pending.done.wait(deadline)
        with self._lock:
            self._waiting.discard(cast(_Call[object], pending))
        if pending.abandoned:
            raise StoreDeadlineError(
                f"the rendezvous store at {self.address} is out of reach ({self._silenced}); "
                f"{what} given up"
            )
        if not answered:
            with self._lock:
                if not pending.done.is_set():
                    pending.late = True
                    self._blocked[id(pending)] = (what, started)
            if pending.late:
                raise StoreDeadlineError(
                    f"the rendezvous store at {self.address} did not answer {what} within "
                    f"{deadline:g} s ({why or self.setting})"
                )
        if pending.error is not None:
            raise pending.error
        return cast(T, pending.value)

    def _serve(self, pending: _Call[T], call: Callable[[], T]) -> None:
        try:
            pending.value = call()
        except BaseException as error:  # handed to the caller
            pending.error = error
        finally:
            with self._lock:
                pending.done.set()
                if pending.late:
                    self._blocked.pop(id(pending), None)
                    logger.info("the rendezvous store at %s answered again", self.address)


class BoundedStore:
    """A store whose every call has a deadline (:class:`StoreDeadline`).

    Args:
        store: torch's store (or a prefix store over it).
        deadline: The deadlines of the store's connection, shared by every wrapper of it.
    """

    def __init__(self, store: RendezvousStore, deadline: StoreDeadline) -> None:
        self.store = store
        self.deadline = deadline

    def silence(self, why: str) -> None:
        """Every later call to the store fails at once (:meth:`StoreDeadline.silence`)."""
        self.deadline.silence(why)

    def set(self, key: str, value: str) -> None:
        """Sets ``key``."""
        self.deadline.run(f"set({key!r})", lambda: self.store.set(key, value))

    def get(self, key: str) -> bytes:
        """The value of ``key``."""
        return self.deadline.run(f"get({key!r})", lambda: self.store.get(key))

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the counter ``key``; returns its new value."""
        return self.deadline.run(f"add({key!r})", lambda: self.store.add(key, amount))

    def check(self, keys: list[str]) -> bool:
        """True when every key is set."""
        return self.deadline.run(f"check({keys!r})", lambda: self.store.check(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``."""
        return self.deadline.run(f"multi_get({keys!r})", lambda: self.store.multi_get(keys))

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        """Waits until every key is set: ``timeout``, then the store's deadline to say so."""
        self.deadline.run(
            f"wait({keys!r})",
            lambda: self.store.wait(keys, timeout),
            seconds=timeout.total_seconds() + self.deadline.seconds,
            why=f"the wait's {timeout.total_seconds():g} s + {self.deadline.setting}",
        )
