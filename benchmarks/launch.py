"""dist-launch vs torchrun: start-up to a finished all_reduce, memory, and crash-to-exit.

For 2, 4 and 8 CPU ranks, in one run, side by side:

- wall time from the command's start until every rank has done one all_reduce and
  exited, for ``dist-launch``, ``torchrun --standalone`` and the floor
  ``python -c "import torch"`` (one interpreter importing torch: no launcher can start
  a rank faster);
- the peak memory of all workers together (sum of PSS, which counts pages shared by
  forked workers once, and sum of RSS), sampled every 50 ms from /proc;
- the time from a rank's crash (the others blocked in a barrier) to the launcher's
  exit, for both launchers.

Across nodes, on torch elastic's c10d rendezvous, both launchers with the same flags
(benchmarks/_lib/multinode.py):

- ``netns``: a 2-node job in network namespaces (root only), start to first all_reduce;
- ``rdzv``: N agents (``--rdzv-agents``, default 8 64 256, one process each, no
  workers) joining one rendezvous on loopback, start to every agent done, with the
  growth per doubling of N; N above ``--rdzv-limit`` is skipped, saying why;
- ``restart``: ``--max-restarts 1``, 4 ranks, a rank's crash to the restarted group's
  first all_reduce, beside the script's own start-up (``import torch``).

Hangs (benchmarks/_lib/hang.py):

- ``hang``: 4 ranks, one sleeping for ever while the others block in an all_reduce: its
  onset to dist-launch's report (``--hang-timeout 10``) and to the restarted group's
  first all_reduce, beside torchrun, which waits for the job's gloo timeout (60 s here);
- ``hang-cost``: the time per step with hang detection off and ``auto``.

Diagnosis (benchmarks/_lib/diagnose.py):

- ``verdict``: 4 ranks, one passing another process group: a hang's onset to the verdict
  naming it, the records' collection, and torch's own analyser (fr_trace) on the same
  ranks' dumps;
- ``recorder-cost``: the time per ~50 ms step with torch's flight recorder, hang
  detection and the slow-rank report, as ratios to none of them;
- ``slow-rank``: the reported lag of a rank late by 100, 200 and 400 ms, and a balanced
  run that must name no rank.

Quiet jobs (benchmarks/_lib/quiet.py):

- ``look-cost``: one look of a worker's beacon (its stack and torch's count of completed
  collectives), as a share of a rank's time;
- ``quiet-soak`` (only when named): every healthy quiet loop of examples/quiet_loops.py
  20 times beside two busy processes: false alarms counted (``nox -s hang_soak``).

Losing a node (benchmarks/_lib/survive.py, only when named: minutes each):

- ``reform``: a node's death to the re-formed round and its first step, c10d against
  etcd, for 2-4 nodes (launcher processes on this host, ``--reform-nodes``);
- ``rdzv-cost``: N simulated agents (``--cost-agents``, default 64 256 1024) joining one
  round on c10d and on etcd: the time and the store operations per agent, beside the
  store's own operation rate.

Run: ``python benchmarks/launch.py [--ranks 2 4 8] [--repeat N] [--only PART ...]``
(``nox -s bench``); the parts are start, crash, netns, rdzv, restart, hang, hang-cost,
verdict, recorder-cost, slow-rank, look-cost, and quiet-soak, reform, rdzv-cost when named.
The measurements also go to ``docs/_data/bench/launch.json`` (``--json``), which the docs draw as a
figure; a run of some parts updates only their keys there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ALL_REDUCE = """\
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
assert int(t.item()) == dist.get_world_size()
dist.destroy_process_group()
"""

CRASH = """\
import os, sys, time, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    dist.barrier(); time.sleep(0.5)  # let the others enter the next barrier first
    with open(sys.argv[1], "w") as f:
        f.write(repr(time.time()))
    raise RuntimeError("deliberate crash")
dist.barrier()
dist.barrier()
"""


PARTS = (
    "start", "crash", "netns", "rdzv", "restart", "hang", "hang-cost",
    "verdict", "recorder-cost", "slow-rank", "look-cost",
)  # fmt: skip
# Run only when named (--only): 16 minutes for the default 80 runs.
ON_REQUEST = ("quiet-soak", "reform", "rdzv-cost")


def _default_rdzv_limit() -> int:
    """Agents that half the available memory holds, at ~120 MiB of their own each."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 2 // (120 * 1024)
    except OSError:
        pass
    return 64


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, pending = [], [root]
    while pending:
        for child in children.get(pending.pop(), []):
            found.append(child)
            pending.append(child)
    return found


def _memory_kib(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in KiB; zeros when it is gone."""
    pss = rss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
            elif line.startswith("Rss:"):
                rss = int(line.split()[1])
    except OSError:
        pass
    return pss, rss


class _MemorySampler(threading.Thread):
    """Samples the summed memory of every descendant of a process (the launcher excluded)."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.peak_pss = self.peak_rss = 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(0.05):
            totals = [_memory_kib(pid) for pid in _descendants(self.root)]
            self.peak_pss = max(self.peak_pss, sum(p for p, _ in totals))
            self.peak_rss = max(self.peak_rss, sum(r for _, r in totals))


def _run(command: list[str], env: dict[str, str]) -> tuple[float, int, int]:
    """Wall seconds, peak PSS and RSS (MiB) of the command's descendants."""
    start = time.perf_counter()
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    sampler = _MemorySampler(process.pid)
    sampler.start()
    _, stderr = process.communicate(timeout=600)
    elapsed = time.perf_counter() - start
    sampler.stop_event.set()
    sampler.join()
    if process.returncode != 0:
        raise RuntimeError(f"{command} failed ({process.returncode}):\n{stderr[-3000:]}")
    return elapsed, sampler.peak_pss // 1024, sampler.peak_rss // 1024


def _crash_to_exit(command: list[str], stamp: Path, env: dict[str, str]) -> float:
    stamp.unlink(missing_ok=True)
    process = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    ended = time.time()
    if process.returncode == 0 or not stamp.exists():
        raise RuntimeError(f"{command} did not crash as planned:\n{process.stderr[-3000:]}")
    return ended - float(stamp.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeat", type=int, default=1, help="runs per point (min is kept)")
    parser.add_argument("--crash-ranks", type=int, default=4)
    parser.add_argument(
        "--only",
        nargs="+",
        choices=PARTS + ON_REQUEST,
        default=list(PARTS),
        metavar="PART",
        help=f"run only these parts ({', '.join(PARTS + ON_REQUEST)}; default: all but "
        f"{', '.join(ON_REQUEST)})",
    )
    parser.add_argument("--soak-runs", type=int, default=20, help="quiet-soak's runs per loop")
    parser.add_argument(
        "--soak-python",
        default=None,
        help="quiet-soak: the interpreter whose dist-launch runs (default: this one)",
    )
    parser.add_argument("--rdzv-agents", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument(
        "--reform-nodes",
        type=int,
        nargs="*",
        default=[2, 3, 4],
        help="reform: node counts with the fast settings (torch's defaults: 2 nodes, always)",
    )
    parser.add_argument("--cost-agents", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument(
        "--rdzv-limit",
        type=int,
        default=_default_rdzv_limit(),
        help="skip rendezvous points with more agents than this "
        "(default: what half the available memory holds at ~120 MiB each)",
    )
    from _lib import diagnose, hang, multinode, quiet, survive
    from _lib.results import add_json_argument, write_results

    add_json_argument(parser, "launch")
    args = parser.parse_args()
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # both launchers set 1 themselves
    python = sys.executable
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as scratch:
        script = Path(scratch, "all_reduce.py")
        script.write_text(ALL_REDUCE)
        crash = Path(scratch, "crash.py")
        crash.write_text(CRASH)
        stamp = Path(scratch, "crashed_at")

        def dist_launch(n: int, target: Path, *rest: str) -> list[str]:
            return [python, "-m", "dist_launch", "-n", str(n), str(target), *rest]

        def torchrun(n: int, target: Path, *rest: str) -> list[str]:
            return [python, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={n}", str(target), *rest]  # fmt: skip

        print(f"machine: {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
        results: dict[str, object] = {}
        if "start" in args.only or "crash" in args.only:
            results.update(_local_parts(args, env, script, crash, stamp, dist_launch, torchrun))
        if "netns" in args.only:
            results.update(multinode.netns_part(Path(scratch), env))
        if "rdzv" in args.only:
            results.update(multinode.rdzv_part(env, args.rdzv_agents, args.rdzv_limit))
        if "restart" in args.only:
            results.update(multinode.restart_part(Path(scratch), env))
        if "hang" in args.only:
            results.update(hang.hang_part(Path(scratch), env))
        if "hang-cost" in args.only:
            results.update(hang.cost_part(Path(scratch), env))
        if "verdict" in args.only:
            results.update(diagnose.verdict_part(Path(scratch), env))
        if "recorder-cost" in args.only:
            results.update(diagnose.recorder_cost_part(Path(scratch), env))
        if "slow-rank" in args.only:
            results.update(diagnose.slow_rank_part(Path(scratch), env))
        if "look-cost" in args.only:
            results.update(quiet.look_cost_part(Path(scratch), env))
        if "reform" in args.only:
            results.update(survive.reform_part(Path(scratch), env, args.reform_nodes))
        if "rdzv-cost" in args.only:
            results.update(survive.rdzv_cost_part(Path(scratch), args.cost_agents))
        if "quiet-soak" in args.only:
            results.update(
                quiet.quiet_soak_part(Path(scratch), env, args.soak_runs, args.soak_python)
            )
    if args.json != "-" and set(args.only) != set(PARTS) and Path(args.json).exists():
        # Some parts only: keep the others' last measurements for the docs' figures.
        kept = json.loads(Path(args.json).read_text())
        results = {k: v for k, v in kept.items() if k not in ("benchmark", "run")} | results
    write_results(args.json, "launch", results)


def _local_parts(
    args: argparse.Namespace,
    env: dict[str, str],
    script: Path,
    crash: Path,
    stamp: Path,
    dist_launch: Callable[..., list[str]],
    torchrun: Callable[..., list[str]],
) -> dict[str, object]:
    """One node: start-up and memory per rank count (start), crash to exit (crash)."""
    python = sys.executable
    results: dict[str, object] = {}
    floor = min(_run([python, "-c", "import torch"], env)[0] for _ in range(args.repeat))
    print(f"floor (python -c 'import torch'): {floor:.2f} s\n")
    results["floor_s"] = round(floor, 3)
    if "start" in args.only:
        header = (
            f"{'ranks':>5} | {'dist-launch s':>13} {'torchrun s':>10} {'ratio':>6} "
            f"{'/floor':>7} | {'PSS MiB dl':>10} {'torchrun':>8} {'ratio':>6} | "
            f"{'RSS MiB dl':>10} {'torchrun':>8}"
        )
        print(header)
        print("-" * len(header))
        measured: dict[str, list[float | int]] = {
            "dist-launch s": [], "torchrun s": [], "dist-launch PSS": [], "torchrun PSS": []
        }  # fmt: skip
        for n in args.ranks:
            ours = [_run(dist_launch(n, script), env) for _ in range(args.repeat)]
            theirs = [_run(torchrun(n, script), env) for _ in range(args.repeat)]
            t_ours = min(r[0] for r in ours)
            t_theirs = min(r[0] for r in theirs)
            pss_ours, rss_ours = max(r[1] for r in ours), max(r[2] for r in ours)
            pss_theirs, rss_theirs = max(r[1] for r in theirs), max(r[2] for r in theirs)
            measured["dist-launch s"].append(round(t_ours, 3))
            measured["torchrun s"].append(round(t_theirs, 3))
            measured["dist-launch PSS"].append(pss_ours)
            measured["torchrun PSS"].append(pss_theirs)
            print(
                f"{n:>5} | {t_ours:>13.2f} {t_theirs:>10.2f} {t_ours / t_theirs:>6.2f} "
                f"{t_ours / floor:>7.2f} | {pss_ours:>10} {pss_theirs:>8} "
                f"{pss_ours / max(pss_theirs, 1):>6.2f} | {rss_ours:>10} {rss_theirs:>8}",
                flush=True,
            )
        print("\nratio = dist-launch / torchrun (target at 8 ranks: <= 0.35); "
              "/floor = dist-launch / one 'import torch'")  # fmt: skip
        results.update({
            "ranks": args.ranks,
            "start_to_exit_s": {
                "dist-launch": measured["dist-launch s"],
                "torchrun": measured["torchrun s"],
            },
            "ratio": [
                round(ours / theirs, 3)
                for ours, theirs in zip(
                    measured["dist-launch s"], measured["torchrun s"], strict=True
                )
            ],
            "peak_pss_mib": {
                "dist-launch": measured["dist-launch PSS"],
                "torchrun": measured["torchrun PSS"],
            },
        })  # fmt: skip
    if "crash" in args.only:
        n = args.crash_ranks
        ours_crash = min(
            _crash_to_exit(dist_launch(n, crash, str(stamp)), stamp, env)
            for _ in range(args.repeat)
        )
        theirs_crash = min(
            _crash_to_exit(torchrun(n, crash, str(stamp)), stamp, env) for _ in range(args.repeat)
        )
        print(
            f"\ncrash to launcher exit, {n} ranks (others blocked in a barrier): "
            f"dist-launch {ours_crash:.2f} s, torchrun {theirs_crash:.2f} s, "
            f"ratio {ours_crash / theirs_crash:.2f} (target: dist-launch <= 0.5 s + the time "
            "the stopped ranks take to die)"
        )
        results.update({
            "crash_ranks": n,
            "crash_to_exit_s": {
                "dist-launch": round(ours_crash, 3),
                "torchrun": round(theirs_crash, 3),
            },
        })  # fmt: skip
    results["targets"] = {"ratio_at_8_ranks": 0.35, "crash_to_exit_s": 0.5}
    return results


if __name__ == "__main__":
    main()
