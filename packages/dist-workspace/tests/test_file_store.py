"""An exchange over a FileStore, whose file keeps every value it was ever given."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_core.testing import run_ranks
from dist_workspace import get_configs_parallel, get_tensors_parallel


def _over_a_file_store(path: str) -> list[Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    got: list[Any] = []
    for step in range(3):
        with get_tensors_parallel(torch.full((2,), float(rank + step)), [0, 1, 2]) as tensors:
            got.append([t.tolist() for t in tensors])
    with get_configs_parallel({"rank": rank}, [2, 1, 0], None) as configs:
        got.append(configs)
    # A FileStore appends every value to its file and never shrinks it: calls that
    # wrote to the store would grow it for as long as the job runs.
    sizes = []
    for step in range(40):
        if step in (3, 39):
            dist.barrier()
            sizes.append(os.path.getsize(path))
            dist.barrier()
        with get_tensors_parallel(torch.ones(2) * step, [0, 1, 2]):
            pass
    got.append(sizes)
    return got


@pytest.mark.processes
@pytest.mark.usefixtures("private_shm_dir")
def test_an_exchange_over_a_file_store(tmp_path: Path) -> None:
    results = run_ranks(_over_a_file_store, 3, str(tmp_path / "init"), timeout=120)
    assert results[0][:3] == [[[float(r + step)] * 2 for r in range(3)] for step in range(3)]
    assert results[1][:3] == [[], [], []]
    assert results[2][3] == [{"rank": 2}, {"rank": 1}, {"rank": 0}]
    before, after = results[0][4]
    assert before == after, results[0][4]  # the calls left nothing in the store's file
