"""Issue 42's rows on a two-node SLURM cluster: dist-launch beside torchrun, a line each.

Not a test (it asserts nothing): it prints what happened, for the closing note's table.
Each node runs 2 ranks under one launcher per node started by ``srun -N2``: dist-launch
by the docs' line (static rendezvous, no node flags), dist-launch with
``--rdzv-backend c10d``, and torchrun (``torch.distributed.run --rdzv-backend c10d``).
Needs root and what ``nox -s cluster`` installs::

    python tests-cluster/compare_multi_node.py [--python /path/to/venv/bin/python]

Times are wall-clock seconds on this machine; run it alone when they matter.
"""

from __future__ import annotations

import argparse
import random
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from job_output import checkpoints, groups_formed  # noqa: E402
from multi_node_slurm import MultiNodeCluster, multi_node_slurm  # noqa: E402
from processes import read_until  # noqa: E402

SCRIPTS = HERE / "scripts"
ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TORCH_DISTRIBUTED_BACKEND": "gloo"}
_TASK_EXIT = re.compile(r"(node\d): task (\d+): Exited with exit code (\d+)")


def launchers(python: str) -> dict[str, list[str]]:
    """Each launcher's per-node command (an endpoint port picked per call for c10d)."""
    c10d = [
        "--nnodes", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"node1:{random.randrange(20000, 30000)}",
        "--rdzv-id", uuid.uuid4().hex[:8],
    ]  # fmt: skip
    return {
        "dist-launch (docs' line, static)": [python, "-m", "dist_launch"],
        "dist-launch --rdzv-backend c10d": [python, "-m", "dist_launch", *c10d],
        "torchrun --rdzv-backend c10d": [python, "-m", "torch.distributed.run", *c10d],
    }


def _node(launcher: list[str], script: str, *args: str) -> list[str]:
    return [*launcher, "--nproc-per-node", "2", str(SCRIPTS / script), *args]


def _exits(err: str) -> str:
    found = {node: code for node, _, code in _TASK_EXIT.findall(err)}
    return ", ".join(f"{node} {code}" for node, code in sorted(found.items())) or "all 0"


def start(cluster: MultiNodeCluster, launcher: list[str]) -> str:
    """srun -N2 and sbatch -N2: ranks, hosts and master right (an all_reduce passes)."""
    cells = []
    for how in ("srun", "sbatch"):
        began = time.monotonic()
        if how == "srun":
            argv = ["srun", "-N2", *_node(launcher, "init_group.py")]
            done = cluster.slurm.run(argv, ENV, timeout=180)
            out, ok = done.stdout, done.returncode == 0
        else:
            step = " ".join(["srun", *_node(launcher, "init_group.py")])
            state, out = cluster.slurm.batch(f"{step}\n", "-N2", env=ENV, timeout=180)
            ok = state == "COMPLETED"
        formed = groups_formed(out)
        right = ok and [(r, w, s) for r, w, _, s in formed] == [(r, 4, 6) for r in range(4)]
        # Static: node k has ranks 2k, 2k+1. c10d orders nodes by rendezvous: any 2 per
        # node will do, one master for all (its name or, with c10d, its address).
        placed = dict(re.findall(r"rank (\d)/4 .* host (\S+) master \S+", out))
        masters = set(re.findall(r"rank \d/4 .* master (\S+)", out))
        per_node = sorted(list(placed.values()).count(node) for node in ("node1", "node2"))
        fits = per_node == [2, 2] and len(masters) == 1
        verdict = "right" if right and fits else f"WRONG: ended ok {ok}, {placed} master {masters}"
        cells.append(f"{how} {verdict} ({time.monotonic() - began:.1f} s)")
    return "; ".join(cells)


def _training(
    cluster: MultiNodeCluster, launcher: list[str], work: Path, name: str
) -> subprocess.Popen[str]:
    argv = ["srun", "-l", "-N2", "-J", name, *_node(launcher, "checkpoint_on_sigterm.py")]
    srun = cluster.slurm.popen([*argv, str(work)], ENV, process_group=0)
    read_until(srun, "training", 4, timeout=180)
    return srun


def preempt(cluster: MultiNodeCluster, launcher: list[str]) -> str:
    """scancel --signal=TERM of the 2-node job, 8 s checkpoint on SIGTERM."""
    work = Path(tempfile.mkdtemp(dir=cluster.slurm.root))
    srun = _training(cluster, launcher, work, work.name)
    try:
        signalled = time.monotonic()
        cluster.slurm.scancel(cluster.slurm.job_id(work.name), "--signal=TERM")
        _, err = srun.communicate(timeout=120)
        took = time.monotonic() - signalled
    finally:
        srun.kill()
        srun.wait(30)
    done = checkpoints(work)
    return f"{len(done)} of 4 checkpoints, exit {srun.returncode} ({_exits(err)}), {took:.1f} s"


def lose_node(python: str, launcher_name: str) -> str:
    """node2 dies (every process of it SIGKILLed): how node1's launcher ends, how fast."""
    with multi_node_slurm(2, first_job_id=random.randrange(1, 20000)) as cluster:
        launcher = launchers(python)[launcher_name]
        work = Path(tempfile.mkdtemp(dir=cluster.slurm.root))
        srun = _training(cluster, launcher, work, work.name)
        assert srun.stderr is not None
        try:
            lost = time.monotonic()
            cluster.host("node2").kill_everything()
            line = ""
            deadline = lost + 120
            while time.monotonic() < deadline and "node1: task 0:" not in line:
                line = srun.stderr.readline()
                if not line:
                    break
            took = time.monotonic() - lost
            cluster.mark_down("node2")
        finally:
            srun.kill()
            srun.wait(30)
    found = re.search(r"node1: task 0: (.*)", line)
    if found is None:
        return f"node1 did not end within {deadline - lost:.0f} s"
    return f"node1: {found[1]} after {took:.2f} s"


def failing_rank(cluster: MultiNodeCluster, launcher: list[str]) -> str:
    """Rank 3 (node2) raises: when each node ends, what each names, traceback shown."""
    argv = ["srun", "-l", "-N2", *_node(launcher, "fail_rank.py", "3")]
    err = cluster.slurm.run(argv, ENV, timeout=180).stderr
    ended = time.time()
    failed_at = re.search(r"FAILED_AT (\d+\.\d+)", err)
    took = f"{ended - float(failed_at[1]):.2f} s" if failed_at else "?"
    named = []
    for task in (0, 1):
        own = "\n".join(line[3:] for line in err.splitlines() if line.startswith(f"{task}: "))
        ours = re.search(r"rank (\d+) \(local rank \d+, node ([^)]+)\) failed first", own)
        theirs = re.search(r"Root Cause[\s\S]*?rank\s*:\s*(\d+)", own)
        if ours:
            named.append(f"node{task + 1} names rank {ours[1]} (node {ours[2]})")
        elif theirs:
            named.append(f"node{task + 1} names rank {theirs[1]}")
        else:
            said = re.search(r"^dist-launch: (?!\[)(.{0,90})", own, re.MULTILINE)
            named.append(f"node{task + 1} names none ({said[1] if said else 'no report'})")
        if "ValueError: rank 3 fails on purpose" in "\n".join(
            line for line in own.splitlines() if not line.startswith("[rank")
        ):
            named[-1] += " + traceback"
    return f"ended {took} after the raise; exit {_exits(err)}; {'; '.join(named)}"


def main() -> None:
    """Prints one line per row and launcher."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--only", nargs="*", default=[])
    args = parser.parse_args()
    with multi_node_slurm(2, first_job_id=random.randrange(1, 20000)) as cluster:
        for name in launchers(args.python):
            rows = {
                "start": lambda name=name: start(cluster, launchers(args.python)[name]),
                "preempt": lambda name=name: preempt(cluster, launchers(args.python)[name]),
                "node dies": lambda name=name: lose_node(args.python, name),
                "rank raises": lambda name=name: failing_rank(
                    cluster, launchers(args.python)[name]
                ),
            }
            for row, run in rows.items():
                if args.only and row not in args.only:
                    continue
                try:
                    cell = run()
                except (subprocess.SubprocessError, OSError, TimeoutError, RuntimeError) as error:
                    cell = f"error: {type(error).__name__}: {str(error)[:120]}"
                cluster.slurm.cancel_everything()
                print(f"| {row} | {name} | {cell} |", flush=True)


if __name__ == "__main__":
    main()
