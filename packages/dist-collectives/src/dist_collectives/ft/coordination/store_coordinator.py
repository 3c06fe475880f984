"""The replica protocol through the job's key-value store: every key and value lives here.

:class:`StoreCoordinator` is the
:class:`~dist_collectives.ft.coordination.coordinator.ReplicaCoordinator` of a Manager
whose replicas share a TCPStore. This module is the only one in ``ft`` that builds a
key of that protocol or encodes a value of it (``tests/ft/test_one_owner.py`` holds it
so): the key shapes are :class:`Keys`', every value is JSON (one record, or one record
per line where replicas append), and counters are the store's own ``add`` counters.

**Rounds.** A replica announces itself by beating a counter (``hb/<id>``) and asks for
a quorum by appending ``[<id>, <step>]`` to the member list of the current *round* (and
bumping the registry version, so that members that reuse their quorum hold a round for
it). The first to join becomes the round's *closer* (``compare_set`` on
``r<round>/closer``). It alone checks, every tick, whether the round is due
(:func:`~dist_collectives.ft.coordination.quorum.round_is_due`) and counts its checks in
``r<round>/closing``; it writes the decision with ``compare_set``, so the first writer
wins and every replica reads the same decision. Every other member only waits for the
decision, and reads that counter ``CLOSER_CHECK_SECONDS`` after joining, then at
doubling intervals up to ``CLOSER_CHECK_MAX_SECONDS``: one that stood still since its
last look means the closer died or left, and the member takes its place. A
replica thus makes a handful of store calls per round whatever the number of replicas
(see ``benchmarks/ft.py --only scale``). The round counter then moves on, and a replica
that arrived too late joins the next round. The job's first round also waits until no
replica has announced itself (or asked to join) for ``first_quorum_window``.

A replica joins a round in four calls and waits for the decision in one ``wait`` on
the store, which the closing replica's write ends at once; on a
:class:`~dist_collectives.ft.coordination.bounded_store.BoundedStore` the four calls go
to the store's own link thread together, and so do the wait, the read of the decision
and the move of the round counter, while the waiting thread checks, every
``ROUND_TICK_SECONDS`` and on a second connection, what closes a round on a timer. No
thread is started per round, and no wait is made with a short timeout: torch's
TCPStore client logs two warnings each time one runs out, which read like a network
fault.

**Replica groups.** In a group of several ranks only group rank 0 joins rounds: each
other rank writes its step under ``group/<group>/<request>/step/<rank>`` and waits for
rank 0's decision under ``group/<group>/<request>``; rank 0 waits until all of them
arrived, asks with the oldest step any rank holds and publishes the decision (or why
there is none). A broken group's watcher ends those waits.

**Steps.** Each rank of each member votes by bumping ``votes/<quorum id>/<step>``; the
last voter writes the verdict to ``commit/<quorum id>/<step>`` with ``compare_set``, and
a replica that failed writes its failure to ``err/<quorum id>`` and a failed verdict
there first. Liveness needs no synchronised clocks: each observer notes, on its own
monotonic clock, when it last saw a counter change.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from dist_collectives.ft.coordination.bounded_store import KeyValueStore, StoreTimeoutError
from dist_collectives.ft.coordination.coordinator import (
    MESSAGE_CHARS,
    CoordinatorSettings,
    FailureReport,
    JoinRequest,
    StepWatch,
    Verdict,
    WaitObserver,
    proposed_verdict,
)
from dist_collectives.ft.coordination.quorum import (
    CLOSER_CHECK_MAX_SECONDS,
    CLOSER_CHECK_SECONDS,
    ROUND_TICK_SECONDS,
    HeartbeatClock,
    Quorum,
    QuorumTimeoutError,
    decide_quorum,
    group_step,
    is_alive,
    is_stale,
    keeps_quorum_id,
    kept_a_failed_quorum,
    proposed_members,
    round_is_due,
    watched_group_ranks,
)
from dist_collectives.ft.errors import FTError, ManagerConfigError, ReplicaError

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Bumped by every replica that announces itself and by every request to join a round:
# a commit that sees it unchanged since the quorum was decided lets the next step reuse
# the quorum without a round. The joins count too because a replica can announce itself
# before a round closes and join only after it closed without it (a round closes without
# a live replica on the join timeout): the members must then hold a round, or it waits
# in one that nobody else joins.
REGISTRY_VERSION_KEY = "replicas_version"
# The wait for a commit decision ends through the watcher, which fails the step at the
# deadline; the wait's own timeout, this much later, only catches a store that is gone.
_VOTE_WAIT_GRACE_SECONDS = 5.0


class Keys:
    """Every key shape of the replica protocol (all under the Manager's namespace)."""

    ROUND = "round"
    REGISTRY = "replicas"
    REGISTRY_VERSION = REGISTRY_VERSION_KEY
    GROUP_WORLD_SIZE = "group_world_size"

    @staticmethod
    def heartbeat(replica_id: str) -> str:
        """A replica's heartbeat counter."""
        return f"hb/{replica_id}"

    @staticmethod
    def rank_heartbeat(group: str, group_rank: int) -> str:
        """The heartbeat counter of one rank of a replica group in one incarnation."""
        return f"hb/{group}/{group_rank}"

    @staticmethod
    def left(replica_id: str) -> str:
        """Whether a replica left for good (a flag)."""
        return f"left/{replica_id}"

    @staticmethod
    def alive(quorum_id: int) -> str:
        """Whom a quorum's first member found gone (its record for the other members)."""
        return f"alive/{quorum_id}"

    @staticmethod
    def members(round_: int) -> str:
        """A round's members, one ``[replica, step]`` line each."""
        return f"r{round_}/members"

    @staticmethod
    def decision(round_: int) -> str:
        """A round's decision (a quorum record)."""
        return f"r{round_}/decision"

    @staticmethod
    def closer(round_: int) -> str:
        """The replica that closes a round."""
        return f"r{round_}/closer"

    @staticmethod
    def closing(round_: int) -> str:
        """How many times the closer checked whether its round is due."""
        return f"r{round_}/closing"

    @staticmethod
    def incarnation(replica_id: str, group_rank: int) -> str:
        """How many times a rank of a replica group started."""
        return f"incarnation/{replica_id}/{group_rank}"

    @staticmethod
    def group_decision(group: str, request: int) -> str:
        """Rank 0's answer to its group's request ``request`` (a quorum or an error)."""
        return f"group/{group}/{request}"

    @staticmethod
    def group_arrived(group: str, request: int) -> str:
        """Set once every other rank of the group asked (or when the group broke)."""
        return f"group/{group}/{request}/arrived"

    @staticmethod
    def group_count(group: str, request: int) -> str:
        """How many of the group's other ranks asked."""
        return f"group/{group}/{request}/count"

    @staticmethod
    def group_step(group: str, request: int, group_rank: int) -> str:
        """The step a rank of the group asked with."""
        return f"group/{group}/{request}/step/{group_rank}"

    @staticmethod
    def votes(quorum: Quorum) -> str:
        """The votes cast for a quorum's step (a counter)."""
        return f"votes/{quorum.quorum_id}/{quorum.max_step}"

    @staticmethod
    def commit(quorum: Quorum) -> str:
        """A quorum's step's verdict."""
        return f"commit/{quorum.quorum_id}/{quorum.max_step}"

    @staticmethod
    def error(quorum: Quorum) -> str:
        """The failure a replica reported under a quorum id."""
        return f"err/{quorum.quorum_id}"


# -- value codecs: JSON only (the store is shared: nothing is unpickled) -------------------


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def encode_line(value: object) -> str:
    """One line of a list that replicas append to."""
    return _json(value) + "\n"


def decode_lines(raw: bytes) -> list[Any]:
    """The records of an appended list."""
    return [json.loads(line) for line in raw.decode().splitlines() if line]


def encode_flag(value: bool) -> str:
    """A flag."""
    return _json(value)


def decode_flag(raw: bytes) -> bool:
    """A flag; a missing (empty) one is False."""
    return bool(json.loads(raw)) if raw else False


def encode_quorum(quorum: Quorum) -> str:
    """A quorum record."""
    return quorum.to_json()


def decode_quorum(raw: bytes) -> Quorum:
    """A quorum record."""
    return Quorum.from_json(raw)


def encode_verdict(verdict: Verdict) -> str:
    """A commit verdict (what a reader needs: committed, and whether to reuse the quorum)."""
    return _json({"committed": verdict.committed, "reuse_quorum": verdict.reuse_quorum})


def decode_verdict(raw: bytes) -> Verdict:
    """A commit verdict."""
    record = json.loads(raw)
    return Verdict(committed=bool(record["committed"]), reuse_quorum=bool(record["reuse_quorum"]))


def encode_failure(failure: FailureReport) -> str:
    """A failure report."""
    return _json({"replica": failure.replica_id, "message": failure.message[:MESSAGE_CHARS]})


def decode_failure(raw: bytes) -> FailureReport | None:
    """A failure report; None for the empty value a watcher creates the key with."""
    if not raw:
        return None
    record = json.loads(raw)
    return FailureReport(str(record["replica"]), str(record["message"]))


def encode_group_answer(quorum: Quorum | None, error: str | None = None) -> str:
    """Rank 0's answer to its group: the quorum, or why there is none."""
    if quorum is None:
        return _json({"error": (error or "")[:MESSAGE_CHARS]})
    return _json({"quorum": json.loads(quorum.to_json())})


def decode_group_answer(raw: bytes) -> Quorum | str:
    """The quorum rank 0 answered with, or why it has none."""
    record = json.loads(raw)
    if "error" in record:
        return str(record["error"])
    return Quorum.from_json(json.dumps(record["quorum"]))


_VERDICT_FAILED = encode_verdict(Verdict(committed=False))
_VERDICT_SAME = encode_verdict(Verdict(committed=True, reuse_quorum=True))


def _append(store: KeyValueStore, key: str, value: str) -> None:
    """Appends atomically on the server (``Store.append`` is missing from torch's stubs)."""
    store.append(key, value)  # type: ignore[attr-defined]


def _existing(store: KeyValueStore, key: str) -> bytes:
    """The value of a key known to exist and not empty, in one round trip.

    torch's TCPStore client makes ``get`` two round trips (a wait for the key, then the
    read); ``compare_set`` of the empty value answers with the stored one and leaves it.
    """
    return bytes(store.compare_set(key, "", ""))


def _on_link(store: KeyValueStore, what: str, calls: Callable[[KeyValueStore], _T]) -> _T:
    """``calls``' store calls, made one after the other on the store's link thread.

    A :class:`~dist_collectives.ft.coordination.bounded_store.BoundedStore` makes each
    call on its link thread; handing it several together costs one hand-over between
    threads instead of one per call, and the hand-overs, not the store, were most of a
    round on a busy host (1,024 simulated replicas on 2 cores: the last join came
    1.52 s after the ask with one hand-over per call, 0.45 s with one per join). On a
    plain store the calls are made here.
    """
    call = getattr(store, "call", None)
    return call(what, calls) if callable(call) else calls(store)


def _join_round(
    store: KeyValueStore, number: int | None, replica_id: str, step: int
) -> tuple[int, bool]:
    """Joins round ``number`` (None: the current one); the round, and whether it closes it.

    Four calls on the store's link: read the round, append this replica to its
    members, bump the registry version after the append (a closer that reads the
    version with this bump also reads this replica among the members, in one
    ``multi_get``, so no decision can count the bump and leave the replica out), and
    ``compare_set`` the round's closer (the first replica to join becomes it).
    """

    def join(raw: KeyValueStore) -> tuple[int, bool]:
        round_ = int(raw.add(Keys.ROUND, 0)) if number is None else number
        _append(raw, Keys.members(round_), encode_line([replica_id, step]))
        raw.add(Keys.REGISTRY_VERSION, 1)
        me = _json(replica_id)
        closing = bytes(raw.compare_set(Keys.closer(round_), "", me)) == me.encode()
        return round_, closing

    known = "r?" if number is None else f"r{number}"
    calls = [f"add({Keys.ROUND!r})"] if number is None else []
    calls += [f"append('{known}/members')", f"add({Keys.REGISTRY_VERSION!r})"]
    calls += [f"compare_set('{known}/closer')"]
    return _on_link(store, ", ".join(calls), join)


def _moved_on(store: KeyValueStore, number: int, decision: bytes) -> bytes:
    """``decision``, once the round counter moved past round ``number`` (one call).

    Every member moves it, not only the closer: a closer that dies between its
    decision and this call must not leave the counter on a decided round, where a
    replica joining later would take the old decision for its own.
    """
    store.compare_set(Keys.ROUND, str(number), str(number + 1))
    return decision


def _decision_when_written(
    store: KeyValueStore, number: int, timeout: timedelta
) -> concurrent.futures.Future[bytes] | None:
    """Round ``number``'s decision once written (the round moved on), on the store's link.

    None for a store without a link thread. One hand-over for three calls: the wait,
    which the closer's write ends at once, the read, the move of the round counter.
    """
    submit = getattr(store, "submit", None)
    if not callable(submit):
        return None
    key = Keys.decision(number)

    def read(raw: KeyValueStore) -> bytes:
        raw.wait([key], timeout)
        return _moved_on(raw, number, _existing(raw, key))

    what = f"wait({key!r}), compare_set({key!r}), compare_set({Keys.ROUND!r})"
    future: concurrent.futures.Future[bytes] = submit(what, read)
    return future


def _reported(store: KeyValueStore, quorum: Quorum) -> FailureReport | None:
    """The failure reported under ``quorum``'s id, if any, in one call.

    ``compare_set`` of the empty value answers with the stored one and creates a
    missing key empty, as a watcher's first look does: either reads as no failure.
    """
    return decode_failure(bytes(store.compare_set(Keys.error(quorum), "", "")))


def _decide(
    store: KeyValueStore,
    round_: int,
    members: dict[str, int],
    known: Quorum | None,
    *,
    registry_version: int,
    init_sync: bool,
) -> Quorum:
    previous = known if known is not None and known.round == round_ - 1 else None
    if previous is None and round_ > 0 and store.check([Keys.decision(round_ - 1)]):
        previous = decode_quorum(_existing(store, Keys.decision(round_ - 1)))
    # The error record costs a read; only a round that could keep the id needs it.
    failed = (
        previous is not None
        and keeps_quorum_id(previous, *proposed_members(members))
        and _reported(store, previous) is not None
    )
    return decide_quorum(
        round_,
        members,
        previous,
        previous_failed=failed,
        registry_version=registry_version,
        init_sync=init_sync,
    )


class Liveness:
    """Which replicas beat their heartbeat counter recently, on this observer's clock."""

    def __init__(self, store: KeyValueStore, heartbeat_timeout: timedelta) -> None:
        self._store = store
        self._timeout = heartbeat_timeout.total_seconds()
        self._clock = HeartbeatClock()
        self._published = 0
        self._created_for: int | None = None  # the quorum whose record and error key exist

    @property
    def store(self) -> KeyValueStore:
        """The connection this observer reads heartbeats through."""
        return self._store

    def beat(self, replica_id: str) -> None:
        """Advances this replica's own counter."""
        self._store.add(Keys.heartbeat(replica_id), 1)

    def announce(self, replica_id: str) -> None:
        """Adds ``replica_id`` to the registry of replicas and clears a previous leave.

        The replica's keys are written before its name enters the registry: a reader of
        the registry then never blocks on (and never times out waiting for) a key of a
        replica that died while announcing itself.
        """
        self._store.set(Keys.left(replica_id), encode_flag(False))
        self.beat(replica_id)
        _append(self._store, Keys.REGISTRY, encode_line(replica_id))
        self._store.add(Keys.REGISTRY_VERSION, 1)

    def beat_rank(self, group: str, group_rank: int) -> None:
        """Advances the counter of one rank of a replica group (``hb/<group>/<rank>``).

        ``group`` names the group and its incarnation: a restarted group counts afresh.
        """
        self._store.add(Keys.rank_heartbeat(group, group_rank), 1)

    def stale_ranks(self, group: str, group_ranks: Sequence[int]) -> list[int]:
        """The ranks of ``group`` (see :meth:`beat_rank`) whose counter stopped moving.

        A rank that never beat (its counter is 0 or missing: it is still starting) is not
        stale; a rank that beat once and then stopped for the heartbeat timeout is.
        """
        keys = [Keys.rank_heartbeat(group, rank) for rank in group_ranks]
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

    def look(self, quorum: Quorum, *, monitor: bool) -> StepWatch:
        """One look at ``quorum``'s step: a failure reported, who is alive, the registry.

        One member reads every member's heartbeat (the first member, whose caller passes
        ``monitor``: its group rank 0) and publishes whom it found gone in
        ``alive/<quorum_id>``: two calls, one read of 2M + 2 keys and one write. Every
        other member reads that record, the monitor's heartbeat, the quorum's error key
        and the registry version in one call of five keys. The first look at a quorum
        creates the record and the error key, empty, so that the reads never wait for a
        missing key (two calls more, once per quorum). A record that stood still for the
        heartbeat timeout while the monitor beats (it no longer watches a step) makes the
        reader read every member itself. Each replica then makes one call per look and
        the store reads O(members) keys, not O(members²).
        """
        record_key, error_key = Keys.alive(quorum.quorum_id), Keys.error(quorum)
        members = quorum.members
        if self._created_for != quorum.quorum_id:
            self._store.compare_set(error_key, "", "")
            if not monitor:
                self._store.compare_set(record_key, "", "")
            self._created_for = quorum.quorum_id
        if monitor:
            error, version, *counters = self._store.multi_get(
                [error_key, Keys.REGISTRY_VERSION, *self._member_keys(members)]
            )
            alive = self._alive_of(members, counters)
            self._published += 1
            found = sorted(set(members) - alive)
            self._store.set(record_key, _json({"seq": self._published, "gone": found}))
        else:
            head = members[0]
            error, version, record, counter, left = self._store.multi_get(
                [error_key, Keys.REGISTRY_VERSION, record_key, *self._member_keys([head])]
            )
            now = time.monotonic()
            head_alive = is_alive(
                self._clock.quiet_for(head, counter, now),
                left=decode_flag(left),
                timeout=self._timeout,
            )
            quiet = self._clock.quiet_for(record_key, record, now)
            if head_alive and quiet is not None and quiet >= self._timeout:
                alive = self._alive_of(members, self._store.multi_get(self._member_keys(members)))
            else:
                gone = set(json.loads(record)["gone"]) if record else set()
                alive = {m for m in members if m not in gone and (m != head or head_alive)}
        return StepWatch(
            failure=decode_failure(error), alive=frozenset(alive), registry_version=int(version)
        )

    @staticmethod
    def _member_keys(members: Sequence[str]) -> list[str]:
        """Every member's heartbeat counter, then every member's leave flag."""
        return [Keys.heartbeat(m) for m in members] + [Keys.left(m) for m in members]

    def _alive_of(self, members: Sequence[str], values: Sequence[bytes]) -> set[str]:
        """The members alive, from the values of :meth:`_member_keys` read just now."""
        now = time.monotonic()
        counters, left = values[: len(members)], values[len(members) :]
        return {
            member
            for member, counter, gone in zip(members, counters, left, strict=True)
            if is_alive(
                self._clock.quiet_for(member, counter, now),
                left=decode_flag(gone),
                timeout=self._timeout,
            )
        }

    def leave(self, replica_id: str) -> None:
        """Marks ``replica_id`` as gone for good, so that nobody waits for it."""
        self._store.set(Keys.left(replica_id), encode_flag(True))

    def alive(self, registry: bytes | None = None) -> set[str]:
        """Replicas whose counter moved within the heartbeat timeout and that did not leave.

        Args:
            registry: The value of the ``replicas`` key when the caller just read it.
        """
        if registry is None:
            if not self._store.check([Keys.REGISTRY]):
                return set()
            registry = self._store.get(Keys.REGISTRY)
        registered = sorted(set(decode_lines(registry)))
        if not registered:
            return set()
        return self._alive_of(registered, self._store.multi_get(self._member_keys(registered)))


def _members_of(raw: bytes) -> dict[str, int]:
    return {str(replica): int(step) for replica, step in decode_lines(raw)}


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
        closing: bool = False,
        init_sync: bool = False,
    ) -> None:
        self.number = number
        self._init_sync = init_sync
        self.decision_key = Keys.decision(number)
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
        self.closer_key = Keys.closer(number)
        self.closing_key = Keys.closing(number)
        self.closing = closing  # this replica closes the round (it joined first, or took over)
        self._closer_seen: tuple[int, str] | None = None
        self._closer_checked_at = self.joined_at
        self._closer_check_every = CLOSER_CHECK_SECONDS

    def wake_in(self, tick: float, now: float) -> float:
        """How long a waiting member may sleep: a tick for the closer, else until its next look.

        Only the closer has anything to do on a timer (close a round that became due);
        the others only look at the closer now and then, and the decision's write
        wakes them at once.
        """
        if self.closing:
            return tick
        return max(tick, self._closer_checked_at + self._closer_check_every - now)

    def take_over_if_idle(self, store: KeyValueStore, replica_id: str, now: float) -> None:
        """Becomes the closer if the closer stopped closing (checked less and less often).

        The closer counts its checks; when the count and the closer stood still since
        this replica's last look, the closer is gone (or no longer in the round) and this
        replica takes its place with ``compare_set`` (one replica wins). The first look
        comes ``CLOSER_CHECK_SECONDS`` after joining; each look that finds the closer at
        work doubles the wait for the next, up to ``CLOSER_CHECK_MAX_SECONDS``. A look
        is one ``multi_get`` (two calls the first time, which creates the counter).
        """
        if self.closing or now - self._closer_checked_at < self._closer_check_every:
            return
        self._closer_checked_at = now
        if self._closer_seen is None:
            seen = (int(store.add(self.closing_key, 0)), _existing(store, self.closer_key).decode())
        else:
            count, closer = store.multi_get([self.closing_key, self.closer_key])
            seen = (int(count), bytes(closer).decode())
        me = _json(replica_id)
        if seen != self._closer_seen:
            if self._closer_seen is not None:
                self._closer_check_every = min(
                    2 * self._closer_check_every, CLOSER_CHECK_MAX_SECONDS
                )
            self._closer_seen = seen
            return
        won = store.compare_set(self.closer_key, seen[1], me)
        self.closing = bytes(won) == me.encode()
        if self.closing:
            logger.info(
                "quorum round %d: %s closes it in place of %s, which stopped",
                self.number,
                replica_id,
                json.loads(seen[1]),
            )

    def try_close(self, store: KeyValueStore, liveness: Liveness) -> bytes | None:
        """The round's decision: the one stored, or the one written now if the round is due.

        Returns None while the round stays open. Counts the check in the round's
        ``closing`` counter, which tells the other members that the closer still closes.
        """
        store.add(self.closing_key, 1)
        if store.check([self.decision_key]):
            return _existing(store, self.decision_key)
        raw_members, registry, version = store.multi_get(
            [Keys.members(self.number), Keys.REGISTRY, Keys.REGISTRY_VERSION]
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
        proposal = encode_quorum(
            _decide(
                store,
                self.number,
                self.members,
                self._previous,
                registry_version=int(version),
                init_sync=self._init_sync,
            )
        )
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
    is the round's closer and the round is due; a member that does not close wakes
    only to check, now and then, that the closer still closes. The round counter has
    moved on when it returns a decision. Returns None at the deadline.
    """
    remaining = timedelta(seconds=max(deadline - time.monotonic(), 0.001))
    waiting = _decision_when_written(store, attempt.number, remaining)
    while True:
        if waiting is None:
            time.sleep(tick)  # a plain store: the tick is the only way to learn of it
        else:
            try:
                now = time.monotonic()
                return waiting.result(
                    timeout=min(attempt.wake_in(tick, now), max(deadline - now, tick))
                )
            except concurrent.futures.TimeoutError:
                pass
            except Exception:  # torch raises DistStoreError (or RuntimeError) on a timeout
                return _decision_if_any(store, attempt)
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
            return _moved_on(store, attempt.number, decision)
        if time.monotonic() > deadline:
            return _decision_if_any(store, attempt)


def _decision_if_any(store: KeyValueStore, attempt: _Round) -> bytes | None:
    """The round's decision if written, once the round counter moved on; else None."""
    if store.check([attempt.decision_key]):
        return _moved_on(store, attempt.number, _existing(store, attempt.decision_key))
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
    next_round: int | None = None  # the store's current round
    while True:
        round_, closing = _join_round(store, next_round, replica_id, step)
        attempt = _Round(
            round_,
            min_replicas=min_replicas,
            join_timeout=join_timeout,
            first_quorum_window=first_quorum_window,
            previous=previous,
            closing=closing,
            init_sync=init_sync,
        )
        decision = attempt.try_close(store, liveness) if attempt.closing else None
        if decision is not None:
            decision = _moved_on(store, round_, decision)
        else:
            decision = _wait_for_decision(store, attempt, liveness, deadline, tick, replica_id)
        if decision is None:
            raise QuorumTimeoutError(
                f"replica {replica_id!r}: no quorum within {timeout}: round {round_} has "
                f"{sorted(attempt.members)} (need at least {min_replicas}), "
                f"alive: {sorted(attempt.alive)}"
            )
        quorum = decode_quorum(decision)
        if replica_id in quorum.members:
            return quorum
        previous = quorum
        next_round = round_ + 1


class StoreCoordinator:
    """The replica protocol of one rank, through the job's store (see the module doc).

    Gives each of the Manager's threads its own connection: the quorum worker two (it
    closes rounds through one while the other waits), the training thread one for the
    vote, the watcher one. A TCPStore client serialises its callers, so a wait on one
    never delays another thread's calls.

    Args:
        settings: The replica, its group, and the protocol's times.
        connect: Opens a connection to the job's store (under the Manager's namespace)
            for the role it is given: ``vote``, ``quorum``, ``round`` or ``watch``. A
            :class:`~dist_collectives.ft.coordination.bounded_store.BoundedStore` keeps
            every call within the timeout.
        observer: The Manager's side of the group's waits and of the vote's.
    """

    def __init__(
        self,
        settings: CoordinatorSettings,
        connect: Callable[[str], KeyValueStore],
        observer: WaitObserver,
    ) -> None:
        self._settings = settings
        self._observer = observer
        self._vote = connect("vote")
        self._quorum = connect("quorum")
        self._round_liveness = Liveness(connect("round"), settings.heartbeat_timeout)
        self._watch = connect("watch")
        self._watch_liveness = Liveness(self._watch, settings.heartbeat_timeout)
        self._incarnation = 0

    @property
    def group_name(self) -> str:
        """This replica group in this incarnation: its ranks' heartbeats and answers."""
        return f"{self._settings.replica_id}/{self._incarnation}"

    def join(self) -> None:
        """Checks the group's size, counts this rank's start, beats, announces (rank 0).

        Every rank of a group counts its own starts; a group restarts as a whole, so its
        ranks agree on the count and use it to keep apart the answers group rank 0
        publishes in each incarnation.
        """
        s = self._settings
        if s.group_world_size > 1:
            raw = self._vote.compare_set(Keys.GROUP_WORLD_SIZE, "", _json(s.group_world_size))
            if json.loads(raw) != s.group_world_size:
                raise ManagerConfigError(
                    f"replica {s.replica_id}: group_world_size={s.group_world_size}, "
                    f"but the job's replica groups have {raw.decode()} ranks; every group "
                    "must have the same size (rank i of each group averages with rank i of "
                    "the others)"
                )
            self._incarnation = int(self._vote.add(Keys.incarnation(s.replica_id, s.group_rank), 1))
            self._watch_liveness.beat_rank(self.group_name, s.group_rank)
        if s.group_rank == 0:
            self._watch_liveness.announce(s.replica_id)

    # -- the quorum worker's ------------------------------------------------------------

    def quorum(self, request: JoinRequest, deadline: float) -> Quorum:
        """The next step's quorum: group rank 0 asks in a round and answers its ranks.

        Rank 0 asks with the oldest step any of its ranks holds: a rank whose load of a
        healed state failed holds an older state than a rank that loaded it, and the
        group must then heal again, every rank of it.
        """
        s = self._settings
        if s.group_world_size == 1:
            return self._round(request, request.step, deadline)
        store, group = self._quorum, self.group_name
        key = Keys.group_decision(group, request.number)
        arrived = Keys.group_arrived(group, request.number)
        if s.group_rank > 0:
            store.set(Keys.group_step(group, request.number, s.group_rank), _json(request.step))
            # Rank 0 asks for the group only once every rank has asked for this step.
            if store.add(Keys.group_count(group, request.number), 1) == s.group_world_size - 1:
                store.set(arrived, _json({"arrived": True}))
            # The watcher ends the wait if rank 0 stops beating.
            broken = self._observer.group_wait(awaited=key)
            if broken is not None:
                raise ReplicaError(broken)
            store.wait([key], s.timeout)
            answer = decode_group_answer(store.get(key))
            if isinstance(answer, str):
                raise ReplicaError(f"replica {s.replica_id}: no quorum for the group: {answer}")
            return answer
        try:
            if self._observer.group_wait(arrival=arrived) is None:
                # Ended by the last rank to arrive, or by the watcher when a rank stopped
                # beating: a group whose rank died mid-step never joins the next round
                # with the ranks it has left.
                store.wait([arrived], s.timeout)
            broken = self._observer.group_wait()
            if broken is not None:
                raise ReplicaError(broken)
            others = [
                Keys.group_step(group, request.number, rank)
                for rank in range(1, s.group_world_size)
            ]
            steps = [int(json.loads(raw)) for raw in store.multi_get(others)]
            quorum = self._round(request, group_step(request.step, steps), deadline)
        except Exception as error:
            store.set(key, encode_group_answer(None, f"{type(error).__name__}: {error}"))
            raise
        store.set(key, encode_group_answer(quorum))
        return quorum

    def _round(self, request: JoinRequest, step: int, deadline: float) -> Quorum:
        """The round's decision; one more round when it kept the id of a failed step.

        A step of this replica that failed on a configuration leaves that group unused
        for good: its exchanges may still run and would pair with the next step's.
        The round keeps the id only when nobody reported the failure under it before
        the round was decided; then this replica reports it and joins the next round,
        which gives a new id.
        """
        quorum = self._compute(step, request.previous, deadline)
        if kept_a_failed_quorum(quorum, request.failed_quorum_id):
            reason = f"quorum {quorum.quorum_id} kept the id of a configuration whose step failed"
            self._quorum.set(
                Keys.error(quorum), encode_failure(FailureReport(self._settings.replica_id, reason))
            )
            quorum = self._compute(step, quorum, deadline)
        return quorum

    def _compute(self, step: int, previous: Quorum | None, deadline: float) -> Quorum:
        s = self._settings
        return compute_quorum(
            self._quorum,
            s.replica_id,
            step,
            liveness=self._round_liveness,
            min_replicas=s.min_replicas,
            join_timeout=s.join_timeout,
            timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.001)),
            previous=previous,
            first_quorum_window=s.first_quorum_window,
            init_sync=s.init_sync,
        )

    def drop(self, number: int) -> None:
        """Request ``number`` was superseded: rank 0 tells its group's ranks."""
        if self._settings.group_world_size > 1 and self._settings.group_rank == 0:
            with contextlib.suppress(Exception):  # they time out on their own otherwise
                key = Keys.group_decision(self.group_name, number)
                self._quorum.set(key, encode_group_answer(None, "superseded"))

    # -- the training thread's ----------------------------------------------------------

    def vote(
        self,
        quorum: Quorum,
        deadline: float,
        *,
        failure: FailureReport | None,
        registry_version: int,
    ) -> Verdict:
        """Votes, and reads the verdict the last voter (or a failure) wrote.

        Three store round trips on the way of the step's last voter: its ``add``, its
        ``compare_set`` of the verdict, and the others' read of it once their ``wait``
        ends. A replica that failed writes the failure first.

        Raises:
            StoreTimeoutError: The store did not answer.
        """
        store, key = self._vote, Keys.commit(quorum)
        raw: bytes | None = None
        timed_out = False
        if failure is None:
            votes = store.add(Keys.votes(quorum), 1)
            proposal = proposed_verdict(
                votes,
                quorum,
                group_world_size=self._settings.group_world_size,
                registry_version=registry_version,
            )
            if proposal is not None:
                raw = bytes(store.compare_set(key, "", encode_verdict(proposal)))
        if raw is None:
            raw, timed_out = self._await_verdict(quorum, deadline, failure)
        verdict = decode_verdict(raw)
        if verdict.committed:
            return verdict
        try:
            reported = _reported(store, quorum)
        except StoreTimeoutError:
            reported = None
        return Verdict(committed=False, failure=reported, timed_out=timed_out)

    def _await_verdict(
        self, quorum: Quorum, deadline: float, failure: FailureReport | None
    ) -> tuple[bytes, bool]:
        """The verdict after one blocking wait, and whether the wait ran out.

        The wait ends when the last voter writes the verdict, or when any replica fails
        the step (each writes a failed verdict), this replica's watcher too when a peer
        stops beating or the deadline passes.
        """
        store, key = self._vote, Keys.commit(quorum)
        timed_out = False
        if failure is not None:  # failed before voting: publish it here, to be sure
            self._publish(store, quorum, failure)
        else:
            self._observer.vote_wait(deadline)
            try:
                grace = max(deadline - time.monotonic(), 0.0) + _VOTE_WAIT_GRACE_SECONDS
                store.wait([key], timedelta(seconds=grace))
            except StoreTimeoutError:
                raise
            except Exception:  # torch raises DistStoreError (or RuntimeError) on a timeout
                if not store.check([key]):
                    timed_out = True
                    reason = f"no commit decision within {self._settings.timeout}"
                    failed = FailureReport.of(self._settings.replica_id, TimeoutError(reason))
                    self._publish(store, quorum, failed)
            finally:
                self._observer.vote_wait(None)
        # The key exists now, so this reads it in one round trip (get would first wait
        # again): compare_set answers with the stored value unless it equals the
        # "committed, same quorum" verdict, which it then leaves as it is.
        return bytes(store.compare_set(key, _VERDICT_SAME, _VERDICT_SAME)), timed_out

    def leave(self) -> None:
        """Rank 0 marks the replica as gone; another rank zeroes its heartbeat.

        A counter of 0 reads as "not started": rank 0 does not break the group for it.
        """
        s = self._settings
        if s.group_rank == 0:
            self._vote.set(Keys.left(s.replica_id), encode_flag(True))
        else:
            self._vote.set(Keys.rank_heartbeat(self.group_name, s.group_rank), "0")

    # -- the watcher's -----------------------------------------------------------------

    def report(self, quorum: Quorum, failure: FailureReport) -> None:
        """Writes ``failure`` and a failed verdict for ``quorum``'s step."""
        self._publish(self._watch, quorum, failure)

    @staticmethod
    def _publish(store: KeyValueStore, quorum: Quorum, failure: FailureReport) -> None:
        store.set(Keys.error(quorum), encode_failure(failure))
        store.compare_set(Keys.commit(quorum), "", _VERDICT_FAILED)

    def reported(self, quorum: Quorum) -> FailureReport | None:
        """The failure a replica reported for ``quorum``'s step, if any."""
        return _reported(self._watch, quorum)

    def decision(self, quorum: Quorum) -> Verdict | None:
        """``quorum``'s step's verdict, if one was written."""
        key = Keys.commit(quorum)
        return decode_verdict(self._watch.get(key)) if self._watch.check([key]) else None

    def beat(self) -> None:
        """Beats this rank's heartbeat; group rank 0 also the replica's."""
        s = self._settings
        if s.group_world_size > 1:
            self._watch_liveness.beat_rank(self.group_name, s.group_rank)
        if s.group_rank == 0:
            self._watch_liveness.beat(s.replica_id)

    def registry_version(self) -> int:
        """The registry version now."""
        return int(self._watch.add(Keys.REGISTRY_VERSION, 0))

    def stale_ranks(self) -> list[int]:
        """The watched ranks of this group that stopped beating (rank 0 watches all)."""
        s = self._settings
        watched = watched_group_ranks(s.group_rank, s.group_world_size)
        return self._watch_liveness.stale_ranks(self.group_name, watched)

    def alive_members(self, quorum: Quorum) -> set[str]:
        """The members of ``quorum`` alive now; the first member reads for everybody."""
        return set(self.watch(quorum).alive)

    def watch(self, quorum: Quorum) -> StepWatch:
        """One look at the step (see :meth:`Liveness.look`): one store call for most ranks.

        The quorum's first member (its group rank 0) reads every member's heartbeat for
        the others.
        """
        s = self._settings
        monitor = s.group_rank == 0 and quorum.members[0] == s.replica_id
        return self._watch_liveness.look(quorum, monitor=monitor)

    def break_group(self, message: str, *, arrival: str | None, awaited: str | None) -> None:
        """Rank 0 leaves and ends its wait for its ranks; another rank ends its wait for rank 0."""
        if self._settings.group_rank == 0:
            self._watch_liveness.leave(self._settings.replica_id)
            if arrival is not None:
                self._watch.compare_set(
                    arrival, "", _json({"arrived": False, "why": message[:MESSAGE_CHARS]})
                )
        elif awaited is not None:
            self._watch.compare_set(awaited, "", encode_group_answer(None, message))

    def close(self) -> None:
        """Closes every connection this coordinator opened."""
        for store in (self._vote, self._quorum, self._round_liveness.store, self._watch):
            close = getattr(store, "close", None)
            if callable(close):
                close()
