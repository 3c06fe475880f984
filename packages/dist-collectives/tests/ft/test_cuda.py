"""GPU checks of dist_collectives.ft (marked ``cuda``: skipped where torch sees no GPU).

Written against torch's documented CUDA semantics; see the package README ("On GPUs")
for where they have run. Multi-rank checks share one GPU over gloo, as NCCL refuses
two ranks on one device; NCCL itself is checked at world size 1 (or on two GPUs).
"""

from __future__ import annotations

import hashlib
import os
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_collectives.ft import (
    BabyProcessError,
    DistributedDataParallel,
    Manager,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    RendezvousTimeoutError,
    StoreAddressReusedError,
)
from dist_collectives.ft.state_transfer import recv_state, send_state
from dist_collectives.ft.wrappers import wait_for_retirements
from dist_core.ports import get_unused_port
from dist_core.testing import run_ranks

MiB = 1 << 20


def _store_addr(prefix: str) -> str:
    return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/{prefix}"


def _busy(stream: torch.cuda.Stream, tensor: torch.Tensor, value: float) -> None:
    """Writes ``value`` into ``tensor`` on ``stream`` behind enough work to take a while.

    A reader that does not wait for ``stream`` sees the old values.
    """
    with torch.cuda.stream(stream):
        big = torch.randn(2048, 2048, device=tensor.device)
        for _ in range(20):
            big = big @ big
            big = big / big.norm()
        tensor.copy_(torch.full_like(tensor, value) + 0.0 * big.sum())


def _digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            h.update(f"{index}.{key}".encode())
            if isinstance(value, torch.Tensor):
                h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _ddp_worker(steps: int, seed: int) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.cuda.set_device(0)
    torch.manual_seed(seed)  # the same weights on every replica
    model = nn.Sequential(nn.Linear(64, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh()).cuda()
    model.append(nn.Linear(512, 1).cuda())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    manager = Manager(
        ProcessGroupGloo(timeout=timedelta(seconds=60)),
        load_state_dict=lambda state: None,
        state_dict=lambda: {},
        min_replica_size=dist.get_world_size(),
        replica_id=f"ddp-cuda-{rank}",
        timeout=timedelta(seconds=60),
        namespace=f"test-ddp-cuda-{seed}",
    )
    ddp = DistributedDataParallel(manager, model, bucket_cap_mb=0.25)
    generator = torch.Generator().manual_seed(1000 * seed + rank)  # different data
    committed = 0
    while manager.current_step() < steps:
        manager.start_quorum()
        x = torch.randn(256, 64, generator=generator).cuda()
        y = x.sum(dim=1, keepdim=True)
        optimizer.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        if manager.should_commit():
            optimizer.step()
            committed += 1
    torch.cuda.synchronize()
    digest = _digest(model, optimizer)
    manager.shutdown()
    return {"digest": digest, "committed": committed, "step": manager.current_step()}


@pytest.mark.processes
@pytest.mark.cuda
@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ddp_replicas_on_a_gpu_end_bit_identical(seed: int) -> None:
    reports = run_ranks(_ddp_worker, 2, 12, seed, timeout=240)
    assert [r["committed"] for r in reports] == [12, 12], reports
    assert reports[0]["digest"] == reports[1]["digest"], "the replicas diverged"


def _manager_cuda_worker() -> list[float]:
    rank = dist.get_rank()
    torch.cuda.set_device(0)
    manager = Manager(
        ProcessGroupGloo(timeout=timedelta(seconds=60)),
        load_state_dict=lambda state: None,
        state_dict=lambda: {},
        min_replica_size=2,
        replica_id=f"manager-cuda-{rank}",
        timeout=timedelta(seconds=60),
        namespace="test-manager-cuda",
    )
    side = torch.cuda.Stream()
    results = []
    for step in range(3):
        manager.start_quorum()
        grad = torch.zeros(1 << 20, device="cuda")
        integer = torch.zeros(4, dtype=torch.int64, device="cuda")
        with torch.cuda.stream(side):
            _busy(side, grad, float(rank + 1 + step))
            integer.fill_(10 * (rank + 1))
            futures = [manager.allreduce(grad), manager.allreduce(integer)]
            for future in futures:
                future.wait()  # the side stream now waits for the averaged values
            total = float(grad.sum()) / grad.numel() + float(integer[0])
        results.append(total)
        assert manager.should_commit()
    manager.shutdown()
    return results


@pytest.mark.processes
@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_manager_allreduce_of_cuda_tensors_written_on_a_side_stream() -> None:
    # mean of (1+s, 2+s) = 1.5+s; integers: (10+20)//2 = 15
    expected = [1.5 + s + 15 for s in range(3)]
    assert run_ranks(_manager_cuda_worker, 2, timeout=240) == [expected, expected]


def _baby_gloo_cuda_worker() -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(0)
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=60))
    pg.configure(_store_addr("baby-gloo-cuda/0"), rank, world)
    side = torch.cuda.Stream()
    t = torch.zeros(1 << 20, device="cuda")
    with torch.cuda.stream(side):
        _busy(side, t, float(rank + 1))
        pg.allreduce([t], dist.AllreduceOptions()).wait()
        mean = float(t.mean())
    b = torch.full((8,), float(rank), device="cuda")
    pg.broadcast([b], 1).wait()
    pg.shutdown()
    return [mean, float(b.mean()), float(t.device.type == "cuda")]


@pytest.mark.processes
@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_baby_gloo_with_cuda_tensors_written_on_a_side_stream() -> None:
    assert run_ranks(_baby_gloo_cuda_worker, 2, timeout=240) == [[3.0, 1.0, 1.0]] * 2


def _state_transfer_worker(backend: str) -> list[object]:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank if backend == "nccl" else 0
    torch.cuda.set_device(device)
    pg = ProcessGroupNCCL() if backend == "nccl" else ProcessGroupGloo()
    pg.configure(_store_addr(f"state-cuda-{backend}/0"), rank, world)
    out: list[object] = []
    if rank == 0:
        weight = torch.zeros(1 << 20, device="cuda")
        _busy(torch.cuda.Stream(), weight, 7.0)  # written on another stream, still running
        half = torch.full((10,), 7.0, device="cuda", dtype=torch.half)
        state = {"w": weight, "step": torch.tensor(3.0), "half": half, "n": 5}
        send_state(pg, state, 42, 1)
        weight.fill_(-1.0)  # after send_state returns the GPU is done with the old values
    else:
        state, step = recv_state(pg, 0)
        out = [
            step,
            float(state["w"].mean()),
            state["step"].device.type,
            float(state["half"].float().mean()),
            state["n"],
        ]
    pg.shutdown()
    return out


@pytest.mark.processes
@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_state_transfer_of_cuda_state_over_gloo() -> None:
    _, received = run_ranks(_state_transfer_worker, 2, "gloo", timeout=240)
    assert received == [42, 7.0, "cpu", 7.0, 5]


@pytest.mark.processes
@pytest.mark.cuda(devices=2)
@pytest.mark.timeout(300)
def test_state_transfer_of_cuda_state_over_nccl() -> None:
    _, received = run_ranks(_state_transfer_worker, 2, "nccl", timeout=240)
    assert received == [42, 7.0, "cpu", 7.0, 5]


@pytest.fixture
def store_port() -> Any:
    port = get_unused_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    yield port
    del server


@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_nccl_reconfigure_does_not_wait_for_the_abort_nor_grow_memory(store_port: int) -> None:
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=30))
    pg.configure(f"127.0.0.1:{store_port}/nccl-mem/0", 0, 1)
    t = torch.ones(4, device="cuda")
    pg.allreduce([t], dist.AllreduceOptions()).wait()
    pg.configure(f"127.0.0.1:{store_port}/nccl-mem/1", 0, 1)
    assert wait_for_retirements(60.0)
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    allocated_before = torch.cuda.memory_allocated()
    times = []
    for i in range(2, 52):
        started = time.perf_counter()
        pg.configure(f"127.0.0.1:{store_port}/nccl-mem/{i}", 0, 1)
        times.append(time.perf_counter() - started)
        t = torch.full((4,), float(i), device="cuda")
        pg.allreduce([t], dist.AllreduceOptions()).wait()
        assert t.tolist() == [float(i)] * 4
    assert wait_for_retirements(120.0), "the old communicators were not aborted"
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    grown = (free_before - free_after) / MiB
    times.sort()
    print(
        f"50 reconfigurations at world size 1: median {1000 * times[25]:.1f} ms, "
        f"max {1000 * times[-1]:.1f} ms; device memory grew {grown:.1f} MiB"
    )
    assert torch.cuda.memory_allocated() <= allocated_before + 1 * MiB
    assert grown < 64, f"device memory grew by {grown:.0f} MiB over 50 reconfigurations"
    started = time.perf_counter()
    pg.shutdown()
    print(f"shutdown returned in {1000 * (time.perf_counter() - started):.1f} ms")
    assert wait_for_retirements(60.0)


@pytest.mark.cuda
@pytest.mark.timeout(120)
def test_nccl_refused_configure_keeps_the_live_communicator(store_port: int) -> None:
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=30))
    pg.configure(f"127.0.0.1:{store_port}/nccl-reuse/0", 0, 1)
    with pytest.raises(StoreAddressReusedError):
        pg.configure(f"127.0.0.1:{store_port}/nccl-reuse/0", 0, 1)
    t = torch.full((3,), 2.0, device="cuda")
    pg.allreduce([t], dist.AllreduceOptions()).wait()
    assert t.tolist() == [2.0] * 3
    pg.shutdown()


@pytest.mark.cuda
@pytest.mark.timeout(120)
def test_nccl_configure_with_a_peer_that_never_comes_fails_in_time(store_port: int) -> None:
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=10))
    address = f"127.0.0.1:{store_port}/nccl-lonely"
    started = time.monotonic()
    with pytest.raises(RendezvousTimeoutError) as caught:
        pg.configure(address, 0, 2)
    elapsed = time.monotonic() - started
    assert caught.value.missing == [1] and address in str(caught.value)
    assert elapsed < 11.0, f"configure took {elapsed:.1f} s with a 10 s timeout"


@pytest.mark.processes
@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_baby_nccl_world_of_one(store_port: int) -> None:
    pg = ProcessGroupBabyNCCL(timeout=timedelta(seconds=30))
    pg.configure(f"127.0.0.1:{store_port}/baby-nccl/0", 0, 1)
    side = torch.cuda.Stream()
    t = torch.zeros(1 << 20, device="cuda")
    with torch.cuda.stream(side):
        _busy(side, t, 3.0)
        work = pg.allreduce([t], dist.AllreduceOptions())
        work.wait()  # the side stream waits for the child's collective
        t.add_(1.0)  # ordered after the allreduce on the GPU
        assert float(t.mean()) == 4.0
    b = torch.full((5,), 9.0, device="cuda")
    pg.broadcast([b], 0).wait()
    torch.cuda.current_stream().synchronize()
    assert b.tolist() == [9.0] * 5
    pg.shutdown()


@pytest.mark.processes
@pytest.mark.cuda
@pytest.mark.timeout(300)
def test_baby_nccl_child_death_and_hang_fail_the_work_and_leak_nothing(store_port: int) -> None:
    pg = ProcessGroupBabyNCCL(timeout=timedelta(seconds=3))
    pg.configure(f"127.0.0.1:{store_port}/baby-nccl-kill/warm", 0, 1)
    warm = torch.ones(1, device="cuda")
    pg.allreduce([warm], dist.AllreduceOptions()).wait()
    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated()
    free_before, _ = torch.cuda.mem_get_info()
    for i in range(6):
        pg.configure(f"127.0.0.1:{store_port}/baby-nccl-kill/{i}", 0, 1)
        pid = pg.child_pid()
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # the child cannot answer: the op stays pending
        t = torch.ones(4 * MiB // 4, device="cuda")  # 4 MiB shared with the child
        work = pg.allreduce([t], dist.AllreduceOptions())
        if i % 2 == 0:
            os.kill(pid, signal.SIGKILL)  # dies
        # else: hangs, and is killed at the timeout
        with pytest.raises(BabyProcessError):
            work.wait()
        assert isinstance(pg.error(), BabyProcessError)
        del t, work
    pg.configure(f"127.0.0.1:{store_port}/baby-nccl-kill/last", 0, 1)
    assert pg.error() is None
    t = torch.full((4,), 5.0, device="cuda")
    pg.allreduce([t], dist.AllreduceOptions()).wait()
    assert t.tolist() == [5.0] * 4
    pg.shutdown()
    del t
    torch.cuda.ipc_collect()
    torch.cuda.synchronize()
    leaked = torch.cuda.memory_allocated() - allocated_before
    free_after, _ = torch.cuda.mem_get_info()
    print(
        f"after 6 dead children: {leaked / MiB:.1f} MiB still allocated by the parent, "
        f"device free memory changed by {(free_after - free_before) / MiB:.1f} MiB"
    )
    assert leaked <= 0, f"{leaked / MiB:.1f} MiB shared with dead children stayed allocated"


@pytest.mark.processes
@pytest.mark.cuda
@pytest.mark.timeout(600)
def test_baby_nccl_reconfigure_does_not_grow_gpu_memory(store_port: int) -> None:
    pg = ProcessGroupBabyNCCL(timeout=timedelta(seconds=30))
    pg.configure(f"127.0.0.1:{store_port}/baby-nccl-mem/warm", 0, 1)
    torch.cuda.synchronize()
    allocated_before = torch.cuda.memory_allocated()
    for i in range(10):
        pg.configure(f"127.0.0.1:{store_port}/baby-nccl-mem/{i}", 0, 1)
        t = torch.ones(MiB, device="cuda")
        pg.allreduce([t], dist.AllreduceOptions()).wait()
        torch.cuda.current_stream().synchronize()
        del t
    pg.shutdown()
    torch.cuda.ipc_collect()
    assert torch.cuda.memory_allocated() <= allocated_before
