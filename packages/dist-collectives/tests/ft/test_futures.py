"""Futures around tensors: CUDA devices where the tensors have them, none on the CPU."""

from __future__ import annotations

import pytest
import torch
from torch.futures import Future

from dist_collectives.ft.work import (
    DummyWork,
    FutureWork,
    all_done,
    completed_future,
    cuda_devices,
    future_for,
)


def test_cpu_tensors_need_no_devices() -> None:
    assert cuda_devices(torch.ones(2)) == []
    assert cuda_devices([torch.ones(1), [torch.zeros(1)], {"a": torch.ones(1)}]) == []
    assert cuda_devices(None) == [] and cuda_devices("text") == []


def test_cuda_devices_reads_devices_without_touching_the_gpu() -> None:
    # Meta tensors stand in for device placement; only CUDA ones count.
    assert cuda_devices([torch.empty(1, device="meta")]) == []


def test_a_cpu_future_completes_and_hands_back_its_tensors() -> None:
    t = torch.arange(3.0)
    future = future_for([t])
    assert not future.done()
    future.set_result([t])
    assert future.wait() == [t]
    done = completed_future([t])
    assert done.done() and done.value()[0] is t
    work = DummyWork([t])
    assert work.is_completed() and work.is_success() and work.wait()


def test_all_done_waits_for_every_future_and_keeps_the_first_error() -> None:
    tensors = [torch.ones(1), torch.zeros(1)]
    first: Future[torch.Tensor] = future_for(tensors[0])
    second: Future[torch.Tensor] = future_for(tensors[1])
    combined = all_done([first, second], tensors)
    first.set_result(tensors[0])
    assert not combined.done()
    second.set_result(tensors[1])
    assert combined.wait() == tensors

    failing: Future[torch.Tensor] = future_for(tensors[0])
    combined = all_done([failing, completed_future(tensors[1])], tensors)
    failing.set_exception(RuntimeError("boom"))
    work = FutureWork(combined)
    assert work.is_completed() and not work.is_success()
    with pytest.raises(RuntimeError, match="boom"):
        work.wait()
    assert all_done([], tensors).value() == tensors
