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


def _sized_parts(rank: int) -> dict[str, torch.Tensor]:
    """Rank 0: three tensors of 8 KiB and one of 24 KiB; rank 1: one; rank 2: none."""
    if rank == 0:
        part = {f"model.layers.{i}.weight": torch.full((64, 32), float(i)) for i in range(3)}
        part["model.embed.weight"] = torch.ones(192, 32)  # 24 KiB: over the limit alone
        return part
    return {"lm_head.weight": torch.full((64, 32), 9.0)} if rank == 1 else {}


def _export_by_size(output: str) -> list[str]:
    import torch.distributed as dist

    rank = dist.get_rank()
    outcomes = []
    for size in ("16 KiB per file", 0, "16KiB"):
        try:
            export_sharded(_sized_parts(rank), output, max_shard_size=size)
            outcomes.append("no error")
        except WorkspaceError as error:
            outcomes.append(str(error))
    return outcomes


@pytest.mark.processes
def test_max_shard_size_spreads_each_ranks_tensors_like_save_pretrained(tmp_path: Path) -> None:
    out = tmp_path / "checkpoint"
    results = run_ranks(_export_by_size, 3, str(out), timeout=180)
    assert "max_shard_size='16 KiB per file'" in results[0][0]  # every rank read it
    assert (
        "rank 1: export_sharded got max_shard_size=0: 0 is not a positive size" in (results[1][1])
    )
    assert [result[2] for result in results] == ["no error"] * 3
    # Rank 0's names in order: embed (24 KiB, alone), layers.0 + layers.1, layers.2;
    # then rank 1's file. Rank 2 holds nothing and writes nothing.
    files = {
        "model-00001-of-00004.safetensors": {"model.embed.weight"},
        "model-00002-of-00004.safetensors": {"model.layers.0.weight", "model.layers.1.weight"},
        "model-00003-of-00004.safetensors": {"model.layers.2.weight"},
        "model-00004-of-00004.safetensors": {"lm_head.weight"},
    }
    assert sorted(os.listdir(out)) == [*sorted(files), "model.safetensors.index.json"]
    for name, tensors in files.items():
        with safe_open(str(out / name), "pt") as handle:
            assert set(handle.keys()) == tensors, name
    loaded = _load(out)  # the index's weight_map and total_size agree with the files
    expected = {**_sized_parts(0), **_sized_parts(1)}
    assert all(torch.equal(loaded[name], tensor) for name, tensor in expected.items())


_EXACT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
                 torch.bfloat16, torch.float8_e4m3fn]  # fmt: skip


def _integers(rank: int) -> dict[str, torch.Tensor]:
    bits = torch.arange(-64, 64, dtype=torch.int64) * (rank + 1)
    return {
        f"rank{rank}.{str(dtype).removeprefix('torch.')}": (
            bits.to(torch.uint8).view(torch.float8_e4m3fn)
            if dtype == torch.float8_e4m3fn
            else bits.to(dtype)
        )
        for dtype in _EXACT_DTYPES
    }


def _export_integers(output: str, holders: int) -> str:
    import torch.distributed as dist

    rank = dist.get_rank()
    export_sharded(_integers(rank) if rank < holders else {}, output)
    return "no error"


@pytest.mark.processes
def test_integer_and_bool_tensors_are_exported_bit_exact_and_one_file_is_model_safetensors(
    tmp_path: Path,
) -> None:
    shards, single = tmp_path / "shards", tmp_path / "single"
    assert run_ranks(_export_integers, 2, str(shards), 2, timeout=180) == ["no error"] * 2
    loaded = _load(shards)
    assert run_ranks(_export_integers, 2, str(single), 1, timeout=180) == ["no error"] * 2
    assert os.listdir(single) == ["model.safetensors"]  # no index, as save_pretrained
    loaded_single = load_file(str(single / "model.safetensors"))
    for got, ranks in ((loaded, (0, 1)), (loaded_single, (0,))):
        expected = {name: t for rank in ranks for name, t in _integers(rank).items()}
        assert set(got) == set(expected)
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype, name
            assert got[name].view(torch.uint8).tolist() == tensor.view(torch.uint8).tolist(), name
