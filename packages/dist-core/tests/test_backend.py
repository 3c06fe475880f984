"""Backend choice, init with the sanity all-reduce, init/destroy repeated in one process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import dist_core
from dist_core import DistEnvError
from dist_core.testing import run_ranks


def test_default_backend_on_cpu_is_gloo() -> None:
    assert not torch.cuda.is_available()
    assert dist_core.default_backend() == "gloo"


def test_backend_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISTRIBUTED_BACKEND", "")  # restored after the test
    assert dist_core.get_distributed_backend() == "gloo"
    dist_core.set_distributed_backend("nccl")
    assert os.environ["TORCH_DISTRIBUTED_BACKEND"] == "nccl"
    assert dist_core.get_distributed_backend() == "nccl"
    monkeypatch.setenv("TORCH_DISTRIBUTED_BACKEND", "cpu:gloo,cuda:nccl")
    assert dist_core.get_distributed_backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.setenv("TORCH_DISTRIBUTED_BACKEND", "glooo")
    with pytest.raises(DistEnvError, match="TORCH_DISTRIBUTED_BACKEND=glooo"):
        dist_core.get_distributed_backend()


def test_set_dist_writes_environment_and_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "INIT_METHOD",
        "NODE_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    dist_core.set_dist(3, 1, 4, 2, "10.1.2.3", 1234, "env://")
    assert os.environ["RANK"] == "3" and os.environ["NODE_RANK"] == "1"
    assert os.environ["MASTER_PORT"] == "1234" and dist_core.get_init_method() == "env://"
    with pytest.raises(DistEnvError, match="RANK=5 with WORLD_SIZE=4"):
        dist_core.set_dist(5, 1, 4, 2, "h", 1, "env://")


def _init_destroy_twice() -> list[int]:
    """Destroys run_ranks' group, then initializes and destroys two more in a row."""
    rank, world = dist.get_rank(), dist.get_world_size()
    port = int(os.environ["MASTER_PORT"])
    dist_core.destroy_dist()
    dist_core.destroy_dist()  # harmless without a group
    sums = []
    for _ in range(2):
        dist_core.init_dist(rank, rank, world, world, "127.0.0.1", port, "env://", backend="gloo")
        value = torch.tensor([rank + 1.0])
        dist.all_reduce(value)
        sums.append(int(value.item()))
        dist_core.destroy_dist()
        assert not dist_core.is_initialized()
    dist_core.init_process_group_from_backend()  # leave a group for run_ranks to destroy
    return sums


def test_init_then_destroy_twice_in_one_process() -> None:
    assert run_ranks(_init_destroy_twice, 2) == [[3, 3], [3, 3]]


def _init_twice_without_destroy() -> None:
    dist_core.init_process_group_from_backend()


def test_second_init_without_destroy_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="already initialized"):
        run_ranks(_init_twice_without_destroy, 1)


def test_single_process_init_and_destroy(monkeypatch: pytest.MonkeyPatch) -> None:
    for round_ in range(2):
        port = dist_core.get_unused_port()
        for name in ("GROUP_RANK", "NODE_RANK"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("RANK", "0")  # let monkeypatch restore what set_dist writes
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        dist_core.init_dist(0, 0, 1, 1, "127.0.0.1", port, "env://")
        try:
            assert dist_core.is_initialized(), round_
            assert dist_core.get_world_size() == 1
        finally:
            dist_core.destroy_dist()
        assert not dist_core.is_initialized()
