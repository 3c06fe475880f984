"""One long-lived quorum worker per Manager: no thread per step, one configure at a time.

A Manager of one replica on an in-process store and a gloo group of one: each step is
failed on purpose, so that the next one needs a round and a new configuration.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dist_collectives.ft import Manager, ProcessGroupGloo
from dist_core.ports import get_unused_port


class _WatchedGloo(ProcessGroupGloo):
    """Records which thread configures it, and whether two configurations overlapped."""

    def __init__(self) -> None:
        super().__init__(timeout=timedelta(seconds=10))
        self.configured_by: set[str] = set()
        self.overlaps = 0
        self._inside = 0
        self._count = threading.Lock()

    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
        with self._count:
            self._inside += 1
            self.overlaps += self._inside > 1
        try:
            self.configured_by.add(threading.current_thread().name)
            super()._configure(store_addr, rank, world_size)
        finally:
            with self._count:
                self._inside -= 1


@pytest.fixture
def store_port() -> Iterator[int]:
    port = get_unused_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    yield port
    del server


def _manager(port: int, pg: ProcessGroupGloo) -> Manager:
    return Manager(
        pg,
        load_state_dict=lambda state: None,
        state_dict=dict,
        replica_id=f"worker-{uuid.uuid4().hex[:8]}",
        store_addr="127.0.0.1",
        store_port=port,
        timeout=timedelta(seconds=10),
        first_quorum_window=timedelta(0),
        namespace=f"t31-worker-{uuid.uuid4().hex}",
    )


def _failed_step(manager: Manager) -> None:
    manager.start_quorum()
    manager.allreduce(torch.ones(2)).wait()
    manager.report_error(RuntimeError("a failed step: the next one needs a round"))
    assert not manager.should_commit()


def test_twenty_steps_with_new_quorums_start_no_thread(
    store_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = _manager(store_port, ProcessGroupGloo(timeout=timedelta(seconds=10)))
    try:
        _failed_step(manager)
        _failed_step(manager)  # the reaper of retired groups has started by now
        started: list[str] = []
        start = threading.Thread.start

        def recording_start(thread: threading.Thread) -> None:
            started.append(thread.name)
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", recording_start)
        quorums = set()
        for _ in range(20):
            _failed_step(manager)
            quorums.add(manager.quorum_id())
        monkeypatch.undo()
        assert len(quorums) == 20, "each step should have had a new quorum"
        assert started == [], f"steps started threads: {started}"
    finally:
        manager.shutdown()


def test_only_the_quorum_worker_configures_the_group_and_never_twice_at_once(
    store_port: int,
) -> None:
    pg = _WatchedGloo()
    manager = _manager(store_port, pg)
    try:
        for _ in range(10):
            manager.start_quorum()  # the step fails before its quorum is even used
            manager.report_error(RuntimeError("failed at once"))
            assert not manager.should_commit()
        manager.start_quorum()
        manager.allreduce(torch.ones(2)).wait()
        assert manager.should_commit()
    finally:
        manager.shutdown()
    assert pg.configured_by == {f"ft-quorum-{manager.replica_id}"}
    assert pg.overlaps == 0
