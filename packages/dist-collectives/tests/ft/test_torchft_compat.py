"""What torchft 0.2.0 code expects of the groups and the Manager, on real processes."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllToAllOptions,
    BarrierOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from torch.futures import Future

import dist_collectives.ft as ft
from dist_collectives.ft import (
    ErrorSwallowingProcessGroupWrapper,
    FTError,
    Manager,
    ProcessGroupBabyGloo,
    ProcessGroupDummy,
    ProcessGroupGloo,
    RendezvousTimeoutError,
)
from dist_core.testing import run_ranks

Check = Callable[[], None]


def _store_addr(prefix: str) -> str:
    return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/{prefix}"


def torch_collectives() -> list[str]:
    """Every method of torch's ProcessGroup that returns a Work, read from torch itself."""
    names = [
        name
        for name, member in vars(dist.ProcessGroup).items()
        if callable(member) and re.search(r"->\s*\S*Work\b", getattr(member, "__doc__", "") or "")
    ]
    assert "allreduce" in names and "reduce_scatter_tensor_coalesced" in names, names
    return sorted(names)


# torch 2.14's reconfigure returns a Work but moves the group rather than data: the
# groups take it by handles (test_reconfigure_handles.py), not as a collective.
GROUP_MANAGEMENT = {"reconfigure"}


def _x(rank: int) -> torch.Tensor:
    return torch.full((2,), float(rank + 1))  # rank 0: [1, 1], rank 1: [2, 2]


def _equal(actual: Any, expected: list[Any]) -> Check:
    def check() -> None:
        got = [t.tolist() for t in actual] if isinstance(actual, list) else actual.tolist()
        assert got == expected, (got, expected)

    return check


def _options(kind: Any, root: int | None = None) -> Any:
    options = kind()
    if root is not None:
        options.rootRank = root
    return options


# Each recipe runs one collective on 2 ranks: (pg, rank) -> (work or None, check). A
# second stage, run only once both ranks got past the first, does the sending half of
# point-to-point recipes (so that a refused receive leaves no send hanging).
def _recipes(rank: int) -> dict[str, Callable[[Any], tuple[Any, Check]]]:
    x, ten = _x(rank), _x(rank) * 10
    pair = torch.cat([_x(rank), _x(rank) * 10])
    sums = [[3.0, 3.0], [30.0, 30.0]][rank]
    both = [1.0, 1.0, 2.0, 2.0]

    def allreduce_coalesced(pg: Any) -> tuple[Any, Check]:
        a, b = _x(rank), _x(rank) * 10
        work = pg.allreduce_coalesced([a, b], AllreduceCoalescedOptions())
        return work, _equal([a, b], [[3.0, 3.0], [30.0, 30.0]])

    def allgather(pg: Any) -> tuple[Any, Check]:
        out = [[torch.zeros(2), torch.zeros(2)]]
        work = pg.allgather(out, [_x(rank)], AllgatherOptions())
        return work, _equal(out[0], [[1.0, 1.0], [2.0, 2.0]])

    def into_tensor(name: str) -> Callable[[Any], tuple[Any, Check]]:
        def run(pg: Any) -> tuple[Any, Check]:
            out = torch.zeros(4)
            work = getattr(pg, name)(out, _x(rank), AllgatherOptions())
            return work, _equal(out, both)

        return run

    def into_tensor_coalesced(name: str) -> Callable[[Any], tuple[Any, Check]]:
        def run(pg: Any) -> tuple[Any, Check]:
            out = torch.zeros(4)
            work = getattr(pg, name)([out], [_x(rank)], AllgatherOptions())
            return work, _equal(out, both)

        return run

    def allgather_coalesced(pg: Any) -> tuple[Any, Check]:
        out = [[torch.zeros(2)], [torch.zeros(2)]]
        work = pg.allgather_coalesced(out, [_x(rank)], AllgatherOptions())
        return work, _equal([out[0][0], out[1][0]], [[1.0, 1.0], [2.0, 2.0]])

    def reduce_scatter_single(name: str, coalesced: bool) -> Callable[[Any], tuple[Any, Check]]:
        def run(pg: Any) -> tuple[Any, Check]:
            out = torch.zeros(2)
            args = ([out], [pair.clone()]) if coalesced else (out, pair.clone())
            work = getattr(pg, name)(*args, ReduceScatterOptions())
            return work, _equal(out, sums)

        return run

    def all_to_all_single(name: str) -> Callable[[Any], tuple[Any, Check]]:
        def run(pg: Any) -> tuple[Any, Check]:
            out = torch.zeros(2)
            source = torch.tensor([10.0 * rank, 10.0 * rank + 1])
            work = getattr(pg, name)(out, source, [], [], AllToAllOptions())
            return work, _equal(out, [float(rank), 10.0 + rank])

        return run

    def simple(
        call: Callable[[Any, list[torch.Tensor]], Any],
        inputs: list[torch.Tensor],
        expected: list[Any] | None,
    ) -> Callable[[Any], tuple[Any, Check]]:
        def run(pg: Any) -> tuple[Any, Check]:
            tensors = [t.clone() for t in inputs]
            work = call(pg, tensors)
            return work, (_equal(tensors, expected) if expected is not None else lambda: None)

        return run

    gather_out: list[list[torch.Tensor]] = [[torch.zeros(2), torch.zeros(2)]] if rank == 0 else []
    scatter_in = [[torch.full((2,), 5.0), torch.full((2,), 6.0)]] if rank == 0 else []
    scatter_out = [torch.zeros(2)]

    def gather(pg: Any) -> tuple[Any, Check]:
        work = pg.gather(gather_out, [_x(rank)], _options(GatherOptions, 0))
        expected = [[1.0, 1.0], [2.0, 2.0]]
        return work, (_equal(gather_out[0], expected) if rank == 0 else lambda: None)

    def scatter(pg: Any) -> tuple[Any, Check]:
        work = pg.scatter(scatter_out, scatter_in, _options(ScatterOptions, 0))
        return work, _equal(scatter_out, [[5.0, 5.0], [6.0, 6.0]][rank : rank + 1])

    def reduce_scatter(pg: Any) -> tuple[Any, Check]:
        out = [torch.zeros(2)]
        work = pg.reduce_scatter(out, [[_x(rank), _x(rank) * 10]], ReduceScatterOptions())
        return work, _equal(out, [sums])

    def alltoall(pg: Any) -> tuple[Any, Check]:
        out = [torch.zeros(1), torch.zeros(1)]
        inputs = [torch.tensor([10.0 * rank + j]) for j in range(2)]
        work = pg.alltoall(out, inputs, AllToAllOptions())
        return work, _equal(out, [[float(rank)], [10.0 + rank]])

    received = torch.zeros(2)

    def receive(name: str, receiver: int) -> Callable[[Any], tuple[Any, Check]]:
        def run(pg: Any) -> tuple[Any, Check]:
            if rank != receiver:
                return None, lambda: None
            if name == "recv_anysource":
                work = pg.recv_anysource([received], 5)
            else:
                work = pg.recv([received], 1 - rank, 5)
            return work, _equal(received, [7.0, 7.0])

        return run

    def send_first(pg: Any) -> tuple[Any, Check]:
        if rank != 1:
            return None, lambda: None
        return pg.send([torch.full((2,), 7.0)], 0, 5), lambda: None

    del x, ten
    return {
        "allreduce": simple(
            lambda pg, t: pg.allreduce(t, dist.AllreduceOptions()), [_x(rank)], [[3.0, 3.0]]
        ),
        "allreduce_coalesced": allreduce_coalesced,
        "reduce": simple(
            lambda pg, t: pg.reduce(t, ReduceOptions()),
            [_x(rank)],
            [[3.0, 3.0]] if rank == 0 else None,
        ),
        "broadcast": simple(
            lambda pg, t: pg.broadcast(t, _options(dist.BroadcastOptions, 1)),
            [_x(rank)],
            [[2.0, 2.0]],
        ),
        "allgather": allgather,
        "all_gather_single": into_tensor("all_gather_single"),
        "_allgather_base": into_tensor("_allgather_base"),
        "allgather_coalesced": allgather_coalesced,
        "all_gather_single_coalesced": into_tensor_coalesced("all_gather_single_coalesced"),
        "allgather_into_tensor_coalesced": into_tensor_coalesced("allgather_into_tensor_coalesced"),
        "gather": gather,
        "scatter": scatter,
        "reduce_scatter": reduce_scatter,
        "reduce_scatter_single": reduce_scatter_single("reduce_scatter_single", False),
        "_reduce_scatter_base": reduce_scatter_single("_reduce_scatter_base", False),
        "reduce_scatter_single_coalesced": reduce_scatter_single(
            "reduce_scatter_single_coalesced", True
        ),
        "reduce_scatter_tensor_coalesced": reduce_scatter_single(
            "reduce_scatter_tensor_coalesced", True
        ),
        "all_to_all_single": all_to_all_single("all_to_all_single"),
        "alltoall_base": all_to_all_single("alltoall_base"),
        "alltoall": alltoall,
        "barrier": lambda pg: (pg.barrier(BarrierOptions()), lambda: None),
        "send": send_first,
        "recv": receive("recv", 0),
        "recv_anysource": receive("recv_anysource", 0),
    }


def _second_stage(name: str, pg: Any, rank: int) -> Any:
    """The sending half of the point-to-point recipes."""
    if name in ("recv", "recv_anysource") and rank == 1:
        return pg.send([torch.full((2,), 7.0)], 0, 5)
    if name == "send" and rank == 0:
        received = torch.zeros(2)
        work = pg.recv([received], 1, 5)
        work.wait()
        assert received.tolist() == [7.0, 7.0]
    return None


# Collectives whose support in torch's own gloo changes between torch versions, each
# called on a group of one: torch 2.11's gloo has no list-form alltoall (2.13's has),
# and torch 2.14 declares gather_into_tensor and gather_single, which its gloo refuses
# ("does not support gather_single").
_GLOO_SUPPORT_VARIES: dict[str, Callable[[Any], Any]] = {
    "alltoall": lambda b: b.alltoall([torch.zeros(1)], [torch.ones(1)], AllToAllOptions()),
    "gather_into_tensor": lambda b: b.gather_into_tensor(
        torch.zeros(1), torch.ones(1), _options(GatherOptions, 0)
    ),
    "gather_single": lambda b: b.gather_single(
        torch.zeros(1), torch.ones(1), _options(GatherOptions, 0)
    ),
}


def torch_gloo_lacks() -> set[str]:
    """The collectives of :data:`_GLOO_SUPPORT_VARIES` this torch's own gloo refuses.

    The wrappers forward them either way (torch's error names the operation), so where
    torch lacks one there is nothing of ours to check.
    """
    backend = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
    lacks = set()
    for name, call in _GLOO_SUPPORT_VARIES.items():
        if not hasattr(backend, name):
            continue  # not declared by this torch: the test does not ask for it
        try:
            call(backend).wait()
        except RuntimeError as error:
            if "does not support" not in str(error):
                raise
            lacks.add(name)
    return lacks


def _make_group(kind: str) -> Any:
    timeout = timedelta(seconds=30)
    return {
        "gloo": lambda: ProcessGroupGloo(timeout=timeout),
        "swallow": lambda: ErrorSwallowingProcessGroupWrapper(ProcessGroupGloo(timeout=timeout)),
        "baby": lambda: ProcessGroupBabyGloo(timeout=timeout),
    }[kind]()


def _collectives_worker(kind: str, torch_lacks: set[str]) -> dict[str, str]:
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = _make_group(kind)
    pg.configure(_store_addr(f"collectives-{kind}"), rank, world)
    group = type(pg).__name__
    recipes = _recipes(rank)
    outcome: dict[str, str] = {}
    for name in sorted(set(torch_collectives()) - GROUP_MANAGEMENT):
        recipe = recipes.get(name)
        if name in torch_lacks and kind != "baby":
            outcome[name] = "torch lacks it"
            continue
        try:
            if recipe is None:
                getattr(pg, name)()  # no recipe: must be refused, whatever the arguments
                raise AssertionError(
                    f"{group}.{name} is forwarded but this test has no recipe for it: add one"
                )
            work, check = recipe(pg)
            status = "ok" if work is not None else "idle"  # idle: the other rank acts
        except NotImplementedError as error:
            assert isinstance(error, FTError), error
            assert f"does not support {name}" in str(error) and group in str(error), error
            status = "refused"
        statuses: list[Any] = [None] * world
        dist.all_gather_object(statuses, status)
        assert len(set(statuses) - {"idle"}) == 1, f"{name}: {statuses}"  # all agree
        status = "refused" if "refused" in statuses else "ok"
        if status == "ok":
            sent = _second_stage(name, pg, rank)
            if work is not None:
                work.wait()
                work.get_future().wait()  # every Work has a future (gloo's reduce_scatter too)
            if sent is not None:
                sent.wait()
            check()
        outcome[name] = status
        dist.barrier()
    pg.shutdown()
    return outcome


@pytest.mark.processes
@pytest.mark.parametrize("kind", ["gloo", "swallow", "baby"])
def test_every_torch_collective_works_on_gloo_or_is_refused_by_name(kind: str) -> None:
    torch_lacks = torch_gloo_lacks()
    first, second = run_ranks(_collectives_worker, 2, kind, torch_lacks, timeout=240)
    assert first == second
    supported = {name for name, status in first.items() if status == "ok"}
    if kind == "baby":
        assert supported == {
            "allreduce",
            "allreduce_coalesced",
            "allgather",
            "allgather_into_tensor_coalesced",
            "broadcast",
            "barrier",
            "send",
            "recv",
        }
    else:
        # Everything torch declares reaches gloo, except coalescing, which gloo lacks,
        # and what this torch's gloo lacks.
        refused = {"_end_coalescing"} | torch_lacks
        assert set(first) - supported == refused, first


def test_the_dummy_group_completes_every_collective() -> None:
    pg = ProcessGroupDummy(0, 1)
    gathers = {"allgather", "_allgather_base", "all_gather_single", "all_gather_single_coalesced"}
    gathers.add("allgather_into_tensor_coalesced")
    for name in sorted(set(torch_collectives()) - gathers - GROUP_MANAGEMENT):
        work = getattr(pg, name)()
        assert work.is_completed(), name
    options = ft.ReconfigureOptions()
    options.handles = [pg.get_reconfigure_handle()]
    assert pg.supports_reconfigure and pg.reconfigure(options).is_completed()
    out, flat = [torch.zeros(2)], torch.zeros(2)
    pg.allgather([out], [torch.ones(2)], AllgatherOptions()).wait()
    pg.all_gather_single(flat, torch.full((2,), 2.0), AllgatherOptions()).wait()
    assert out[0].tolist() == [1.0, 1.0] and flat.tolist() == [2.0, 2.0]
    for name in (
        "all_gather_single_coalesced",
        "allgather_into_tensor_coalesced",
        "_allgather_base",
    ):
        target = torch.zeros(2)
        inputs: Any = [torch.full((2,), 3.0)]
        outputs: Any = [target]
        if name == "_allgather_base":
            outputs, inputs = target, inputs[0]
        getattr(pg, name)(outputs, inputs, AllgatherOptions()).wait()
        assert target.tolist() == [3.0, 3.0], name


def _torchft_api_worker() -> list[Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    # torchft 0.2.0's signature: the second argument is the replica id.
    pg.configure(
        _store_addr("torchft-api/0"),
        f"replica{rank}",
        rank,
        world,
        quorum_id=4,
        group_rank=0,
        group_world_size=1,
        global_ranks=[0, 1],
    )
    assert pg.configuration is not None
    assert (pg.configuration.replica_id, pg.configuration.quorum_id) == (f"replica{rank}", 4)
    t = _x(rank)
    pg.broadcast_one(t, 1).wait()
    assert pg.errored() is None
    pg.configure(
        store_addr=_store_addr("torchft-api/1"), replica_id="r", rank=rank, world_size=world
    )
    with pytest.raises(TypeError, match=r"takes \(store_addr, rank, world_size\)"):
        pg.configure(_store_addr("torchft-api/2"), 1.5, world)
    with pytest.raises(ValueError, match="global_ranks"):
        pg.configure(_store_addr("torchft-api/2"), "r", rank, world, global_ranks=[0])
    elapsed = None
    if rank == 0:
        # The constructor's 30 s no longer applies: the next configure waits 2 s.
        pg.set_timeout(timedelta(seconds=2))
        started = time.monotonic()
        with pytest.raises(RendezvousTimeoutError):
            pg.configure(_store_addr("torchft-api/lonely"), 0, world)
        elapsed = time.monotonic() - started
    dist.barrier()
    u = _x(rank)
    pg.allreduce([u], dist.AllreduceOptions()).wait()  # the old configuration still works
    pg.shutdown()
    return [t.tolist(), u.tolist(), elapsed]


@pytest.mark.processes
def test_torchft_configure_broadcast_one_errored_and_set_timeout() -> None:
    first, second = run_ranks(_torchft_api_worker, 2, timeout=120)
    assert first[:2] == second[:2] == [[2.0, 2.0], [3.0, 3.0]]
    assert first[2] is not None and first[2] < 3.5, first[2]


def test_error_swallowing_wrapper_answers_errored() -> None:
    pg = ErrorSwallowingProcessGroupWrapper(ProcessGroupDummy(0, 1))
    assert pg.errored() is None
    error = RuntimeError("boom")
    pg.report_error(error)
    assert pg.errored() is error and pg.error() is error


def _manager_work_worker() -> list[Any]:
    rank = dist.get_rank()
    manager = Manager(
        ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=lambda state: None,
        state_dict=lambda: {},
        min_replica_size=2,
        replica_id=f"compat{rank}",
        timeout=timedelta(seconds=30),
        namespace="test-torchft-compat",
    )
    results: list[Any] = []
    manager.start_quorum()
    averaged, summed = _x(rank), _x(rank)
    work = manager.allreduce(averaged)  # torchft code treats this as a Work
    work.wait()
    assert work.is_completed() and work.is_success()
    work.get_future().wait()
    summed_work = manager.allreduce(summed, reduce_op=dist.ReduceOp.SUM)
    assert isinstance(summed_work, Future)  # and ours as a future
    summed_work.then(lambda f: f.value()).wait()
    results += [averaged.tolist(), summed.tolist(), manager.should_commit()]

    manager.start_quorum()
    pending: Future[str] = Future()
    wrapped = manager.wrap_future(pending, "default")
    if rank == 0:
        pending.set_exception(RuntimeError("boom"))
    else:
        pending.set_result("value")
    results += [wrapped.wait(), manager.should_commit()]

    manager.start_quorum()
    started = time.monotonic()
    never: Future[int] = Future()
    late = manager.wrap_future(never, 5, timeout=timedelta(seconds=0.3))
    results += [late.wait(), time.monotonic() - started >= 0.3]
    results += [type(manager.errored()).__name__, manager.should_commit()]
    dist.barrier()
    manager.shutdown()
    return results


@pytest.mark.processes
def test_manager_allreduce_is_a_work_and_wrap_future_reports_errors() -> None:
    first, second = run_ranks(_manager_work_worker, 2, timeout=150)
    assert first[:3] == second[:3] == [[1.5, 1.5], [3.0, 3.0], True]
    # A failed wrapped future gives its default and fails the step on every replica.
    assert first[3:5] == ["default", False] and second[3:5] == ["value", False]
    # One that never completes gives its default at its timeout, as a TimeoutError.
    assert first[5:] == second[5:] == [5, True, "TimeoutError", False]


def test_every_ft_error_derives_from_fterror() -> None:
    errors = [
        getattr(ft, name)
        for name in ft.__all__
        if isinstance(getattr(ft, name), type) and issubclass(getattr(ft, name), Exception)
    ]
    assert len(errors) >= 10, errors
    assert all(issubclass(error, FTError) for error in errors), errors
    assert issubclass(ft.BabyTimeoutError, TimeoutError)
    assert issubclass(ft.UnsupportedOperationError, NotImplementedError)
    assert issubclass(ft.StoreTimeoutError, TimeoutError)
    assert issubclass(ft.QuorumWorkerTimeoutError, TimeoutError)


def test_torch_store_types_come_from_public_names() -> None:
    source = Path(ft.__file__).parent
    private = re.compile(r"from torch\._C\._distributed_c10d import\s*(\([^)]*\)|[^\n]*)")
    offenders = [
        f"{path.name}: {names}"
        for path in sorted(source.glob("*.py"))
        for names in private.findall(path.read_text())
        if re.search(r"\b(Store|PrefixStore|TCPStore|GradBucket)\b", names)
    ]
    assert offenders == []
