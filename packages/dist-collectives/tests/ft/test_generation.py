"""A step's Generation: the group gets buffers of its own, the caller's tensor only a result.

The group here is a fake whose exchanges the test completes by hand, so a late
exchange (one that completes after the step failed) is a line of the test, not a race.
"""

from __future__ import annotations

import operator
import threading
from typing import Any

import pytest
import torch
from torch.futures import Future

from dist_collectives.ft.generation import Generation
from dist_collectives.ft.manager_futures import BufferPool


class _HandGroup:
    """A group whose allreduces wait until the test completes them with a sum."""

    def __init__(self) -> None:
        self.exchanges: list[tuple[torch.Tensor, Future[Any]]] = []

    def allreduce(self, tensors: list[torch.Tensor], options: Any) -> Any:
        future: Future[Any] = Future()
        self.exchanges.append((tensors[0], future))

        class _Work:
            def get_future(self) -> Future[Any]:
                return future

        return _Work()

    def complete(self, index: int, others: torch.Tensor) -> None:
        """The exchange ``index`` adds ``others`` (the peers' part) and completes."""
        buffer, future = self.exchanges[index]
        buffer.add_(others)
        future.set_result([buffer])


def _generation(group: _HandGroup, errors: list[Exception] | None = None) -> Generation:
    pool = BufferPool()
    return Generation(
        1,
        group,  # type: ignore[arg-type]  # the fake has the one method a generation calls
        pool,
        on_error=(errors if errors is not None else []).append,
        swallowed_error=lambda: None,
        copy_wait=5.0,
    )


def test_an_exchange_completing_after_its_generation_failed_leaves_the_tensor() -> None:
    group = _HandGroup()
    generation = _generation(group)
    gradient = torch.full((4,), 2.0)
    result = generation.allreduce(gradient, participants=2, behind=False)
    assert group.exchanges[0][0] is not gradient, "the group must get a buffer, not the tensor"
    assert generation.fail()
    assert result.done() and result.value() is gradient
    assert torch.equal(gradient, torch.full((4,), 2.0)), "failing touched the tensor"
    group.complete(0, torch.full((4,), 100.0))  # the late exchange
    assert torch.equal(gradient, torch.full((4,), 2.0)), "the late exchange wrote into it"


def test_a_successful_exchange_writes_the_average_and_only_then_completes() -> None:
    group = _HandGroup()
    generation = _generation(group)
    gradient = torch.full((4,), 2.0)
    result = generation.allreduce(gradient, participants=2, behind=False)
    assert not result.done() and torch.equal(gradient, torch.full((4,), 2.0))
    group.complete(0, torch.full((4,), 3.0))  # the peer's 6.0, divided by 2 on its side
    assert result.value() is gradient and torch.equal(gradient, torch.full((4,), 4.0))
    assert not generation.unfinished()
    generation.fail()  # a failure after the exchange: the result stays
    assert torch.equal(gradient, torch.full((4,), 4.0))


def test_failing_a_generation_waits_for_a_copy_in_progress_and_no_copy_starts_after() -> None:
    group = _HandGroup()
    generation = _generation(group)
    first, second = torch.zeros(2), torch.zeros(2)
    generation.allreduce(first, participants=1, behind=False)
    generation.allreduce(second, participants=1, behind=False)
    copying, release = threading.Event(), threading.Event()
    original_copy = torch.Tensor.copy_

    def slow_copy(self: torch.Tensor, source: torch.Tensor, *args: Any) -> torch.Tensor:
        if self is first:
            copying.set()
            assert release.wait(10)
        return original_copy(self, source, *args)

    torch.Tensor.copy_ = slow_copy  # type: ignore[assignment, method-assign]
    try:
        completer = threading.Thread(target=group.complete, args=(0, torch.ones(2)))
        completer.start()
        assert copying.wait(10)
        failed = threading.Event()
        failer = threading.Thread(target=lambda: (generation.fail(), failed.set()))
        failer.start()
        assert not failed.wait(0.2), "fail() returned while a copy into a tensor was under way"
        release.set()
        assert failed.wait(10)
        completer.join(10)
        failer.join(10)
    finally:
        torch.Tensor.copy_ = original_copy  # type: ignore[method-assign]
    assert torch.equal(first, torch.ones(2)), "the copy under way finishes"
    group.complete(1, torch.ones(2))
    assert torch.equal(second, torch.zeros(2)), "a copy started after fail()"


def test_a_failed_generations_buffers_never_return_to_the_pool() -> None:
    group = _HandGroup()
    pool = BufferPool()
    generation = Generation(
        1,
        group,  # type: ignore[arg-type]  # the fake has the one method a generation calls
        pool,
        on_error=print,
        swallowed_error=lambda: None,
        copy_wait=5.0,
    )
    generation.allreduce(torch.zeros(3), participants=1, behind=False)
    buffer = group.exchanges[0][0]
    generation.fail()
    group.complete(0, torch.ones(3))
    assert pool.take(torch.Size([3]), torch.float32, torch.device("cpu")) is not buffer


def test_a_healing_replica_exchanges_zeros_without_touching_its_tensor() -> None:
    group = _HandGroup()
    generation = _generation(group)
    stale = torch.full((3,), 7.0)
    result = generation.allreduce(stale, participants=2, behind=True)
    assert torch.equal(group.exchanges[0][0], torch.zeros(3))
    assert torch.equal(stale, torch.full((3,), 7.0))
    group.complete(0, torch.full((3,), 1.5))
    assert result.value() is stale and torch.equal(stale, torch.full((3,), 1.5))


def test_views_integers_and_bfloat16_get_the_average_only_on_success() -> None:
    group = _HandGroup()
    generation = _generation(group)
    matrix = torch.zeros(3, 2)
    column = matrix[:, 1]  # not contiguous
    integers = torch.full((3,), 1, dtype=torch.int64)
    halves = torch.full((4,), 4.0, dtype=torch.bfloat16)
    for tensor in (column, integers, halves):
        generation.allreduce(tensor, participants=2, behind=False)
    assert torch.equal(matrix, torch.zeros(3, 2))
    group.complete(0, torch.full((3,), 0.5))
    group.complete(1, torch.full((3,), 4, dtype=torch.int64))  # 1 + 4 = 5: floor 2
    group.complete(2, torch.full((4,), 0.0, dtype=torch.bfloat16))
    assert matrix[:, 0].tolist() == [0.0] * 3 and column.tolist() == [0.5] * 3
    assert integers.tolist() == [2] * 3 and halves.float().tolist() == [2.0] * 4


def test_an_allreduce_issued_after_the_generation_failed_completes_at_once_unchanged() -> None:
    group = _HandGroup()
    generation = _generation(group)
    generation.fail()
    tensor = torch.ones(2)
    result = generation.allreduce(tensor, participants=2, behind=False)
    assert result.value() is tensor and torch.equal(tensor, torch.ones(2))
    assert group.exchanges == []


def test_a_failed_exchange_is_reported_and_leaves_the_tensor() -> None:
    group = _HandGroup()
    errors: list[Exception] = []
    generation = _generation(group, errors)
    tensor = torch.ones(2)
    generation.allreduce(tensor, participants=2, behind=False)
    group.exchanges[0][1].set_exception(RuntimeError("peer died"))
    assert [str(e) for e in errors] == ["peer died"]
    assert torch.equal(tensor, torch.ones(2))


def test_a_list_is_gathered_into_one_buffer_and_each_tensor_gets_its_average() -> None:
    group = _HandGroup()
    generation = _generation(group)
    first, second = torch.full((2, 2), 2.0), torch.full((3,), 4.0)
    result = generation.allreduce([first, second], participants=2, behind=False)
    buffer = group.exchanges[0][0]
    assert buffer.shape == (7,), "one flat buffer for the whole list"
    assert torch.equal(buffer, torch.tensor([1.0] * 4 + [2.0] * 3)), "divided on the way in"
    group.complete(0, torch.tensor([3.0] * 4 + [5.0] * 3))
    assert all(map(operator.is_, result.value(), [first, second]))
    assert torch.equal(first, torch.full((2, 2), 4.0))
    assert torch.equal(second, torch.full((3,), 7.0))


def test_a_list_whose_exchange_completes_after_the_failure_keeps_every_tensor() -> None:
    group = _HandGroup()
    generation = _generation(group)
    tensors = [torch.full((2,), 2.0), torch.full((2,), 3.0)]
    result = generation.allreduce(tensors, participants=2, behind=False)
    assert generation.fail()
    group.complete(0, torch.full((4,), 100.0))  # the late exchange
    assert result.value() is tensors
    assert torch.equal(tensors[0], torch.full((2,), 2.0))
    assert torch.equal(tensors[1], torch.full((2,), 3.0))


def test_the_next_steps_list_reuses_the_buffer_of_the_last_one() -> None:
    pool = BufferPool()
    buffers = []
    for number in (1, 2):
        group = _HandGroup()
        generation = Generation(
            number,
            group,  # type: ignore[arg-type]  # the fake has the one method a generation calls
            pool,
            on_error=print,
            swallowed_error=lambda: None,
            copy_wait=5.0,
        )
        generation.allreduce([torch.ones(2), torch.ones(3)], participants=1, behind=False)
        buffers.append(group.exchanges[0][0])
        group.complete(0, torch.zeros(5))
    assert buffers[0] is buffers[1], "a step allocated a second exchange buffer"


def test_a_list_of_two_dtypes_is_refused_by_index() -> None:
    generation = _generation(_HandGroup())
    with pytest.raises(ValueError, match=r"tensor 1 of the list is torch\.int64"):
        generation.allreduce(
            [torch.ones(2), torch.ones(2, dtype=torch.int64)], participants=2, behind=False
        )
