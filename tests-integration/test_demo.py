"""The demo trainer end to end: it learns, and its export holds exactly what it trained."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.processes

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def test_loss_falls_and_progress_is_printed_on_rank_zero(demo_run: Any) -> None:
    report = json.loads((demo_run.report_dir / "rank0.json").read_text())
    losses = report["losses"]
    assert len(losses) == 20
    assert losses[-1] < 0.75 * losses[0], losses
    progress = [line for line in demo_run.output.splitlines() if "moe-demo: step" in line]
    assert progress and all(line.startswith("[rank0]: ") for line in progress)
    assert "tokens/s" in progress[-1] and "loss" in progress[-1]


def test_export_holds_exactly_the_trained_weights(demo_run: Any) -> None:
    exported = load_file(str(demo_run.export_dir / "model.safetensors"))
    trained: dict[str, str] = {}
    for rank in range(4):
        report = json.loads((demo_run.report_dir / f"rank{rank}.json").read_text())
        for name, digest in report["digests"].items():
            # Data-parallel replicas of an expert hold the same weights.
            assert trained.setdefault(name, digest) == digest, (name, rank)
    assert set(exported) == set(trained)
    for name, tensor in exported.items():
        assert _digest(tensor) == trained[name], name
    config = json.loads((demo_run.export_dir / "config.json").read_text())
    assert config["num_experts"] == 4


def test_the_exports_workspace_is_inspected_as_the_readme_shows(demo_run: Any) -> None:
    # The README's demo (``nox -s demo``) shows the export with ``dist-workspace
    # inspect``: the four ranks' files, each verified against its checksums.
    inspect = Path(sys.executable).with_name("dist-workspace")
    workspace = demo_run.export_dir / "workspace"
    completed = subprocess.run(
        [str(inspect), "inspect", str(workspace), "--json", "--verify"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert [item["rank"] for item in report] == [0, 1, 2, 3], report
    # Ranks 0-1 hold the experts; their data-parallel replicas, 2-3, only a config.
    shards = {tensor["name"] for item in report for tensor in item["tensors"]}
    assert shards == set(load_file(str(demo_run.export_dir / "model.safetensors"))), report


def test_fault_tolerant_path_finishes_on_the_survivors() -> None:
    completed = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "train.py"),
            "--fault-tolerant",
            "--steps",
            "24",
            "--kill-rank",
            "3",
            "--kill-at-step",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, output
    assert "SIGKILL mid-step" in output
    assert "discarded on every replica" in output  # the Manager's own line
    assert "recovered in" in output
    assert "waitForInput" not in output  # the quorum's waits are quiet now
    assert (
        "3 survivor(s) finished 24 steps; replica 3 was killed; weights bit-identical: yes"
        in output
    )
