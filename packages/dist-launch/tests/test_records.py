"""What the installed torch records, and a rank answering while blocked in a collective.

The first test runs in every CI torch session (2.11, 2.13, 2.15): it says, with real
processes, whether this torch's flight recorder holds gloo's collectives under the
environment dist-launch gives its workers, and what is missing if not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launcher_nodes import LAUNCH

from dist_launch.diagnostics.flight_records import parse_rank_records
from dist_launch.plan.build import build_plan
from dist_launch.workers.environment import node_environment

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

# One rank (gloo, world size 1): three all_reduces on the world, a broadcast on a group
# of its own, then the records file a worker writes when the launcher asks.
# gloo marks a collective completed in the recorder from its own thread, just after the
# caller's wait returned: the probe reads again (bounded) until the records, and the
# count read from them, caught up (on a loaded host the count lagged: 2 of 4).
PROBE = """\
import sys, time
import torch
import torch.distributed as dist
from dist_launch.diagnostics.flight_records import parse_rank_records
from dist_launch.in_worker.completed_collectives import CompletedCollectives
from dist_launch.in_worker.records import collect

counter = CompletedCollectives()
assert counter.read() is None  # no process group yet
dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
value = torch.ones(4)
for _ in range(3):
    dist.all_reduce(value)
solo = dist.new_group([0])
dist.broadcast(value, src=0, group=solo)
deadline = time.monotonic() + 10
while True:
    records = collect(0, {"id": 1, "kind": "hang"})
    groups = parse_rank_records(records, 0, "probe").groups.values()
    caught_up = all(group.last_completed == group.last_enqueued for group in groups)
    if time.monotonic() > deadline or (caught_up and counter.read() == 4):
        break
    time.sleep(0.01)
# What the beacon publishes as progress: every group's completed collectives.
print("completed", counter.read(), file=sys.stderr)
sys.stdout.buffer.write(records)
"""


def test_installed_torch_records_gloo_collectives(tmp_path: Path, script: str) -> None:
    import torch

    # What a worker of `dist-launch` sees: TORCH_FR_BUFFER_SIZE unless the user set one.
    plan = build_plan({"target": script, "nproc_per_node": "1"}, environ={})
    env = node_environment(plan, {k: v for k, v in os.environ.items() if "BUFFER_SIZE" not in k})
    result = subprocess.run(
        [sys.executable, "-c", PROBE, f"file://{tmp_path / 'store'}"],
        capture_output=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert result.returncode == 0, result.stderr.decode()
    records = parse_rank_records(result.stdout, 0, "probe")
    has_dump = hasattr(torch._C._distributed_c10d, "_dump_fr_trace_json")
    if not has_dump:
        # The documented fallback: the verdict comes from the stacks and says why.
        assert records.missing == f"torch {torch.__version__} has no _dump_fr_trace_json"
        return
    assert records.missing is None, f"torch {torch.__version__}: {records.missing}"
    assert records.torch == torch.__version__
    # 3 all_reduces on the world and a broadcast on the group of one.
    assert "completed 4\n" in result.stderr.decode()
    default = next(group for group in records.groups.values() if group.is_default)
    assert (default.backend, default.last_enqueued, default.last_completed) == ("gloo", 3, 3)
    assert [default.ops[seq].describe() for seq in (1, 2, 3)] == ["all_reduce [4]"] * 3
    assert default.members == (0,)
    (solo,) = [group for group in records.groups.values() if not group.is_default]
    assert (solo.last_enqueued, solo.last_completed, solo.members) == (1, 1, (0,))
    assert solo.ops[1].describe() == "broadcast [4]"
    assert solo.ops[1].created_ns >= default.ops[3].created_ns > 0


# Rank 1 sleeps; rank 0 blocks in the second all_reduce after saying "warm".
BLOCKED = """\
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
if dist.get_rank() == 1:
    time.sleep(600)
print("warm", flush=True)
dist.all_reduce(value)
"""


def test_a_rank_blocked_in_a_collective_answers_a_request(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(BLOCKED)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    launcher = subprocess.Popen(
        [*LAUNCH, "-n", "2", "--hang-timeout", "600", "--grace-period", "1", str(script)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "TMPDIR": str(scratch)},  # the round's scratch directory
    )
    try:
        assert launcher.stdout is not None
        assert b"warm" in launcher.stdout.readline()  # rank 0 is about to block
        (fifo,) = scratch.glob("dist-launch-*/rank0.requests")
        answer = fifo.parent / "rank0.records.7.json"
        deadline = time.monotonic() + 60
        # Rank 0 may not be in the collective yet, and gloo marks the first one completed
        # from its own thread after the caller's wait returned (see PROBE): ask again
        # until the records show both, within the deadline.
        while time.monotonic() < deadline:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, json.dumps({"id": 7, "kind": "hang"}).encode() + b"\n")
            os.close(fd)
            answered = time.monotonic() + 10
            while not answer.exists() and time.monotonic() < answered:
                time.sleep(0.05)
            assert answer.exists(), "rank 0's beacon thread did not answer within 10 s"
            records = parse_rank_records(answer.read_bytes(), 0, str(answer))
            default = next(group for group in records.groups.values() if group.is_default)
            if (default.last_enqueued, default.last_completed) == (2, 1):
                break
            answer.unlink()
        assert (default.last_enqueued, default.last_completed) == (2, 1)
    finally:
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode == 128 + signal.SIGTERM, stderr.decode()
