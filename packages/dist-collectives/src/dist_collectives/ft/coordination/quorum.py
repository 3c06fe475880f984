"""Quorums of live replicas, agreed through a key-value store.

A replica announces itself by beating a counter (``hb/<id>``) and asks for a quorum
by appending ``<id> <step>`` to the member list of the current *round* (and bumping
the registry version, so that members that reuse their quorum hold a round for it). Any replica may
close a round once every replica it sees alive has joined (or ``join_timeout`` has
passed since it joined); closing writes the decision with ``compare_set``, so the first
writer wins and every replica reads the same decision. The round counter then moves
on, and a replica that arrived too late joins the next round. The job's first round
also waits until no replica has announced itself (or asked to join) for
``first_quorum_window``, so that replicas started together begin in one quorum instead
of the last ones healing a step later.

Only one replica per round reads who is alive: the first to join, which becomes the
round's *closer* (``compare_set`` on ``r<round>/closer``). It alone checks, every tick,
whether the round is due and counts its checks in ``r<round>/closing``; every other
member only waits for the decision, and every ``CLOSER_CHECK_SECONDS`` reads that
counter: one that stood still since its last look means the closer died or left the
round, and the member takes its place. A replica thus makes a handful of store calls per
round whatever the number of replicas (see ``benchmarks/ft.py --only scale``).

A replica waits for the decision in one ``wait`` on the store, which the closing
replica's write ends at once; on a
:class:`~dist_collectives.ft.coordination.bounded_store.BoundedStore` that wait runs on
the store's own link thread while the waiting thread checks, every ``ROUND_TICK_SECONDS``
and on a second connection, what closes a round on a timer (a
replica that stopped beating, a join time that ran out). No thread is started per
round. No wait is made with a short timeout: torch's TCPStore client logs two warnings
(``[c10d] waitForInput: ... likely a timeout``) each time one runs out, which read like
a network fault; here only a real timeout logs. On a plain torch store (tests,
benchmarks) the waiting thread only checks every tick.

The decision keeps the quorum id of the previous round when the members are the same
and no error was reported in it; otherwise the id goes up by one and every member
reconfigures its group on a prefix named after the new id.

Liveness needs no synchronised clocks: each observer notes, on its own monotonic
clock, when it last saw a replica's counter change.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Collection, Sequence
from datetime import timedelta

from dist_collectives.ft.coordination.bounded_store import KeyValueStore
from dist_collectives.ft.errors import FTError

logger = logging.getLogger(__name__)

# How often a replica that waits for a round's decision checks whether the round is due
# to close on a timer (a replica stopped beating, a join time ran out). The replica that
# completes a round wakes the waiters at once; the tick only bounds how late a round
# closes after a replica died.
ROUND_TICK_SECONDS = 0.1
# Bumped by every replica that announces itself and by every request to join a round:
# a commit that sees it unchanged since the quorum was decided lets the next step reuse
# the quorum without a round. The joins count too because a replica can announce itself
# before a round closes and join only after it closed without it (a round closes without
# a live replica on the join timeout): the members must then hold a round, or it waits
# in one that nobody else joins.
REGISTRY_VERSION_KEY = "replicas_version"
# How often a member that does not close its round checks that the closer still does.
CLOSER_CHECK_SECONDS = 1.0


def _append(store: KeyValueStore, key: str, value: str) -> None:
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
    # Whether members that start a job together copy one state before the first step,
    # as torchft's ``init_sync`` does: replicas whose weights were initialised
    # differently (an unseeded init, a different device's kernels) would otherwise
    # train on apart for ever with every step committed.
    init_sync: bool = False
    # The quorum's UUID, as torchft 0.3 names a quorum: new whenever ``quorum_id`` is,
    # kept with it. ``quorum_id`` stays the integer torchft 0.2 returned.
    quorum_uuid: str = ""

    @property
    def communicator_uuid(self) -> int | None:
        """The ``uuid`` of the group this quorum configures (``torchft_<uuid>_rank_<n>``).

        The low 63 bits of :attr:`quorum_uuid` (torch's ``ReconfigureOptions.uuid`` is a
        signed 64-bit integer); None for a decision written without a UUID.
        """
        if not self.quorum_uuid:
            return None
        return uuid.UUID(self.quorum_uuid).int & ((1 << 63) - 1)

    @property
    def max_step(self) -> int:
        """The newest step any member has committed."""
        return max(self.steps)

    @property
    def participants(self) -> tuple[str, ...]:
        """Members that hold the newest state; the others must heal first."""
        return tuple(m for m, s in zip(self.members, self.steps, strict=True) if s == self.max_step)

    @property
    def syncs_first_state(self) -> bool:
        """Whether, before anyone committed a step, every member copies the first one's state.

        They copy it before they compute the first step (the Manager loads it in
        ``start_quorum``), so all of them still take part in that step.
        """
        return self.init_sync and self.max_step == 0 and len(self.members) > 1

    @property
    def receivers(self) -> tuple[str, ...]:
        """Members that receive a peer's state in this quorum.

        The members behind the newest step (:meth:`is_behind`), or, when
        :attr:`syncs_first_state`, every member but the first.
        """
        if self.syncs_first_state:
            return self.members[1:]
        return tuple(m for m, s in zip(self.members, self.steps, strict=True) if s < self.max_step)

    def is_behind(self, replica_id: str) -> bool:
        """Whether ``replica_id`` is behind the newest step: it heals and does not take part."""
        return self.step_of(replica_id) < self.max_step

    def replica_rank(self, replica_id: str) -> int:
        """The rank of ``replica_id`` in the group of this quorum."""
        return self.members.index(replica_id)

    def step_of(self, replica_id: str) -> int:
        """The step ``replica_id`` had committed when it joined."""
        return self.steps[self.members.index(replica_id)]

    def heal_source(self, replica_id: str) -> str:
        """The participant that sends its state to the receiving member ``replica_id``."""
        if self.syncs_first_state:
            return self.members[0]
        participants = self.participants
        return participants[self.receivers.index(replica_id) % len(participants)]

    def healers_of(self, source_id: str) -> list[str]:
        """The members that ``source_id`` sends its state to."""
        return [m for m in self.receivers if self.heal_source(m) == source_id]

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
            init_sync=bool(raw.get("init_sync", False)),
            quorum_uuid=str(raw.get("quorum_uuid", "")),
        )

    def next_step(self) -> Quorum:
        """The same quorum one committed step later (every member then shares a step)."""
        return dataclasses.replace(self, steps=(self.max_step + 1,) * len(self.members))


class HeartbeatClock:
    """When each heartbeat counter last moved, on one observer's clock: no store, no clock.

    The observer hands in each counter it read and the time it read it; clocks of
    different hosts are never compared.
    """

    def __init__(self) -> None:
        self._seen: dict[str, tuple[bytes, float]] = {}

    def quiet_for(self, key: str, counter: bytes, now: float) -> float | None:
        """How long the counter of ``key`` has not moved; None if it moved (or appeared) now."""
        previous = self._seen.get(key)
        if previous is None or previous[0] != counter:
            self._seen[key] = (counter, now)
            return None
        return now - previous[1]


def is_alive(quiet: float | None, *, left: bool, timeout: float) -> bool:
    """Whether a replica counts as alive: it did not leave, and its counter moved lately.

    Args:
        quiet: How long its counter has not moved (:meth:`HeartbeatClock.quiet_for`).
        left: Whether it marked itself as gone for good.
        timeout: The heartbeat timeout, in seconds.
    """
    return not left and (0.0 if quiet is None else quiet) < timeout


def is_stale(quiet: float | None, *, counter: int, timeout: float) -> bool:
    """Whether a rank of a replica group stopped beating.

    A rank that never beat (its counter is 0: it is still starting) is not stale, nor
    one whose counter just moved; one whose counter stood still for ``timeout`` is.
    """
    return quiet is not None and counter > 0 and quiet >= timeout


class Liveness:
    """Which replicas beat their heartbeat counter recently, on this observer's clock."""

    def __init__(self, store: KeyValueStore, heartbeat_timeout: timedelta) -> None:
        self._store = store
        self._timeout = heartbeat_timeout.total_seconds()
        self._clock = HeartbeatClock()
        self._published = 0

    @property
    def store(self) -> KeyValueStore:
        """The connection this observer reads heartbeats through."""
        return self._store

    def beat(self, replica_id: str) -> None:
        """Advances this replica's own counter."""
        self._store.add(f"hb/{replica_id}", 1)

    def announce(self, replica_id: str) -> None:
        """Adds ``replica_id`` to the registry of replicas and clears a previous leave.

        The replica's keys are written before its name enters the registry: a reader of
        the registry then never blocks on (and never times out waiting for) a key of a
        replica that died while announcing itself.
        """
        self._store.set(f"left/{replica_id}", "0")
        self.beat(replica_id)
        _append(self._store, "replicas", f"{replica_id}\n")
        self._store.add(REGISTRY_VERSION_KEY, 1)

    def beat_rank(self, group: str, group_rank: int) -> None:
        """Advances the counter of one rank of a replica group (``hb/<group>/<rank>``).

        ``group`` names the group and its incarnation: a restarted group counts afresh.
        """
        self._store.add(f"hb/{group}/{group_rank}", 1)

    def stale_ranks(self, group: str, group_ranks: Sequence[int]) -> list[int]:
        """The ranks of ``group`` (see :meth:`beat_rank`) whose counter stopped moving.

        A rank that never beat (its counter is 0 or missing: it is still starting) is not
        stale; a rank that beat once and then stopped for the heartbeat timeout is.
        """
        keys = [f"hb/{group}/{rank}" for rank in group_ranks]
        # add(key, 0) creates a missing key, so that multi_get does not block on it.
        counters = [self._store.add(key, 0) for key in keys]
        now = time.monotonic()
        return [
            rank
            for rank, key, counter in zip(group_ranks, keys, counters, strict=True)
            if is_stale(
                self._clock.quiet_for(key, str(counter).encode(), now),
                counter=counter,
                timeout=self._timeout,
            )
        ]

    def alive_members(
        self, quorum_id: int, members: Sequence[str], replica_id: str, *, monitor: bool
    ) -> set[str]:
        """The members of a quorum that are alive, for the quorum's step watchers.

        One member reads everybody's heartbeat (the first member, whose caller passes
        ``monitor``: its group rank 0) and publishes whom it found gone in
        ``alive/<quorum_id>``; every other member reads that record and the monitor's own
        heartbeat, two store calls of a few keys. A record that stood still for the
        heartbeat timeout while the monitor beats (it no longer watches a step) makes the
        reader read everybody itself. The store then reads O(members) keys per interval,
        not O(members²).
        """
        key = f"alive/{quorum_id}"
        if monitor:
            alive = self.alive()
            self._published += 1
            found = sorted(set(members) - alive)
            self._store.set(key, json.dumps({"seq": self._published, "gone": found}))
            return alive & set(members)
        head = members[0]
        record = bytes(self._store.compare_set(key, "", ""))  # creates a missing record
        counter, left = self._store.multi_get([f"hb/{head}", f"left/{head}"])
        now = time.monotonic()
        head_alive = is_alive(
            self._clock.quiet_for(head, counter, now), left=left == b"1", timeout=self._timeout
        )
        quiet = self._clock.quiet_for(key, record, now)
        if head_alive and quiet is not None and quiet >= self._timeout:
            return self.alive() & set(members)
        gone = set(json.loads(record)["gone"]) if record else set()
        return {m for m in members if m not in gone and (m != head or head_alive)}

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
        counters, left = values[: len(registered)], values[len(registered) :]
        return {
            replica
            for replica, counter, gone in zip(registered, counters, left, strict=True)
            if is_alive(
                self._clock.quiet_for(replica, counter, now),
                left=gone == b"1",
                timeout=self._timeout,
            )
        }


def _members_of(raw: bytes) -> dict[str, int]:
    members: dict[str, int] = {}
    for line in raw.decode().splitlines():
        replica, _, step = line.rpartition(" ")
        if replica:
            members[replica] = int(step)
    return members


def proposed_members(members: dict[str, int]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """A round's members in the order of their ranks, and the step each had committed."""
    ordered = tuple(sorted(members))
    return ordered, tuple(members[m] for m in ordered)


def keeps_quorum_id(previous: Quorum, members: tuple[str, ...], steps: tuple[int, ...]) -> bool:
    """Whether a round with ``members`` at ``steps`` may keep ``previous``'s quorum id.

    Only the same members, all at one step, keep it (and only when no error was
    reported in ``previous``, which the caller checks last: it costs a store read);
    anything else gets a new id, so every member configures a new group.
    """
    return previous.members == members and len(set(steps)) == 1


def round_is_due(
    *,
    members: Collection[str],
    alive: Collection[str],
    min_replicas: int,
    waited: float,
    join_timeout: float,
    settled_for: float,
    window: float,
) -> bool:
    """Whether a round may close with ``members``.

    Args:
        members: The replicas that joined the round.
        alive: The replicas whose heartbeat moved lately.
        min_replicas: A round closes only with at least this many members.
        waited: How long this replica has waited in the round.
        join_timeout: After this long the round closes without replicas that look
            alive but did not join.
        settled_for: How long since a replica last announced itself or asked to join.
        window: The round closes only once no replica announced itself or asked to join
            for this long (the job's first round; 0 for the others), or after
            ``join_timeout``.
    """
    out_of_time = waited > join_timeout
    everyone_in = set(alive).issubset(members) or out_of_time
    settled = settled_for >= window or out_of_time
    return len(members) >= min_replicas and everyone_in and settled


def _decide(
    store: KeyValueStore, round_: int, members: dict[str, int], known: Quorum | None
) -> Quorum:
    previous = known if known is not None and known.round == round_ - 1 else None
    if previous is None and round_ > 0 and store.check([f"r{round_ - 1}/decision"]):
        previous = Quorum.from_json(store.get(f"r{round_ - 1}/decision"))
    ordered, steps = proposed_members(members)
    quorum_uuid = str(uuid.uuid4())
    if previous is None:
        quorum_id = round_  # round 0; later rounds always have a previous decision
    else:
        unchanged = keeps_quorum_id(previous, ordered, steps) and not store.check(
            [f"err/{previous.quorum_id}"]
        )
        quorum_id = previous.quorum_id if unchanged else previous.quorum_id + 1
        if unchanged and previous.quorum_uuid:
            quorum_uuid = previous.quorum_uuid
    return Quorum(
        round=round_, quorum_id=quorum_id, members=ordered, steps=steps, quorum_uuid=quorum_uuid
    )


class _Round:
    """A round this replica joined: whether it is due to close, and closing it.

    Used by the one thread that waits for the round.
    """

    def __init__(
        self,
        number: int,
        *,
        min_replicas: int,
        join_timeout: timedelta,
        first_quorum_window: timedelta,
        previous: Quorum | None,
        init_sync: bool = False,
    ) -> None:
        self.number = number
        self._init_sync = init_sync
        self.decision_key = f"r{number}/decision"
        self.joined_at = time.monotonic()
        self._min_replicas = min_replicas
        self._join_timeout = join_timeout.total_seconds()
        # Only the job's first round waits for replicas still starting: later rounds
        # (a replica died, one joined) must not hold up the survivors.
        self._window = first_quorum_window.total_seconds() if number == 0 else 0.0
        self._previous = previous
        self._version: bytes | None = None
        self._version_changed_at = self.joined_at
        self.members: dict[str, int] = {}
        self.alive: set[str] = set()
        self.closer_key = f"r{number}/closer"
        self.closing_key = f"r{number}/closing"
        self.closing = False
        self._closer_seen: tuple[int, str] | None = None
        self._closer_checked_at = self.joined_at

    def elect(self, store: KeyValueStore, replica_id: str) -> None:
        """Makes this replica the round's closer if nobody is yet (one store call)."""
        self.closing = bytes(store.compare_set(self.closer_key, "", replica_id)) == (
            replica_id.encode()
        )

    def take_over_if_idle(self, store: KeyValueStore, replica_id: str, now: float) -> None:
        """Every ``CLOSER_CHECK_SECONDS``, becomes the closer if the closer stopped closing.

        The closer counts its checks; when the count and the closer stood still since
        this replica's last look, the closer is gone (or no longer in the round) and this
        replica takes its place with ``compare_set`` (one replica wins).
        """
        if self.closing or now - self._closer_checked_at < CLOSER_CHECK_SECONDS:
            return
        self._closer_checked_at = now
        seen = (int(store.add(self.closing_key, 0)), store.get(self.closer_key).decode())
        if seen != self._closer_seen:
            self._closer_seen = seen
            return
        won = store.compare_set(self.closer_key, seen[1], replica_id)
        self.closing = bytes(won) == replica_id.encode()
        if self.closing:
            logger.info(
                "quorum round %d: %s closes it in place of %s, which stopped",
                self.number,
                replica_id,
                seen[1],
            )

    def try_close(self, store: KeyValueStore, liveness: Liveness) -> bytes | None:
        """The round's decision: the one stored, or the one written now if the round is due.

        Returns None while the round stays open. Counts the check in the round's
        ``closing`` counter, which tells the other members that the closer still closes.
        """
        store.add(self.closing_key, 1)
        if store.check([self.decision_key]):
            return bytes(store.get(self.decision_key))
        raw_members, registry, version = store.multi_get(
            [f"r{self.number}/members", "replicas", REGISTRY_VERSION_KEY]
        )
        self.members = _members_of(raw_members)
        self.alive = liveness.alive(registry)
        now = time.monotonic()
        if version != self._version:  # somebody announced itself or joined: the window starts again
            self._version, self._version_changed_at = version, now
        due = round_is_due(
            members=self.members,
            alive=self.alive,
            min_replicas=self._min_replicas,
            waited=now - self.joined_at,
            join_timeout=self._join_timeout,
            settled_for=now - self._version_changed_at,
            window=self._window,
        )
        if not due:
            return None
        proposal = dataclasses.replace(
            _decide(store, self.number, self.members, self._previous),
            registry_version=int(version),
            init_sync=self._init_sync,
        ).to_json()
        # The first proposal wins; compare_set answers with the one that did.
        return bytes(store.compare_set(self.decision_key, "", proposal))


def _wait_for_decision(
    store: KeyValueStore,
    attempt: _Round,
    liveness: Liveness,
    deadline: float,
    tick: float,
    replica_id: str,
) -> bytes | None:
    """The round's decision: the one another replica writes, or the one this replica writes.

    Waits for the decision key on ``store`` (on its link thread, when it has one) and,
    every ``tick``, closes the round through ``liveness``'s connection when this replica
    is the round's closer and the round is due (or checks that the closer still closes).
    Returns None at the deadline.
    """
    wait_async = getattr(store, "wait_async", None)
    remaining = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
    waiting = wait_async([attempt.decision_key], remaining) if callable(wait_async) else None
    while True:
        if waiting is None:
            time.sleep(tick)  # a plain store: the tick is the only way to learn of it
        else:
            try:
                waiting.result(timeout=tick)
                return bytes(store.get(attempt.decision_key))
            except concurrent.futures.TimeoutError:
                pass
            except Exception:  # torch raises DistStoreError (or RuntimeError) on a timeout
                if not store.check([attempt.decision_key]):
                    return None
                return bytes(store.get(attempt.decision_key))
        try:
            attempt.take_over_if_idle(liveness.store, replica_id, time.monotonic())
            if attempt.closing:
                decision = attempt.try_close(liveness.store, liveness)
            elif waiting is None:
                decision = _decision_if_any(store, attempt)
            else:
                decision = None
        except FTError:
            raise  # a store that does not answer: the caller reports it by name
        except Exception:  # the wait's own timeout reports a store that is gone
            logger.debug("quorum tick: store call failed", exc_info=True)
            decision = None
        if decision is not None:
            return decision
        if time.monotonic() > deadline:
            return _decision_if_any(store, attempt)


def _decision_if_any(store: KeyValueStore, attempt: _Round) -> bytes | None:
    if store.check([attempt.decision_key]):
        return bytes(store.get(attempt.decision_key))
    return None


def compute_quorum(
    store: KeyValueStore,
    replica_id: str,
    step: int,
    *,
    liveness: Liveness,
    min_replicas: int,
    join_timeout: timedelta,
    timeout: timedelta,
    previous: Quorum | None = None,
    first_quorum_window: timedelta = timedelta(0),
    tick: float = ROUND_TICK_SECONDS,
    init_sync: bool = False,
) -> Quorum:
    """Joins the current round and returns its decision (see the module doc).

    Every store call is a round trip that the training processes pay for in CPU, so
    reads are batched, the decision comes back from ``compare_set`` itself, and only
    the round's closer reads who is alive: a replica makes about seven calls per round
    whatever the number of replicas (more only in a round that lasts seconds).

    Args:
        store: The store all replicas share (prefixed for this manager group).
        replica_id: This replica.
        step: The last step this replica committed.
        liveness: This replica's view of who is alive, on a connection other than
            ``store``'s (the round is closed through it while ``store`` waits for the
            decision).
        min_replicas: A round closes only with at least this many members.
        join_timeout: Close a round without a replica that looks alive but did not join.
        timeout: Give up after this long.
        previous: The last decision this replica saw (saves reading it again).
        first_quorum_window: The job's first round closes only once no replica has
            announced itself or asked to join for this long (at most ``join_timeout``
            after joining).
        tick: How often the waiting thread checks whether the round is due to close.
        init_sync: Decide, when no member has committed a step, that every member but
            the first heals from it (:attr:`Quorum.init_sync`). The replica that closes
            the round decides, so every replica of a job should pass the same value.

    Raises:
        QuorumTimeoutError: no decision that includes this replica within ``timeout``.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    round_ = int(store.add("round", 0))
    while True:
        _append(store, f"r{round_}/members", f"{replica_id} {step}\n")
        # After the append: a closer that reads the version with this bump also reads
        # this replica among the members (one multi_get), so no decision can count the
        # bump and leave the replica out.
        store.add(REGISTRY_VERSION_KEY, 1)
        attempt = _Round(
            round_,
            min_replicas=min_replicas,
            join_timeout=join_timeout,
            first_quorum_window=first_quorum_window,
            previous=previous,
            init_sync=init_sync,
        )
        attempt.elect(store, replica_id)
        decision = attempt.try_close(store, liveness) if attempt.closing else None
        if decision is None:
            decision = _wait_for_decision(store, attempt, liveness, deadline, tick, replica_id)
        if decision is None:
            raise QuorumTimeoutError(
                f"replica {replica_id!r}: no quorum within {timeout}: round {round_} has "
                f"{sorted(attempt.members)} (need at least {min_replicas}), "
                f"alive: {sorted(attempt.alive)}"
            )
        quorum = Quorum.from_json(decision)
        store.compare_set("round", str(round_), str(round_ + 1))
        if replica_id in quorum.members:
            return quorum
        previous = quorum
        round_ += 1
