"""CUDA tensors written, exchanged and read back: bit-exact, on CPU, ties kept.

Every test here needs a GPU (``@pytest.mark.cuda``) and is skipped elsewhere. The
expected values are built on CPU from a seeded generator and moved to the GPU, so a
comparison of bytes checks the whole trip device -> record -> CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dist_core.testing import run_ranks
from dist_workspace import NFSWorkspace, get_configs_parallel, get_tensors_parallel

pytestmark = pytest.mark.cuda

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.bool,
]


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes on CPU, for bit-exact comparison (NaN payloads, -0.0 included)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A CPU tensor of random bytes (every bit pattern, NaNs too; 0/1 for bool)."""
    numel = 1
    for dim in shape:
        numel *= dim
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    if dtype == torch.bool:
        return (raw % 2).bool().reshape(shape)
    return raw.view(dtype).reshape(shape)


def _same_storage(*tensors: torch.Tensor) -> bool:
    return len({tensor.untyped_storage().data_ptr() for tensor in tensors}) == 1


def _views(whole: torch.Tensor, alone: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.whole": whole,
        f"{prefix}.T": whole.t(),  # shares storage with .whole
        f"{prefix}.row": whole[2],  # so does this
        f"{prefix}.strided": alone[1:7, ::3],  # a slice of a buffer that is not written
        f"{prefix}.narrow": alone.narrow(1, 5, 4).t(),
    }


def _cuda_weights() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Weights on cuda:0 of every dtype, as tensors, views and slices; and CPU twins."""
    on_gpu: dict[str, torch.Tensor] = {}
    on_cpu: dict[str, torch.Tensor] = {}
    for seed, dtype in enumerate(DTYPES):
        prefix = str(dtype).removeprefix("torch.")
        whole, alone = _random(dtype, (6, 10), seed), _random(dtype, (8, 12), seed + 100)
        on_cpu.update(_views(whole, alone, prefix))
        on_gpu.update(_views(whole.cuda(), alone.cuda(), prefix))
    return on_gpu, on_cpu


def test_cuda_tensors_round_trip_bit_exact(any_dir: Path) -> None:
    on_gpu, on_cpu = _cuda_weights()
    workspace = NFSWorkspace(any_dir / "ws")
    workspace.write_configs_and_weights({"amax": on_gpu["float32.row"]}, on_gpu, rank=0)
    config, result = workspace.read_configs_and_weights_from_rank(0)
    assert result is not None and list(result) == list(on_gpu)
    for name, expected in on_cpu.items():
        back = result[name]
        assert back.device.type == "cpu", name
        assert back.dtype == expected.dtype and back.shape == expected.shape, name
        assert torch.equal(_bits(back), _bits(expected)), name
    assert config["amax"].device.type == "cpu"
    assert torch.equal(_bits(config["amax"]), _bits(on_cpu["float32.row"]))
    for dtype in DTYPES:
        name = str(dtype).removeprefix("torch.")
        assert _same_storage(result[f"{name}.whole"], result[f"{name}.T"], result[f"{name}.row"])


def test_tied_cuda_weights_are_stored_once_and_read_back_tied(any_dir: Path) -> None:
    embedding = _random(torch.float32, (50, 8), 1)
    sizes = {}
    results = {}
    for device in ("cpu", "cuda"):
        emb = embedding.to(device)
        weights = {"emb.weight": emb, "head.weight": emb, "emb.T": emb.t()}
        config = {"amax": emb[0], "same": emb[0]}
        workspace = NFSWorkspace(any_dir / device)
        path = workspace.write_configs_and_weights(config, weights, rank=0)
        sizes[device] = path.stat().st_size
        results[device] = workspace.read_configs_and_weights_from_rank(0)
    untied = {"emb.weight": embedding, "head.weight": embedding.clone()}
    path = NFSWorkspace(any_dir / "untied").write_configs_and_weights({}, untied, rank=0)
    assert sizes["cuda"] == sizes["cpu"] < path.stat().st_size
    config, back = results["cuda"]
    assert back is not None
    assert all(tensor.device.type == "cpu" for tensor in back.values())
    assert torch.equal(_bits(back["emb.weight"]), _bits(embedding))
    assert _same_storage(back["emb.weight"], back["head.weight"], back["emb.T"])
    back["emb.weight"][0, 0] = 123.0
    assert back["head.weight"][0, 0] == 123.0 and back["emb.T"][0, 0] == 123.0
    assert _same_storage(config["amax"], config["same"])


def _gather_cuda_tensors() -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    out: dict[str, Any] = {}
    for seed, dtype in enumerate(DTYPES):
        whole = _random(dtype, (6, 8), 10 * seed + rank)
        for kind, given in (("whole", whole), ("view", whole[1:, ::2])):
            tensor = whole.to(device) if kind == "whole" else whole.to(device)[1:, ::2]
            with get_tensors_parallel(tensor, [0, 1], None, timeout=60) as tensors:
                if not tensors:
                    continue
                out[f"{dtype}.{kind}"] = {
                    "devices": [str(t.device) for t in tensors],
                    "dtypes": [str(t.dtype) for t in tensors],
                    "bits": [_bits(t).tolist() for t in tensors],
                }
                tensors[0].reshape(-1).view(torch.uint8).fill_(0)  # its own entry is a copy
                out[f"{dtype}.{kind}.caller_unchanged"] = torch.equal(_bits(tensor), _bits(given))
    return out


@pytest.mark.processes
def test_get_tensors_parallel_with_cuda_tensors_two_ranks() -> None:
    results = run_ranks(_gather_cuda_tensors, 2, backend="gloo", timeout=180)
    assert results[1] == {}
    for seed, dtype in enumerate(DTYPES):
        expected = [_random(dtype, (6, 8), 10 * seed + rank) for rank in (0, 1)]
        for kind in ("whole", "view"):
            got = results[0][f"{dtype}.{kind}"]
            wanted = expected if kind == "whole" else [t[1:, ::2] for t in expected]
            assert got["devices"] == ["cpu", "cpu"], (dtype, kind)
            assert got["dtypes"] == [str(dtype)] * 2, (dtype, kind)
            assert got["bits"] == [_bits(t).tolist() for t in wanted], (dtype, kind)
            assert results[0][f"{dtype}.{kind}.caller_unchanged"] is True, (dtype, kind)


def _gather_cuda_configs(directory: str) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    out: dict[str, Any] = {}
    for transport, path in (("shm", None), ("dir", directory)):
        amax = torch.tensor([rank + 0.5, -0.0], device=device)
        config = {"amax": amax, "same": amax, "scales": [torch.full((2,), rank, device=device)]}
        with get_configs_parallel(config, [0, 1], None, path, timeout=60) as configs:
            if not configs:
                continue
            stacked = torch.stack([c["amax"] for c in configs])
            own = configs[0]
            out[transport] = {
                "devices": sorted(
                    {str(c["amax"].device) for c in configs}
                    | {str(c["scales"][0].device) for c in configs}
                ),
                "stacked": stacked.tolist(),
                "stacked_bits": _bits(stacked).tolist(),
                "ties": [_same_storage(c["amax"], c["same"]) for c in configs],
            }
            own["amax"].add_(10.0)  # the receiver's own entry is a CPU copy
            out[transport]["caller_unchanged"] = amax.tolist() == [0.5, 0.0]
    return out


@pytest.mark.processes
def test_get_configs_parallel_with_cuda_tensors_stacks_on_cpu(tmp_path: Path) -> None:
    results = run_ranks(_gather_cuda_configs, 2, str(tmp_path), backend="gloo", timeout=180)
    assert results[1] == {}
    expected = torch.tensor([[0.5, -0.0], [1.5, -0.0]])
    for transport in ("shm", "dir"):
        got = results[0][transport]
        assert got["devices"] == ["cpu"], transport
        assert got["stacked"] == expected.tolist(), transport
        assert got["stacked_bits"] == _bits(expected).tolist(), transport  # -0.0 kept
        assert got["ties"] == [True, True], transport
        assert got["caller_unchanged"] is True, transport


def _export_on_nccl(output: str) -> list[str]:
    import os

    import torch.distributed as dist

    from dist_workspace import export_sharded

    rank = dist.get_rank()
    export_sharded({f"w{rank}": torch.full((4,), float(rank + 1), device="cuda")}, output)
    return sorted(os.listdir(output))


@pytest.mark.processes
def test_export_sharded_on_an_nccl_group_with_cuda_tensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    out = tmp_path / "checkpoint"
    files = run_ranks(_export_on_nccl, 1, str(out), backend="nccl", timeout=180)[0]
    assert files == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    loaded = load_file(str(out / files[0]))
    assert torch.equal(loaded["w0"], torch.ones(4))
