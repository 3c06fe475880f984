"""torchft 0.3's reconfiguration by handles, in one process (threads as members)."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_collectives.ft as ft
from dist_collectives.ft import (
    ErrorSwallowingProcessGroupWrapper,
    FTError,
    HandleExchangeTimeoutError,
    ManagerConfigError,
    ProcessGroupBabyGloo,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupWrapper,
    ReconfigureOptions,
    reconfigure_with_store,
)
from dist_collectives.ft.reconfigure import configuration_uuid, rendezvous_of

TIMEOUT = timedelta(seconds=20)


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)


def _options(uuid: int, handles: list[str]) -> Any:
    options = ReconfigureOptions()
    options.uuid = uuid
    options.handles = handles
    return options


def _in_threads(members: int, fn: Callable[[int], Any]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=members) as pool:
        futures = [pool.submit(fn, rank) for rank in range(members)]
        return [future.result(timeout=TIMEOUT.total_seconds() * 2) for future in futures]


def _handle(handle_id: str, store: str = "host:1", global_rank: int | None = None) -> str:
    return json.dumps({"id": handle_id, "store": store, "global_rank": global_rank})


def test_a_members_rank_is_the_index_of_its_handle_and_all_meet_on_the_first_ones_store() -> None:
    handles = [_handle("a", "first:11", 4), _handle("b", "second:22", 9)]
    plan = rendezvous_of(_options(7, handles), "b")
    assert (plan.store_addr, plan.rank, plan.world_size) == ("first:11/torchft/7", 1, 2)
    assert plan.global_ranks == [4, 9]
    assert rendezvous_of(_options(7, handles), "a").rank == 0
    one_unknown = [_handle("a", global_rank=4), _handle("b")]
    assert rendezvous_of(_options(7, one_unknown), "a").global_ranks is None


def test_handles_must_be_an_ordered_list_holding_this_members_own() -> None:
    with pytest.raises(ValueError, match="list in rank order"):
        rendezvous_of(_options(1, {_handle("a")}), "a")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\(id 'c'\) is not among the 2 handles"):
        rendezvous_of(_options(1, [_handle("a"), _handle("b")]), "c")
    with pytest.raises(ValueError, match="not a reconfigure handle"):
        rendezvous_of(_options(1, ["not json"]), "a")


def test_a_handle_names_the_group_for_its_lifetime_and_carries_its_global_rank() -> None:
    first, second = ProcessGroupGloo(), ProcessGroupGloo()
    first.set_rank_info("replica0", 1, 2, 3)
    handle = json.loads(first.get_reconfigure_handle())
    assert handle["global_rank"] == 3
    host, _, port = handle["store"].rpartition(":")
    assert host and int(port) > 0
    first.set_rank_info("replica0", 1, 2, None)
    again = json.loads(first.get_reconfigure_handle())
    assert again["id"] == handle["id"] and again["store"] == handle["store"]
    assert again["global_rank"] is None
    assert json.loads(second.get_reconfigure_handle())["id"] != handle["id"]


def test_set_rank_info_refuses_a_group_rank_outside_the_group() -> None:
    with pytest.raises(ValueError, match=r"group_rank=2 is not in 0\.\.1"):
        ProcessGroupGloo().set_rank_info("replica0", 2, 2)


def test_every_group_supports_reconfigure() -> None:
    groups = [
        ProcessGroupGloo(),
        ProcessGroupDummy(0, 1),
        ProcessGroupWrapper(pg=ProcessGroupDummy(0, 1)),
        ErrorSwallowingProcessGroupWrapper(ProcessGroupDummy(0, 1)),
        ProcessGroupBabyGloo(),  # no child until it is configured
    ]
    assert all(group.supports_reconfigure for group in groups)


def test_a_wrapper_is_one_member_with_the_group_it_wraps() -> None:
    dummy = ProcessGroupDummy(0, 1)
    wrapper = ProcessGroupWrapper(pg=dummy)
    wrapper.set_rank_info("replica0", 0, 1, 5)
    assert wrapper.get_reconfigure_handle() == dummy.get_reconfigure_handle()
    assert json.loads(dummy.get_reconfigure_handle())["global_rank"] == 5
    wrapper.reconfigure(_options(3, [wrapper.get_reconfigure_handle()])).wait()
    assert dummy.reconfigure_count == 1
    assert wrapper.size() == 1 and wrapper.configuration is not None
    assert wrapper.configuration.quorum_id == 3


def test_reconfiguring_forgets_the_error_swallowed_before() -> None:
    wrapper = ErrorSwallowingProcessGroupWrapper(ProcessGroupDummy(0, 1))
    wrapper.report_error(RuntimeError("peer died"))
    wrapper.reconfigure(_options(1, [wrapper.get_reconfigure_handle()])).wait()
    assert wrapper.error() is None


def test_groups_exchange_handles_on_a_store_and_reduce_twice(store: dist.TCPStore) -> None:
    groups = [ProcessGroupGloo(timeout=TIMEOUT) for _ in range(2)]
    for rank, group in enumerate(groups):
        group.set_rank_info(f"replica{rank}", 0, 1, 10 + rank)

    def member(rank: int) -> list[Any]:
        seen = []
        for generation in range(2):
            address = f"localhost:{store.port}/exchange/{generation}"
            reconfigure_with_store(groups[rank], address, rank, 2, TIMEOUT)
            tensor = torch.tensor([float(rank + 1)])
            groups[rank].allreduce([tensor], dist.ReduceOp.SUM).wait()
            configuration = groups[rank].configuration
            assert configuration is not None
            backend_name = groups[rank].parent.options.group_name
            seen.append((tensor.item(), configuration.quorum_id, backend_name))
        return seen

    try:
        first, second = _in_threads(2, member)
    finally:
        for group in groups:
            group.shutdown()
    assert [total for total, _, _ in first] == [3.0, 3.0]
    assert [uuid for _, uuid, _ in first] == [uuid for _, uuid, _ in second]
    assert first[0][1] != first[1][1], "each reconfiguration has a uuid of its own"
    assert [name for _, _, name in first] == [f"torchft_{uuid}_rank_0" for _, uuid, _ in first]
    assert groups[0].configuration is not None
    assert groups[0].configuration.global_ranks == (10, 11)


def test_a_missing_member_fails_the_exchange_by_rank_and_leaves_the_group_alone(
    store: dist.TCPStore,
) -> None:
    group = ProcessGroupGloo(timeout=TIMEOUT)
    address = f"localhost:{store.port}/missing"
    with pytest.raises(HandleExchangeTimeoutError, match=r"rank\(s\) \[1\]'s handles") as caught:
        reconfigure_with_store(group, address, 0, 2, timedelta(milliseconds=200))
    assert isinstance(caught.value, dist.DistStoreError) and isinstance(caught.value, FTError)
    assert caught.value.missing == [1]
    assert group.configuration is None


def test_configure_keeps_working_and_names_its_backend_after_the_address() -> None:
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    group = ProcessGroupGloo(timeout=TIMEOUT)
    group.set_rank_info("replica0", 0, 1)
    address = f"localhost:{store.port}/configured"
    group.configure(address, 0, 1)
    try:
        assert group.size() == 1
        name = group.parent.options.group_name
        assert name == f"torchft_{configuration_uuid(address)}_rank_0"
    finally:
        group.shutdown()


def test_the_manager_refuses_a_group_it_cannot_reconfigure_and_names_it() -> None:
    plain = dist.ProcessGroup(dist.HashStore(), 0, 1)  # torch's, with no backend
    with pytest.raises(ManagerConfigError, match=r"ProcessGroup .* cannot be reconfigured"):
        ft.Manager(
            plain,
            load_state_dict=lambda state: None,
            state_dict=dict,
            store_addr="localhost",
            store_port=1,
        )
    assert issubclass(ManagerConfigError, ValueError)
