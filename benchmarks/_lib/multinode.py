"""The parts of benchmarks/launch.py that need torch elastic's c10d rendezvous.

- ``netns``: a 2-node c10d job in network namespaces, start to first all_reduce;
- ``rdzv``: N agents joining one c10d rendezvous on loopback, start to all agents done;
- ``restart``: with ``--max-restarts 1``, a rank's crash to the restarted group's first
  all_reduce.

Each runs both launchers with the same flags. A launcher that fails (a flag it does not
know yet, a timeout) is printed as failed with its last output lines, and the part goes
on with the other launcher. Times across processes are wall-clock ``time.time()``.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from _lib import netns

LAUNCHERS = ("dist-launch", "torchrun")
RUN_SECONDS = 300.0  # one launcher run; past it the run counts as failed

FIRST_ALL_REDUCE = """\
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"first_all_reduce rank={dist.get_rank()} at={time.time():.6f}", flush=True)
assert int(t.item()) == dist.get_world_size()
dist.destroy_process_group()
"""

RESTART = """\
import os, sys, time, torch, torch.distributed as dist
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
print(f"first_all_reduce attempt={attempt} rank={dist.get_rank()} at={time.time():.6f}",
      flush=True)
if attempt == 0:
    if dist.get_rank() == 1:
        with open(sys.argv[1], "w") as f:
            f.write(repr(time.time()))
        os._exit(1)
    dist.barrier()  # blocks until rank 1 is gone, then fails: the group restarts
dist.destroy_process_group()
"""

# torchrun (torch 2.13) keeps its rendezvous store across restarts and gives it to the
# workers, whose gloo then reads the previous attempt's addresses ("Connection refused")
# and the restarted group fails; torch's own opt-out gives each attempt a fresh store.
RESTART_ENV = {"torchrun": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}}

STAMP = re.compile(r"first_all_reduce (?:attempt=(\d+) )?rank=(\d+) at=([0-9.]+)")


class LaunchFailed(RuntimeError):
    """A launcher exited non-zero, timed out, or printed less than expected."""


def launcher(kind: str) -> list[str]:
    """The command of launcher ``kind``, run by this interpreter."""
    module = {"dist-launch": "dist_launch", "torchrun": "torch.distributed.run"}[kind]
    return [sys.executable, "-m", module]


def _tail(text: str, lines: int = 8) -> str:
    return "\n".join("      " + line for line in text.strip().splitlines()[-lines:])


def _finish(processes: list[subprocess.Popen[str]], deadline: float) -> list[str]:
    """Outputs of the processes; LaunchFailed unless every one exits 0 by ``deadline``."""
    outputs = []
    try:
        for process in processes:
            out, _ = process.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            outputs.append(out)
    except subprocess.TimeoutExpired as timed_out:
        raise LaunchFailed(f"timed out after {RUN_SECONDS:g} s") from timed_out
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=30)
    failed = [
        (p.returncode, out) for p, out in zip(processes, outputs, strict=True) if p.returncode
    ]
    if failed:
        code, out = failed[0]
        raise LaunchFailed(f"exit {code}, {len(failed)} of {len(processes)} failed:\n{_tail(out)}")
    return outputs


def _stamps(output: str) -> list[tuple[int, int, float]]:
    """(attempt, rank, time) of every first-all_reduce line."""
    return [(int(a or 0), int(r), float(t)) for a, r, t in STAMP.findall(output)]


def _start_on(host: netns.Host, argv: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        host.command(argv),
        env={**env, "GLOO_SOCKET_IFNAME": host.interface},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _measure(kind: str, run: Callable[[], float]) -> float | None:
    try:
        return run()
    except (LaunchFailed, OSError, subprocess.SubprocessError) as error:
        print(f"    {kind}: failed: {error}", flush=True)
        return None


def _cell(value: float | None, width: int) -> str:
    return f"{value:>{width}.2f}" if value is not None else f"{'failed':>{width}}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:>6.2f}" if ours is not None and theirs else f"{'-':>6}"


def netns_part(scratch: Path, env: dict[str, str], port: int = 29611) -> dict[str, object]:
    """A 2-node c10d job (2 ranks each) in network namespaces: start to first all_reduce."""
    print("\n2-node c10d job in network namespaces (2 ranks per node), start to the last "
          "rank's first all_reduce, same flags for both launchers:")  # fmt: skip
    problem = netns.why_not()
    if problem is not None:
        print(f"  skipped: {problem}")
        return {"netns_first_all_reduce_s": None}
    script = scratch / "first_all_reduce.py"
    script.write_text(FIRST_ALL_REDUCE)
    results: dict[str, float | None] = {}
    with netns.network(2) as hosts:
        for offset, kind in enumerate(LAUNCHERS):

            def run(kind: str = kind, port: int = port + offset) -> float:
                endpoint = f"{hosts[0].name}:{port}"
                flags = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", endpoint, "--rdzv-id", "bench"]  # fmt: skip
                started = time.time()
                processes = [_start_on(host, [*launcher(kind), *flags, str(script)], env)
                             for host in hosts]  # fmt: skip
                outputs = _finish(processes, time.monotonic() + RUN_SECONDS)
                stamps = _stamps("".join(outputs))
                if sorted(rank for _, rank, _ in stamps) != [0, 1, 2, 3]:
                    raise LaunchFailed(f"expected ranks 0-3 to print:\n{_tail(''.join(outputs))}")
                return max(at for _, _, at in stamps) - started

            results[kind] = _measure(kind, run)
            for host in hosts:
                host.kill_everything()
    ours, theirs = results["dist-launch"], results["torchrun"]
    print(f"  dist-launch {_cell(ours, 6)} s   torchrun {_cell(theirs, 6)} s   "
          f"ratio {_ratio(ours, theirs)}")  # fmt: skip
    return {"netns_first_all_reduce_s": results}


def rdzv_part(
    env: dict[str, str], counts: list[int], limit: int, port: int = 29711
) -> dict[str, object]:
    """N agents (one process each, no workers) joining one c10d rendezvous on loopback."""
    print("\nrendezvous scale: N agents on loopback, one c10d rendezvous, --no-python true "
          "workers; start to every agent done:")  # fmt: skip
    run_counts = [n for n in counts if n <= limit]
    for n in counts:
        if n > limit:
            print(f"  skipped N={n}: above --rdzv-limit {limit} (each agent imports torch: "
                  f"~120 MiB and ~1-2 CPU-s; {os.cpu_count()} CPUs here)")  # fmt: skip
    measured: dict[str, list[float | None]] = {kind: [] for kind in LAUNCHERS}
    floors: list[float] = []
    header = (
        f"  {'N':>5} | {'dist-launch s':>13} {'torchrun s':>10} {'ratio':>6} | "
        f"{'floor s':>7} {'dl/floor':>8}"
    )
    print(header)
    for i, n in enumerate(run_counts):
        # The machine's limit: N interpreters importing torch's rendezvous at once, which
        # every agent of either launcher must do; nothing meets, nothing runs.
        floor_started = time.perf_counter()
        importers = [
            subprocess.Popen([sys.executable, "-c", "import torch.distributed.elastic.rendezvous"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(n)
        ]  # fmt: skip
        _finish(importers, time.monotonic() + RUN_SECONDS)
        floors.append(time.perf_counter() - floor_started)
        for offset, kind in enumerate(LAUNCHERS):

            def run(kind: str = kind, n: int = n, port: int = port + 2 * i + offset) -> float:
                flags = ["--nnodes", str(n), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"scale{n}",
                         "--rdzv-conf", "join_timeout=600", "--no-python", "true"]  # fmt: skip
                started = time.perf_counter()
                processes = [
                    subprocess.Popen([*launcher(kind), *flags], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                    for _ in range(n)
                ]  # fmt: skip
                _finish(processes, time.monotonic() + RUN_SECONDS)
                return time.perf_counter() - started

            measured[kind].append(_measure(kind, run))
        ours, theirs = measured["dist-launch"][-1], measured["torchrun"][-1]
        print(f"  {n:>5} | {_cell(ours, 13)} {_cell(theirs, 10)} {_ratio(ours, theirs)} | "
              f"{floors[-1]:>7.2f} {_ratio(ours, floors[-1]):>8}", flush=True)  # fmt: skip
    for kind in LAUNCHERS:
        points = [(n, t) for n, t in zip(run_counts, measured[kind], strict=True) if t]
        if len(points) >= 2:
            (n0, t0), (n1, t1) = points[0], points[-1]
            growth = (t1 / t0) ** (1 / math.log2(n1 / n0))
            print(f"  {kind}: x{growth:.2f} per doubling of N ({n0} to {n1})")
    print("  floor: N interpreters importing torch's rendezvous at once (every agent of "
          "either launcher does), nothing else")  # fmt: skip
    return {
        "rdzv_agents": run_counts,
        "rdzv_all_done_s": measured,
        "rdzv_floor_s": [round(f, 3) for f in floors],
    }


def restart_part(scratch: Path, env: dict[str, str], ranks: int = 4) -> dict[str, object]:
    """Crash of rank 1 (attempt 0) to the restarted group's first all_reduce."""
    print(f"\nrestart latency, {ranks} ranks, --max-restarts 1: rank 1 crashes after its first "
          "all_reduce; its crash to the last rank's first all_reduce of attempt 1:")  # fmt: skip
    script = scratch / "restart.py"
    script.write_text(RESTART)
    stamp = scratch / "crashed_at"
    floor_started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, env=env, timeout=300)
    floor = time.perf_counter() - floor_started
    results: dict[str, float | None] = {}
    for kind in LAUNCHERS:

        def run(kind: str = kind) -> float:
            stamp.unlink(missing_ok=True)
            flags = ["--standalone", "--nproc-per-node", str(ranks), "--max-restarts", "1"]
            process = subprocess.Popen(
                [*launcher(kind), *flags, str(script), str(stamp)],
                env={**env, **RESTART_ENV.get(kind, {})}, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            )  # fmt: skip
            (output,) = _finish([process], time.monotonic() + RUN_SECONDS)
            restarted = [at for attempt, _, at in _stamps(output) if attempt == 1]
            if len(restarted) != ranks or not stamp.exists():
                raise LaunchFailed(f"expected a crash, then {ranks} ranks again:\n{_tail(output)}")
            return max(restarted) - float(stamp.read_text())

        results[kind] = _measure(kind, run)
    ours, theirs = results["dist-launch"], results["torchrun"]
    print(f"  dist-launch {_cell(ours, 6)} s   torchrun {_cell(theirs, 6)} s   "
          f"ratio {_ratio(ours, theirs)}   floor (import torch) {floor:.2f} s")  # fmt: skip
    print("  target: dist-launch <= 0.5 s + the script's own start-up (a warm fork server "
          "needs no new import torch)")  # fmt: skip
    return {"restart_s": results, "restart_floor_s": round(floor, 3), "restart_ranks": ranks}
