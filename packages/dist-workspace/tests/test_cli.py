"""The dist-workspace command: inspect, merge, clean (run as real subprocesses too)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dist_workspace import NFSWorkspace
from dist_workspace.cli import main


def _workspace(directory: Path) -> NFSWorkspace:
    workspace = NFSWorkspace(directory)
    shared = torch.randn(6, 4)
    workspace.write_configs_and_weights(
        {"tp": 0, "note": "x", "t": torch.ones(2)},
        {
            "a": torch.arange(6, dtype=torch.int32),
            "tied": shared,
            "tied.T": shared.t(),
            "h": torch.randn(3).half(),
        },
        rank=0,
    )
    workspace.write_configs_and_weights(
        {"tp": 1}, {"b": torch.ones(2, 2, dtype=torch.bfloat16), "a": torch.zeros(1)}, rank=1
    )
    return workspace


def test_inspect_lists_ranks_configs_and_tensors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _workspace(tmp_path)
    assert main(["inspect", str(tmp_path), "--json", "--verify"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [item["rank"] for item in report] == [0, 1]
    assert report[0]["config"]["tp"] == 0
    tensors = {t["name"]: t for t in report[0]["tensors"]}
    assert tensors["a"] == {"name": "a", "dtype": "I32", "shape": [6], "bytes": 24, "shared": False}
    assert tensors["tied.T"]["shape"] == [4, 6] and tensors["tied.T"]["shared"]
    assert report[0]["stored_bytes"] == report[0]["tensor_bytes"] - 4 * 6 * 4  # tied once
    assert main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "rank 1:" in text and "b  BF16  (2, 2)  8 bytes" in text
    assert "tied  F32  (6, 4)  96 bytes  (shares storage with tied.T)" in text
    assert "shared storage counted once" in text


def test_inspect_prints_human_sizes_and_bytes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    NFSWorkspace(tmp_path).write_configs_and_weights({}, {"w": torch.zeros(3, 1024)}, rank=0)
    assert main(["inspect", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "w  F32  (3, 1024)  12.0 KiB (12288 bytes)" in text
    assert "total: 1 ranks, 1 tensors, 12.0 KiB (12288 bytes)" in text


def test_merge_refuses_duplicates_naming_both_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _workspace(tmp_path / "ws")
    out = tmp_path / "merged.safetensors"
    assert main(["merge", str(tmp_path / "ws"), str(out)]) == 2
    error = capsys.readouterr().err
    assert "'a'" in error and "rank 0" in error and "rank 1" in error and "--rank-prefix" in error
    assert not out.exists()


def test_merge_with_rank_prefix_streams_every_tensor(tmp_path: Path) -> None:
    workspace = _workspace(tmp_path / "ws")
    out = tmp_path / "merged.safetensors"
    assert main(["merge", str(tmp_path / "ws"), str(out), "--rank-prefix"]) == 0
    expected = {}
    for rank in (0, 1):
        _, weights = workspace.read_configs_and_weights_from_rank(rank)
        assert weights is not None
        expected.update({f"rank{rank}.{name}": tensor for name, tensor in weights.items()})
    with safe_open(str(out), "pt") as handle:
        assert sorted(handle.keys()) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(handle.get_tensor(name), tensor), name
        assert json.loads(handle.metadata()["dist_workspace.configs"])["1"] == '{"tp":1}'


def test_merge_aborts_on_a_corrupted_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workspace = NFSWorkspace(tmp_path / "ws")
    path = workspace.write_configs_and_weights({}, {"w": torch.randn(1000)}, rank=0)
    raw = bytearray(path.read_bytes())
    (header_size,) = struct.unpack("<Q", raw[:8])
    raw[8 + header_size + 10] ^= 0x80
    path.write_bytes(bytes(raw))
    out = tmp_path / "merged.safetensors"
    assert main(["merge", str(tmp_path / "ws"), str(out)]) == 2
    assert "checksum mismatch" in capsys.readouterr().err and not out.exists()


def test_clean_removes_workspace_files_only(tmp_path: Path) -> None:
    _workspace(tmp_path)
    (tmp_path / "keep.txt").write_text("user data")
    exchange = tmp_path / "exchange-0123456789ab-0123456789abcdef-0"
    NFSWorkspace(exchange).write_configs_and_weights({}, {"x": torch.ones(2)}, rank=1)
    (tmp_path / "exchange-rates").mkdir()  # named like one, not one: kept
    assert main(["clean", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exchange-rates", "keep.txt"]


@pytest.mark.processes
def test_console_script_and_module_entry_point(tmp_path: Path) -> None:
    _workspace(tmp_path)
    script = Path(sysconfig.get_path("scripts")) / "dist-workspace"
    commands = [[sys.executable, "-m", "dist_workspace"]]
    if script.exists():
        commands.append([str(script)])
    for command in commands:
        done = subprocess.run(
            [*command, "inspect", str(tmp_path), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ),
        )
        assert done.returncode == 0, done.stderr
        assert [item["rank"] for item in json.loads(done.stdout)] == [0, 1]
