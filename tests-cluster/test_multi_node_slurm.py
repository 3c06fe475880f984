"""dist-launch on two SLURM nodes (network namespaces), 2 ranks per node, real srun/sbatch.

Each node's launcher is started by the line docs/guides/schedulers.md gives,
``srun dist-launch --nproc-per-node 2 train.py``, with no node flags: they come from
SLURM. ``srun -l`` labels each line with its task, that is its node (task 0 on node1).
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from job_output import checkpoints, groups_formed
from multi_node_slurm import MultiNodeCluster, multi_node_slurm
from one_host_slurm import SlurmCluster
from processes import read_until

from conftest import SCRIPTS, first_job_id, require_cluster_tools

pytestmark = pytest.mark.processes

PY = sys.executable
NODE_LAUNCH = [PY, "-m", "dist_launch", "--nproc-per-node", "2"]
CHECKPOINT = str(SCRIPTS / "checkpoint_on_sigterm.py")
CHECKPOINT_SECONDS = "4"
# tests-integration's training loop: a line per all_reduce step (see its docstring).
STEPS = str(SCRIPTS.parent.parent / "tests-integration" / "scripts" / "elastic_steps.py")
# Generous bounds on how long a node may take to end after another failed: a loaded
# machine must not miss them (the measured figures are printed).
NODE_LOST_BOUND = 30.0
RANK_FAILED_BOUND = 10.0
CUT_HANG_TIMEOUT = 10
# The target is --hang-timeout + 5 s on both sides; the bound leaves a loaded machine room.
CUT_BOUND = CUT_HANG_TIMEOUT + 5 + 15
_HOST_LINE = re.compile(r"rank (\d+)/\d+ port \d+ sum \d+ host (\S+) master (\S+)")


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[MultiNodeCluster]:
    """Two nodes, node1 and node2, for this module's tests in this pytest process."""
    require_cluster_tools()
    with multi_node_slurm(2, first_job_id=first_job_id()) as cluster:
        yield cluster


class Lines:
    """A stream's lines as they come, each with the time it was read."""

    def __init__(self, stream: object) -> None:
        self.lines: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._changed:
                self.lines.append((time.monotonic(), line))
                self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> tuple[float, re.Match[str]]:
        """The time and match of the first line matching ``pattern``.

        Raises:
            TimeoutError: None within ``timeout`` seconds (the message holds the lines).
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for when, line in self.lines:
                    found = re.search(pattern, line)
                    if found:
                        return when, found
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no {pattern!r} in {timeout:g} s:\n{self.text()}")
                self._changed.wait(remaining)

    def text(self) -> str:
        """Everything read so far."""
        return "".join(line for _, line in self.lines)


def assert_one_group_across_both_nodes(out: str) -> None:
    """Ranks 0-1 on node1, 2-3 on node2, node1 the master, the all_reduce's sum right."""
    assert [(rank, world, total) for rank, world, _, total in groups_formed(out)] == [
        (rank, 4, 0 + 1 + 2 + 3) for rank in range(4)
    ], out
    placed = sorted((int(rank), host, master) for rank, host, master in _HOST_LINE.findall(out))
    assert placed == [
        (0, "node1", "node1"),
        (1, "node1", "node1"),
        (2, "node2", "node1"),
        (3, "node2", "node1"),
    ], out


def test_srun_two_nodes_form_one_group(
    two_nodes: MultiNodeCluster, job_env: dict[str, str]
) -> None:
    argv = ["srun", "-N2", *NODE_LAUNCH, str(SCRIPTS / "init_group.py")]
    done = two_nodes.slurm.run(argv, job_env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert_one_group_across_both_nodes(done.stdout)


def test_sbatch_two_nodes_form_one_group(
    two_nodes: MultiNodeCluster, job_env: dict[str, str]
) -> None:
    step = " ".join(["srun", *NODE_LAUNCH, str(SCRIPTS / "init_group.py")])
    state, out = two_nodes.slurm.batch(f"{step}\n", "-N2", env=job_env, timeout=120)
    assert state == "COMPLETED", out
    assert_one_group_across_both_nodes(out)


def start_training(
    slurm: SlurmCluster, job_env: dict[str, str], tag: str, tmp_path: Path
) -> subprocess.Popen[str]:
    """A 2-node job of checkpoint_on_sigterm.py, once its 4 ranks train."""
    argv = ["srun", "-l", "-N2", "-J", tag, *NODE_LAUNCH, CHECKPOINT]
    srun = slurm.popen([*argv, str(tmp_path), CHECKPOINT_SECONDS], job_env, process_group=0)
    read_until(srun, "training", 4, timeout=120)
    return srun


def test_scancel_signal_term_checkpoints_on_both_nodes(
    two_nodes: MultiNodeCluster, job_env: dict[str, str], tag: str, tmp_path: Path
) -> None:
    slurm = two_nodes.slurm
    srun = start_training(slurm, job_env, tag, tmp_path)
    try:
        slurm.scancel(slurm.job_id(tag), "--signal=TERM")
        _, err = srun.communicate(timeout=90)
    finally:
        srun.kill()
        srun.wait(10)
    assert sorted(checkpoints(tmp_path)) == [0, 1, 2, 3], err
    assert [c["SIGTERM"] for c in checkpoints(tmp_path).values()] == [1] * 4
    assert srun.returncode == 143, err


def test_a_lost_node_ends_the_other_node(job_env: dict[str, str], tag: str, tmp_path: Path) -> None:
    require_cluster_tools()
    # A cluster of its own: the lost node does not come back.
    with multi_node_slurm(2, first_job_id=first_job_id() + 500) as cluster:
        srun = start_training(cluster.slurm, job_env, tag, tmp_path)
        err = Lines(srun.stderr)
        try:
            lost = time.monotonic()
            cluster.host("node2").kill_everything()
            ended, found = err.wait_for(
                r"node1: task 0: (Exited with exit code \d+|\w+)", timeout=90
            )
            print(f"node1's launcher ended {ended - lost:.2f} s after node2 died: {found[1]}")
            cluster.mark_down("node2")
            srun.wait(60)
        finally:
            srun.kill()
            srun.wait(10)
    assert found[1] == "Exited with exit code 137", err.text()
    assert ended - lost < NODE_LOST_BOUND, err.text()


def test_a_rank_failing_on_node2_ends_both_nodes_naming_it(
    two_nodes: MultiNodeCluster, job_env: dict[str, str], tag: str
) -> None:
    argv = ["srun", "-l", "-N2", "-J", tag, *NODE_LAUNCH, str(SCRIPTS / "fail_rank.py"), "3"]
    err = two_nodes.slurm.run(argv, job_env, timeout=120).stderr
    ended = time.time()
    failed_at = float(re.findall(r"^1: (?:\[rank3\]: )?FAILED_AT (\S+)$", err, re.MULTILINE)[0])
    print(f"both nodes ended {ended - failed_at:.2f} s after rank 3 raised")
    assert ended - failed_at < RANK_FAILED_BOUND, err
    for task, node in enumerate(("node1", "node2")):
        assert f"srun: error: {node}: task {task}: Exited with exit code 1\n" in err, err
        own = "".join(line[3:] + "\n" for line in err.splitlines() if line.startswith(f"{task}: "))
        # node2 tells its own rank's failure; node1 the record node2 shared.
        named = (
            "first failure: rank 3 on node 1 (node2)"
            if node == "node1"
            else "dist-launch: rank 3 (local rank 1, node 1) failed first"
        )
        assert named in own, (task, err)
    assert "ValueError: rank 3 fails on purpose" in err


def node_files_with(directory: Path, pattern: str, count: int, timeout: float) -> None:
    """Waits, bounded, until the nodes' output files hold ``count`` lines matching ``pattern``.

    Raises:
        TimeoutError: They do not within ``timeout`` seconds (the message holds them).
    """
    deadline = time.monotonic() + timeout
    while True:
        text = "".join(path.read_text() for path in sorted(directory.glob("*.out")))
        if len(re.findall(pattern, text, re.MULTILINE)) >= count:
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no {count} x {pattern!r} in {timeout:g} s:\n{text}")
        time.sleep(0.1)  # polling files a node writes: nothing to wait on instead


def test_a_cut_cable_ends_both_nodes_and_names_the_unreachable_one(
    job_env: dict[str, str], tag: str, tmp_path: Path
) -> None:
    """node2's cable is pulled mid-step in a job started by the docs' line.

    Each node's output goes to a file of its own (``srun -o %N.out``: node2's cannot
    reach srun once cut), and a shell beside each launcher writes its exit code and the
    time. node1 serves the launchers' store (node 0): it ends with its hang report (75),
    naming node2 unreachable; node2, cut off from the store, is fenced (137), naming the
    store's node. Both within --hang-timeout + 5 s (asserted with a margin; printed).
    """
    require_cluster_tools()
    out = tmp_path / "out"
    out.mkdir()
    launch = [*NODE_LAUNCH, "--hang-timeout", str(CUT_HANG_TIMEOUT), "--grace-period", "1"]
    # The exit file is written once the launcher has exited, with the wall clock then.
    wrapped = ["sh", "-c", f'"$@"; echo "$? $(date +%s.%N)" > {out}/$SLURMD_NODENAME.exit', "sh"]
    argv = ["srun", "-N2", "-J", tag, "-o", f"{out}/%N.out", *wrapped, *launch, STEPS]
    env = {**job_env, "MAX_STEPS": "100000", "FINISH_FILE": "/none", "COLLECTIVE_TIMEOUT": "600"}
    # A cluster of its own: the cut node's slurmd and steps are not the module's to reuse.
    with multi_node_slurm(2, first_job_id=first_job_id() + 700) as cluster:
        srun = cluster.slurm.popen(argv, env, process_group=0)
        try:
            # Mid-training: every rank has stepped a while (and every board beaten).
            node_files_with(out, r"\bstep attempt=.* step=20 ", 4, timeout=120)
            cut = time.time()
            cluster.network.cut(cluster.host("node2"))
            ended = {}
            deadline = time.monotonic() + 90
            while len(ended) < 2 and time.monotonic() < deadline:
                for path in out.glob("*.exit"):
                    code, when = path.read_text().split()
                    ended[path.stem] = (int(code), float(when) - cut)
                time.sleep(0.1)  # polling the shells' files, as above
            outputs = {path.stem: path.read_text() for path in out.glob("*.out")}
        finally:
            srun.kill()
            srun.wait(10)
    print(f"\ncut node2 under SLURM: {ended}")
    assert sorted(ended) == ["node1", "node2"], (ended, outputs)
    assert [ended["node1"][0], ended["node2"][0]] == [75, 137], (ended, outputs)
    assert max(seconds for _, seconds in ended.values()) < CUT_BOUND, (ended, outputs)
    node2 = cluster.host("node2")
    assert re.search(
        rf"node2 \({re.escape(node2.address)}\) unreachable from node1 since "
        r"\d\d:\d\d:\d\d; ranks 2-3",
        outputs["node1"],
    ), outputs
    assert "which serves the launchers' store" in outputs["node2"], outputs
