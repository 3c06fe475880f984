"""A cut cable, without a process: who is unreachable, which side stops, and the wording.

The decisions (:mod:`dist_launch.watch.partition`) are pure; the cut watch reads a job
board over a fake store; a store that is given up fails every call at once.
"""

from __future__ import annotations

import threading
import time

import pytest
from fake_rendezvous import FakeStore

from dist_launch.rendezvous.job_board import UNREACHABLE_KEY, JobBoard
from dist_launch.rendezvous.store_deadline import StoreDeadline, StoreDeadlineError
from dist_launch.watch.cut_watch import CutWatch, node_ranks, silence_bound
from dist_launch.watch.partition import (
    PeerNode,
    Unreachable,
    decide_side,
    unreachable_nodes,
)

IDLE = 3600.0  # the boards' own threads never exchange during a test: it calls _exchange
NODE2 = PeerNode(2, "node2", "10.0.0.2", (4, 5))
NODE1 = PeerNode(1, "node1", "10.0.0.1", (2, 3))


def test_a_silent_heartbeat_marks_its_node_unreachable_since_that_beat() -> None:
    found = unreachable_nodes(
        [NODE1, NODE2], {1: 99.0, 2: 90.0}, 99.5, now=100.0, silent_after=5.0, seen_from="node0"
    )
    assert found == [Unreachable(NODE2, 90.0, "node0")]


def test_a_quiet_but_beating_job_has_nobody_unreachable() -> None:
    # The ranks may be quiet for minutes; the boards' heartbeats are not.
    found = unreachable_nodes(
        [NODE1, NODE2], {1: 99.0, 2: 98.0}, 99.9, now=100.0, silent_after=5.0, seen_from="node0"
    )
    assert found == []


def test_a_node_never_heard_from_is_silent_since_this_node_began_listening() -> None:
    # A cable cut before the peer's first heartbeat was read (a cut in the first step).
    found = unreachable_nodes(
        [NODE1, NODE2], {1: 99.0}, 99.5, now=100.0, silent_after=5.0, seen_from="node0",
        listening_since=90.0,
    )  # fmt: skip
    assert found == [Unreachable(NODE2, 90.0, "node0")]


def test_a_node_not_yet_heard_from_in_a_new_round_is_not_unreachable() -> None:
    # The false alarm beside it: a peer's first beat may take a few seconds to arrive.
    found = unreachable_nodes(
        [NODE1, NODE2], {1: 99.0}, 99.5, now=100.0, silent_after=5.0, seen_from="node0",
        listening_since=97.0,
    )  # fmt: skip
    assert found == []


def test_a_silent_store_makes_every_other_node_unreachable_since_its_last_answer() -> None:
    found = unreachable_nodes(
        [NODE1, NODE2], {1: 99.0, 2: 99.0}, 80.0, now=100.0, silent_after=5.0, seen_from="node0"
    )
    assert [(u.peer.node, u.since) for u in found] == [(1, 80.0), (2, 80.0)]


def test_the_line_names_host_address_time_and_ranks() -> None:
    since = time.mktime((2026, 1, 1, 12, 0, 3, 0, 0, -1))
    line = Unreachable(NODE2, since, "node1").describe()
    assert line == "node2 (10.0.0.2) unreachable from node1 since 12:00:03; ranks 4-5"
    assert Unreachable(NODE2, since, "node1").to_json()["ranks"] == [4, 5]


@pytest.mark.parametrize(("store_reachable", "side"), [(True, "go_on"), (False, "fence")])
def test_with_a_store_only_the_side_that_reaches_it_goes_on(
    store_reachable: bool, side: str
) -> None:
    decision = decide_side(
        has_store=True, store_reachable=store_reachable, reachable_nodes=1, round_nodes=3
    )
    assert decision.side == side


@pytest.mark.parametrize(
    ("reachable", "nodes", "side"),
    [(2, 3, "go_on"), (1, 3, "fence"), (1, 2, "fence"), (2, 4, "fence"), (3, 4, "go_on")],
)
def test_without_a_store_only_a_strict_majority_goes_on(
    reachable: int, nodes: int, side: str
) -> None:
    decision = decide_side(
        has_store=False, store_reachable=False, reachable_nodes=reachable, round_nodes=nodes
    )
    assert decision.side == side
    if side == "fence":
        assert "no majority" in decision.why


def test_two_halves_never_both_go_on() -> None:
    for nodes in range(2, 7):
        for left in range(1, nodes):
            sides = [
                decide_side(
                    has_store=False, store_reachable=False, reachable_nodes=n, round_nodes=nodes
                ).side
                for n in (left, nodes - left)
            ]
            assert sides.count("go_on") <= 1, (nodes, left)


def test_the_silence_bound_is_the_shorter_of_hang_timeout_and_keep_alive() -> None:
    assert silence_bound(10.0, 15.0) == 10.0
    assert silence_bound(None, 15.0) == 15.0
    assert silence_bound(1.0, 15.0) >= 5.0  # never a second or two: a loaded host lags
    assert silence_bound(None, 3.0, 6.0) == 11.0  # etcd: an election's stall on top


def test_node_ranks_follow_the_assignment() -> None:
    assert node_ranks(base_rank=2, nproc=2, nodes=3, own=1) == {0: (0, 1), 1: (2, 3), 2: (4, 5)}


def _watch(board: JobBoard, fenced: list[str]) -> CutWatch:
    return CutWatch(
        board,
        f"node{board.node}",
        node_ranks(board.node * 2, 2, board.nodes, board.node),
        silent_after=5.0,
        on_fence=fenced.append,
        store_node=lambda since: "node0 (10.0.0.1:29400), which served the rendezvous",
    )


def test_the_side_that_hears_the_store_is_not_fenced_and_names_the_cut_node() -> None:
    store = FakeStore()
    here, there = JobBoard(store, 0, 2, IDLE), JobBoard(store, 1, 2, IDLE)
    fenced: list[str] = []
    try:
        there.introduce({"host": "node1", "address": "10.0.0.2", "ranks": [2, 3]})
        there._exchange()
        here._exchange()
        watch = _watch(here, fenced)
        assert watch.due(time.monotonic()) is not None and fenced == []
        later = time.time() + 60.0  # node 1 wrote nothing since: its cable is cut
        (lost,) = watch.unreachable(later)
        assert lost.describe().startswith("node1 (10.0.0.2) unreachable from node0 since ")
        assert lost.peer.ranks == (2, 3)
    finally:
        here.stop()
        there.stop()


def test_at_a_hang_the_reachable_side_counts_the_cut_node_once() -> None:
    store = FakeStore()
    here, there = JobBoard(store, 0, 2, IDLE), JobBoard(store, 1, 2, IDLE)
    fenced: list[str] = []
    try:
        there._exchange()
        here._exchange()
        store.set("dist_launch/alive/1", '{"t": 1.0, "who": {"host": "node1"}}')
        here._exchange()  # reads node 1's beat from long ago; the store answers
        watch = _watch(here, fenced)
        assert [u.peer.host for u in watch.at_hang()] == ["node1"]
        assert [u.peer.host for u in watch.at_hang()] == ["node1"]
        assert fenced == []
        assert store.add(UNREACHABLE_KEY, 0) == 1
    finally:
        here.stop()
        there.stop()


def test_the_side_whose_store_is_silent_is_fenced_once_and_names_the_store_node() -> None:
    store = FakeStore()
    board = JobBoard(store, 1, 2, IDLE)
    fenced: list[str] = []
    try:
        board._exchange()
        watch = _watch(board, fenced)
        assert board.store_answered_at is not None
        board.store_answered_at -= 30.0  # no exchange has finished since
        assert watch.due(time.monotonic()) is None
        assert watch.due(time.monotonic()) is None
        (why,) = fenced
        assert why.startswith("this node cannot reach the rendezvous store: node0 (10.0.0.1")
        assert "unreachable from node1 since" in why and "ranks 0-1" in why
    finally:
        board.stop()


@pytest.mark.parametrize(("silent", "fenced_at_hang"), [(8.0, False), (10.0, True)])
def test_at_a_hang_a_store_that_may_stall_fences_only_past_its_stall(
    silent: float, fenced_at_hang: bool
) -> None:
    # etcd electing a leader leaves a healthy node unanswered for up to its stall (6 s);
    # a hang then must not fence it after the usual 3 s of silence.
    store = FakeStore()
    board = JobBoard(store, 1, 2, IDLE)
    fenced: list[str] = []
    try:
        board._exchange()
        watch = _watch(board, fenced)
        watch.stall_seconds = 6.0
        assert board.store_answered_at is not None
        board.store_answered_at -= silent
        watch.at_hang()
        assert bool(fenced) == fenced_at_hang
    finally:
        board.stop()


def test_a_store_given_up_fails_every_call_at_once_and_frees_its_waiters() -> None:
    deadline = StoreDeadline("node0:29400", seconds=60.0)
    blocked = threading.Event()
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            deadline.run("get('x')", lambda: blocked.wait(120.0))
        except StoreDeadlineError as error:
            errors.append(error)

    thread = threading.Thread(target=waiter)
    thread.start()  # given up while it waits, or refused before its call: an error either way
    started = time.monotonic()
    deadline.silence("this node cannot reach the rendezvous store")
    thread.join(timeout=10.0)
    blocked.set()
    assert not thread.is_alive() and time.monotonic() - started < 10.0
    with pytest.raises(StoreDeadlineError, match="out of reach"):
        deadline.run("add('y')", lambda: 1)
    assert len(errors) == 1 and "node0:29400" in str(errors[0])
