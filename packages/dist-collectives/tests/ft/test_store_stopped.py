"""A store server that stops answering (SIGSTOP) fails the step with a timeout, not a hang.

The server is a real process (``python -m dist_collectives.ft.store_server``); the
Manager (one replica, a gloo group of one) runs in the test. torch's TCPStore client
would block for ever in most calls to a stopped server; every store call of the
Manager is bounded by its timeout and the step fails with a ``StoreTimeoutError``
naming the call and the store. Once the server goes on, so does training.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from dist_collectives.ft import Manager, ProcessGroupGloo, StoreTimeoutError
from dist_core.ports import get_unused_port

pytestmark = pytest.mark.processes

TIMEOUT = timedelta(seconds=2)


def _stop(pid: int) -> None:
    """SIGSTOPs ``pid`` and returns once every thread of it is stopped.

    The signal is delivered asynchronously: a server thread already running could
    otherwise still answer the next call.
    """
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    tasks = Path(f"/proc/{pid}/task")
    while not all(
        (task / "stat").read_text().rpartition(")")[2].split()[0] == "T" for task in tasks.iterdir()
    ):
        assert time.monotonic() < deadline, "the store server did not stop"
        time.sleep(0.01)  # polling the kernel's view of the process


@pytest.mark.parametrize("stopped_in", ["quorum", "vote"])
def test_a_stopped_store_server_fails_the_step_with_a_timeout_naming_the_call(
    stopped_in: str,
) -> None:
    port = get_unused_port()
    command = [sys.executable, "-m", "dist_collectives.ft.store_server", "--host", "127.0.0.1"]
    server = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.PIPE)
    manager = None
    try:
        assert server.stdout is not None
        assert b"listening" in server.stdout.readline()  # ready: it printed after binding
        manager = Manager(
            ProcessGroupGloo(timeout=timedelta(seconds=10)),
            load_state_dict=lambda state: None,
            state_dict=dict,
            replica_id=f"stopped-{stopped_in}",
            store_addr="127.0.0.1",
            store_port=port,
            timeout=TIMEOUT,
            first_quorum_window=timedelta(0),
            namespace=f"t31-stopped-{uuid.uuid4().hex}",
        )
        manager.start_quorum()
        manager.allreduce(torch.ones(2)).wait()
        assert manager.should_commit()
        manager.start_quorum()  # fails: the next step needs a round on the store
        manager.report_error(RuntimeError("forced"))
        assert not manager.should_commit()

        if stopped_in == "quorum":
            _stop(server.pid)
            started = time.monotonic()
            manager.start_quorum()
            manager.allreduce(torch.ones(2)).wait()
        else:
            manager.start_quorum()
            manager.allreduce(torch.ones(2)).wait()
            _stop(server.pid)
            started = time.monotonic()
        committed = manager.should_commit()
        waited = time.monotonic() - started
        error = manager.errored()
        os.kill(server.pid, signal.SIGCONT)

        assert not committed, f"committed with the store stopped ({waited:.1f} s, {error!r})"
        assert waited < 3 * TIMEOUT.total_seconds(), f"the step took {waited:.1f} s to fail"
        assert isinstance(error, StoreTimeoutError), repr(error)
        assert f"on 127.0.0.1:{port}/" in str(error) and "timed out after" in str(error)
        call = "add('round')" if stopped_in == "quorum" else "add('votes/"
        assert f"store {call}" in str(error), str(error)

        manager.start_quorum()  # the server answers again: so does the Manager
        manager.allreduce(torch.ones(2)).wait()
        assert manager.should_commit()
    finally:
        os.kill(server.pid, signal.SIGCONT)  # a stopped process does not act on SIGTERM
        if manager is not None:
            manager.shutdown()
        server.terminate()
        server.wait(timeout=30)
