"""NCCL's completed collectives are progress too: the counter read on a real GPU.

Needs a CUDA device (``@pytest.mark.cuda``), skipped elsewhere with the count. One
rank on one GPU (NCCL refuses two ranks on one device of one host): three
``all_reduce`` calls on CUDA tensors, then the count the beacon publishes must reach
three. NCCL's watchdog thread marks completions a little after the stream finished,
so the rank reads again until it does (bounded).
"""

from __future__ import annotations

import pytest

from dist_core.testing import run_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(240)]


def count_after_three_all_reduces() -> tuple[int | None, int | None]:
    import time

    import torch
    import torch.distributed as dist

    from dist_launch.in_worker.completed_collectives import CompletedCollectives

    counter = CompletedCollectives()
    before = counter.read()
    value = torch.ones(4, device="cuda")
    for _ in range(3):
        dist.all_reduce(value)
    torch.cuda.synchronize()
    deadline = time.monotonic() + 30
    after = counter.read()
    while (after is None or before is None or after < before + 3) and time.monotonic() < deadline:
        time.sleep(0.05)
        after = counter.read()
    return before, after


def test_nccl_collectives_that_completed_are_counted() -> None:
    ((before, after),) = run_ranks(count_after_three_all_reduces, 1, backend="nccl")
    assert before is not None and after is not None, (before, after)
    assert after >= before + 3, (before, after)
