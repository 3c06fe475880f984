"""Quorums of live replicas: the decision record and the rules that make it.

A *round* collects the replicas that ask for a quorum, each with the last step it
committed; it closes (:func:`round_is_due`) once every replica seen alive has joined,
or its join time ran out, with at least the minimum of members; the decision
(:func:`decide_quorum`) orders the members by name and keeps the previous round's
quorum id when the members are the same, all at one step, and no error was reported
under it; otherwise the id goes up by one and every member reconfigures its group on a
prefix named after the new id. Liveness needs no synchronised clocks: each observer
notes, on its own monotonic clock, when it last saw a replica's counter change
(:class:`HeartbeatClock`).

Nothing here touches a store, a thread or a clock. The coordinators carry the rounds
out: :mod:`dist_collectives.ft.coordination.store_coordinator` through the job's
key-value store (it owns every key and value there),
:mod:`dist_collectives.ft.coordination.memory_coordinator` in one process.
:func:`compute_quorum` and :class:`Liveness`, which used to live here, are that store
module's and stay importable from here.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Collection, Sequence
from typing import Any

from dist_collectives.ft.errors import FTError

# How often a replica that waits for a round's decision checks whether the round is due
# to close on a timer (a replica stopped beating, a join time ran out). The replica that
# completes a round wakes the waiters at once; the tick only bounds how late a round
# closes after a replica died.
ROUND_TICK_SECONDS = 0.1
# How often a member that does not close its round first checks that the closer still
# does; each check that finds the closer at work doubles the wait for the next, up to
# CLOSER_CHECK_MAX_SECONDS, so that a round of N members that lasts T seconds costs the
# store about N * log2(T) checks, not N * T.
CLOSER_CHECK_SECONDS = 1.0
CLOSER_CHECK_MAX_SECONDS = 8.0
# Names that moved to the store coordinator, importable from here as before.
_MOVED = ("Liveness", "compute_quorum", "REGISTRY_VERSION_KEY")


def __getattr__(name: str) -> Any:
    """The names that moved to :mod:`~dist_collectives.ft.coordination.store_coordinator`."""
    if name in _MOVED:
        from dist_collectives.ft.coordination import store_coordinator  # noqa: PLC0415  (it imports this module)

        return getattr(store_coordinator, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def decide_quorum(
    round_: int,
    members: dict[str, int],
    previous: Quorum | None,
    *,
    previous_failed: bool,
    registry_version: int = 0,
    init_sync: bool = False,
) -> Quorum:
    """The decision of round ``round_`` with ``members`` (replica -> last committed step).

    Args:
        round_: The round's number.
        members: The replicas that joined it, each with the step it had committed.
        previous: The previous round's decision (None only for round 0).
        previous_failed: Whether an error was reported under ``previous``'s quorum id.
        registry_version: The registry version the closer read with the members.
        init_sync: See :attr:`Quorum.init_sync`.
    """
    ordered, steps = proposed_members(members)
    quorum_uuid = str(uuid.uuid4())
    if previous is None:
        quorum_id = round_  # round 0; later rounds always have a previous decision
    else:
        unchanged = keeps_quorum_id(previous, ordered, steps) and not previous_failed
        quorum_id = previous.quorum_id if unchanged else previous.quorum_id + 1
        if unchanged and previous.quorum_uuid:
            quorum_uuid = previous.quorum_uuid
    return Quorum(
        round=round_,
        quorum_id=quorum_id,
        members=ordered,
        steps=steps,
        registry_version=registry_version,
        init_sync=init_sync,
        quorum_uuid=quorum_uuid,
    )


def kept_a_failed_quorum(quorum: Quorum, failed_quorum_id: int | None) -> bool:
    """Whether a decided quorum keeps the id of a configuration whose step failed here.

    Such a group is never used again: the failed step's exchanges may still be running
    on it and would pair with the next step's.
    """
    return failed_quorum_id is not None and quorum.quorum_id == failed_quorum_id


def watched_group_ranks(group_rank: int, group_world_size: int) -> range:
    """The ranks of its replica group whose heartbeat a rank watches.

    Rank 0 watches every other rank; the others watch rank 0.
    """
    return range(1, group_world_size) if group_rank == 0 else range(1)


def group_step(own: int, others: Sequence[int]) -> int:
    """The step a replica group asks for a quorum with: the oldest any of its ranks holds.

    Args:
        own: The step of group rank 0, which asks for the group.
        others: The steps the group's other ranks hold (those whose load of a healed
            state failed hold an older one than the ranks that loaded it).
    """
    return min(own, *others)
