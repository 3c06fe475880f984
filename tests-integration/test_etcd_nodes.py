"""A job on etcd across three hosts (network namespaces) survives the loss of any one.

Three hosts on one switch (:mod:`netns`), each running one member of a three-member
etcd cluster and one launcher of one rank (``--nnodes 2:3``, ``--rdzv-backend etcd``
naming the three members). Once a round of three runs, the host whose launcher's
worker holds rank 0 (it serves the round's TCPStore, the workers'
``MASTER_ADDR:MASTER_PORT``) is made etcd's leader too, then lost:

- killed: every process of it (launcher, worker, etcd member) gets SIGKILL, as when a
  machine loses power; the other two re-form a round of two and finish;
- cut off: its switch port goes down; the two others (etcd's majority) re-form and
  finish, and the cut host, which reaches no etcd majority, stops its worker (fenced)
  and exits 137 (``INFRASTRUCTURE``), starting no other round.

The worker (scripts/etcd_rounds.py) marks each round it runs in; the tests print the
time from the loss to the re-formed round and the timeouts that bound it. Killing
etcd's leader is also the false-alarm guard of the fencing: during the election no
member answers, and the two healthy hosts must not take that for a cut.

Needs root (namespaces) and etcd (``apt-get install etcd-server``): skipped without
them, failed in CI (``CI``) or under ``DIST_LAUNCH_REQUIRE_ETCD``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from netns import Host, Network, network

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "packages/dist-launch/tests"))

from etcd_cluster import EtcdCluster, Place, etcd_cluster
from etcd_markers import (
    RDZV_CONF,
    STALL_SECONDS,
    TIMEOUTS,
    WORKER,
    Marker,
    full_round,
    rounds,
    running,
    wait_for,
)

pytestmark = pytest.mark.processes


@dataclass
class EtcdJob:
    """Three hosts, an etcd member and a launcher on each; the launchers' logs in files."""

    net: Network
    etcd: EtcdCluster
    out: Path
    logs: list[Path]
    launchers: list[subprocess.Popen[bytes]]

    def output(self, index: int) -> str:
        return self.logs[index].read_text(errors="replace")

    def outputs(self) -> str:
        return "\n".join(
            f"--- {host.name} (exit {launcher.poll()}) ---\n{self.output(i)}"
            for i, (host, launcher) in enumerate(zip(self.net.hosts, self.launchers, strict=True))
        )

    def wait_exits(self, indices: list[int]) -> list[float]:
        """Waits for these launchers to exit; the wall time at which each was seen to."""
        seen: dict[int, float] = {}

        def exited() -> bool:
            for index in indices:
                if index not in seen and self.launchers[index].poll() is not None:
                    seen[index] = time.time()
            return len(seen) == len(indices)

        wait_for(exited, f"the launchers of hosts {indices} exit", self.outputs)
        return [seen[index] for index in indices]

    def first_round(self) -> list[Marker]:
        """Once a round of three runs: its markers, by rank (rank 0 holds the store)."""
        wait_for(lambda: full_round(self.out, 3) is not None, "a round of three", self.outputs)
        first = full_round(self.out, 3)
        assert first is not None
        return first

    def host_of(self, marker: Marker) -> int:
        """The index of the host the marker's worker ran on."""
        return [host.name for host in self.net.hosts].index(marker.node)


def start_launcher(host: Host, argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as sink:
        return subprocess.Popen(
            host.command(argv),
            env={**os.environ, "NODE_TAG": host.name, "GLOO_SOCKET_IFNAME": host.interface},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@pytest.fixture
def etcd_job(tmp_path: Path) -> Iterator[EtcdJob]:
    """Three hosts, an etcd member and one launcher (one rank, ``--nnodes 2:3``) on each."""
    out = tmp_path / "rounds"
    out.mkdir()
    with network(3) as net:
        places = [Place(h.address, ("ip", "netns", "exec", h.namespace)) for h in net.hosts]
        with etcd_cluster(tmp_path, places=places) as etcd:
            argv = [
                sys.executable, "-m", "dist_launch", "--nnodes=2:3", "--nproc-per-node=1",
                "--rdzv-backend=etcd", f"--rdzv-endpoint={etcd.endpoints}",
                f"--rdzv-id={uuid.uuid4().hex}", f"--rdzv-conf={RDZV_CONF}",
                "--max-restarts=1", "--monitor-interval=0.1", str(WORKER), str(out),
            ]  # fmt: skip
            logs = [tmp_path / f"{host.name}.log" for host in net.hosts]
            launchers = [
                start_launcher(host, argv, log) for host, log in zip(net.hosts, logs, strict=True)
            ]
            try:
                yield EtcdJob(net, etcd, out, logs, launchers)
            finally:
                for host, launcher in zip(net.hosts, launchers, strict=True):
                    host.kill_everything()
                    if launcher.poll() is None:
                        launcher.kill()
                    launcher.wait(30)


def assert_the_others_re_formed_and_finished(job: EtcdJob, lost: int, lost_at: float) -> float:
    """The two other hosts exit 0 after a round of two of theirs; seconds to re-form."""
    others = [i for i in range(3) if i != lost]
    job.wait_exits(others)
    outputs = job.outputs()
    assert [job.launchers[i].returncode for i in others] == [0, 0], outputs
    second = full_round(job.out, 2, after=lost_at)
    assert second is not None, outputs
    assert {m.node for m in second} == {job.net.hosts[i].name for i in others}, outputs
    # The budget's rule: the lost node's round counts as at most one restart (when the
    # survivors' ranks failed before it was declared dead); here --max-restarts is 1.
    assert {m.restarts for m in second} <= {0, 1}, outputs
    # Neither healthy host took the lost node (or etcd's election) for a cut of its own.
    assert "fenced off" not in "".join(job.output(i) for i in others), outputs
    return max(m.started for m in second) - lost_at


def test_killing_the_store_hosts_node_with_etcds_leader_leaves_two_that_finish(
    etcd_job: EtcdJob,
) -> None:
    job = etcd_job
    lost = job.host_of(job.first_round()[0])
    job.etcd.make_leader(job.etcd.members[lost])  # the worst case: etcd must elect anew
    killed_at = time.time()
    job.net.hosts[lost].kill_everything()  # launcher, worker and etcd member, at once
    re_formed = assert_the_others_re_formed_and_finished(job, lost, killed_at)
    restarts = {m.restarts for m in full_round(job.out, 2, after=killed_at) or []}
    print(
        f"\nkilled {job.net.hosts[lost].name} (rank 0, the workers' store, etcd's leader):"
        f" the other two re-formed a round of 2 in {re_formed:.1f} s (restarts spent:"
        f" {max(restarts)}), finished {time.time() - killed_at:.1f} s after the kill; {TIMEOUTS}"
    )


def test_a_cut_off_node_is_fenced_and_the_majority_finishes(etcd_job: EtcdJob) -> None:
    job = etcd_job
    store_worker = job.first_round()[0]
    cut = job.host_of(store_worker)
    host = job.net.hosts[cut]
    member = job.etcd.members[cut]
    job.etcd.make_leader(member)  # cut off with the lead: the majority must elect anew
    cut_at = time.time()
    job.net.cut(host)
    wait_for(lambda: not running(store_worker.pid), "the cut host's worker stops", job.outputs)
    stopped_at = time.time()
    (exited_at,) = job.wait_exits([cut])
    outputs = job.outputs()
    # Its worker was stopped with it: only its etcd member is left on the host.
    assert set(host.processes()) == {member.process.pid}, (host.processes(), outputs)
    assert job.launchers[cut].returncode == 137, outputs
    assert "fenced off" in job.output(cut), outputs
    assert "cut off from the job's majority" in job.output(cut), outputs
    re_formed = assert_the_others_re_formed_and_finished(job, cut, cut_at)
    # Only the majority went on: the cut host's worker ran in the first round alone.
    joined = [port for port, r in rounds(job.out).items() if any(m.node == host.name for m in r)]
    assert len(joined) == 1, outputs
    print(
        f"\ncut {host.name} off (rank 0, the workers' store, etcd's leader): its worker"
        f" stopped {stopped_at - cut_at:.1f} s after the cut, its launcher exited 137"
        f" (fenced) after {exited_at - cut_at:.1f} s; the other two re-formed a round of 2"
        f" in {re_formed:.1f} s and finished; {TIMEOUTS}"
    )
    # Fenced within the silence bound (5 s + STALL_SECONDS) plus a loaded machine's
    # margin, and out soon after: a fenced node waits on no etcd member for long.
    assert stopped_at - cut_at < 5 + STALL_SECONDS + 10, outputs
    assert exited_at - stopped_at < STALL_SECONDS + 10, outputs
