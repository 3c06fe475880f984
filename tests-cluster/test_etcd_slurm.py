"""A job on etcd across three SLURM nodes (network namespaces) outlives its store's node.

The recipe of docs/guides/surviving-node-loss.md: one launcher per node started by
``srun --no-kill`` (without it SLURM ends the whole step when one node fails), each
node holding one member of a three-member etcd cluster::

    srun -N3 --no-kill --kill-on-bad-exit=0 dist-launch --nnodes 2:3 --nproc-per-node 1 \\
        --rdzv-backend etcd --rdzv-endpoint node1:2379,node2:2379,node3:2379 ...

Once a round of three runs, the node whose worker holds rank 0 (the round's workers'
store) is made etcd's leader and killed: every process of it, slurmd and its etcd
member included, and SLURM is told the node is down (as its controller finds out
``SlurmdTimeout`` later): without ``--no-kill`` SLURM would then end the step on every
node ("Job step aborted"). The two other nodes' launchers re-form a round of two and
finish, each task exiting 0. The worker is tests-integration's scripts/etcd_rounds.py; the time from
the death to the re-formed round is printed with the timeouts that bound it.

Needs root, SLURM's programs and etcd; ``nox -s cluster`` installs them and sets
``DIST_LAUNCH_REQUIRE_ETCD`` (a missing etcd then fails the test instead of skipping).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
from multi_node_slurm import multi_node_slurm

from conftest import first_job_id, require_cluster_tools

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "packages/dist-launch/tests"))

from etcd_cluster import Place, etcd_cluster
from etcd_markers import RDZV_CONF, TIMEOUTS, WORKER, full_round, wait_for

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


def test_srun_no_kill_job_on_etcd_outlives_the_node_of_its_store(
    job_env: dict[str, str], tag: str, tmp_path: Path
) -> None:
    require_cluster_tools()
    out = tmp_path / "rounds"
    out.mkdir()
    # A cluster of its own: the lost node does not come back.
    with multi_node_slurm(3, first_job_id=first_job_id() + 700) as cluster:
        places = [
            Place(cluster.host(node).address, ("ip", "netns", "exec", cluster.host(node).namespace))
            for node in NODES
        ]
        with etcd_cluster(tmp_path, places=places) as etcd:
            launch = [
                sys.executable, "-m", "dist_launch", "--nnodes=2:3", "--nproc-per-node=1",
                "--rdzv-backend=etcd", f"--rdzv-endpoint={etcd.endpoints}",
                f"--rdzv-id={tag}", f"--rdzv-conf={RDZV_CONF}", "--max-restarts=1",
                "--monitor-interval=0.1", str(WORKER), str(out),
            ]  # fmt: skip
            argv = ["srun", "-l", "-N3", "--no-kill", "--kill-on-bad-exit=0", "-J", tag, *launch]
            srun = cluster.slurm.popen(argv, job_env, process_group=0)
            stdout, stderr = Output(srun.stdout), Output(srun.stderr)

            def logs() -> str:
                return f"stdout:\n{stdout.text()}\nstderr:\n{stderr.text()}"

            try:
                wait_for(lambda: full_round(out, 3) is not None, "a round of three", logs)
                first = full_round(out, 3)
                assert first is not None
                lost = first[0].node  # rank 0's node serves the workers' store
                etcd.make_leader(etcd.members[NODES.index(lost)])
                killed_at = time.time()
                cluster.host(lost).kill_everything()  # launcher, worker, slurmd, etcd member
                # SLURM finds out (SlurmdTimeout later; here at once): without --no-kill
                # it would now end the step on the other nodes too.
                cluster.mark_down(lost)
                wait_for(
                    lambda: stdout.text().count("finished") == 2,
                    "the other two nodes' ranks finishing",
                    logs,
                )
                finished_at = time.time()
                srun.wait(60)
            finally:
                if srun.poll() is None:
                    srun.kill()
                srun.wait(10)
    second = full_round(out, 2)
    assert second is not None, logs()
    survivors = set(NODES) - {lost}
    assert {m.node for m in second} == survivors, logs()
    assert {m.restarts for m in second} <= {0, 1}, logs()
    # A task that ended non-zero is reported by srun; the survivors' tasks ended 0.
    for node in survivors:
        assert f"srun: error: {node}: task" not in stderr.text(), logs()
    assert "fenced off" not in stdout.text() + stderr.text(), logs()
    re_formed = max(m.started for m in second) - killed_at
    print(
        f"\nsrun --no-kill, killed {lost} (rank 0, the workers' store, etcd's leader, slurmd):"
        f" {', '.join(sorted(survivors))} re-formed a round of 2 in {re_formed:.1f} s and"
        f" finished {finished_at - killed_at:.1f} s after the kill; srun exited"
        f" {srun.returncode}; {TIMEOUTS}"
    )
