"""configure on CPU: a refused call changes nothing, a missing peer is named in time."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dist_collectives.ft import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupGloo,
    RendezvousTimeoutError,
    StoreAddressReusedError,
)
from dist_collectives.ft.baby import BabyProcessError
from dist_collectives.ft.wrappers import wait_for_retirements
from dist_core.devices import cuda_device_count
from dist_core.ports import get_unused_port
from dist_core.testing import run_ranks

ARRIVAL_TIMEOUT = 3.0


def _store_addr(prefix: str) -> str:
    return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/{prefix}"


def _refused_worker(kind: str) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    timeout = timedelta(seconds=30)
    pg = {
        "gloo": lambda: ProcessGroupGloo(timeout=timeout),
        "baby": lambda: ProcessGroupBabyGloo(timeout=timeout),
        "swallow": lambda: ErrorSwallowingProcessGroupWrapper(ProcessGroupGloo(timeout=timeout)),
    }[kind]()
    pg.configure(_store_addr(f"refused-{kind}/0"), rank, world)
    with pytest.raises(StoreAddressReusedError, match=f"refused-{kind}/0"):
        pg.configure(_store_addr(f"refused-{kind}/0"), rank, world)
    with pytest.raises(ValueError, match="rank=5"):
        pg.configure(_store_addr(f"refused-{kind}/1"), 5, world)
    assert (pg.rank(), pg.size()) == (rank, world), "a refused configure keeps rank and size"
    t = torch.tensor([float(rank + 1)])
    pg.allreduce([t], dist.AllreduceOptions()).wait()  # still on the old configuration
    pg.configure(_store_addr(f"refused-{kind}/1"), rank, world)  # an unused address works
    u = torch.tensor([1.0])
    pg.allreduce(u, dist.ReduceOp.SUM).wait()
    pg.shutdown()
    return [float(t), float(u)]


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["gloo", "baby", "swallow"])
def test_a_refused_configure_leaves_the_group_working(kind: str) -> None:
    assert run_ranks(_refused_worker, 2, kind, timeout=120) == [[3.0, 2.0]] * 2


def _missing_peer_worker() -> list[object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = ProcessGroupGloo(timeout=timedelta(seconds=ARRIVAL_TIMEOUT))
    pg.configure(_store_addr("missing/0"), rank, world)
    outcome: list[object] = []
    if rank == 0:
        # Rank 1 never configures "missing/1": rank 0 must give up at the timeout.
        started = time.monotonic()
        with pytest.raises(RendezvousTimeoutError) as caught:
            pg.configure(_store_addr("missing/1"), 0, world)
        elapsed = time.monotonic() - started
        assert caught.value.missing == [1]
        assert caught.value.store_addr == _store_addr("missing/1")
        assert _store_addr("missing/1") in str(caught.value)
        assert "[1]" in str(caught.value)
        outcome.append(elapsed)
    dist.barrier()
    # The failed configure left the old one in place on rank 0.
    t = torch.tensor([float(rank + 1)])
    pg.allreduce([t], dist.AllreduceOptions()).wait()
    outcome.append(float(t))
    pg.shutdown()
    return outcome


@pytest.mark.processes
def test_a_peer_that_never_arrives_is_named_within_the_timeout() -> None:
    first, second = run_ranks(_missing_peer_worker, 2, timeout=120)
    elapsed, total = first
    assert ARRIVAL_TIMEOUT - 0.5 <= float(elapsed) < ARRIVAL_TIMEOUT + 1.0, elapsed
    assert total == 3.0 and second == [3.0]


def test_lonely_configure_names_the_store_and_the_missing_ranks() -> None:
    port = get_unused_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=ARRIVAL_TIMEOUT))
    started = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match=r"rank\(s\) \[1, 2\] of world_size=3"):
        pg.configure(f"127.0.0.1:{port}/lonely", 0, 3)
    assert time.monotonic() - started < ARRIVAL_TIMEOUT + 1.0
    with pytest.raises(RuntimeError, match="not configured"):
        pg.allreduce([torch.ones(1)], dist.AllreduceOptions())
    del server


def _baby_missing_worker() -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    message = ""
    if rank == 0:
        pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=ARRIVAL_TIMEOUT))
        with pytest.raises(BabyProcessError) as caught:
            pg.configure(_store_addr("baby-missing/0"), 0, world)
        message = str(caught.value)
    dist.barrier()
    return message


@pytest.mark.processes
def test_baby_group_names_a_peer_that_never_arrives() -> None:
    message, _ = run_ranks(_baby_missing_worker, 2, timeout=120)
    assert "RendezvousTimeoutError" in message and "[1]" in message


def test_retired_groups_can_be_awaited() -> None:
    port = get_unused_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=10))
    for i in range(3):
        pg.configure(f"127.0.0.1:{port}/retire/{i}", 0, 1)
    pg.shutdown()
    assert wait_for_retirements(30.0)
    del server


@pytest.mark.skipif(cuda_device_count() > 0, reason="checks a machine without a GPU")
def test_baby_nccl_names_what_is_missing_without_a_gpu() -> None:
    pg = ProcessGroupBabyNCCL(timeout=timedelta(seconds=5))
    assert pg.getBackendName() == "ft-baby-nccl"
    with pytest.raises(RuntimeError, match=r"ProcessGroupBabyNCCL needs CUDA.*(CUDA|NCCL|device)"):
        pg.configure("127.0.0.1:1/x", 0, 1)
    # Refused before anything changed: the address is not used up.
    with pytest.raises(RuntimeError, match="needs CUDA"):
        pg.configure("127.0.0.1:1/x", 0, 1)
