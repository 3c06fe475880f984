"""run_ranks: results in rank order, the failing rank's own traceback, timeouts with stacks.

This file is collected in pytest's importlib mode (root pyproject.toml), so these tests
also show that worker functions defined in a test file load in the workers.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from dist_core.testing import RankFailedError, run_ranks


@dataclasses.dataclass(frozen=True)
class Payload:
    """A class defined in the test file: its instances travel to and from workers."""

    scale: int


def _all_reduce_scaled(payload: Payload, *, offset: int) -> Payload:
    value = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(value)
    return Payload(int(value.item()) * payload.scale)


def _identity_rank() -> tuple[int, int, str]:
    return dist.get_rank(), dist.get_world_size(), os.environ["RUN_RANKS_MARKER"]


def _rank_two_raises_while_others_block() -> None:
    if dist.get_rank() == 2:
        raise ValueError("rank two saw a bad shape (3, 4)")
    dist.barrier()  # blocks until the launcher stops this rank


def _rank_one_exits_hard() -> None:
    if dist.get_rank() == 1:
        os._exit(7)
    dist.barrier()


def _rank_one_segfaults() -> None:
    if dist.get_rank() == 1:
        ctypes.string_at(0)
    dist.barrier()


def _rank_one_sigkills_itself() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _rank_zero_sleeps_in_python() -> None:
    if dist.get_rank() == 0:
        time.sleep(600)
    dist.barrier()


def _rank_one_reads_the_store_after_rank_zero_returned() -> int:
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    if dist.get_rank() == 0:
        store.set("rank0", str(os.getpid()))
        return 0
    rank_zero = int(store.get("rank0"))
    # Rank 0 has returned: give its process up to 2 s to end (as it did, taking the
    # store it serves with it, before run_ranks kept it until every rank finished).
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            os.kill(rank_zero, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)  # polling another process's end: nothing to wait on here
    return int(store.get("rank0")) - rank_zero + 1


@pytest.mark.processes
def test_rank_zero_keeps_the_store_until_every_rank_returned() -> None:
    assert run_ranks(_rank_one_reads_the_store_after_rank_zero_returned, 2, timeout=60) == [0, 1]


@pytest.mark.processes
def test_results_come_back_in_rank_order() -> None:
    results = run_ranks(_all_reduce_scaled, 3, Payload(10), offset=1)
    assert results == [Payload(60)] * 3


@pytest.mark.processes
def test_workers_see_the_callers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUN_RANKS_MARKER", "from-the-test")
    assert run_ranks(_identity_rank, 2) == [(0, 2, "from-the-test"), (1, 2, "from-the-test")]


@pytest.mark.processes
def test_failing_rank_traceback_comes_first_and_others_are_stopped() -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(_rank_two_raises_while_others_block, 4, timeout=60)
    message = str(info.value)
    assert info.value.rank == 2
    assert message.startswith("rank 2 of 4 failed first:")
    assert "ValueError: rank two saw a bad shape (3, 4)" in message
    assert "_rank_two_raises_while_others_block" in message
    for other in (0, 1, 3):
        assert f"  rank {other}: " in message


@pytest.mark.processes
@pytest.mark.parametrize(
    ("worker", "how"),
    [
        (_rank_one_exits_hard, "exit code 7"),
        (_rank_one_segfaults, "signal SIGSEGV"),
        (_rank_one_sigkills_itself, "signal SIGKILL"),
    ],
)
def test_rank_dying_without_a_traceback_is_named(worker: object, how: str) -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(worker, 3, timeout=60)  # type: ignore[arg-type]
    assert info.value.rank == 1
    assert f"rank 1 of 3 failed first: its process ended with {how}" in str(info.value)


@pytest.mark.processes
def test_timeout_reports_where_each_rank_was() -> None:
    with pytest.raises(RankFailedError) as info:
        run_ranks(_rank_zero_sleeps_in_python, 2, timeout=8)
    message = str(info.value)
    assert info.value.rank is None
    assert message.startswith("timed out after 8 s")
    assert "rank 0: still running at the timeout" in message
    assert "in _rank_zero_sleeps_in_python" in message
    assert "rank 1: still running at the timeout" in message


def test_nested_function_is_refused_with_a_clear_error() -> None:
    def nested() -> None:
        return None

    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(nested, 2)


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size=0"):
        run_ranks(_identity_rank, 0)
