"""Every store call returns within its bound, even when the server never answers.

The server here is a listening socket that never accepts: the kernel completes the
connection, and every call (and torch's own connect) then waits for an answer that
never comes, as with a stopped store server.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from dist_collectives.ft import FTError
from dist_collectives.ft.bounded_store import MAX_STUCK_LINKS, BoundedStore, StoreTimeoutError

BOUND = timedelta(seconds=0.3)


@pytest.fixture
def silent_port() -> Iterator[int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    yield listener.getsockname()[1]
    listener.close()  # the waiting connections are reset: the stuck link threads end


CALLS: dict[str, Callable[[BoundedStore], Any]] = {
    "set('k')": lambda store: store.set("k", "v"),
    "get('k')": lambda store: store.get("k"),
    "add('k')": lambda store: store.add("k", 1),
    "append('k')": lambda store: store.append("k", "v"),
    "check(['k'])": lambda store: store.check(["k"]),
    "compare_set('k')": lambda store: store.compare_set("k", "", "v"),
    "multi_get(2 keys)": lambda store: store.multi_get(["k", "j"]),
    "num_keys()": lambda store: store.num_keys(),
    "delete_key('k')": lambda store: store.delete_key("k"),
    "wait(['k'])": lambda store: store.wait(["k"], BOUND),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_every_call_to_a_server_that_never_answers_times_out_naming_the_call(
    silent_port: int, call: str
) -> None:
    store = BoundedStore("127.0.0.1", silent_port, prefix="ns", timeout=BOUND, label="test")
    started = time.monotonic()
    with pytest.raises(StoreTimeoutError) as raised:
        CALLS[call](store)
    assert time.monotonic() - started < 5
    assert f"store {call} on 127.0.0.1:{silent_port}/ns timed out after" in str(raised.value)
    assert isinstance(raised.value, FTError | TimeoutError | RuntimeError)
    store.close(timeout=0)


def test_stuck_calls_are_capped_and_then_fail_at_once() -> None:
    # Calls stuck for as long as the test runs: waits of a minute for a key nobody sets,
    # on a real server, each given up after BOUND. (On the silent port, torch's own
    # connect timeout, BOUND too, could end an abandoned link before the next call.)
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = BoundedStore("127.0.0.1", server.port, timeout=BOUND, label="test")

    def wait_for_ever(torch_store: dist.Store) -> None:
        torch_store.wait(["never"], timedelta(seconds=60))

    for _ in range(MAX_STUCK_LINKS):
        with pytest.raises(StoreTimeoutError, match="timed out"):
            store.call("wait(['never'])", wait_for_ever, BOUND)
    started = time.monotonic()
    with pytest.raises(StoreTimeoutError, match=f"{MAX_STUCK_LINKS} earlier calls are still"):
        store.add("k", 1)
    assert time.monotonic() - started < BOUND.total_seconds()
    store.close(timeout=0)
    server.set("never", "")  # the stuck waits return: their link threads end


def test_a_timed_out_link_is_replaced_and_the_next_call_succeeds() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    store = BoundedStore("127.0.0.1", port, prefix="ns", timeout=BOUND, label="test")
    with pytest.raises(StoreTimeoutError):
        store.set("k", "v")
    listener.close()  # the stuck call's connection is reset; a real server takes the port
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    try:
        store.timeout = timedelta(seconds=10)
        store.set("k", "v")
        assert store.get("k") == b"v" and store.add("n", 2) == 2
        assert dist.PrefixStore("ns", server).get("k") == b"v"
    finally:
        store.close()
        del server
