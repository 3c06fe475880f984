"""A failed step's exchange that completes late writes into no tensor the caller sees.

Two replicas as real processes. In the second step replica 1 reports an error instead
of joining replica 0's allreduce, so the step fails on both; then replica 1 joins that
very exchange on the group as it was configured, with other values, as a peer whose
exchange ran on past the failure would. Replica 0's tensor must read afterwards what it
read when the step failed: FSDP2 and DDP keep gradient tensors between steps, so a late
write there would be averaged into a later, committed step on one replica only.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_collectives.ft import Manager, ProcessGroupGloo
from dist_core.testing import run_ranks

pytestmark = pytest.mark.processes


class _RecordingGloo(ProcessGroupGloo):
    """A gloo group that keeps the Work of its last allreduce, for the test to wait on."""

    last_work: Any = None

    def allreduce(self, *args: Any) -> dist.Work:  # type: ignore[override]
        work = super().allreduce(*args)  # type: ignore[call-arg]
        self.last_work = work
        return work


def _late_write_worker() -> list[object]:
    rank = dist.get_rank()
    pg = _RecordingGloo(timeout=timedelta(seconds=20))
    manager = Manager(
        pg,
        load_state_dict=lambda state: None,
        state_dict=dict,
        min_replica_size=2,
        replica_id=f"late{rank}",
        timeout=timedelta(seconds=20),
        first_quorum_window=timedelta(0),
        namespace=f"test-late-write-{os.environ['MASTER_PORT']}",
    )
    try:
        manager.start_quorum()  # step 1 commits: the group works
        manager.allreduce(torch.ones(4)).wait()
        assert manager.should_commit()

        manager.start_quorum()  # step 2 fails: replica 1 reports an error instead
        gradient = torch.full((1024,), 2.0)
        future = manager.allreduce(gradient) if rank == 0 else None
        dist.barrier()
        if rank == 1:
            manager.report_error(RuntimeError("replica 1 gives up on step 2"))
        committed = manager.should_commit()
        seen = gradient.clone()
        dist.barrier()
        if rank == 1:  # the exchange replica 0 still waits in, completed late
            late = torch.full((1024,), 100.0)
            pg.allreduce([late], dist.AllreduceOptions()).wait()
        else:
            pg.last_work.wait()
        dist.barrier()
        unchanged = bool(torch.equal(gradient, seen))
        handed_back = future is None or future.value() is gradient

        manager.start_quorum()  # step 3 commits on a new quorum
        after = torch.full((2,), float(rank))
        manager.allreduce(after).wait()
        recovered = manager.should_commit()
        return [committed, unchanged, handed_back, recovered, after.tolist()]
    finally:
        dist.barrier()  # nobody closes its connections while the other still decides
        manager.shutdown()


def test_a_failed_steps_exchange_completing_late_changes_no_tensor_the_caller_sees() -> None:
    first, second = run_ranks(_late_write_worker, 2, timeout=120)
    assert first[0] is False and second[0] is False, "the step with an error committed"
    assert first[1], "the failed step's late exchange wrote into replica 0's tensor"
    assert first[2], "the future of the failed step must hand back the caller's tensor"
    assert first[3] and second[3], "the step after the failure did not commit"
    assert first[4] == second[4] == [0.5, 0.5]
