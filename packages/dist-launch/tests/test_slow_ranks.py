"""The slow-rank report with real processes: a balanced job, then one rank turning late."""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from launcher_nodes import LAUNCH

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

# Steps of 30 ms and an all_reduce, balanced; after BALANCED steps rank 1 sleeps 200 ms
# before each all_reduce (a slow data loader) until the launcher's report names a rank
# (the file REPORT exists), at most LATE more steps: the late phase does not end before
# a report window on a loaded machine. Rank 1 tells the others to stop through the
# all_reduce itself, so every rank takes the same number of steps.
BALANCED_THEN_LATE = """\
import os, sys, time
import torch
import torch.distributed as dist

balanced, late, report = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo")
rank = dist.get_rank()
for step in range(balanced + late):
    if step == balanced and rank == 1:
        print(f"late from {time.time()}", flush=True)
    time.sleep(0.03)
    if step >= balanced and rank == 1:
        time.sleep(0.2)
    stop = torch.zeros(1)
    if step >= balanced and rank == 1 and os.path.exists(report):
        stop += 1
    dist.all_reduce(stop)
    if stop.item():
        break
"""


def test_a_balanced_job_names_no_rank_and_a_late_rank_is_named(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(BALANCED_THEN_LATE)
    log_dir = tmp_path / "logs"
    result = subprocess.run(
        [
            *LAUNCH, "-n", "3", "--slow-ranks", "2", "--log-dir", str(log_dir),
            "--run-id", "s", str(script), "120", "200", str(log_dir / "s" / "slow_ranks.jsonl"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=dict(os.environ),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (late_from,) = re.findall(r"\[rank1\]: late from ([\d.]+)", result.stdout)
    late_from_s = int(float(late_from))  # the report's times are whole seconds
    warnings = [line for line in result.stderr.splitlines() if "after the others" in line]
    assert warnings, result.stderr
    for line in warnings:
        match = re.search(r"WARNING: rank (\d+) enters all_reduce (\d+) ms after the others", line)
        assert match is not None, line
        assert match[1] == "1", result.stderr
        assert 100 <= int(match[2]) <= 400, line
    lines = [
        json.loads(line) for line in (log_dir / "s" / "slow_ranks.jsonl").read_text().splitlines()
    ]
    assert len(lines) == len(warnings)
    for line in lines:
        assert (line["rank"], line["group"], line["op"], line["node"]) == (
            1,
            "default",
            "all_reduce",
            0,
        )
        assert line["window_s"] == 2.0 and line["attempt"] == 0
        # Nothing was named while the job was balanced.
        assert datetime.datetime.fromisoformat(line["time"]).timestamp() >= late_from_s, lines
