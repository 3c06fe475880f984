"""Replica groups lose a rank and rejoin, as real processes: the scenario and its verdict.

Three replica groups of two ranks each train one MLP sharded across the group's ranks
with torch's FSDP2 (``group_worker.py``); one rank of the last group SIGKILLs itself
at step 3, the test stops its group's other rank (as the group's launcher would), the
other groups commit without the group, the group restarts as a whole and heals. The
restarted group's last rank fails its first load of the healed state after rank 0
loaded its own, so the group's ranks hold different steps until they heal again.

Shared by ``test_replica_groups.py``, which checks one run, and the soak
(``benchmarks/ft.py --only soak``), which runs it many times and counts the runs whose
shards differ between groups.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

WORKER = Path(__file__).with_name("group_worker.py")
GROUPS, GROUP_SIZE = 3, 2
PROCESS_TIMEOUT = 120


@dataclasses.dataclass(frozen=True)
class ScenarioResult:
    """What one run left: each rank's report, the victim's death, the groups."""

    reports: dict[tuple[str, int], Any]  # (group, group rank) -> group_worker.py's report
    killed: dict[str, Any]  # the quorum id and step the victim died in
    groups: list[str]
    victim: str


def spawn_rank(port: int, group: str, rank: int, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    """Starts one rank of a replica group (``group_worker.py``) on the store at ``port``."""
    command = [sys.executable, str(WORKER), "--port", str(port), "--group", group]
    command += ["--group-rank", str(rank), "--group-size", str(GROUP_SIZE), "--out", str(out)]
    return subprocess.Popen([*command, "--min-replicas", str(GROUPS - 1), *extra])


def wait_until(condition: Any, what: str) -> None:
    """Polls ``condition`` until it holds; fails after :data:`PROCESS_TIMEOUT`."""
    deadline = time.monotonic() + PROCESS_TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)  # polling the store for progress other processes write


def wait_for_the_survivors(store: Any, groups: list[str], victim_group: str) -> dict[str, Any]:
    """Waits until every other group committed past the kill, then lets the victim restart.

    Returns:
        What the victim wrote under ``test/killed`` (the step it was killed at).
    """
    killed: dict[str, Any] = json.loads(store.get("test/killed"))
    survivors = [(g, r) for g in groups if g != victim_group for r in range(GROUP_SIZE)]

    def survivors_moved_on() -> bool:
        keys = [f"test/progress/{g}/{r}" for g, r in survivors]
        return store.check(keys) and all(int(store.get(k)) > killed["step"] for k in keys)

    wait_until(survivors_moved_on, "the surviving groups to commit without the victim")
    store.set("test/restart_ok", "1")
    return killed


def stop_after_the_rejoin(store: Any, groups: list[str], victim_group: str) -> None:
    """Waits until the restarted group committed a step; every rank stops 3 steps later."""
    wait_until(
        lambda: (
            store.check([f"test/rejoined/{victim_group}"])
            and int(store.get(f"test/rejoined/{victim_group}")) == GROUP_SIZE
        ),
        "the restarted group to commit a step",
    )
    progress = [int(store.get(f"test/progress/{g}/{r}")) for g in groups for r in range(GROUP_SIZE)]
    store.set("test/stop_at", str(max(progress) + 3))


def run_lose_a_rank_and_rejoin(workdir: Path, port: int) -> ScenarioResult:
    """Runs the scenario once (see the module doc) with its store on ``port``.

    Each rank writes its report under ``workdir``.

    Raises:
        AssertionError: a rank did not end as the scenario expects (the victim not
            killed, a survivor failing, a wait past :data:`PROCESS_TIMEOUT`).
    """
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    groups = [f"group{g}" for g in range(GROUPS)]
    victim_group, victim_rank = groups[-1], GROUP_SIZE - 1
    outs = {(g, r): workdir / f"{g}-{r}.json" for g in groups for r in range(GROUP_SIZE)}
    procs: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
    try:
        for (group, rank), out in outs.items():
            extra = []
            if (group, rank) == (victim_group, victim_rank):
                extra = ["--kill-at-step", "3", "--kill-when-count", str(GROUPS)]
            procs[group, rank] = spawn_rank(port, group, rank, out, *extra)
        assert procs[victim_group, victim_rank].wait(timeout=PROCESS_TIMEOUT) == -signal.SIGKILL
        # What the group's launcher does: its other ranks are stopped, the group restarts.
        for rank in range(GROUP_SIZE):
            procs[victim_group, rank].kill()
            procs[victim_group, rank].wait()
        killed = wait_for_the_survivors(store, groups, victim_group)
        for rank in range(GROUP_SIZE):
            out = outs[victim_group, rank]
            # Its last rank's first load fails after rank 0 loaded: the group heals again.
            extra = ["--restarted"] + (["--fail-first-load"] if rank == GROUP_SIZE - 1 else [])
            procs[victim_group, rank] = spawn_rank(port, victim_group, rank, out, *extra)
        stop_after_the_rejoin(store, groups, victim_group)
        for key, proc in procs.items():
            assert proc.wait(timeout=PROCESS_TIMEOUT) == 0, f"{key} failed"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    reports = {key: json.loads(out.read_text()) for key, out in outs.items()}
    return ScenarioResult(reports, killed, groups, victim_group)


def divergent_shards(result: ScenarioResult) -> dict[int, str]:
    """The group ranks whose shard differs between groups at the end, each with where."""
    divergent = {}
    for rank in range(GROUP_SIZE):
        digests = {result.reports[g, rank]["digest"] for g in result.groups}
        if len(digests) > 1:
            divergent[rank] = first_divergence(result.reports, result.groups, rank)
    return divergent


def first_divergence(reports: dict[tuple[str, int], Any], groups: list[str], rank: int) -> str:
    """The first step after which rank ``rank``'s shard differs between groups, with context."""
    by_step: dict[int, dict[str, Any]] = {}
    for group in groups:
        for entry in reports[group, rank]["log"]:
            if entry["committed"]:
                by_step.setdefault(entry["step"], {})[group] = entry
    for step in sorted(by_step):
        entries = by_step[step]
        if len({entry["digest"] for entry in entries.values()}) > 1:
            return f"first differs after step {step}: {entries}"
    return "no committed step differs (the divergence is in a step some groups did not log)"


def check_scenario(result: ScenarioResult) -> None:
    """Asserts what the scenario must show, whoever started the groups.

    The step the victim died in is discarded everywhere, the others go on without its
    group, the restarted group rejoins, and every group's shards end identical.
    """
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
