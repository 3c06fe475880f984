"""python -m dist_core: the environment report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dist_core.backend import choose_backend, default_backend
from dist_core.collect_env import collect, format_report, main
from dist_core.devices import accelerator_type, cuda_device_count
from dist_core.interfaces import Interface, gloo_choice, nccl_choice
from dist_core.torch_features import is_tested_release


def test_report_names_source_backend_devices_and_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID"):
        monkeypatch.setenv(name, "")
    report = collect()
    assert report["environment"]["source"] == "openmpi"
    assert report["environment"]["rank"] == 1
    # For this environment's 2 ranks on this node; where they would share a GPU, the
    # report says so after the name.
    default, _, reason = report["backend"]["default"].partition(" (")
    assert default == default_backend()
    assert ("share" in reason) == choose_backend().shares_devices
    assert report["devices"]["cuda_devices"] == cuda_device_count()
    assert report["devices"]["accelerator"] == (accelerator_type() or "none (CPU only)")
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


@pytest.mark.processes
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


def test_report_has_what_distributed_bug_reports_need(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_IB_DISABLE", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    report = collect()
    assert report["variables"]["NCCL_DEBUG"] == "INFO"
    assert report["variables"]["NCCL_IB_DISABLE"] == "1"
    assert report["variables"]["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    assert report["variables"]["OMP_NUM_THREADS"] == "3"
    assert "lo 127.0.0.1" in report["network"]["interfaces"]
    assert report["network"]["gloo_would_use"] == "lo (GLOO_SOCKET_IFNAME)"
    assert "nccl_version" in report["backend"]
    if Path("/dev/shm").is_dir():
        assert report["shared_memory"]["size_gib"] > 0
        assert 0 <= report["shared_memory"]["free_gib"] <= report["shared_memory"]["size_gib"]
    text = format_report(report)
    assert text.splitlines()[0].startswith("Copy and paste everything below into your bug report")
    assert "count: 1" not in text  # one of what? the keys say what they count


def test_nccl_and_gloo_choices_follow_their_documented_defaults() -> None:
    lo, eth, dock, ib = (
        Interface("lo", "127.0.0.1"),
        Interface("eth0", "10.0.0.2"),
        Interface("docker0", "172.17.0.1"),
        Interface("ib0", "10.1.0.2"),
    )
    assert nccl_choice({}, [lo, dock, eth, ib]).startswith("ib0")
    assert nccl_choice({}, [lo, dock, eth]).startswith("eth0")
    assert nccl_choice({}, [lo]).startswith("lo")
    assert nccl_choice({"NCCL_SOCKET_IFNAME": "eth1"}, [lo, eth]) == "eth1 (NCCL_SOCKET_IFNAME)"
    assert gloo_choice({"GLOO_SOCKET_IFNAME": "eth0"}, [lo]) == "eth0 (GLOO_SOCKET_IFNAME)"
    assert "host name" in gloo_choice({}, [lo, eth])


def _torch_at_least(major: int, minor: int) -> bool:
    found = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    return found >= (major, minor)


def test_report_names_the_torch_version_and_what_differs_between_versions() -> None:
    section = collect()["torch"]
    assert section["version"] == torch.__version__
    assert section["tested_releases"] == "2.11.0, 2.13.0, 2.15.0"
    assert section["tested"] == (torch.__version__.split("+")[0] in ("2.11.0", "2.13.0", "2.15.0"))
    # torch 2.14 added ProcessGroup.reconfigure; looked up, not derived from the version.
    assert section["reconfigurable_groups"] == _torch_at_least(2, 14)
    if not dist.is_nccl_available():
        assert section["nccl_means"] == "no NCCL in this torch"
    elif not _torch_at_least(2, 14):
        assert section["nccl_means"] == "nccl-legacy"  # nccl2 came with torch 2.14
    else:
        assert section["nccl_means"] in ("nccl2", "nccl-legacy")
    assert "nccl_means:" in format_report(collect())


@pytest.mark.processes
@pytest.mark.skipif(
    not (dist.is_nccl_available() and hasattr(dist, "ProcessGroupNCCL2")),
    reason="this torch has no nccl2 backend (torch < 2.14, or built without NCCL)",
)
def test_nccl_means_nccl2_when_torch_dist_use_nccl2_says_so() -> None:
    # torch reads the variable when it registers the backend: a fresh interpreter.
    completed = subprocess.run(
        [sys.executable, "-m", "dist_core", "--json"],
        env={**os.environ, "TORCH_DIST_USE_NCCL2": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(completed.stdout)["torch"]["nccl_means"] == "nccl2"


def test_a_tested_release_is_told_by_its_release_part() -> None:
    assert (
        is_tested_release("2.15.0+cu132")
        and is_tested_release("2.13.0")
        and is_tested_release("2.11.0")
    )
    assert not is_tested_release("2.14.1+cu130") and not is_tested_release("2.15.1")
