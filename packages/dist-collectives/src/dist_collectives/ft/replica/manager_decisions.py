"""What a :class:`~dist_collectives.ft.Manager` decides, as pure functions.

Each function takes what the Manager's executor read (from the store, the clock, its
own state) and answers what follows: the commit vote, whether the next step reuses the
quorum, who heals from whom, whether the watcher fails the step, which replicas a
quorum lost. None of them touches the store, a thread or a clock, so a test calls them
directly, without processes. The executor (:mod:`dist_collectives.ft.replica.manager_executor`)
does the reading and the writing around them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Sequence
from datetime import timedelta

from dist_collectives.ft.coordination.coordinator import Verdict
from dist_collectives.ft.coordination.quorum import Quorum
from dist_collectives.ft.errors import ReplicaError

# A failure's cause in the log: its first line, at most this long.
CAUSE_CHARS = 200
# gloo's messages start with the C++ source location: "[/path/to/pair.cc:537] Read error".
_SOURCE_LOCATION = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\]\s*")


def reused_quorum(last: Quorum | None, *, reuse: bool, group_broken: bool) -> Quorum | None:
    """The next step's quorum when it needs no round, else None.

    The last step's verdict let the next step reuse its quorum: same members, same group, one
    step on. A broken replica group always asks for a round (its rank 0 then fails it).
    """
    if not reuse or group_broken or last is None:
        return None
    return last.next_step()


@dataclasses.dataclass(frozen=True)
class HealPlan:
    """Whom a replica receives a state from, and whom it sends its own to, in one quorum."""

    receive_from: int | None  # the sender's rank in the quorum's group, if this one heals
    send_to: tuple[int, ...]  # the ranks of the replicas this one heals


def heal_plan(quorum: Quorum, replica_id: str) -> HealPlan:
    """Who heals from whom, for ``replica_id`` in ``quorum``."""
    if replica_id in quorum.receivers:
        source = quorum.replica_rank(quorum.heal_source(replica_id))
        return HealPlan(receive_from=source, send_to=())
    healers = tuple(quorum.replica_rank(m) for m in quorum.healers_of(replica_id))
    return HealPlan(receive_from=None, send_to=healers)


@dataclasses.dataclass(frozen=True)
class Configure:
    """Configure the group for a quorum whose id is new to it."""

    quorum_id: int
    address: str
    rank: int
    world_size: int
    # The group's ``uuid`` (from the quorum's UUID) for groups reconfigured by handles;
    # None: rank 0 draws one.
    communicator_uuid: int | None = None


@dataclasses.dataclass(frozen=True)
class ReceiveState:
    """Receive a healthy peer's state (this replica heals)."""

    source: int  # the sender's rank in the quorum's group


@dataclasses.dataclass(frozen=True)
class SendState:
    """Send this replica's state to the replicas that heal from it."""

    healers: tuple[int, ...]


QuorumAction = Configure | ReceiveState | SendState


def quorum_actions(
    quorum: Quorum,
    replica_id: str,
    *,
    configured_id: int | None,
    store_address: str,
    group_rank: int,
    group_world_size: int,
) -> tuple[QuorumAction, ...]:
    """What the quorum worker does, in order, once ``quorum`` is decided.

    Args:
        quorum: The decided quorum.
        replica_id: This replica.
        configured_id: The quorum id the group is configured for now (None: never).
        store_address: ``host:port/namespace`` of the job's store.
        group_rank: This process's rank in its replica group.
        group_world_size: The size of each replica group.
    """
    actions: list[QuorumAction] = []
    if quorum.quorum_id != configured_id:
        address = group_address(
            store_address,
            quorum.quorum_id,
            group_rank=group_rank,
            group_world_size=group_world_size,
        )
        rank = quorum.replica_rank(replica_id)
        # Rank i of every replica group forms a group of its own: those draw their own
        # uuid, so that no two groups of one quorum share a rendezvous prefix.
        named = quorum.communicator_uuid if group_world_size == 1 else None
        actions.append(Configure(quorum.quorum_id, address, rank, len(quorum.members), named))
    plan = heal_plan(quorum, replica_id)
    if plan.receive_from is not None:
        actions.append(ReceiveState(plan.receive_from))
    elif plan.send_to:
        actions.append(SendState(plan.send_to))
    return tuple(actions)


def describe_action(action: QuorumAction) -> str:
    """What the quorum worker is doing, for a timeout's message."""
    if isinstance(action, Configure):
        return (
            f"configuring the group for quorum {action.quorum_id} "
            f"(rank {action.rank} of {action.world_size} on {action.address})"
        )
    if isinstance(action, ReceiveState):
        return f"receiving a state from rank {action.source}"
    return f"sending its state to ranks {list(action.healers)}"


def request_is_stale(request_generation: int, current_generation: int) -> bool:
    """Whether a quorum request of ``request_generation`` was superseded by a newer step.

    The worker drops such a request without a store call: nobody waits for it, and a
    round joined with an old step would only make the others wait for it.
    """
    return request_generation != current_generation


def overdue_error(
    now: float,
    *,
    allreduce_deadline: float | None,
    allreduce_unfinished: bool,
    vote_deadline: float | None,
    timeout: timedelta,
) -> TimeoutError | None:
    """The error the watcher fails a step with when a wait of the step ran past its deadline.

    Args:
        now: The monotonic clock.
        allreduce_deadline: When the commit's wait for the step's allreduces must end
            (None while it does not wait).
        allreduce_unfinished: Whether any allreduce of the step is still in flight.
        vote_deadline: When the wait for the commit decision must end (None while
            none waits).
        timeout: The Manager's timeout, for the message.
    """
    if allreduce_deadline is not None and now > allreduce_deadline and allreduce_unfinished:
        return TimeoutError(f"allreduce did not finish within {timeout}")
    if vote_deadline is not None and now > vote_deadline:
        return TimeoutError(f"no commit decision within {timeout}")
    return None


def lost_members(quorum: Quorum, alive: Collection[str], replica_id: str) -> list[str]:
    """The members of ``quorum`` other than ``replica_id`` that are no longer alive."""
    return [m for m in quorum.members if m not in alive and m != replica_id]


def lost_member_error(lost: Sequence[str], decision: Verdict | None) -> ReplicaError | None:
    """The error that fails a step whose quorum lost the members ``lost``, if any.

    Args:
        lost: The members that stopped beating their heartbeat or left.
        decision: The step's verdict if one was reached yet: a member that left after
            the step committed does not fail it (the next quorum is without it).
    """
    if not lost or (decision is not None and decision.committed):
        return None
    return ReplicaError(f"replicas {list(lost)} stopped beating their heartbeat or left")


def broken_group_message(replica_id: str, stale: Sequence[int]) -> str:
    """Why a replica group is out of the quorum: its ranks ``stale`` stopped beating."""
    return (
        f"replica group {replica_id}: group ranks {list(stale)} stopped beating their "
        "heartbeat; the group is out of the quorum until all its ranks restart"
    )


def group_address(
    store_address: str, quorum_id: int, *, group_rank: int, group_world_size: int
) -> str:
    """Where the group of quorum ``quorum_id`` rendezvouses, under ``store_address``.

    Args:
        store_address: ``host:port/namespace`` of the job's store.
        quorum_id: The quorum's id: a new id, a new group.
        group_rank: This process's rank in its replica group.
        group_world_size: The size of each replica group; above 1, rank ``i`` of each
            group forms a group of its own with rank ``i`` of the others.
    """
    address = f"{store_address}/pg/{quorum_id}"
    return f"{address}/{group_rank}" if group_world_size > 1 else address


def membership_change(configured: Sequence[str], members: Sequence[str]) -> str:
    """``, without a, b, joined by c`` against the last configured members ('' if none)."""
    if not configured:
        return ""
    lost = [m for m in configured if m not in members]
    joined = [m for m in members if m not in configured]
    parts = ([f"without {', '.join(lost)}"] if lost else []) + (
        [f"joined by {', '.join(joined)}"] if joined else []
    )
    return "".join(f", {part}" for part in parts)


@dataclasses.dataclass(frozen=True)
class Failure:
    """The first failure since the last step that committed: what recovery is timed from."""

    seen_at: float  # monotonic
    step: int
    members: tuple[str, ...]
    generation: int


def recovered_failure(failure: Failure | None, *, committed: bool, generation: int) -> bool:
    """Whether a step of ``generation`` that ``committed`` ends the recovery from ``failure``.

    A failure seen in the committing step's own generation came after every replica
    voted (a peer died after its vote): it belongs to the next step, whose commit ends
    it. A step that does not commit leaves the recovery open.
    """
    return committed and failure is not None and failure.generation != generation


def lost_since(failure: Failure, quorum: Quorum) -> list[str]:
    """The members at ``failure`` that ``quorum`` no longer has."""
    return [m for m in failure.members if m not in quorum.members]


def failure_cause(error: BaseException) -> str:
    """``error`` on one line of bounded length: its type and the first line of its message."""
    lines = _SOURCE_LOCATION.sub("", str(error)).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= CAUSE_CHARS else text[: CAUSE_CHARS - 3] + "..."
