"""Every call to the rendezvous store ends within its deadline, also when the store is silent.

A silent store is a real ``TCPStore`` whose server process is stopped (SIGSTOP): its
connections stay open, so a call sees neither an answer nor an error, as after a cut
cable. torch's own client then blocks until TCP gives up (minutes).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from dist_launch.plan.build import build_plan
from dist_launch.rendezvous.c10d import C10dRendezvous
from dist_launch.rendezvous.protocol import FailureRecord
from dist_launch.rendezvous.store_deadline import BoundedStore, StoreDeadline, StoreDeadlineError

BOUND = 10.0  # seconds the test waits for anything beyond the deadline under test

SERVER = """\
import time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=30))
print(store.port, flush=True)
time.sleep(600)
"""


def _ends_within(call: Callable[[], object], seconds: float) -> tuple[float, BaseException | None]:
    """Runs ``call`` on a thread; fails the test unless it ends within ``seconds``."""
    ended = threading.Event()
    outcome: list[BaseException | None] = [None]

    def run() -> None:
        try:
            call()
        except BaseException as error:
            outcome[0] = error
        finally:
            ended.set()

    started = time.monotonic()
    threading.Thread(target=run, daemon=True).start()
    assert ended.wait(seconds), f"the call was still blocked after {seconds:g} s"
    return time.monotonic() - started, outcome[0]


# -- the deadline itself, on a call that blocks until released ---------------------------


def test_a_late_call_raises_naming_the_store_and_later_calls_fail_at_once() -> None:
    deadline = StoreDeadline("node0:29400", 0.2)
    release = threading.Event()
    try:
        _, error = _ends_within(lambda: deadline.run("add('x')", release.wait), BOUND)
        assert isinstance(error, StoreDeadlineError)
        assert "node0:29400 did not answer add('x') within 0.2 s (read_timeout)" in str(error)
        asked = threading.Event()
        _, error = _ends_within(lambda: deadline.run("check(['y'])", asked.set), BOUND)
        assert isinstance(error, StoreDeadlineError) and "is silent" in str(error)
        assert "check(['y']) not tried" in str(error) and not asked.is_set()
    finally:
        release.set()


def test_a_blocked_call_that_returns_clears_the_silence() -> None:
    deadline = StoreDeadline("h:1", 0.1)
    release = threading.Event()
    with pytest.raises(StoreDeadlineError):
        deadline.run("wait(['k'])", release.wait)
    release.set()
    end = time.monotonic() + BOUND
    while time.monotonic() < end:  # the blocked thread ends promptly once released
        try:
            assert deadline.run("check(['k'])", lambda: True) is True
            break
        except StoreDeadlineError:
            threading.Event().wait(0.01)
    else:
        pytest.fail("the store stayed silent after its blocked call returned")


def test_a_calls_own_error_reaches_the_caller() -> None:
    def refuse() -> None:
        raise ConnectionResetError("peer gone")

    with pytest.raises(ConnectionResetError, match="peer gone"):
        StoreDeadline("h:1", BOUND).run("set('k')", refuse)


# -- a real store whose server stops answering --------------------------------------------


class SilentServer:
    """A TCPStore server in a process of its own, stopped and resumed on demand."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdout is not None
        self.port = int(self.process.stdout.readline())
        self.address = f"127.0.0.1:{self.port}"

    def client(self) -> dist.TCPStore:
        """A connected client (made while the server answers)."""
        os.kill(self.process.pid, signal.SIGCONT)
        return dist.TCPStore("127.0.0.1", self.port, is_master=False, timeout=timedelta(seconds=30))

    def stop(self) -> None:
        """SIGSTOP; returns once the kernel shows the process stopped (bounded)."""
        os.kill(self.process.pid, signal.SIGSTOP)
        stat = Path(f"/proc/{self.process.pid}/stat")
        end = time.monotonic() + BOUND
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < end, "the server did not stop"
            threading.Event().wait(0.01)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(BOUND)


@pytest.fixture(scope="module")
def server() -> Iterator[SilentServer]:
    silent = SilentServer()
    try:
        yield silent
    finally:
        silent.kill()


CALLS: dict[str, Callable[[BoundedStore], object]] = {
    "add": lambda store: store.add("n", 1),
    "check": lambda store: store.check(["present"]),
    "get": lambda store: store.get("present"),
    "multi_get": lambda store: store.multi_get(["present"]),
    "wait": lambda store: store.wait(["absent"], timedelta(seconds=0.5)),
}


@pytest.mark.processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(CALLS))
def test_each_store_call_ends_within_its_deadline_when_the_server_is_silent(
    server: SilentServer, name: str
) -> None:
    client = server.client()
    client.set("present", "1")
    store = BoundedStore(client, StoreDeadline(server.address, 1.0))
    server.stop()
    _, error = _ends_within(lambda: CALLS[name](store), 1.0 + 0.5 + BOUND)
    assert isinstance(error, StoreDeadlineError), error
    assert server.address in str(error)
    if name == "wait":  # its own timeout first, then the store's deadline to say so
        assert "within 1.5 s (the wait's 0.5 s + read_timeout)" in str(error)


def _record() -> FailureRecord:
    return FailureRecord(node="host1", group_rank=1, rank=2, timestamp=1.0, summary="boom")


@pytest.mark.processes
@pytest.mark.timeout(120)
def test_the_failure_count_ends_within_read_timeout_when_the_store_is_silent(
    server: SilentServer, script: str
) -> None:
    # A cut-off node's launcher counts its failed round on a store that sends nothing.
    client = server.client()
    round_store = dist.PrefixStore("round0/", client)
    round_store.set("dist_launch/nproc/0", "2")  # node 0 joined this round too
    handler = SimpleNamespace(
        next_rendezvous=lambda: SimpleNamespace(
            store=round_store,
            rank=1,
            world_size=2,
            bootstrap_store_info=SimpleNamespace(master_addr="127.0.0.1", master_port=1),
        ),
        set_closed=lambda: None,
    )
    plan = build_plan(
        {
            "target": script,
            "rdzv_backend": "c10d",
            "rdzv_endpoint": server.address,
            "rdzv_conf": "read_timeout=2",
        },
        environ={},
    )
    rdzv = C10dRendezvous(plan, handler)
    rdzv.next_round()
    server.stop()
    _, error = _ends_within(lambda: rdzv.count_failure(_record()), 2.0 + BOUND)
    assert isinstance(error, StoreDeadlineError), error
    assert f"rendezvous store at {server.address}" in str(error)
    assert "within 2 s (read_timeout)" in str(error)
    # The node then ends: closing the job waits on the silent store no more.
    took, _ = _ends_within(lambda: rdzv.close_job("node 1 failed"), BOUND)
    assert took < 2.0  # less than one read_timeout
