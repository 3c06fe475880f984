"""A job on etcd across three SLURM nodes (network namespaces) outlives any one node.

The recipe of docs/guides/surviving-node-loss.md: one launcher per node started by
``srun --no-kill`` (without it SLURM ends the whole step when one node fails), each
node holding one member of a three-member etcd cluster::

    srun -N3 --no-kill --kill-on-bad-exit=0 dist-launch --nnodes 2:3 --nproc-per-node 1 \\
        --rdzv-backend etcd --rdzv-endpoint node1:2379,node2:2379,node3:2379 ...

Once a round of three runs, the node whose worker holds rank 0 (the round's workers'
store) is made etcd's leader, then lost:

- cut off: its switch port goes down (no netem here: the cable is pulled). The two
  others (etcd's majority) re-form a round of two and finish, each task exiting 0; the
  cut node, which reaches no etcd majority, stops its worker (fenced by its lease's
  silence) and exits 137 (``INFRASTRUCTURE``), starting no other round. Its port comes
  back up afterwards so that srun hears its task's end;
- killed: every process of it, slurmd and its etcd member included, and SLURM is told
  the node is down (as its controller finds out ``SlurmdTimeout`` later): without
  ``--no-kill`` SLURM would then end the step on every node ("Job step aborted"). The
  two other nodes' launchers re-form a round of two and finish, each task exiting 0.

Both tests share one cluster (the cut runs first: its node comes back; the killed one
does not). The worker is tests-integration's scripts/etcd_rounds.py; the times from the
loss to the re-formed round are printed with the timeouts that bound them.

Needs root, SLURM's programs and etcd; ``nox -s cluster`` installs them and sets
``DIST_LAUNCH_REQUIRE_ETCD`` (a missing etcd then fails the test instead of skipping).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from multi_node_slurm import MultiNodeCluster, multi_node_slurm

from conftest import first_job_id, require_cluster_tools

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "packages/dist-launch/tests"))

from etcd_cluster import EtcdCluster, Place, etcd_cluster
from etcd_markers import (
    BOUND,
    RDZV_CONF,
    TIMEOUTS,
    WORKER,
    Marker,
    full_round,
    rounds,
    running,
    wait_for,
)

pytestmark = pytest.mark.processes

NODES = ("node1", "node2", "node3")


class Output:
    """A stream read to its end by a thread, so that the process never blocks on it."""

    def __init__(self, stream: object) -> None:
        self.chunks: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            self.chunks.append(line)

    def text(self) -> str:
        return "".join(self.chunks)


@dataclass(frozen=True)
class SlurmEtcd:
    """Three SLURM nodes, each holding a member of one etcd cluster."""

    cluster: MultiNodeCluster
    etcd: EtcdCluster


@pytest.fixture(scope="module")
def slurm_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmEtcd]:
    require_cluster_tools()
    with multi_node_slurm(3, first_job_id=first_job_id() + 700) as cluster:
        places = [
            Place(cluster.host(node).address, ("ip", "netns", "exec", cluster.host(node).namespace))
            for node in NODES
        ]
        with etcd_cluster(tmp_path_factory.mktemp("etcd"), places=places) as etcd:
            yield SlurmEtcd(cluster, etcd)


@dataclass
class SrunJob:
    """One ``srun --no-kill`` step of a launcher per node; its output, its round markers."""

    srun: subprocess.Popen[str]
    stdout: Output
    stderr: Output
    out: Path

    def logs(self) -> str:
        return f"stdout:\n{self.stdout.text()}\nstderr:\n{self.stderr.text()}"

    def first_round(self) -> list[Marker]:
        """Once a round of three runs: its markers, by rank (rank 0 holds the store)."""
        wait_for(lambda: full_round(self.out, 3) is not None, "a round of three", self.logs)
        first = full_round(self.out, 3)
        assert first is not None
        return first

    def wait_survivors_finish(self) -> float:
        """Waits until two nodes' ranks finished; the wall time it was seen."""
        wait_for(
            lambda: self.stdout.text().count("finished") == 2,
            "the other two nodes' ranks finishing",
            self.logs,
        )
        return time.time()


@contextlib.contextmanager
def srun_job(setup: SlurmEtcd, env: dict[str, str], tag: str, out: Path) -> Iterator[SrunJob]:
    launch = [
        sys.executable, "-m", "dist_launch", "--nnodes=2:3", "--nproc-per-node=1",
        "--rdzv-backend=etcd", f"--rdzv-endpoint={setup.etcd.endpoints}",
        f"--rdzv-id={tag}", f"--rdzv-conf={RDZV_CONF}", "--max-restarts=1",
        "--monitor-interval=0.1", str(WORKER), str(out),
    ]  # fmt: skip
    argv = ["srun", "-l", "-N3", "--no-kill", "--kill-on-bad-exit=0", "-J", tag, *launch]
    srun = setup.cluster.slurm.popen(argv, env, process_group=0)
    job = SrunJob(srun, Output(srun.stdout), Output(srun.stderr), out)
    try:
        yield job
    finally:
        if srun.poll() is None:
            srun.kill()
        srun.wait(10)


def assert_survivors_re_formed(job: SrunJob, lost: str, lost_at: float) -> tuple[set[str], float]:
    """The two other nodes ran a round of two after the loss, their tasks ended 0; its start."""
    second = full_round(job.out, 2, after=lost_at)
    assert second is not None, job.logs()
    survivors = set(NODES) - {lost}
    assert {m.node for m in second} == survivors, job.logs()
    assert {m.restarts for m in second} <= {0, 1}, job.logs()
    # A task that ended non-zero is reported by srun; the survivors' tasks ended 0.
    for node in survivors:
        assert f"srun: error: {node}: task" not in job.stderr.text(), job.logs()
    return survivors, max(m.started for m in second)


def lead_from_the_store_node(setup: SlurmEtcd, job: SrunJob) -> tuple[list[Marker], str]:
    """Once a round of three runs: its markers and rank 0's node, made etcd's leader.

    Rank 0's node serves the round's workers' store; with etcd's lead on it too, its
    loss makes the other two elect a new leader as well.
    """
    first = job.first_round()
    node = first[0].node
    setup.etcd.make_leader(setup.etcd.members[NODES.index(node)])
    return first, node


def parent_of(pid: int) -> int:
    """The parent of process ``pid`` (the worker's: its launcher)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def test_srun_no_kill_job_on_etcd_fences_a_cut_off_node_and_the_majority_finishes(
    slurm_etcd: SlurmEtcd, job_env: dict[str, str], tag: str, tmp_path: Path
) -> None:
    setup = slurm_etcd
    with srun_job(setup, job_env, tag, tmp_path) as job:
        first, cut = lead_from_the_store_node(setup, job)
        launcher = parent_of(first[0].pid)
        member = setup.etcd.members[NODES.index(cut)]
        host = setup.cluster.host(cut)
        cut_at = time.time()
        setup.cluster.network.cut(host)
        try:
            wait_for(lambda: not running(first[0].pid), "the cut node's worker stops", job.logs)
            stopped_at = time.time()
            wait_for(lambda: not running(launcher), "the cut node's launcher exits", job.logs)
            exited_at = time.time()
            finished_at = job.wait_survivors_finish()
        finally:
            setup.cluster.network.restore(host)  # srun hears the cut task's end
        job.srun.wait(BOUND)
        wait_for(member.healthy, f"etcd member {member.name} back in the cluster", job.logs)
    survivors, re_formed_at = assert_survivors_re_formed(job, cut, cut_at)
    # Only the majority went on: the cut node's worker ran in the first round alone,
    # it was fenced and its task ended 137 (INFRASTRUCTURE).
    joined = [port for port, r in rounds(job.out).items() if any(m.node == cut for m in r)]
    assert len(joined) == 1, job.logs()
    assert f"srun: error: {cut}: task" in job.stderr.text(), job.logs()
    assert "exit code 137" in job.stderr.text(), job.logs()
    assert "fenced off" in job.stdout.text() + job.stderr.text(), job.logs()
    print(
        f"\nsrun --no-kill, cut {cut} off (rank 0, the workers' store, etcd's leader): its"
        f" worker stopped {stopped_at - cut_at:.1f} s after the cut, its launcher exited"
        f" 137 (fenced) {exited_at - cut_at:.1f} s after; {', '.join(sorted(survivors))}"
        f" re-formed a round of 2 {re_formed_at - cut_at:.1f} s after the cut and had"
        f" finished {finished_at - cut_at:.1f} s after (looked once the cut node was out);"
        f" srun exited {job.srun.returncode}; {TIMEOUTS}"
    )


def test_srun_no_kill_job_on_etcd_outlives_the_node_of_its_store(
    slurm_etcd: SlurmEtcd, job_env: dict[str, str], tag: str, tmp_path: Path
) -> None:
    setup = slurm_etcd
    with srun_job(setup, job_env, tag, tmp_path) as job:
        _, lost = lead_from_the_store_node(setup, job)
        killed_at = time.time()
        setup.cluster.host(lost).kill_everything()  # launcher, worker, slurmd, etcd member
        # SLURM finds out (SlurmdTimeout later; here at once): without --no-kill it
        # would now end the step on the other nodes too.
        setup.cluster.mark_down(lost)
        finished_at = job.wait_survivors_finish()
        job.srun.wait(60)
    survivors, re_formed_at = assert_survivors_re_formed(job, lost, killed_at)
    assert "fenced off" not in job.stdout.text() + job.stderr.text(), job.logs()
    print(
        f"\nsrun --no-kill, killed {lost} (rank 0, the workers' store, etcd's leader, slurmd):"
        f" {', '.join(sorted(survivors))} re-formed a round of 2 in"
        f" {re_formed_at - killed_at:.1f} s and finished {finished_at - killed_at:.1f} s"
        f" after the kill; srun exited {job.srun.returncode}; {TIMEOUTS}"
    )
