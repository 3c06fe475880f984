"""Replicas as real processes: one is SIGKILLed mid-allreduce, survivors go on, it rejoins."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_collectives.ft import ProcessGroupReconfigurableGloo, UnsupportedOperationError
from dist_collectives.ft.reconfigurable import torch_reconfigure_missing
from dist_core.ports import get_unused_port

WORKER = Path(__file__).with_name("replica_worker.py")
PROCESS_TIMEOUT = 90


def _spawn(port: int, replica: str, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, str(WORKER), "--port", str(port), "--replica-id", replica]
    return subprocess.Popen([*command, "--out", str(out), *extra])


def _run_kill_and_rejoin(
    tmp_path: Path, replicas: int, mode: str, device: str = "cpu", group: str = "gloo"
) -> dict[str, Any]:
    port = get_unused_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    victim = f"replica{replicas - 1}"
    outs = {f"replica{i}": tmp_path / f"replica{i}.json" for i in range(replicas)}
    common = ["--mode", mode, "--min-replicas", str(replicas - 1), "--device", device]
    common += ["--group", group]
    procs = {}
    try:
        for replica, out in outs.items():
            extra = list(common)
            if replica == victim:
                extra += ["--kill-at-step", "3", "--kill-when-count", str(replicas)]
            procs[replica] = _spawn(port, replica, out, *extra)
        assert procs[victim].wait(timeout=PROCESS_TIMEOUT) == -signal.SIGKILL
        killed = json.loads(store.get("test/killed"))
        # Restart the victim only once every survivor has committed a step without it,
        # so that the test sees both the smaller quorum and the rejoin (not a race).
        survivors = [r for r in outs if r != victim]
        deadline = time.monotonic() + PROCESS_TIMEOUT
        while time.monotonic() < deadline and not all(
            store.check([f"test/progress/{r}"])
            and int(store.get(f"test/progress/{r}")) > killed["step"]
            for r in survivors
        ):
            time.sleep(0.05)  # polling the store for progress other processes write
        procs[victim] = _spawn(port, victim, outs[victim], *common, "--restarted")
        store.wait(["test/rejoined"], timedelta(seconds=PROCESS_TIMEOUT))
        progress = [int(store.get(f"test/progress/{r}")) for r in outs]
        store.set("test/stop_at", str(max(progress) + 3))
        for replica, proc in procs.items():
            assert proc.wait(timeout=PROCESS_TIMEOUT) == 0, f"{replica} failed"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    reports = {r: json.loads(out.read_text()) for r, out in outs.items()}
    return {"killed": killed, "reports": reports, "victim": victim}


def _check(result: dict[str, Any], replicas: int) -> list[float]:
    killed, reports, victim = result["killed"], result["reports"], result["victim"]
    survivors = [r for r in reports if r != victim]
    notice = []
    for replica in survivors:
        log = reports[replica]["log"]
        at_kill = [
            e for e in log if e["quorum_id"] == killed["quorum_id"] and e["step"] == killed["step"]
        ]
        assert at_kill, f"{replica} never ran the step the victim died in: {log}"
        assert not at_kill[-1]["committed"], f"{replica} committed a step with a dead peer"
        assert at_kill[-1]["error"], f"{replica} saw no error"
        notice.append(at_kill[-1]["error_time"] - killed["time"])
        after = log[log.index(at_kill[-1]) + 1 :]
        smaller = [e for e in after if e["committed"] and e["members"] == replicas - 1]
        assert smaller, f"{replica} never committed a step with {replicas - 1} replicas: {after}"
        assert any(e["committed"] and e["members"] == replicas for e in after), (
            f"{replica} never trained with the rejoined replica: {after}"
        )
    for entry in (e for r in reports.values() for e in r["log"] if e["committed"]):
        assert entry["error"] is None, f"a step was committed despite an error: {entry}"
    steps = {r: reports[r]["step"] for r in reports}
    assert len(set(steps.values())) == 1, f"replicas stopped at different steps: {steps}"
    digests = {r: reports[r]["digest"] for r in reports}
    assert len(set(digests.values())) == 1, f"weights differ between replicas: {digests}"
    return notice


@pytest.mark.processes
@pytest.mark.timeout(400)
def test_sigkill_mid_allreduce_survivors_go_on_and_the_replica_rejoins(tmp_path: Path) -> None:
    result = _run_kill_and_rejoin(tmp_path, 4, "manager")
    notice = _check(result, 4)
    print(f"survivors noticed the kill after {[round(n, 3) for n in notice]} s")


@pytest.mark.processes
@pytest.mark.timeout(400)
def test_ddp_survivors_go_on_after_a_peer_dies_mid_backward(tmp_path: Path) -> None:
    result = _run_kill_and_rejoin(tmp_path, 3, "ddp")
    notice = _check(result, 3)
    print(f"survivors noticed the kill after {[round(n, 3) for n in notice]} s")


@pytest.mark.processes
@pytest.mark.skipif(
    torch_reconfigure_missing() is not None, reason=str(torch_reconfigure_missing())
)
@pytest.mark.timeout(400)
def test_torchs_reconfigurable_gloo_group_under_the_manager_survives_a_kill(
    tmp_path: Path,
) -> None:
    result = _run_kill_and_rejoin(tmp_path, 3, "ddp", group="reconfigurable-gloo")
    notice = _check(result, 3)
    print(f"survivors noticed the kill after {[round(n, 3) for n in notice]} s")


@pytest.mark.processes
@pytest.mark.skipif(
    torch_reconfigure_missing() is not None, reason=str(torch_reconfigure_missing())
)
@pytest.mark.timeout(400)
def test_a_manager_moves_torchs_own_reconfigurable_group_through_a_kill(tmp_path: Path) -> None:
    # torchft 0.3's form: init_process_group(..., enable_reconfigure=True), the default
    # group handed to the Manager, which reconfigures it by handles at every quorum.
    result = _run_kill_and_rejoin(tmp_path, 3, "manager", group="torch")
    notice = _check(result, 3)
    print(f"survivors noticed the kill after {[round(n, 3) for n in notice]} s")


@pytest.mark.skipif(
    torch_reconfigure_missing() is None, reason="this torch has reconfigurable groups"
)
def test_without_torchs_reconfigurable_groups_building_one_says_what_is_missing() -> None:
    with pytest.raises(UnsupportedOperationError) as caught:
        ProcessGroupReconfigurableGloo()
    message = str(caught.value)
    assert f"torch {torch.__version__} has no reconfigurable process groups" in message
    assert "enable_reconfigure=True" in message and "ReconfigureOptions" in message
    assert "ProcessGroupGloo" in message, "it names what to use instead"


@pytest.mark.processes
@pytest.mark.cuda
@pytest.mark.timeout(400)
def test_ddp_on_a_gpu_survivors_go_on_and_end_identical(tmp_path: Path) -> None:
    # The same run with the model on the GPU: the replicas' digests must still agree
    # (device-less futures let DDP read its buckets before the averaged values landed).
    result = _run_kill_and_rejoin(tmp_path, 3, "ddp", "cuda")
    notice = _check(result, 3)
    print(f"survivors noticed the kill after {[round(n, 3) for n in notice]} s")
