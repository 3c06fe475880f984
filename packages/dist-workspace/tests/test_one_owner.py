"""The record format has one owner: merge, the reader and the writer say the same things.

Up to 0.3.3 merge wrote safetensors headers, named dtypes, read chunks with CRC checks
and rebuilt views on its own, and the copies had drifted apart (error wording, chunk
size, how a view's offset is computed).
"""

from __future__ import annotations

import ast
import json
import struct
from pathlib import Path

import pytest
import torch

import dist_workspace.transport
import dist_workspace.transports
from dist_workspace import NFSWorkspace, WorkspaceError
from dist_workspace.format import ALIGNMENT, encode_safetensors_header
from dist_workspace.merge import merge_workspace


def test_the_transport_interface_imports_none_of_its_implementations() -> None:
    source = Path(dist_workspace.transport.__file__).read_text(encoding="utf-8")
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert not {name for name in imported if name.endswith("_transport")}, imported
    # The choice is made in one place beside them.
    assert dist_workspace.transports.open_transport.__module__ == "dist_workspace.transports"


def test_a_corrupted_tensor_is_reported_in_the_same_words_by_merge_and_the_reader(
    tmp_path: Path,
) -> None:
    workspace = NFSWorkspace(tmp_path / "ws")
    workspace.write_configs_and_weights({"tp": 0}, {"w": torch.arange(64.0)}, rank=0)
    path = workspace.rank_path(0)
    raw = bytearray(path.read_bytes())
    (header_size,) = struct.unpack("<Q", raw[:8])
    raw[8 + header_size + 10] ^= 0x80
    path.write_bytes(bytes(raw))
    with pytest.raises(WorkspaceError) as by_reader:
        workspace.read_configs_and_weights_from_rank(0)
    with pytest.raises(WorkspaceError) as by_merge:
        merge_workspace(tmp_path / "ws", tmp_path / "model.safetensors")
    assert "checksum mismatch in tensor 'w': recorded" in str(by_reader.value)
    assert str(by_merge.value) == str(by_reader.value)
    assert not (tmp_path / "model.safetensors").exists()


def test_merged_files_and_records_have_headers_from_one_encoder(tmp_path: Path) -> None:
    workspace = NFSWorkspace(tmp_path / "ws")
    weights = {"a": torch.ones(3, dtype=torch.bfloat16), "b": torch.zeros(2, 2)}
    workspace.write_configs_and_weights({}, weights, rank=0)
    out = tmp_path / "model.safetensors"
    merge_workspace(tmp_path / "ws", out)
    raw = out.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + length]
    metadata = json.loads(header)["__metadata__"]
    tensors = [("a", "BF16", [3], 6), ("b", "F32", [2, 2], 16)]
    assert header == encode_safetensors_header(tensors, metadata, 8)
    record = workspace.rank_path(0).read_bytes()
    (record_length,) = struct.unpack("<Q", record[:8])
    assert (8 + record_length) % ALIGNMENT == 0 and (8 + length) % 8 == 0
