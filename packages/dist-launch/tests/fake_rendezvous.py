"""A dict-backed store and a fake torch rendezvous handler, for tests without processes.

:class:`FakeStore` has the methods of torch's ``Store`` that
:mod:`dist_launch.rendezvous.c10d` uses, with torch's meaning (values are bytes,
counters are decimal strings, reads wait for missing keys up to a bounded timeout).
:class:`FakeJob` plays torch's c10d rendezvous for several nodes on threads of one
process: each round is a prefix of one job store, as torch hands out a
``PrefixStore`` per round.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace

# Reads of a missing key give up after this long: a test that forgets a node fails
# quickly instead of hanging.
WAIT_SECONDS = 5.0


class FakeStore:
    """A thread-safe dict with torch ``Store`` semantics."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: str | bytes) -> None:
        with self._changed:
            self.data[key] = value.encode() if isinstance(value, str) else value
            self._changed.notify_all()

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            total = int(self.data.get(key, b"0")) + amount
            self.data[key] = str(total).encode()
            self._changed.notify_all()
            return total

    def check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(key in self.data for key in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = WAIT_SECONDS if timeout is None else min(WAIT_SECONDS, timeout.total_seconds())
        with self._changed:
            if not self._changed.wait_for(lambda: all(k in self.data for k in keys), seconds):
                missing = [k for k in keys if k not in self.data]
                raise TimeoutError(f"keys not set in time: {missing}")

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.data[key]

    def wait_for_value(self, key: str, value: bytes) -> None:
        """Waits (bounded) until ``key`` holds ``value``: a counter reached, not only made."""
        with self._changed:
            if not self._changed.wait_for(lambda: self.data.get(key) == value, WAIT_SECONDS):
                raise TimeoutError(f"{key} is {self.data.get(key)!r}, not {value!r}")

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return [self.data[key] for key in keys]


class FakePrefixStore(FakeStore):
    """A view of ``underlying_store`` under ``prefix``, as torch's ``PrefixStore``."""

    def __init__(self, prefix: str, underlying_store: FakeStore) -> None:
        self.prefix = prefix
        self.underlying_store = underlying_store

    def set(self, key: str, value: str | bytes) -> None:
        self.underlying_store.set(self.prefix + key, value)

    def add(self, key: str, amount: int) -> int:
        return self.underlying_store.add(self.prefix + key, amount)

    def check(self, keys: list[str]) -> bool:
        return self.underlying_store.check([self.prefix + key for key in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.underlying_store.wait([self.prefix + key for key in keys], timeout)

    def get(self, key: str) -> bytes:
        return self.underlying_store.get(self.prefix + key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.underlying_store.multi_get([self.prefix + key for key in keys])


@dataclass
class BootstrapInfo:
    master_addr: str
    master_port: int


@dataclass
class RoundInfo:
    """What torch's ``next_rendezvous`` returns (``RendezvousInfo``), as far as used."""

    store: FakePrefixStore
    rank: int
    world_size: int
    bootstrap_store_info: BootstrapInfo


@dataclass
class FakeJob:
    """One job's rendezvous state, shared by the nodes' handlers."""

    nodes: int = 1
    store: FakeStore = field(default_factory=FakeStore)
    round: int = 0
    closed: bool = False
    waiting: int = 0
    participants: int | None = None  # None: every node of the round is alive

    def handler(self, group_rank: int) -> FakeHandler:
        return FakeHandler(self, group_rank)

    def next_round(self) -> None:
        """A new round forms (every node will join it)."""
        self.round += 1


class FakeHandler:
    """torch's ``RendezvousHandler`` for one node of a :class:`FakeJob`.

    A lone node forms a new round each time it joins; with several nodes the test
    moves the job to its next round (:meth:`FakeJob.next_round`).
    """

    def __init__(self, job: FakeJob, group_rank: int) -> None:
        self.job = job
        self.group_rank = group_rank
        self.shut_down = False
        self._joined: int | None = None

    def next_rendezvous(self) -> RoundInfo:
        job = self.job
        if job.closed:
            raise RuntimeError("the rendezvous is closed")
        if job.nodes == 1 and self._joined is not None:
            job.next_round()
        self._joined = job.round
        return RoundInfo(
            store=FakePrefixStore(f"torch.rendezvous.job.{job.round}/", job.store),
            rank=self.group_rank,
            world_size=job.nodes,
            bootstrap_store_info=BootstrapInfo("node0", 29511),
        )

    def num_nodes_waiting(self) -> int:
        return self.job.waiting

    @property
    def _state_holder(self) -> SimpleNamespace | None:
        # Where torch's DynamicRendezvousHandler keeps the round's live participants.
        alive = self.job.participants
        if alive is None:
            alive = self.job.nodes
        return SimpleNamespace(state=SimpleNamespace(participants=dict.fromkeys(range(alive))))

    def is_closed(self) -> bool:
        return self.job.closed

    def set_closed(self) -> None:
        self.job.closed = True

    def shutdown(self) -> bool:
        self.shut_down = True
        return True
