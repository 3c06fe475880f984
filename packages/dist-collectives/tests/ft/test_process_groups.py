"""Reconfigurable groups on real processes: gloo, wrappers, the dummy group, the store."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dist_collectives.ft import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupNCCL,
    ProcessGroupWrapper,
    StoreAddressError,
    StoreAddressReusedError,
    create_store_client,
)
from dist_collectives.ft.store import parse_store_addr
from dist_core.ports import get_unused_port
from dist_core.testing import run_ranks


def _store_addr(prefix: str) -> str:
    return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/{prefix}"


def _gloo_reconfigure_worker() -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    results = []
    pg.configure(_store_addr("gloo/0"), rank, world)
    assert pg.size() == world and pg.rank() == rank
    t = torch.tensor([float(rank + 1)])
    pg.allreduce([t], dist.AllreduceOptions()).wait()
    results.append(float(t))
    # A smaller group on a new prefix: the last rank leaves.
    if rank < world - 1:
        pg.configure(_store_addr("gloo/1"), rank, world - 1)
        t = torch.tensor([float(rank + 1)])
        pg.allreduce(t, dist.ReduceOp.SUM).wait()  # the tensor + ReduceOp overload
        results.append(float(t))
        with pytest.raises(StoreAddressReusedError, match="gloo/1"):
            pg.configure(_store_addr("gloo/1"), rank, world - 1)
        b = torch.tensor([float(rank)])
        opts = dist.BroadcastOptions()
        opts.rootRank = 1
        pg.broadcast([b], opts).wait()
        results.append(float(b))
    pg.shutdown()
    return results


@pytest.mark.processes
def test_gloo_reconfigures_to_fewer_members_on_a_new_prefix() -> None:
    results = run_ranks(_gloo_reconfigure_worker, 3, timeout=90)
    assert results[0] == results[1] == [6.0, 3.0, 1.0]
    assert results[2] == [6.0]


def _functional_worker() -> list[float]:
    import torch.distributed._functional_collectives as funcol

    rank, world = dist.get_rank(), dist.get_world_size()
    pg = ProcessGroupGloo()
    pg.configure(_store_addr("functional/0"), rank, world)
    pg.register("test-functional")
    try:
        out = funcol.all_reduce(torch.tensor([float(rank)]), "sum", pg)
        first = float(funcol.wait_tensor(out))
        pg.configure(_store_addr("functional/1"), rank, world)  # still registered
        assert pg.group_name == str(dist.get_pg_count() - 1), "torch's registry name"
        out = funcol.all_reduce(torch.tensor([1.0]), "sum", pg.group_name)
        second = float(funcol.wait_tensor(out))
    finally:
        pg.unregister()
        pg.shutdown()
    return [first, second]


@pytest.mark.processes
def test_register_makes_functional_collectives_use_the_group() -> None:
    assert run_ranks(_functional_worker, 2, timeout=90) == [[1.0, 2.0], [1.0, 2.0]]


def _swallow_worker() -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = ErrorSwallowingProcessGroupWrapper(ProcessGroupGloo(timeout=timedelta(seconds=30)))
    pg.configure(_store_addr("swallow/0"), rank, world)
    t = torch.ones(2)
    pg.allreduce([t], dist.AllreduceOptions()).wait()
    assert pg.error() is None
    # gloo refuses a root rank outside the group when the op is issued.
    bad_root = dist.BroadcastOptions()
    bad_root.rootRank = world + 3
    pg.broadcast([torch.ones(1)], bad_root).wait()
    assert pg.error() is not None, "a failing broadcast must be recorded"
    after = torch.full((2,), 7.0)
    dummy = pg.allreduce([after], dist.AllreduceOptions())
    assert dummy.is_completed()
    dummy.wait()
    assert after.tolist() == [7.0, 7.0], "tensors are left unchanged after an error"
    pg.configure(_store_addr("swallow/1"), rank, world)
    assert pg.error() is None
    t = torch.ones(1)
    pg.allreduce([t], dist.AllreduceOptions()).wait()
    pg.shutdown()
    return [float(t)]


@pytest.mark.processes
def test_error_swallowing_wrapper_skips_ops_until_reconfigured() -> None:
    assert run_ranks(_swallow_worker, 2, timeout=90) == [[2.0], [2.0]]


def _swallow_async_worker() -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = ErrorSwallowingProcessGroupWrapper(ProcessGroupGloo(timeout=timedelta(seconds=30)))
    pg.configure(_store_addr("swallow-async/0"), rank, world)
    if rank == 1:
        pg.shutdown()  # closes the connections rank 0 receives on
        dist.barrier()
        return True
    t = torch.full((4,), 3.0)
    work = pg.recv([t], 1, 0)
    work.wait()  # fails inside gloo when rank 1 goes away; must not raise here
    error = pg.error()
    dist.barrier()
    assert error is not None
    assert t.tolist() == [3.0] * 4
    return True


@pytest.mark.processes
def test_error_swallowing_wrapper_records_asynchronous_failures() -> None:
    assert run_ranks(_swallow_async_worker, 2, timeout=90) == [True, True]


def test_report_error_makes_every_op_a_completed_dummy() -> None:
    pg = ErrorSwallowingProcessGroupWrapper(ProcessGroupDummy(0, 1))
    pg.report_error(RuntimeError("boom"))
    t = torch.ones(3)
    work = pg.allreduce(t, dist.ReduceOp.SUM)
    assert work.is_completed()
    assert work.get_future().value() == [t]
    assert isinstance(pg.error(), RuntimeError)


def test_dummy_group_is_one_member_only() -> None:
    with pytest.raises(ValueError, match="world must be 1"):
        ProcessGroupDummy(0, 2)
    pg = ProcessGroupDummy(0, 1)
    assert pg.size() == 1 and pg.getBackendName() == "ft-dummy"
    t = torch.arange(3.0)
    work = pg.allreduce([t], dist.AllreduceOptions())
    assert work.wait() and work.is_completed()
    assert t.tolist() == [0.0, 1.0, 2.0]


def test_unconfigured_wrapper_says_configure_first() -> None:
    with pytest.raises(RuntimeError, match="not configured"):
        ProcessGroupGloo().allreduce([torch.ones(1)], dist.AllreduceOptions())
    with pytest.raises(NotImplementedError, match="_create_pg"):
        ProcessGroupWrapper().configure("127.0.0.1:1/x", 0, 1)


def test_configure_checks_rank_and_world_size() -> None:
    with pytest.raises(ValueError, match=r"rank=3 is not in 0\.\.1"):
        ProcessGroupGloo().configure("127.0.0.1:1/x", 3, 2)


def test_nccl_group_constructs_and_refuses_without_cuda() -> None:
    pg = ProcessGroupNCCL(timeout=timedelta(seconds=5))
    assert pg.getBackendName() == "ft-nccl"
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without a GPU")
    with pytest.raises(RuntimeError, match="needs CUDA"):
        pg.configure("127.0.0.1:1/x", 0, 1)


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("localhost:29500", "no prefix"),
        ("localhost/abc", "host:port"),
        ("localhost:port/abc", "not an integer"),
        ("localhost:70000/abc", "out of range"),
    ],
)
def test_malformed_store_address_is_named(address: str, message: str) -> None:
    with pytest.raises(StoreAddressError, match=message):
        parse_store_addr(address)


def test_store_client_shares_one_connection_per_host_port() -> None:
    port = get_unused_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    a = create_store_client(f"127.0.0.1:{port}/a")
    b = create_store_client(f"127.0.0.1:{port}/b")
    a.set("k", "from-a")
    b.set("k", "from-b")
    assert a.get("k") == b"from-a" and b.get("k") == b"from-b"
    assert server.get("a/k") == b"from-a"
    assert server.num_keys() >= 2
    assert parse_store_addr("[::1]:5/p").host == "::1"


def test_a_store_restarted_on_the_same_port_gets_a_fresh_shared_connection() -> None:
    # A job's store restarted on its port (a launcher's restart), or a test's store
    # closed and its port reused: the cached connection to the old server is dead.
    import gc

    port = get_unused_port()
    first = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    # A short timeout on the connection that gets cached: a call on it fails, not hangs.
    old = create_store_client(f"127.0.0.1:{port}/old", timeout=timedelta(seconds=5))
    old.set("k", "old")
    del first, old
    gc.collect()
    second = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    client = create_store_client(f"127.0.0.1:{port}/new", timeout=timedelta(seconds=5))
    client.set("k", "new")
    assert second.check(["new/k"]), "the write went to the old server's dead connection"


def test_a_rendezvous_blocked_on_the_shared_connection_does_not_block_the_next() -> None:
    import threading

    from dist_collectives.ft.store import rendezvous_store

    port = get_unused_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    outcome: list[str] = []
    entered = threading.Event()

    def stuck_rendezvous() -> None:
        with rendezvous_store(f"127.0.0.1:{port}/old", timedelta(seconds=20)) as store:
            entered.set()
            try:
                store.wait(["peer"], timedelta(seconds=20))  # a peer that never comes
                outcome.append("released")
            except Exception as error:
                outcome.append(f"timed out: {error}")

    thread = threading.Thread(target=stuck_rendezvous)
    thread.start()
    assert entered.wait(30)
    # Had this shared the blocked connection, the set would queue behind the wait and
    # the wait would time out instead of seeing the key.
    with rendezvous_store(f"127.0.0.1:{port}/old", timedelta(seconds=20)) as other:
        other.set("peer", "here")
    thread.join(60)
    assert outcome == ["released"]
    assert server.get("old/peer") == b"here"
