"""Quorums of live replicas, agreed through a key-value store.

A replica announces itself by beating a counter (``hb/<id>``) and asks for a quorum
by appending ``<id> <step>`` to the member list of the current *round*. Any replica may
close a round once every replica it sees alive has joined (or ``join_timeout`` has
passed since it joined); closing writes the decision with ``compare_set``, so the first
writer wins and every replica reads the same decision. The round counter then moves
on, and a replica that arrived too late joins the next round.

The decision keeps the quorum id of the previous round when the members are the same
and no error was reported in it; otherwise the id goes up by one and every member
reconfigures its group on a prefix named after the new id.

Liveness needs no synchronised clocks: each observer notes, on its own monotonic
clock, when it last saw a replica's counter change.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from datetime import timedelta

from torch.distributed import Store  # type: ignore[attr-defined]  # public, not re-exported in the stubs

from dist_collectives.ft.errors import FTError

logger = logging.getLogger(__name__)

# How long a waiter sleeps on the server before it looks again at who is alive. The
# replica that completes a round, and any error, wake waiters at once; the slice only
# bounds how late a waiter notices that a replica stopped beating.
WAIT_SLICE_SECONDS = 0.5
# Bumped by every replica that announces itself: a commit that sees it unchanged since
# the quorum was decided lets the next step reuse the quorum without a round.
REGISTRY_VERSION_KEY = "replicas_version"


def wait_for_key(store: Store, key: str, seconds: float, *, check_first: bool = True) -> bool:
    """Whether ``key`` appears in ``store`` within ``seconds``.

    Waits on the server, which answers as soon as the key is set: polling instead took
    CPU from the training processes on small machines (about a quarter of a small
    step on 2 cores). A wait that runs out makes torch's TCPStore client log a warning;
    that happens only while a replica is missing. ``check_first=False`` saves a round
    trip when the key is most likely still missing.
    """
    if check_first and store.check([key]):
        return True
    try:
        store.wait([key], timedelta(seconds=seconds))
    except Exception:  # torch raises DistStoreError (or RuntimeError) on a timeout
        return bool(store.check([key]))
    return True


def _append(store: Store, key: str, value: str) -> None:
    """Appends atomically on the server (``Store.append`` is missing from torch's stubs)."""
    store.append(key, value)  # type: ignore[attr-defined]


class QuorumTimeoutError(FTError, TimeoutError):
    """No quorum could be formed in time (too few replicas, or the store did not answer)."""


@dataclasses.dataclass(frozen=True)
class Quorum:
    """One round's decision: who trains the next step, and from which state."""

    round: int
    quorum_id: int
    members: tuple[str, ...]
    steps: tuple[int, ...]
    registry_version: int = 0

    @property
    def max_step(self) -> int:
        """The newest step any member has committed."""
        return max(self.steps)

    @property
    def participants(self) -> tuple[str, ...]:
        """Members that hold the newest state; the others must heal first."""
        return tuple(m for m, s in zip(self.members, self.steps, strict=True) if s == self.max_step)

    def replica_rank(self, replica_id: str) -> int:
        """The rank of ``replica_id`` in the group of this quorum."""
        return self.members.index(replica_id)

    def step_of(self, replica_id: str) -> int:
        """The step ``replica_id`` had committed when it joined."""
        return self.steps[self.members.index(replica_id)]

    def heal_source(self, replica_id: str) -> str:
        """The participant that sends its state to the healing member ``replica_id``."""
        behind = [m for m, s in zip(self.members, self.steps, strict=True) if s < self.max_step]
        participants = self.participants
        return participants[behind.index(replica_id) % len(participants)]

    def healers_of(self, source_id: str) -> list[str]:
        """The members that ``source_id`` sends its state to."""
        behind = [m for m, s in zip(self.members, self.steps, strict=True) if s < self.max_step]
        return [m for m in behind if self.heal_source(m) == source_id]

    def to_json(self) -> str:
        """The decision as stored."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> Quorum:
        """Parses a stored decision (JSON only: the store is shared, nothing is unpickled)."""
        raw = json.loads(text)
        return cls(
            round=int(raw["round"]),
            quorum_id=int(raw["quorum_id"]),
            members=tuple(str(m) for m in raw["members"]),
            steps=tuple(int(s) for s in raw["steps"]),
            registry_version=int(raw.get("registry_version", 0)),
        )

    def next_step(self) -> Quorum:
        """The same quorum one committed step later (every member then shares a step)."""
        return dataclasses.replace(self, steps=(self.max_step + 1,) * len(self.members))


class Liveness:
    """Which replicas beat their heartbeat counter recently, on this observer's clock."""

    def __init__(self, store: Store, heartbeat_timeout: timedelta) -> None:
        self._store = store
        self._timeout = heartbeat_timeout.total_seconds()
        self._seen: dict[str, tuple[bytes, float]] = {}

    def beat(self, replica_id: str) -> None:
        """Advances this replica's own counter."""
        self._store.add(f"hb/{replica_id}", 1)

    def announce(self, replica_id: str) -> None:
        """Adds ``replica_id`` to the registry of replicas and clears a previous leave."""
        _append(self._store, "replicas", f"{replica_id}\n")
        self._store.set(f"left/{replica_id}", "0")
        self.beat(replica_id)
        self._store.add(REGISTRY_VERSION_KEY, 1)

    def leave(self, replica_id: str) -> None:
        """Marks ``replica_id`` as gone for good, so that nobody waits for it."""
        self._store.set(f"left/{replica_id}", "1")

    def alive(self, registry: bytes | None = None) -> set[str]:
        """Replicas whose counter moved within the heartbeat timeout and that did not leave.

        Args:
            registry: The value of the ``replicas`` key when the caller just read it.
        """
        if registry is None:
            if not self._store.check(["replicas"]):
                return set()
            registry = self._store.get("replicas")
        registered = sorted(set(registry.decode().split()))
        if not registered:
            return set()
        values = self._store.multi_get(
            [f"hb/{r}" for r in registered] + [f"left/{r}" for r in registered]
        )
        now = time.monotonic()
        alive = set()
        for index, replica in enumerate(registered):
            counter, left = values[index], values[len(registered) + index]
            previous = self._seen.get(replica)
            if previous is None or previous[0] != counter:
                self._seen[replica] = (counter, now)
                last_change = now
            else:
                last_change = previous[1]
            if left != b"1" and now - last_change < self._timeout:
                alive.add(replica)
        return alive


def _members_of(raw: bytes) -> dict[str, int]:
    members: dict[str, int] = {}
    for line in raw.decode().splitlines():
        replica, _, step = line.rpartition(" ")
        if replica:
            members[replica] = int(step)
    return members


def _decide(store: Store, round_: int, members: dict[str, int], known: Quorum | None) -> Quorum:
    previous = known if known is not None and known.round == round_ - 1 else None
    if previous is None and round_ > 0 and store.check([f"r{round_ - 1}/decision"]):
        previous = Quorum.from_json(store.get(f"r{round_ - 1}/decision"))
    ordered = sorted(members)
    steps = tuple(members[m] for m in ordered)
    if previous is None:
        quorum_id = round_  # round 0; later rounds always have a previous decision
    else:
        unchanged = (
            previous.members == tuple(ordered)
            and len(set(steps)) == 1
            and not store.check([f"err/{previous.quorum_id}"])
        )
        quorum_id = previous.quorum_id if unchanged else previous.quorum_id + 1
    return Quorum(round=round_, quorum_id=quorum_id, members=tuple(ordered), steps=steps)


def compute_quorum(
    store: Store,
    replica_id: str,
    step: int,
    *,
    liveness: Liveness,
    min_replicas: int,
    join_timeout: timedelta,
    timeout: timedelta,
    previous: Quorum | None = None,
) -> Quorum:
    """Joins the current round and returns its decision (see the module doc).

    Every store call is a round trip that the training processes pay for in CPU, so
    reads are batched and the decision comes back from ``compare_set`` itself.

    Args:
        store: The store all replicas share (prefixed for this manager group).
        replica_id: This replica.
        step: The last step this replica committed.
        liveness: This replica's view of who is alive.
        min_replicas: A round closes only with at least this many members.
        join_timeout: Close a round without a replica that looks alive but did not join.
        timeout: Give up after this long.
        previous: The last decision this replica saw (saves reading it again).

    Raises:
        QuorumTimeoutError: no decision that includes this replica within ``timeout``.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    round_ = int(store.add("round", 0))
    joined: int | None = None
    joined_at = 0.0
    members: dict[str, int] = {}
    alive: set[str] = set()
    while True:
        if joined != round_:
            _append(store, f"r{round_}/members", f"{replica_id} {step}\n")
            joined, joined_at = round_, time.monotonic()
        decision_key = f"r{round_}/decision"
        decision: bytes | None = None
        if store.check([decision_key]):
            decision = store.get(decision_key)
        else:
            raw_members, registry, version = store.multi_get(
                [f"r{round_}/members", "replicas", REGISTRY_VERSION_KEY]
            )
            members = _members_of(raw_members)
            alive = liveness.alive(registry)
            waited = time.monotonic() - joined_at
            everyone_in = alive.issubset(members) or waited > join_timeout.total_seconds()
            if len(members) >= min_replicas and everyone_in:
                proposal = dataclasses.replace(
                    _decide(store, round_, members, previous), registry_version=int(version)
                ).to_json()
                # The first proposal wins; compare_set answers with the one that did.
                decision = store.compare_set(decision_key, "", proposal)
        if decision is not None:
            quorum = Quorum.from_json(decision)
            store.compare_set("round", str(round_), str(round_ + 1))
            if replica_id in quorum.members:
                return quorum
            previous = quorum
            round_ += 1
            continue
        if time.monotonic() > deadline:
            raise QuorumTimeoutError(
                f"replica {replica_id!r}: no quorum within {timeout}: round {round_} has "
                f"{sorted(members)} (need at least {min_replicas}), alive: {sorted(alive)}"
            )
        wait_for_key(store, decision_key, WAIT_SLICE_SECONDS)
