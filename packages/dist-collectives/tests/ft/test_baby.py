"""The backend in a child process: a crash of the child fails the op; configure recovers."""

from __future__ import annotations

import os
import signal
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dist_collectives.ft import BabyProcessError, ProcessGroupBabyGloo


def _store_addr(prefix: str) -> str:
    return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/{prefix}"


def _baby_worker() -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=20))
    pg.configure(_store_addr("baby/0"), rank, world)
    t = torch.tensor([float(rank + 1)])
    pg.allreduce([t], dist.AllreduceOptions()).wait()
    results = [float(t)]
    dist.barrier()
    # Rank 0's child dies in the middle of an allreduce; both parents get an error.
    pending = torch.full((1000,), 5.0)
    work = pg.allreduce(pending, dist.ReduceOp.SUM)
    if rank == 0:
        child = pg.child_pid()
        assert child is not None
        os.kill(child, signal.SIGKILL)
    with pytest.raises((BabyProcessError, RuntimeError)):
        work.wait()
    assert pending[0].item() == 5.0, "a failed op leaves the tensor as it was"
    pg.configure(_store_addr("baby/1"), rank, world)
    t = torch.tensor([10.0 * (rank + 1)])
    pg.allreduce(t, dist.ReduceOp.SUM).wait()
    results.append(float(t))
    b = torch.tensor([float(rank)])
    pg.broadcast([b], 1).wait()
    results.append(float(b))
    pg.shutdown()
    return results


def test_baby_gloo_survives_its_child_dying() -> None:
    from dist_core.testing import run_ranks

    assert run_ranks(_baby_worker, 2, timeout=120) == [[3.0, 30.0, 1.0]] * 2


def _baby_hang_worker() -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=3))
    pg.configure(_store_addr("baby-hang/0"), rank, world)
    if rank == 0:
        # Rank 1 never joins this allreduce: the op must fail after the timeout.
        work = pg.allreduce(torch.ones(4), dist.ReduceOp.SUM)
        with pytest.raises((BabyProcessError, RuntimeError)):
            work.wait()
    dist.barrier()
    pg.configure(_store_addr("baby-hang/1"), rank, world)
    t = torch.ones(1)
    pg.allreduce(t, dist.ReduceOp.SUM).wait()
    pg.shutdown()
    return float(t) == world


def test_baby_gloo_fails_an_op_that_outlives_the_timeout() -> None:
    from dist_core.testing import run_ranks

    assert run_ranks(_baby_hang_worker, 2, timeout=120) == [True, True]
