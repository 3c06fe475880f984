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

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from group_scenario import (
    GROUP_SIZE,
    GROUPS,
    PROCESS_TIMEOUT,
    WORKER,
    ScenarioResult,
    divergent_shards,
    run_lose_a_rank_and_rejoin,
    wait_until,
)

from dist_collectives.ft import Manager, ManagerConfigError, ProcessGroupDummy
from dist_core.ports import get_unused_port

SERVER_ARGS = ("--host", "127.0.0.1", "--port")


@pytest.mark.processes
@pytest.mark.timeout(500)
def test_a_replica_group_loses_a_rank_is_left_out_and_rejoins_as_a_whole(tmp_path: Path) -> None:
    _check(run_lose_a_rank_and_rejoin(tmp_path, get_unused_port()))


def _check(result: ScenarioResult) -> None:
    reports, killed, groups = result.reports, result.killed, result.groups
    survivors = [(g, r) for g in groups if g != result.victim for r in range(GROUP_SIZE)]
    for key in survivors:
        log = reports[key]["log"]
        at_kill = [
            e for e in log if e["quorum_id"] == killed["quorum_id"] and e["step"] == killed["step"]
        ]
        assert at_kill, f"{key} never ran the step the victim died in: {log}"
        assert not at_kill[-1]["committed"], f"{key} committed a step with a dead group"
        assert at_kill[-1]["error"], f"{key} saw no error"
        after = log[log.index(at_kill[-1]) + 1 :]
        assert any(e["committed"] and e["members"] == GROUPS - 1 for e in after), (
            f"{key} never committed a step with {GROUPS - 1} groups: {after}"
        )
        assert any(e["committed"] and e["members"] == GROUPS for e in after), (
            f"{key} never trained with the restarted group: {after}"
        )
    for entry in (e for report in reports.values() for e in report["log"] if e["committed"]):
        assert entry["error"] is None, f"a step was committed despite an error: {entry}"
    steps = {key: report["step"] for key, report in reports.items()}
    assert len(set(steps.values())) == 1, f"ranks stopped at different steps: {steps}"
    # On every torch: a failed step's exchanges never write into a tensor the caller
    # sees afterwards (the steps' generations own their buffers; test_late_write.py).
    divergent = divergent_shards(result)
    assert not divergent, f"shards differ between groups: {divergent}"
    shards = {reports[groups[0], rank]["digest"] for rank in range(GROUP_SIZE)}
    assert len(shards) == GROUP_SIZE, "the ranks of a group must hold different shards"


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


@pytest.mark.processes
@pytest.mark.timeout(500)
def test_one_dist_launch_per_replica_group_restarts_only_its_group(tmp_path: Path) -> None:
    pytest.importorskip("dist_launch", reason="the launcher is dist-launch's")
    port = get_unused_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "dist_collectives.ft.store_server", *SERVER_ARGS, str(port)],
        stdout=subprocess.PIPE,
    )
    launchers: dict[str, subprocess.Popen[bytes]] = {}
    groups = [f"group{g}" for g in range(GROUPS)]
    try:
        assert server.stdout is not None
        assert b"listening" in server.stdout.readline()  # ready: it printed after binding
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        for index, group in enumerate(groups):
            command = [sys.executable, "-m", "dist_launch", "-n", str(GROUP_SIZE)]
            command += ["--max-restarts", "1", "--master-port", str(get_unused_port())]
            command += [str(WORKER), "--out", str(tmp_path / "{group}-{rank}.json")]
            command += ["--min-replicas", str(GROUPS - 1)]
            if group == groups[-1]:
                command += ["--kill-at-step", "3", "--kill-rank", "1"]
            env = {**os.environ, "FT_STORE": f"127.0.0.1:{port}", "GROUP_ID": str(index)}
            launchers[group] = subprocess.Popen(command, env=env)
        store.wait(["test/killed"], timedelta(seconds=PROCESS_TIMEOUT))
        killed = json.loads(store.get("test/killed"))
        survivors = [(g, r) for g in groups[:-1] for r in range(GROUP_SIZE)]

        def survivors_moved_on() -> bool:
            keys = [f"test/progress/{g}/{r}" for g, r in survivors]
            return store.check(keys) and all(int(store.get(k)) > killed["step"] for k in keys)

        wait_until(survivors_moved_on, "the surviving groups to commit without the victim")
        store.set("test/restart_ok", "1")  # the victim's launcher restarted it meanwhile
        wait_until(
            lambda: (
                store.check([f"test/rejoined/{groups[-1]}"])
                and int(store.get(f"test/rejoined/{groups[-1]}")) == GROUP_SIZE
            ),
            "the restarted group to commit a step",
        )
        progress = [
            int(store.get(f"test/progress/{g}/{r}")) for g in groups for r in range(GROUP_SIZE)
        ]
        store.set("test/stop_at", str(max(progress) + 3))
        for group, launcher in launchers.items():
            assert launcher.wait(timeout=PROCESS_TIMEOUT) == 0, f"{group}'s launcher failed"
    finally:
        for launcher in launchers.values():
            if launcher.poll() is None:
                launcher.terminate()
                launcher.wait(timeout=30)
        server.terminate()
        assert server.wait(timeout=30) == 0, "the store server did not stop on SIGTERM"
    reports = {
        (g, r): json.loads((tmp_path / f"{g}-{r}.json").read_text())
        for g in groups
        for r in range(GROUP_SIZE)
    }
    _check(ScenarioResult(reports, killed, groups, groups[-1]))


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
