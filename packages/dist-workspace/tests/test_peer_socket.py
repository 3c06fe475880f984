"""Handshakes over direct connections between senders and receiver, on real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_core.testing import RankFailedError, run_ranks
from dist_workspace import WorkspaceError, get_configs_parallel, get_tensors_parallel, peer_socket

pytestmark = pytest.mark.usefixtures("private_shm_dir")


class _WatchedStore:
    """The process group's store, noting the key of every ``set`` made through it."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.keys: list[str] = []

    def set(self, key: str, value: Any) -> None:
        self.keys.append(key)
        self._store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


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


def _calls_and_keys(count: int, off_rank: int | None) -> dict[str, Any]:
    """``count`` calls on ranks 0-2 (``off_rank`` without connections); the keys set."""
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == off_rank:
        os.environ["DIST_WORKSPACE_PEER_SOCKETS"] = "0"
    watched = _watch_store()
    right: list[bool] = []
    for call in range(count):
        _tensor_call(rank, call, right)
        config = {"rank": rank, "call": call}
        with get_configs_parallel(config, [0, 1, 2], None) as configs:
            if configs:
                right.append(configs == [{"rank": r, "call": call} for r in range(3)])
    return {
        "right": right,
        "statuses": sum("/status/" in key for key in watched.keys),
        "verdicts": sum(key.endswith("/verdict") for key in watched.keys),
    }


@pytest.mark.processes
def test_after_the_first_call_the_handshake_leaves_the_store() -> None:
    ranks = run_ranks(_calls_and_keys, 3, 6, None, timeout=120)
    assert all(ranks[0]["right"]) and len(ranks[0]["right"]) == 12
    # Tensors and configs of one list of ranks are one sequence of calls: only its first
    # call's statuses and verdict go through the store, the others over connections.
    assert [r["statuses"] for r in ranks] == [0, 1, 1], ranks
    assert ranks[0]["verdicts"] == 1, ranks


@pytest.mark.processes
def test_a_sender_without_connections_keeps_the_store_beside_the_others() -> None:
    ranks = run_ranks(_calls_and_keys, 3, 6, 2, timeout=120)
    assert all(ranks[0]["right"]) and len(ranks[0]["right"]) == 12
    assert [r["statuses"] for r in ranks] == [0, 1, 12], ranks
    assert ranks[0]["verdicts"] == 12, ranks  # rank 2 reads every verdict there


@pytest.mark.processes
def test_turned_off_everywhere_every_handshake_goes_through_the_store() -> None:
    os.environ["DIST_WORKSPACE_PEER_SOCKETS"] = "0"  # the ranks inherit it
    ranks = run_ranks(_calls_and_keys, 3, 4, None, timeout=120)
    assert all(ranks[0]["right"])
    assert [r["statuses"] for r in ranks] == [0, 8, 8], ranks
    assert ranks[0]["verdicts"] == 8, ranks


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


def test_a_connection_without_the_token_is_dropped() -> None:
    listener = peer_socket.Listener("this host")
    address = b"\0" + listener.endpoint()["address"].encode()
    hellos = {
        "wrong": {"token": "nope", "prefix": "p", "rank": 1},
        "right": {"token": listener.endpoint()["token"], "prefix": "p", "rank": 2},
    }
    clients = []
    for hello in hellos.values():
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.settimeout(10)
        client.connect(address)
        data = json.dumps(hello).encode()
        client.sendall(len(data).to_bytes(4, "little") + data)
        clients.append(client)
    for client in clients:  # both hellos are in: sweep reads them without blocking
        client.shutdown(socket.SHUT_WR)
    listener.sweep()
    assert listener.linked("p") == {2}
    assert clients[0].recv(1) == b""  # the receiver closed the one with a wrong token


def test_a_sender_whose_endpoint_is_unreachable_stays_on_the_store() -> None:
    prefix = f"test/{os.getpid()}"
    endpoint = {"address": "dist_workspace/nobody/listens", "host": "h", "token": "t"}
    peer_socket.connect(prefix, 1, 0, endpoint, "h")
    assert peer_socket.link_for(prefix) is None
    peer_socket.connect(prefix, 1, 0, {**endpoint, "host": "elsewhere"}, "h")
    assert peer_socket.link_for(prefix) is None


def test_the_variable_turns_connections_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert peer_socket.enabled()
    monkeypatch.setenv("DIST_WORKSPACE_PEER_SOCKETS", "0")
    assert not peer_socket.enabled()


def _sender_in_another_network_namespace(count: int) -> dict[str, Any]:
    """Rank 2 moves to a network namespace of its own (abstract socket names are per
    namespace) after its store connections are open; then ``count`` calls."""
    import ctypes

    from dist_workspace.store_reader import reader_for

    rank = torch.distributed.get_rank()
    watched = _watch_store()
    if rank == 2:
        reader_for(watched)  # its verdict reads' connection, opened here before the move
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
            return {"skip": os.strerror(ctypes.get_errno())}
    right: list[bool] = []
    for call in range(count):
        _tensor_call(rank, call, right)
    return {"right": right, "statuses": sum("/status/" in key for key in watched.keys)}


@pytest.mark.processes
def test_a_sender_in_another_network_namespace_keeps_the_store() -> None:
    ranks = run_ranks(_sender_in_another_network_namespace, 3, 5, timeout=120)
    if "skip" in ranks[2]:
        pytest.skip(f"cannot make a network namespace here: {ranks[2]['skip']}")
    assert ranks[0]["right"] == [True] * 5, ranks
    assert [r["statuses"] for r in ranks] == [0, 1, 5], ranks


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
def test_calls_through_a_directory_between_connected_ones_keep_the_store(
    tmp_path: Path,
) -> None:
    right = run_ranks(_shared_memory_and_directory_calls, 3, 4, str(tmp_path), timeout=120)[0]
    assert right == [True] * 8, right


def _receiver_without_a_socket(count: int) -> dict[str, Any]:
    """Rank 0 cannot open its listener (as when out of file descriptors); then calls."""
    import errno
    import logging

    if torch.distributed.get_rank() == 0:

        def refuse(self: peer_socket.Listener, host: str) -> None:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

        peer_socket.Listener.__init__ = refuse  # type: ignore[method-assign]
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logging.getLogger(peer_socket.__name__).addHandler(handler)
        logging.getLogger(peer_socket.__name__).setLevel(logging.INFO)
        result = _calls_and_keys(count, None)
        result["logged"] = [record.getMessage() for record in records]
        return result
    return _calls_and_keys(count, None)


@pytest.mark.processes
def test_a_receiver_that_cannot_open_its_socket_keeps_the_store() -> None:
    ranks = run_ranks(_receiver_without_a_socket, 3, 3, timeout=120)
    assert all(ranks[0]["right"]) and len(ranks[0]["right"]) == 6
    assert [r["statuses"] for r in ranks] == [0, 6, 6], ranks
    assert ranks[0]["verdicts"] == 6, ranks
    # Logged once, at the first call, naming why; not once per call.
    assert len(ranks[0]["logged"]) == 1, ranks[0]["logged"]
    assert "Too many open files" in ranks[0]["logged"][0], ranks[0]["logged"]
