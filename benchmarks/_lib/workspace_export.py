"""Exporting a model that 4 ranks hold: every rank writing its shard, or rank 0 alone.

Each rank holds a quarter of a model of ``--export-gib`` GiB (2 by default) as
bfloat16 tensors of 64 MiB. Methods, interleaved, the fastest of the repeats kept:

- ``export_sharded``: dist-workspace's ``export_sharded`` (torch.distributed.checkpoint's
  Hugging Face writer underneath): every rank writes and fsyncs its own
  ``model-0000k-of-00004.safetensors`` at once, rank 0 the index, then the directory
  is renamed into place.
- ``export_sharded 256MB``: the same with ``max_shard_size="256MB"``, as
  ``save_pretrained`` would split it: each rank packs its tensors into files of at
  most 256 MB (3 files of up to 192 MiB per rank at 2 GiB).
- ``gather + one file``: what exports do today: ``get_configs_parallel`` gives rank 0
  every rank's tensors (shared memory), rank 0 writes them into one
  ``model.safetensors`` with ``safetensors.torch.save_file`` and fsyncs it.
- limit ``4 writers``: each rank writes its quarter into a file of its own and fsyncs
  it, nothing else (the disk's parallel write rate, with these processes).
- limit ``1 writer``: rank 0 writes the whole model into one file and fsyncs it.

Time: rank 0's, from a barrier to the checkpoint being complete on disk.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch

MIB = 1024 * 1024
WORLD = 4
TENSOR_BYTES = 64 * MIB


def _quarter(total_bytes: int, rank: int) -> dict[str, torch.Tensor]:
    count = max(1, total_bytes // WORLD // TENSOR_BYTES)
    return {
        f"model.layers.{rank * count + index}.weight": torch.full(
            (TENSOR_BYTES // 2,), float(rank), dtype=torch.bfloat16
        )
        for index in range(count)
    }


def _write_and_sync(path: str, tensors: dict[str, torch.Tensor]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for tensor in tensors.values():
            data = memoryview(tensor.view(torch.uint8).numpy())
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _once(method: str, total_bytes: int, root: str) -> float | None:
    import torch.distributed as dist
    from safetensors.torch import save_file

    from dist_workspace import export_sharded, get_configs_parallel

    rank = dist.get_rank()
    part = _quarter(total_bytes, rank)
    out = os.path.join(root, method.replace(" ", "-").replace("+", ""))
    dist.barrier()
    began = time.perf_counter()
    if method == "export_sharded":
        export_sharded(part, out)
    elif method == "export_sharded 256MB":
        export_sharded(part, out, max_shard_size="256MB")
    elif method == "gather + one file":
        with get_configs_parallel(part, list(range(WORLD)), None) as parts:
            if parts:
                os.makedirs(out)
                merged = {name: t for value in parts for name, t in value.items()}
                save_file(merged, os.path.join(out, "model.safetensors"), {"format": "pt"})
                _fsync_file(os.path.join(out, "model.safetensors"))
    elif method == "4 writers":
        os.makedirs(out, exist_ok=True)
        _write_and_sync(os.path.join(out, f"part-{rank}"), part)
    elif method == "1 writer" and rank == 0:
        os.makedirs(out)
        everything = {
            name: tensor for r in range(WORLD) for name, tensor in _quarter(total_bytes, r).items()
        }
        began = time.perf_counter()  # building the model is not writing it
        _write_and_sync(os.path.join(out, "model"), everything)
    dist.barrier()
    elapsed = time.perf_counter() - began
    if rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    dist.barrier()
    return elapsed if rank == 0 else None


METHODS = ("export_sharded", "export_sharded 256MB", "gather + one file", "4 writers", "1 writer")


def measure(total_bytes: int, repeats: int, root: str) -> dict[str, float]:
    """Runs on every rank (``run_ranks``); rank 0 returns the fastest time per method."""
    torch.set_num_threads(1)
    best: dict[str, float] = {}
    for _ in range(repeats):
        for method in METHODS:
            seconds = _once(method, total_bytes, root)
            if seconds is not None:
                best[method] = min(best.get(method, seconds), seconds)
    return best


def report(best: dict[str, float], total_bytes: int) -> dict[str, Any]:
    """Prints the table; returns what goes into the JSON file."""
    gib = total_bytes / 2**30
    print()
    print(f"exporting a {gib:g} GiB model held by {WORLD} ranks (bfloat16, 64 MiB tensors)")
    header = f"{'method':<22}{'seconds':>9}{'GB/s':>7}{'x 4 writers':>13}"
    print(header)
    print("-" * len(header))
    limit = best["4 writers"]
    for method in METHODS:
        seconds = best[method]
        print(
            f"{method:<22}{seconds:>9.2f}{total_bytes / seconds / 1e9:>7.2f}"
            f"{limit / seconds:>13.2f}"
        )
    speedup = best["gather + one file"] / best["export_sharded"]
    split = best["gather + one file"] / best["export_sharded 256MB"]
    print(f"export_sharded speed-up over gather + one file: {speedup:.2f}x ({split:.2f}x, 256MB)")
    return {
        "gib": gib,
        "seconds": {method: round(best[method], 3) for method in METHODS},
        "speedup_over_gather": round(speedup, 3),
        "speedup_over_gather_256mb": round(split, 3),
    }
