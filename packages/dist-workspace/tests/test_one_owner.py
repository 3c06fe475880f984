"""One owner each: the record format (merge, reader and writer say the same things), and
the rule that picks a record's path.

Up to 0.3.3 merge wrote safetensors headers, named dtypes, read chunks with CRC checks
and rebuilt views on its own, and the copies had drifted apart (error wording, chunk
size, how a view's offset is computed). Up to 0.4.3 a record's path was picked in
three modules, by the call's history, the store and three environment variables.
"""

from __future__ import annotations

import ast
import json
import struct
from pathlib import Path

import pytest
import torch

import dist_workspace.protocol
from dist_workspace import NFSWorkspace, WorkspaceError
from dist_workspace.format import ALIGNMENT, encode_safetensors_header
from dist_workspace.merge import merge_workspace


def test_the_route_is_decided_in_one_place() -> None:
    """Only protocol.py reads LINK_MAX_BYTES; only exchange.py asks protocol.route."""
    package = Path(dist_workspace.protocol.__file__).parent
    reads: dict[str, set[str]] = {}
    for module in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            name = None
            if isinstance(node, ast.Name):
                name = node.id
            elif isinstance(node, ast.Attribute):
                name = node.attr
            if name in ("LINK_MAX_BYTES", "route"):
                reads.setdefault(name, set()).add(module.name)
    assert reads["LINK_MAX_BYTES"] == {"protocol.py"}, reads
    assert reads["route"] == {"exchange.py"}, reads  # defined in protocol.py, used here only


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
