"""The link between the ranks of a call: no store once open, peers that die, late senders."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_core.testing import RankFailedError, run_ranks
from dist_workspace import WorkspaceError, get_configs_parallel, get_tensors_parallel

pytestmark = pytest.mark.usefixtures("private_shm_dir")


class _WatchedStore:
    """The process group's store, noting every call made through it (and a set's key)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.keys: list[str] = []
        self.calls = 0

    def set(self, key: str, value: Any) -> None:
        self.keys.append(key)
        self.calls += 1
        self._store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name)
        if not callable(attribute):
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return attribute(*args, **kwargs)

        return counted


def _watch_store() -> _WatchedStore:
    import torch.distributed.distributed_c10d as c10d

    watched = _WatchedStore(c10d._get_default_store())
    c10d._get_default_store = lambda: watched  # type: ignore[assignment]
    return watched


def _tensor_call(rank: int, call: int, right: list[bool]) -> None:
    """One call on ranks 0-2; the receiver notes whether every value came right."""
    tensor = torch.full((1024,), float(10 * rank + call))
    with get_tensors_parallel(tensor, [0, 1, 2]) as tensors:
        if tensors:
            right.append([float(t[0]) for t in tensors] == [call, 10 + call, 20 + call])


def _store_calls_per_call(count: int) -> dict[str, Any]:
    """``count`` calls on ranks 0-2, tensors and configs; the store calls of each."""
    import torch.distributed as dist

    rank = dist.get_rank()
    watched = _watch_store()
    right: list[bool] = []
    per_call = []
    for call in range(count):
        before = watched.calls
        _tensor_call(rank, call, right)
        config = {"rank": rank, "call": call}
        with get_configs_parallel(config, [2, 0, 1], None) as configs:
            if configs:
                right.append(configs == [{"rank": r, "call": call} for r in (2, 0, 1)])
        per_call.append(watched.calls - before)
    return {"right": right, "store_calls": per_call}


@pytest.mark.processes
def test_no_call_uses_the_store_once_the_link_is_open() -> None:
    ranks = run_ranks(_store_calls_per_call, 3, 6, timeout=120)
    right = ranks[0]["right"] + ranks[2]["right"]
    assert all(right) and len(right) == 12, ranks
    # The first call opens the link through the store (one list of ranks, in any
    # order, shares one link); no later call touches the store.
    for result in ranks:
        assert result["store_calls"][0] > 0, ranks
        assert result["store_calls"][1:] == [0] * 5, ranks


def _one_rank_killed(victim: int) -> None:
    """Two calls, then ``victim`` kills itself (SIGKILL) before the third."""
    import torch.distributed as dist

    rank = dist.get_rank()
    for call in range(3):
        if rank == victim and call == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        # A timeout far beyond run_ranks': only a closed connection ends this in time.
        with get_tensors_parallel(torch.ones(8), [0, 1, 2], timeout=3600):
            pass


@pytest.mark.processes
def test_the_receiver_names_a_sender_that_died_at_once() -> None:
    with pytest.raises(RankFailedError) as failed:
        run_ranks(_one_rank_killed, 3, 2, timeout=60)
    # The receiver raised at once, maybe before rank 2's death was seen: its error
    # reads as a peer's failure, so rank 2 is still the root cause.
    assert failed.value.rank == 2, failed.value
    assert "SIGKILL" in str(failed.value)
    assert "rank(s) [2] never wrote their value: its connection to this receiver was lost" in (
        str(failed.value)
    )


@pytest.mark.processes
def test_a_sender_names_a_receiver_that_died_at_once() -> None:
    with pytest.raises(RankFailedError) as failed:
        run_ranks(_one_rank_killed, 3, 0, timeout=60)
    assert failed.value.rank == 0, failed.value
    assert "SIGKILL" in str(failed.value)
    assert "receiver rank 0 closed its connection" in str(failed.value)


def _late_sender() -> list[str]:
    """Rank 2 comes to call 1 only after the receiver gave up on it; call 2 works."""
    import torch.distributed as dist

    rank = dist.get_rank()
    store = _watch_store()
    outcomes = []
    for call in range(3):
        if rank == 2 and call == 1:
            store.wait(["test/receiver-gave-up"])  # bounded by the store's timeout
        try:
            with get_tensors_parallel(
                torch.full((4,), float(rank + call)), [0, 1, 2], timeout=2 if call == 1 else 60
            ) as tensors:
                ok = not tensors or [float(t[0]) for t in tensors] == [call, 1 + call, 2 + call]
                outcomes.append("ok" if ok else "wrong values")
        except WorkspaceError as error:
            outcomes.append(str(error))
            if rank == 0:
                store.set("test/receiver-gave-up", "1")
    return outcomes


@pytest.mark.processes
def test_a_late_sender_gets_the_failed_verdict_and_the_next_call_works() -> None:
    ranks = run_ranks(_late_sender, 3, timeout=90)
    receiver, early, late = ranks
    assert receiver[0] == "ok" and receiver[2] == "ok", receiver
    assert "rank(s) [2] never wrote their value" in receiver[1], receiver
    assert early[1] != "ok" and late[1] != "ok", ranks  # every rank raises in call 1
    # The verdict it reads is the one the receiver sent when it gave up, naming it.
    assert "rank(s) [2] never wrote their value" in late[1], late
    assert early[2] == late[2] == "ok", ranks


def _sender_in_another_network_namespace(timeout: float) -> dict[str, Any]:
    """Rank 2 moves to a network namespace of its own (with a loopback of its own) after
    its store connection is open: its link address is not the others' to reach."""
    import ctypes
    import fcntl
    import socket
    import struct

    rank = torch.distributed.get_rank()
    if rank == 2:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
            return {"skip": os.strerror(ctypes.get_errno())}
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as handle:
            up = 0x1 | 0x8 | 0x40  # IFF_UP | IFF_LOOPBACK | IFF_RUNNING
            fcntl.ioctl(handle, 0x8914, struct.pack("16sH14x", b"lo", up))  # SIOCSIFFLAGS
    try:
        with get_tensors_parallel(torch.ones(4), [0, 1, 2], timeout=timeout):
            pass
    except WorkspaceError as error:
        return {"error": str(error)}
    return {"error": "no error"}


@pytest.mark.processes
def test_a_link_that_cannot_connect_names_the_ranks() -> None:
    ranks = run_ranks(_sender_in_another_network_namespace, 3, 3.0, timeout=120)
    if "skip" in ranks[2]:
        pytest.skip(f"cannot make a network namespace here: {ranks[2]['skip']}")
    for rank, result in enumerate(ranks):
        assert "could not connect the link between ranks [0, 1, 2]" in result["error"], ranks
        assert f"rank {rank}: get_tensors_parallel" in result["error"], ranks
    # Ranks 0 and 1 waited for rank 2 to connect to them; rank 2 could not reach them.
    assert "no connection with rank(s) [2]" in ranks[0]["error"], ranks
    assert "no connection with rank(s) [2]" in ranks[1]["error"], ranks
    assert (
        "no connection with rank(s) [0, 1] ([Errno 111] Connection refused)" in (ranks[2]["error"])
    ), ranks


def _shared_memory_and_directory_calls(count: int, directory: str) -> list[bool]:
    """Calls on one list of ranks alternate: shared memory, then through ``directory``."""
    import torch.distributed as dist

    rank = dist.get_rank()
    right: list[bool] = []
    for call in range(count):
        _tensor_call(rank, call, right)
        config = {"rank": rank, "call": call}
        with get_configs_parallel(config, [0, 1, 2], None, directory) as configs:
            if configs:
                right.append(configs == [{"rank": r, "call": call} for r in range(3)])
    return right


@pytest.mark.processes
def test_calls_through_a_directory_and_through_shared_memory_share_the_link(
    tmp_path: Path,
) -> None:
    right = run_ranks(_shared_memory_and_directory_calls, 3, 4, str(tmp_path), timeout=120)[0]
    assert right == [True] * 8, right
