"""`inspect --verify`: a last line saying what was checked and whether it is intact."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from dist_workspace import NFSWorkspace
from dist_workspace.cli import main


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> NFSWorkspace:
    monkeypatch.setenv("DIST_WORKSPACE_JOB_ID", "test-job")
    workspace = NFSWorkspace(tmp_path)
    shared = torch.randn(256, 256)
    workspace.write_configs_and_weights(
        {"t": torch.ones(3)}, {"tied": shared, "tied.T": shared.t(), "b": torch.zeros(10)}, rank=0
    )
    workspace.write_configs_and_weights({}, {"w": torch.randn(1000)}, rank=1)
    return workspace


def _flip(path: Path, entry: str) -> None:
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    begin, _ = header[entry]["data_offsets"]
    raw[8 + length + begin + 3] ^= 0x01
    path.write_bytes(bytes(raw))


def test_intact_workspace_ends_with_what_was_checked(
    workspace: NFSWorkspace, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(workspace.path), "--verify"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == "verified 4 tensors in 2 files (260 KiB): checksums and headers intact"


def test_a_damaged_tensor_is_named_with_its_file_and_the_status_is_1(
    workspace: NFSWorkspace, capsys: pytest.CaptureFixture[str]
) -> None:
    _flip(workspace.rank_path(1), "w")
    assert main(["inspect", str(workspace.path), "--verify"]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("verification FAILED: 1 of 2 files damaged; ")
    assert f"rank 1's file {workspace.rank_path(1)}: tensor 'w': checksum mismatch" in last


def test_damage_in_shared_storage_names_every_tensor_using_it(
    workspace: NFSWorkspace, capsys: pytest.CaptureFixture[str]
) -> None:
    _flip(workspace.rank_path(0), "dist_workspace.shared.0")
    assert main(["inspect", str(workspace.path), "--verify", "--json"]) == 1
    captured = capsys.readouterr()
    assert [item["rank"] for item in json.loads(captured.out)] == [0, 1]  # stdout stays JSON
    assert "tensors 'tied', 'tied.T' (sharing 'dist_workspace.shared.0')" in captured.err


def test_a_damaged_header_is_reported_and_the_other_files_still_checked(
    workspace: NFSWorkspace, capsys: pytest.CaptureFixture[str]
) -> None:
    path = workspace.rank_path(0)
    raw = bytearray(path.read_bytes())
    raw[20] = ord("X") if raw[20] != ord("X") else ord("Y")  # inside the header JSON
    path.write_bytes(bytes(raw))
    assert main(["inspect", str(workspace.path), "--verify"]) == 1
    out = capsys.readouterr().out
    assert "rank 1:" in out and "rank 0:" not in out  # the intact file is still listed
    assert out.splitlines()[-1].startswith(
        f"verification FAILED: 1 of 2 files damaged; rank 0's file {path}: header: "
    )
    assert main(["inspect", str(workspace.path)]) == 2  # without --verify: an error, as before
