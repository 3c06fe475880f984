"""Replica groups of two ranks as real processes: one rank of one group is SIGKILLed
mid-step, the other groups discard the step and go on without that group, the group
restarts as a whole (as its own launcher would restart it) and heals rank by rank.

Each group trains one MLP sharded across its two ranks with torch's own FSDP
(``torch.distributed.fsdp.fully_shard`` on the group's gloo process group, CPU): the
forward all-gathers the parameters inside the group, the backward reduce-scatters the
gradients inside the group, and each rank's Manager averages its shard's gradients
with the same rank of the other groups (see ``group_worker.py``). The loss depends on
the whole sharded model, so a shard healed from the wrong peer, or exchanged with the
wrong rank, leaves the groups' shards different at the end.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from group_scenario import (
    check_scenario,
    run_lose_a_rank_and_rejoin,
)

from dist_collectives.ft import Manager, ManagerConfigError, ProcessGroupDummy
from dist_core.ports import get_unused_port


@pytest.mark.processes
@pytest.mark.timeout(500)
def test_a_replica_group_loses_a_rank_is_left_out_and_rejoins_as_a_whole(tmp_path: Path) -> None:
    check_scenario(run_lose_a_rank_and_rejoin(tmp_path, get_unused_port()))


def _manager(port: int, **kwargs: Any) -> Manager:
    kwargs.setdefault("timeout", timedelta(seconds=10))
    return Manager(
        ProcessGroupDummy(0, 1),
        load_state_dict=lambda state: None,
        state_dict=dict,
        store_addr="127.0.0.1",
        store_port=port,
        **kwargs,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"replica_id": "g", "group_rank": 2, "group_world_size": 2}, r"in \[0, 2\)"),
        ({"replica_id": "g", "group_rank": 0, "group_world_size": 0}, "at least 1"),
        ({"group_rank": 1, "group_world_size": 2}, "needs a replica_id"),
    ],
)
def test_a_group_rank_outside_its_group_or_a_group_without_a_name_is_refused(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ManagerConfigError, match=message):
        _manager(get_unused_port(), **kwargs)


def test_replica_groups_of_different_sizes_are_refused() -> None:
    port = get_unused_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    first = _manager(port, replica_id="a", group_rank=0, group_world_size=2)
    try:
        with pytest.raises(ManagerConfigError, match="every group must have the same size"):
            _manager(port, replica_id="b", group_rank=0, group_world_size=3)
        assert (first.group_rank, first.group_world_size) == (0, 2)
    finally:
        first.shutdown()
    del store


def test_a_rank_whose_group_rank_0_is_gone_fails_the_step_without_waiting_its_timeout() -> None:
    port = get_unused_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    fast = {"heartbeat_timeout": timedelta(seconds=0.5), "timeout": timedelta(seconds=60)}
    leader = _manager(port, replica_id="g", group_rank=0, group_world_size=2, **fast)
    follower = _manager(port, replica_id="g", group_rank=1, group_world_size=2, **fast)
    try:
        leader.shutdown()  # stops beating, never publishes a decision
        started = time.monotonic()
        follower.start_quorum()
        assert not follower.should_commit()
        assert time.monotonic() - started < 30, "the rank waited for its timeout"
        assert "group ranks [0] stopped beating" in str(follower.errored())
    finally:
        follower.shutdown()
    del store
