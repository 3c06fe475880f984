"""export_sharded on real processes: one Hugging Face checkpoint, every rank writing."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dist_core.testing import run_ranks
from dist_workspace import WorkspaceError, export_sharded


def _part(rank: int) -> dict[str, torch.Tensor]:
    if rank == 2:
        return {}  # a rank that holds nothing writes no shard
    return {
        f"model.layers.{rank}.mlp.weight": torch.full((64, 32), float(rank)),
        f"model.layers.{rank}.norm.weight": torch.arange(32, dtype=torch.bfloat16) + rank,
    }


def _export(output: str, overwrite: bool) -> str:
    import torch.distributed as dist

    rank = dist.get_rank()
    try:
        export_sharded(_part(rank), output, overwrite=overwrite)
    except WorkspaceError as error:
        return f"WorkspaceError: {error}"
    return "no error"


def _load(directory: Path) -> dict[str, torch.Tensor]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    loaded: dict[str, torch.Tensor] = {}
    for file_name in sorted(set(index["weight_map"].values())):
        with safe_open(str(directory / file_name), "pt") as handle:
            assert handle.metadata()["format"] == "pt"  # what transformers requires
        loaded.update(load_file(str(directory / file_name)))
    assert set(index["weight_map"]) == set(loaded)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in loaded.values())
    return loaded


@pytest.mark.processes
def test_every_rank_writes_its_shard_of_one_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "checkpoint"
    assert run_ranks(_export, 4, str(out), False, timeout=180) == ["no error"] * 4
    assert sorted(os.listdir(out)) == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    expected = {name: t for rank in range(4) for name, t in _part(rank).items()}
    loaded = _load(out)
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with safe_open(str(out / "model-00002-of-00003.safetensors"), "pt") as handle:
        assert set(handle.keys()) == set(_part(1))  # rank 1's tensors, in its own shard
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]  # no temporary left


@pytest.mark.processes
def test_an_existing_checkpoint_is_refused_on_every_rank_then_replaced_when_asked(
    tmp_path: Path,
) -> None:
    out = tmp_path / "checkpoint"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"an older export")
    refused = run_ranks(_export, 3, str(out), False, timeout=180)
    assert "exists" in refused[0] and "overwrite=True" in refused[0], "the Python way to replace"
    assert all(result.startswith("WorkspaceError") for result in refused)
    assert "rank(s) [0]" in refused[1]
    assert (out / "model.safetensors").read_bytes() == b"an older export"
    assert run_ranks(_export, 3, str(out), True, timeout=180) == ["no error"] * 3
    assert set(_load(out)) == {name for rank in range(3) for name in _part(rank)}
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]


def _export_catching(output: str, tensors: dict[str, Any]) -> str:
    try:
        export_sharded(tensors, output)
    except WorkspaceError as error:
        return str(error)
    return "no error"


def _clash(output: str) -> str:
    import torch.distributed as dist

    rank = dist.get_rank()
    tensors: dict[str, Any] = {"lm_head.weight": torch.ones(4)} if rank in (0, 2) else {}
    tensors[f"own.{rank}"] = torch.zeros(2)
    if rank == 1:
        tensors["scale"] = 0.5  # not a tensor
    return _export_catching(output, tensors)


@pytest.mark.processes
def test_bad_input_fails_on_every_rank_naming_it_and_writes_nothing(tmp_path: Path) -> None:
    results = run_ranks(_clash, 3, str(tmp_path / "checkpoint"), timeout=180)
    assert "rank 1: export_sharded needs tensors; 'scale' is a float" in results[1]
    assert "rank(s) [1]" in results[0] and "rank(s) [1]" in results[2]
    assert os.listdir(tmp_path) == []


def _replicated(output: str) -> str:
    import torch.distributed as dist

    rank = dist.get_rank()
    tensors = {f"own.{rank}": torch.zeros(2)}
    if rank in (0, 2):
        tensors["lm_head.weight"] = torch.ones(4)
    return _export_catching(output, tensors)


@pytest.mark.processes
def test_a_name_on_two_ranks_is_named_with_both_ranks(tmp_path: Path) -> None:
    results = run_ranks(_replicated, 3, str(tmp_path / "checkpoint"), timeout=180)
    assert "'lm_head.weight' (ranks 0 and 2)" in results[0]
    assert "'lm_head.weight' (ranks 2 and 0)" in results[2]
    assert "rank(s) [0, 2]" in results[1]
    assert os.listdir(tmp_path) == []


def _export_a_llama(output: str) -> str:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    rank, world = dist.get_rank(), dist.get_world_size()
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    state = LlamaForCausalLM(config).state_dict()
    mine = {
        name: t for index, (name, t) in enumerate(sorted(state.items())) if index % world == rank
    }
    export_sharded(mine, output)
    if rank == 0:
        config.save_pretrained(output)
    return "no error"


@pytest.mark.processes
def test_transformers_loads_the_export_as_it_loads_save_pretrained(tmp_path: Path) -> None:
    import transformers  # a test dependency (dist-workspace[test])

    out = tmp_path / "llama"
    assert run_ranks(_export_a_llama, 3, str(out), timeout=300) == ["no error"] * 3
    torch.manual_seed(0)
    config = transformers.LlamaConfig.from_pretrained(out)
    expected = transformers.LlamaForCausalLM(config).state_dict()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert set(loaded) == set(expected)
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)
