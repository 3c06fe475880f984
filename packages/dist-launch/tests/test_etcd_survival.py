"""A job on etcd outlives the node that hosts its round's worker store, and an etcd member.

Three launchers on this host (one rank each, ``--nnodes 2:3``) meet through a
three-member etcd cluster on loopback ports. Once a round of three runs, the launcher
whose node holds rank 0 (its worker serves the round's TCPStore, the workers'
``MASTER_ADDR:MASTER_PORT``) is killed with its workers (SIGKILL to its process
group, as a node dies), and so is etcd's leader; the two other launchers must re-form
a round of two and finish.

Each round is named by its ``MASTER_PORT`` (a fresh port per round). A worker writes
``<port>-<rank>`` (its node's tag, the world size, the wall time it started), then
all-reduces until its round breaks or, in a round of two, for a few steps and exits 0.
The test prints the time from the kill to the re-formed round's start, and the
timeouts that bound it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from etcd_cluster import etcd_cluster

LAUNCH = [sys.executable, "-m", "dist_launch"]
BOUND = 180.0  # seconds for the whole job, and for any one wait of this test
# The timeouts that bound the re-forming (seconds): a survivor whose ranks only lost
# their peers waits up to c10d.CAUSE_WAIT_SECONDS (5) for the dead node's record of the
# cause; torch drops the dead node after keep_alive_interval * keep_alive_max_attempt
# without a heartbeat (its lease ends as soon); then a round of MIN < MAX nodes waits
# last_call_timeout for more. DIST_LAUNCH_TEST_RDZV_CONF replaces them (to measure
# torch's defaults: DIST_LAUNCH_TEST_RDZV_CONF=join_timeout=120).
RDZV_CONF = os.environ.get(
    "DIST_LAUNCH_TEST_RDZV_CONF",
    "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2,join_timeout=120",
)

WORKER = """\
import os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist

out = Path(sys.argv[1])
started = time.time()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
name = f"{os.environ['MASTER_PORT']}-{rank}"
(out / (name + ".tmp")).write_text(f"{os.environ['NODE_TAG']} {world} {started}")
(out / (name + ".tmp")).rename(out / name)
deadline = time.monotonic() + 150
steps = 0
while time.monotonic() < deadline:
    dist.all_reduce(torch.ones(1))
    steps += 1
    if world == 2 and steps == 20:
        print("finished", rank, "of", world, flush=True)
        sys.exit(0)
    time.sleep(0.05)  # pacing: this host has two cores
sys.exit(3)
"""


def rounds(out: Path) -> dict[str, list[tuple[int, str, int, float]]]:
    """Each round's markers: ``(rank, node tag, world size, start time)``."""
    found: dict[str, list[tuple[int, str, int, float]]] = {}
    for path in out.iterdir():
        if path.suffix == ".tmp":
            continue
        port, _, rank = path.name.partition("-")
        tag, world, started = path.read_text().split()
        found.setdefault(port, []).append((int(rank), tag, int(world), float(started)))
    return found


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    """Polls ``predicate`` (markers written by other processes) for :data:`BOUND` s."""
    deadline = time.monotonic() + BOUND
    while not predicate():
        assert time.monotonic() < deadline, f"not within {BOUND} s: {what}"
        threading.Event().wait(0.1)


def full_round(out: Path, world: int) -> list[tuple[int, str, int, float]] | None:
    for markers in rounds(out).values():
        if len(markers) == world and all(m[2] == world for m in markers):
            return sorted(markers)
    return None


@pytest.mark.processes
def test_killing_the_store_hosts_node_and_an_etcd_member_leaves_two_that_finish(
    tmp_path: Path,
) -> None:
    out = tmp_path / "rounds"
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with etcd_cluster(tmp_path, size=3) as cluster:
        argv = [
            *LAUNCH,
            "--nnodes=2:3",
            "--nproc-per-node=1",
            "--rdzv-backend=etcd",
            f"--rdzv-endpoint={cluster.endpoints}",
            f"--rdzv-id={uuid.uuid4().hex}",
            f"--rdzv-conf={RDZV_CONF}",
            "--max-restarts=3",
            "--monitor-interval=0.1",
            str(script),
            str(out),
        ]
        launchers = [
            subprocess.Popen(
                argv,
                cwd=tmp_path,
                env={**os.environ, "NODE_TAG": str(tag)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,  # a node: the launcher and its workers
            )
            for tag in range(3)
        ]
        try:
            wait_for(lambda: full_round(out, 3) is not None, "a round of three")
            first = full_round(out, 3)
            assert first is not None
            store_host = int(first[0][1])  # rank 0's node serves the workers' store
            killed_at = time.time()
            os.killpg(launchers[store_host].pid, signal.SIGKILL)
            leader = cluster.leader()
            leader.kill()  # the others elect a new one; meanwhile every member refuses
            survivors = [p for tag, p in enumerate(launchers) if tag != store_host]
            outputs = [p.communicate(timeout=BOUND)[0] for p in survivors]
        finally:
            for launcher in launchers:
                if launcher.poll() is None:
                    os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait(30)
    logs = "\n\n".join(outputs)
    assert [p.returncode for p in survivors] == [0, 0], logs
    second = full_round(out, 2)
    assert second is not None, logs
    assert {m[1] for m in second} == {str(t) for t in range(3)} - {str(store_host)}
    re_formed = max(m[3] for m in second) - killed_at
    print(
        f"\nkilled node {store_host} (rank 0, the workers' store) and etcd's leader {leader.name}; "
        f"the other two re-formed a round of 2 in {re_formed:.1f} s "
        f"with --rdzv-conf {RDZV_CONF}: bounded by max(the wait for the cause, 5 s; "
        "keep_alive_interval x keep_alive_max_attempt) + last_call_timeout + the "
        "start of the new round's workers"
    )
