"""python -m dist_core: the environment report."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dist_core.backend import default_backend
from dist_core.collect_env import collect, format_report, main
from dist_core.devices import device_count


def test_report_names_source_backend_devices_and_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.setenv(name, "")
    report = collect()
    assert report["environment"]["source"] == "openmpi"
    assert report["environment"]["rank"] == 1
    assert report["backend"]["default"] == default_backend()  # for this environment's ranks
    assert report["devices"]["count"] == device_count()
    assert "dist-core" in report["versions"] and "torch" in report["versions"]
    assert "source: openmpi" in format_report(report)


def test_main_prints_json_and_fails_on_bad_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert "RANK=9 with WORLD_SIZE=2" in report["environment"]["error"]


def test_module_entry_point_runs() -> None:
    completed = subprocess.run(
        [sys.executable, "-m", "dist_core"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert "environment:" in completed.stdout and "versions:" in completed.stdout
