"""The backend in a child process: a crash of the child fails the op; configure recovers."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dist_collectives.ft import BabyProcessError, ProcessGroupBabyGloo

pytestmark = pytest.mark.processes


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
    # The configure's timeout covers the child's start (an interpreter importing torch,
    # seconds on a loaded machine); the operation's is set short once it has joined.
    pg = ProcessGroupBabyGloo(timeout=timedelta(seconds=60))
    pg.configure(_store_addr("baby-hang/0"), rank, world)
    pg.set_timeout(timedelta(seconds=3))
    if rank == 0:
        # Rank 1 never joins this allreduce: the op must fail after the timeout, with
        # an error that is both a BabyProcessError and a TimeoutError.
        work = pg.allreduce(torch.ones(4), dist.ReduceOp.SUM)
        with pytest.raises(TimeoutError) as caught:
            work.wait()
        assert isinstance(caught.value, BabyProcessError), caught.value
        # gloo in the child may give up first (the child lives on), else the parent
        # kills the child at the deadline and records why.
        assert pg.errored() is None or isinstance(pg.errored(), TimeoutError)
    dist.barrier()
    # The new quorum's child starts a fresh interpreter too: a generous bound again.
    pg.set_timeout(timedelta(seconds=60))
    pg.configure(_store_addr("baby-hang/1"), rank, world)
    t = torch.ones(1)
    pg.allreduce(t, dist.ReduceOp.SUM).wait()
    pg.shutdown()
    return float(t) == world


def test_baby_gloo_fails_an_op_that_outlives_the_timeout() -> None:
    from dist_core.testing import run_ranks

    assert run_ranks(_baby_hang_worker, 2, timeout=120) == [True, True]


def _baby_heal_worker() -> list[float]:
    from dist_collectives.ft import Manager

    rank = dist.get_rank()
    weight = torch.full((3,), float(rank))

    def make_manager() -> Manager:
        return Manager(
            ProcessGroupBabyGloo(timeout=timedelta(seconds=30)),
            load_state_dict=lambda state: weight.copy_(state["w"]),
            state_dict=lambda: {"w": weight},
            replica_id=f"baby{rank}",
            timeout=timedelta(seconds=90),
            namespace="test-baby-heal",
        )

    if rank == 0:  # trains one step alone before replica 1 exists
        manager = make_manager()
        manager.start_quorum()
        assert manager.replica_count() == 1
        assert manager.should_commit()
        weight.add_(7.0)
    dist.barrier()
    if rank == 1:
        manager = make_manager()  # announced before replica 0 asks for the next quorum
    dist.barrier()
    # Replica 0 may finish a few more steps alone: a quorum is reused for the step
    # after a commit that saw no new replica, and the voters see a newcomer through
    # their watcher's registry reads (every few heartbeats); bounded, not counted.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        manager.start_quorum()
        grad = torch.ones(3)
        manager.allreduce(grad).wait()
        members = manager.replica_count()
        committed = manager.should_commit()
        if members == 2:
            break
    result = [float(committed), float(manager.current_step()), *weight.tolist(), *grad.tolist()]
    dist.barrier()
    manager.shutdown()
    return result


def test_manager_heals_a_joining_replica_through_a_baby_group() -> None:
    from dist_core.testing import run_ranks

    # Replica 1 joins behind: it receives replica 0's weights over the child process's
    # gloo, contributes zeros, and both average over the single participant.
    first, second = run_ranks(_baby_heal_worker, 2, timeout=150)
    assert first == second, "both replicas must end at the same step with the same weights"
    committed, step, *values = first
    assert committed == 1.0 and step >= 2.0
    assert values == [7.0, 7.0, 7.0, 1.0, 1.0, 1.0]
