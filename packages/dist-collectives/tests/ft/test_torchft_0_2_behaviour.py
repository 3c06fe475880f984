"""What torchft 0.2.0's own ``process_group_test.py`` expects, each checked here our way.

Real stores, real gloo, real child processes; the manager behind a managed group is a
small stand-in, since the behaviour under test is the group's wait, not the quorum.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist
from torch.distributed import TCPStore
from torch.futures import Future

from dist_collectives.ft import (
    BabyClosedError,
    BabyTimeoutError,
    FTError,
    FutureWork,
    ManagedProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupDummy,
    ProcessGroupGloo,
    ProcessGroupWrapper,
    RendezvousTimeoutError,
    WorkTimeoutError,
    create_store_client,
)
from dist_collectives.ft.store import parse_store_addr
from dist_core.testing import run_ranks


@pytest.fixture
def store() -> TCPStore:
    return TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)


def _on_threads(*calls: Callable[[], Any], timeout: float = 120) -> list[Any]:
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result(timeout=timeout) for future in futures]


# -- no wait blocks past the group's timeout ---------------------------------------------


class _StuckManager:
    """A manager whose allreduce result never comes (its quorum thread is stuck)."""

    def __init__(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.calls = 0

    def allreduce(self, tensor: torch.Tensor) -> Future[torch.Tensor]:
        self.calls += 1
        return Future()

    def num_participants(self) -> int:
        return 1


def test_a_managed_allreduce_whose_result_never_comes_raises_naming_the_operation() -> None:
    manager = _StuckManager(timedelta(seconds=0.2))
    group = ManagedProcessGroup(manager)  # type: ignore[arg-type]  # a stand-in
    work = group.allreduce([torch.ones(2), torch.ones(3)], dist.ReduceOp.SUM)
    with pytest.raises(WorkTimeoutError, match=r"ManagedProcessGroup\.allreduce timed out after"):
        work.wait()
    assert manager.calls == 2


def test_a_work_whose_future_nobody_completes_times_out_as_torch_and_torchft_word_it() -> None:
    work = FutureWork(Future(), "ProcessGroupX.barrier", timedelta(milliseconds=100))
    with pytest.raises(WorkTimeoutError) as caught:
        work.wait()
    assert str(caught.value).startswith("ProcessGroupX.barrier timed out after 100ms")
    for kind in (TimeoutError, RuntimeError, FTError):
        assert isinstance(caught.value, kind), kind
    with pytest.raises(WorkTimeoutError, match="timed out after 10ms"):
        work.wait(timedelta(milliseconds=10))


def test_a_managed_group_hands_back_a_managers_own_work() -> None:
    class _WorkManager(_StuckManager):
        def allreduce(self, tensor: torch.Tensor) -> Any:
            self.calls += 1
            return "a manager's own work"

    group = ManagedProcessGroup(_WorkManager(timedelta(seconds=1)))  # type: ignore[arg-type]
    assert group.allreduce([torch.ones(1)], dist.ReduceOp.SUM) == "a manager's own work"  # type: ignore[comparison-overlap]


# -- baby gloo: allgather_into_tensor_coalesced, num_active_work, a closed handle --------


@pytest.mark.processes
def test_baby_gloo_allgathers_into_tensors_coalesced_and_counts_active_work(
    store: TCPStore,
) -> None:
    address = f"localhost:{store.port}/baby-coalesced"
    groups = [ProcessGroupBabyGloo(timeout=timedelta(seconds=30)) for _ in range(2)]
    try:
        _on_threads(*(lambda r=r: groups[r].configure(address, r, 2) for r in range(2)))

        def gather(rank: int) -> list[list[float]]:
            first = torch.tensor([rank + 1.0])
            second = torch.tensor([[rank + 10.0, rank + 20.0]])
            outputs = [torch.zeros(2), torch.zeros(2, 2)]
            groups[rank].allgather_into_tensor_coalesced(outputs, [first, second]).wait()
            return [o.flatten().tolist() for o in outputs]

        gathered = _on_threads(lambda: gather(0), lambda: gather(1))
        assert gathered == [[[1.0, 2.0], [10.0, 20.0, 11.0, 21.0]]] * 2
        assert groups[0].num_active_work() == 0

        alone = groups[0].allreduce([torch.ones(1)], dist.ReduceOp.SUM)  # its peer never joins
        assert groups[0].num_active_work() == 1
        groups[0].shutdown()
        with pytest.raises(BabyClosedError):
            alone.wait()
        assert groups[0].num_active_work() == 0
        with pytest.raises(OSError, match="handle is closed"):
            groups[0].allreduce([torch.ones(1)], dist.AllreduceOptions()).wait()
    finally:
        for group in groups:
            group.shutdown()


@pytest.mark.processes
def test_baby_gloo_refuses_outputs_of_the_wrong_size_naming_the_shapes(store: TCPStore) -> None:
    group = ProcessGroupBabyGloo(timeout=timedelta(seconds=30))
    group.configure(f"localhost:{store.port}/baby-shapes", 0, 1)
    try:
        with pytest.raises(ValueError, match=r"output 0 of shape \(3,\).*input 0 of shape \(2,\)"):
            group.allgather_into_tensor_coalesced([torch.zeros(3)], [torch.zeros(2)])
    finally:
        group.shutdown()


# -- timeouts read like torchft's, with our detail after ----------------------------------


@pytest.mark.processes
@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (ProcessGroupGloo, "ProcessGroupGloo.configure timed out after 10ms"),
        (ProcessGroupBabyGloo, "ProcessGroupBabyGloo.configure timed out after 0.01 seconds"),
    ],
)
def test_a_configure_whose_peer_never_comes_times_out_like_torchft(
    store: TCPStore, kind: type[ProcessGroupGloo | ProcessGroupBabyGloo], expected: str
) -> None:
    address = f"localhost:{store.port}/{kind.__name__}-alone"
    create_store_client(address)  # connected: the 10 ms below are the wait for rank 1
    group = kind(timeout=timedelta(seconds=0.01))
    with pytest.raises((RendezvousTimeoutError, BabyTimeoutError)) as caught:
        group.configure(address, 0, 2)
    message = str(caught.value)
    assert isinstance(caught.value, RuntimeError), "torchft's tests catch a RuntimeError"
    assert isinstance(caught.value, TimeoutError)
    assert message.startswith(expected), message
    assert "timeout after 10ms" in message, "the store's own words follow"
    assert "rank(s) [1]" in message and address in message


@pytest.mark.processes
def test_a_baby_operation_that_times_out_names_it_like_torchft(store: TCPStore) -> None:
    address = f"localhost:{store.port}/baby-op"
    # Configured with room for the children's start (seconds on a loaded machine); the
    # operation's timeout is then set to the 1 s whose message is checked.
    groups = [ProcessGroupBabyGloo(timeout=timedelta(seconds=60)) for _ in range(2)]
    try:
        _on_threads(*(lambda r=r: groups[r].configure(address, r, 2) for r in range(2)))
        groups[0].set_timeout(timedelta(seconds=1))
        work = groups[0].allreduce([torch.ones(1)], dist.ReduceOp.SUM)  # rank 1 never joins
        with pytest.raises(BabyTimeoutError) as caught:
            work.wait()
        expected = "ProcessGroupBabyGloo.allreduce timed out after 1 seconds"
        assert str(caught.value).startswith(expected), caught.value
    finally:
        for group in groups:
            group.shutdown()


@pytest.mark.processes
def test_a_baby_set_timeout_bounds_the_running_childs_next_operation_and_aborts(
    store: TCPStore,
) -> None:
    # torchft's resiliency tests lower the timeout after configure and expect the next
    # operation to fail by it, then errored() to say the group was aborted.
    address = f"localhost:{store.port}/baby-set-timeout"
    groups = [ProcessGroupBabyGloo(timeout=timedelta(seconds=60)) for _ in range(2)]
    try:
        _on_threads(*(lambda r=r: groups[r].configure(address, r, 2) for r in range(2)))
        groups[0].set_timeout(timedelta(seconds=0.5))
        work = groups[0].allreduce([torch.ones(1)], dist.ReduceOp.SUM)  # rank 1 never joins
        with pytest.raises(BabyTimeoutError) as caught:
            work.wait(timedelta(seconds=30))  # a backstop: the 60 s must no longer apply
        expected = "ProcessGroupBabyGloo.allreduce timed out after 0.5 seconds"
        assert str(caught.value).startswith(expected), caught.value
        errored = groups[0].errored()
        assert isinstance(errored, RuntimeError) and "aborted" in str(errored), errored
    finally:
        for group in groups:
            group.shutdown()


# -- names, reprs, store addresses --------------------------------------------------------


def _registered_worker() -> list[object]:
    import torch.distributed._functional_collectives as funcol
    from torch._C._distributed_c10d import _resolve_process_group

    rank, world = dist.get_rank(), dist.get_world_size()
    address = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/registered"
    group = ProcessGroupGloo().register("replicas")
    group.configure(address, rank, world)
    try:
        named = group.group_name == str(dist.get_pg_count() - 1)
        found = _resolve_process_group(group.group_name) is group
        out = funcol.all_reduce(torch.tensor([float(rank + 1)]), "sum", group.group_name)
        total = float(funcol.wait_tensor(out))
    finally:
        group.unregister()
        group.shutdown()
    return [named, found, total]


@pytest.mark.processes
def test_register_gives_the_group_torchs_registry_name() -> None:
    assert run_ranks(_registered_worker, 2, timeout=90) == [[True, True, 3.0]] * 2


def test_a_wrapper_repr_shows_the_wrapped_group() -> None:
    wrapper = ProcessGroupWrapper(pg=ProcessGroupDummy(0, 1))
    assert repr(wrapper) == "ProcessGroupWrapper(pg=ProcessGroupDummy())"


@pytest.mark.parametrize(
    ("address", "host", "port", "prefix"),
    [
        ("localhost:1234/my/prefix", "localhost", 1234, "my/prefix"),
        ("fdaa:0:1:2:3:4:5:6:29521/ft/0/1", "fdaa:0:1:2:3:4:5:6", 29521, "ft/0/1"),
        ("::1:29521/ft/0/1", "::1", 29521, "ft/0/1"),
        ("[fdaa:0:1:2:3:4:5:6]:29521/ft/0/1", "fdaa:0:1:2:3:4:5:6", 29521, "ft/0/1"),
    ],
)
def test_store_addresses_take_bare_and_bracketed_ipv6(
    address: str, host: str, port: int, prefix: str
) -> None:
    parsed = parse_store_addr(address)
    assert (parsed.host, parsed.port, parsed.prefix) == (host, port, prefix)
    with (
        patch("dist_collectives.ft.store.TCPStore") as tcp_store,
        patch("dist_collectives.ft.store.PrefixStore") as prefix_store,
    ):
        create_store_client(address, timeout=timedelta(seconds=1))
    assert tcp_store.call_args.kwargs["host_name"] == host
    assert tcp_store.call_args.kwargs["port"] == port
    assert prefix_store.call_args.args[0] == prefix


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
@pytest.mark.parametrize("bracketed", [False, True])
def test_a_store_client_reaches_a_real_store_on_ipv6(bracketed: bool) -> None:
    server = TCPStore(host_name="::1", port=0, is_master=True, wait_for_workers=False)
    host = "[::1]" if bracketed else "::1"
    client = create_store_client(f"{host}:{server.port}/v6", timeout=timedelta(seconds=10))
    client.set("key", "value")
    assert server.get("v6/key") == b"value"
