"""The c10d round watch: what it reports, once, from a fake rendezvous (no store, no process)."""

from __future__ import annotations

import threading

from dist_launch.rendezvous.membership_watch import MembershipWatch
from dist_launch.rendezvous.protocol import RoundChange

BOUND = 5.0  # seconds a report may take


class FakeMembership:
    """Answers the watch's polls from fields a test sets; counts the polls."""

    def __init__(
        self, *, closed: bool = False, waiting: int = 0, lost: int = 0, finished: int = 0
    ) -> None:
        self.closed = closed
        self.waiting = waiting
        self.lost = lost
        self.finished = finished
        self.finished_from_poll: int | None = None  # workers stop finishing from this poll
        self.error: Exception | None = None
        self.polls = 0
        self.waiting_from_poll: int | None = None  # nodes start waiting at this poll

    def is_closed(self) -> bool:
        self.polls += 1
        if self.error is not None:
            raise self.error
        return self.closed

    def nodes_waiting(self) -> int:
        if self.waiting_from_poll is not None and self.polls >= self.waiting_from_poll:
            return 1
        return self.waiting

    def lost_nodes(self) -> int:
        return self.lost

    def nodes_finished(self) -> int:
        if self.finished_from_poll is not None and self.polls >= self.finished_from_poll:
            return 0
        return self.finished

    def lost_store(self, error: Exception, since: float) -> str:
        return f"node0 stopped answering ({error})"


def first_change(membership: FakeMembership, lost_after: float = 0.0) -> list[RoundChange]:
    changes: list[RoundChange] = []
    seen = threading.Event()

    def on_change(change: RoundChange) -> None:
        changes.append(change)
        seen.set()

    watch = MembershipWatch(membership, 0.001, on_change, lost_after)
    assert seen.wait(BOUND)
    watch.stop()
    return changes


def test_a_closed_job_is_reported() -> None:
    assert first_change(FakeMembership(closed=True)) == [RoundChange("closed")]


def test_a_silent_store_is_reported_with_its_error() -> None:
    membership = FakeMembership()
    membership.error = TimeoutError("read timed out")
    (change,) = first_change(membership)
    assert change.kind == "unreachable"
    assert str(change) == "unreachable: node0 stopped answering (read timed out)"


def test_waiting_nodes_are_reported() -> None:
    assert first_change(FakeMembership(waiting=2)) == [
        RoundChange("membership", "2 node(s) waiting to join")
    ]


def test_lost_nodes_are_reported_once_lost_long_enough() -> None:
    assert first_change(FakeMembership(lost=1)) == [
        RoundChange("membership", "1 node(s) stopped sending heartbeats")
    ]


def test_a_node_lost_for_less_than_a_heartbeat_is_not_reported() -> None:
    # Lost from the first poll but never for an hour: what ends the round is the node
    # that starts waiting at the fifth poll.
    membership = FakeMembership(lost=1)
    membership.waiting_from_poll = 5
    changes = first_change(membership, lost_after=3600.0)
    assert changes == [RoundChange("membership", "1 node(s) waiting to join")]
    assert membership.polls == 5


def test_a_finishing_round_is_not_re_formed_for_lost_or_waiting_nodes() -> None:
    # A node's workers all succeeded: lost and waiting nodes change nothing while it is
    # so. The fake's finished count drops at the fifth poll only to end the test.
    membership = FakeMembership(lost=2, waiting=1, finished=1)
    membership.finished_from_poll = 5
    changes = first_change(membership)
    assert changes == [RoundChange("membership", "1 node(s) waiting to join")]
    assert membership.polls == 5


def test_a_closed_job_is_reported_while_it_finishes() -> None:
    assert first_change(FakeMembership(closed=True, finished=1)) == [RoundChange("closed")]
