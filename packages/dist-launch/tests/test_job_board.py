"""The job board over a fake store: progress elsewhere, a hang's alarm, shared reports."""

from __future__ import annotations

import time
from pathlib import Path

from fake_rendezvous import FakeStore

from dist_launch.plan.hang_policy import HangPolicy
from dist_launch.rendezvous.job_board import JobBoard, progress_key
from dist_launch.watch.hang_watch import HangWatch

IDLE = 3600.0  # the boards' own threads never exchange during a test: it calls _exchange


def test_each_node_reads_the_latest_progress_of_the_others() -> None:
    store = FakeStore()
    boards = [JobBoard(store, node, 3, IDLE) for node in range(3)]
    try:
        for node, board in enumerate(boards):
            board.publish(1000.0 + node)
        boards[0]._exchange()
        assert boards[0].latest_elsewhere() is None  # the others have not published yet
        boards[1]._exchange()
        boards[2]._exchange()
        boards[0]._exchange()
        assert boards[0].latest_elsewhere() == 1002.0
        assert float(store.data[progress_key(1)]) == 1001.0
    finally:
        for board in boards:
            board.stop()


def test_a_node_is_not_hung_while_another_makes_progress(tmp_path: Path) -> None:
    store = FakeStore()
    here, there = JobBoard(store, 0, 2, IDLE), JobBoard(store, 1, 2, IDLE)
    watch = HangWatch(HangPolicy("fixed", 3.0), str(tmp_path), "n0 (node 0)", board=here)
    try:
        now = time.monotonic()
        watch.quiet.last_progress = now - 10.0  # this node has been quiet for 10 s
        there.publish(time.time() - 1.0)  # the other node made progress a second ago
        there._exchange()
        here._exchange()
        assert watch.due(now) is not None  # no alarm: the other node's progress counts
        assert watch.reason is None
        assert watch.quiet.quiet_for(now) < 3.0
    finally:
        here.stop()
        there.stop()
        watch.close()


def test_a_hang_found_on_one_node_is_found_on_every_node(tmp_path: Path) -> None:
    store = FakeStore()
    here, there = JobBoard(store, 0, 2, IDLE), JobBoard(store, 1, 2, IDLE)
    watch = HangWatch(HangPolicy("fixed", 3.0), str(tmp_path), "n0 (node 0)", board=here)
    other = HangWatch(HangPolicy("fixed", 300.0), str(tmp_path), "n1 (node 1)", board=there)
    try:
        now = time.monotonic()
        watch.quiet.last_progress = now - 10.0
        there.publish(time.time() - 10.0)
        there._exchange()
        here._exchange()
        assert watch.due(now) is not None  # suspected: the round asks the ranks' records
        assert watch.reason is None
        watch.confirm()  # the records show no sign of life
        assert watch.reason is not None
        assert watch.reason.startswith("no rank of the job made progress")
        here._exchange()  # sends the alarm
        there._exchange()  # reads it
        # The other node's own timeout is far away: it takes the first node's alarm.
        assert other.due(now) is None
        assert other.reason == f"the job was found hung on node 0: {watch.reason}"
        there._exchange()
        assert store.data["dist_launch/hang/alarms"] == b"1"  # it did not count itself
    finally:
        here.stop()
        there.stop()
        watch.close()
        other.close()


def test_each_node_reads_the_others_reports_once_all_are_there() -> None:
    store = FakeStore()
    boards = [JobBoard(store, node, 3, IDLE) for node in range(3)]
    try:
        boards[0].share("hang", "zero")
        boards[1].share("hang", "one")
        for board in boards:
            board._exchange()
        assert boards[0].shared("hang") is None  # node 2 has not shared yet
        boards[2].share("hang", "two")
        boards[2]._exchange()
        boards[0]._exchange()
        assert boards[0].shared("hang") == {1: "one", 2: "two"}
        assert boards[2].shared("hang") == {0: "zero", 1: "one"}
        boards[0].forget("hang")
        assert boards[0].shared("hang") is None
    finally:
        for board in boards:
            board.stop()


def test_a_suspicion_tells_no_other_node_until_the_records_confirm_it(tmp_path: Path) -> None:
    store = FakeStore()
    here, there = JobBoard(store, 0, 2, IDLE), JobBoard(store, 1, 2, IDLE)
    watch = HangWatch(HangPolicy("fixed", 3.0), str(tmp_path), "n0 (node 0)", board=here)
    try:
        now = time.monotonic()
        watch.quiet.last_progress = now - 10.0
        there.publish(time.time() - 10.0)
        there._exchange()
        here._exchange()
        assert watch.due(now) is not None  # suspected, still watching
        assert watch.suspicion is not None and watch.reason is None
        here._exchange()
        assert store.data.get("dist_launch/hang/alarms", b"0") == b"0"
        # The records showed a collective completed a second ago: not hung.
        watch.dismiss(now, now - 1.0)
        assert watch.suspicion is None and watch.reason is None
        assert not watch.quiet.hung(now + 1.9)
        # Quiet again for the timeout, and this time the records confirm it.
        assert watch.due(now + 2.0) is not None
        assert watch.suspicion is not None
        watch.confirm()
        assert watch.reason is not None and watch.reason.startswith("no rank of the job")
        here._exchange()
        assert store.data["dist_launch/hang/alarms"] == b"1"
    finally:
        here.stop()
        there.stop()
        watch.close()


def test_a_suspicion_waiting_for_the_records_does_not_spin_the_loop(tmp_path: Path) -> None:
    """While the records are asked for, the next look is a look period away, not past."""
    watch = HangWatch(HangPolicy("fixed", 3.0), str(tmp_path), "n0 (node 0)")
    try:
        now = time.monotonic()
        watch.quiet.last_progress = now - 10.0
        assert watch.due(now) is not None
        assert watch.suspicion is not None
        for turn in range(1, 4):  # the loop comes back at the time due gave it
            later = now + turn * 0.5
            due = watch.due(later)
            assert due is not None
            assert due >= later + watch.policy.look_period
        watch.dismiss(now + 2.0)
        assert watch.due(now + 2.0) is not None  # the look after a dismissal is at once
        assert watch.suspicion is None
    finally:
        watch.close()


class CountingStore(FakeStore):
    """A fake store that counts the calls made to it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def set(self, key: str, value: str | bytes) -> None:
        self.calls += 1
        super().set(key, value)

    def check(self, keys: list[str]) -> bool:
        self.calls += 1
        return super().check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.calls += 1
        return super().multi_get(keys)


def test_a_heartbeat_costs_the_store_the_same_calls_whatever_the_node_count() -> None:
    # Every node's board reads every other node's beat each period: per-node reads made
    # the store's load grow with the square of the node count.
    costs = []
    for nodes in (2, 16):
        store = CountingStore()
        boards = [JobBoard(store, node, nodes, IDLE) for node in range(nodes)]
        try:
            for board in boards:
                board._heartbeat()
            before = store.calls
            boards[0]._heartbeat()
            costs.append(store.calls - before)
            assert len(boards[0].heartbeats()) == nodes - 1
        finally:
            for board in boards:
                board.stop()
    assert costs == [3, 3]
