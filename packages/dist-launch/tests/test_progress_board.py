"""The job's progress board over a fake store: a node takes another node's later progress."""

from __future__ import annotations

import time
from pathlib import Path

from fake_rendezvous import FakeStore

from dist_launch.plan.hang_policy import HangPolicy
from dist_launch.rendezvous.progress_board import ProgressBoard, progress_key
from dist_launch.watch.hang_watch import HangWatch

IDLE = 3600.0  # the boards' own threads never exchange during a test: it calls _exchange


def test_each_node_reads_the_latest_progress_of_the_others() -> None:
    store = FakeStore()
    boards = [ProgressBoard(store, node, 3, IDLE) for node in range(3)]
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
    here, there = ProgressBoard(store, 0, 2, IDLE), ProgressBoard(store, 1, 2, IDLE)
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


def test_without_progress_anywhere_the_node_is_hung(tmp_path: Path) -> None:
    store = FakeStore()
    here, there = ProgressBoard(store, 0, 2, IDLE), ProgressBoard(store, 1, 2, IDLE)
    watch = HangWatch(HangPolicy("fixed", 3.0), str(tmp_path), "n0 (node 0)", board=here)
    reasons: list[str] = []
    watch.on_hang = reasons.append
    try:
        now = time.monotonic()
        watch.quiet.last_progress = now - 10.0
        there.publish(time.time() - 10.0)
        there._exchange()
        here._exchange()
        assert watch.due(now) is None
        assert reasons and reasons[0].startswith("no rank of the job made progress")
    finally:
        here.stop()
        there.stop()
        watch.close()
