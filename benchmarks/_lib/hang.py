"""benchmarks/launch.py's hang parts: a hang's onset to its report and to the restart,
and the hang detector's cost on a step.

``hang``: 4 ranks on gloo, ``--max-restarts 1``; after one all_reduce rank 1 sleeps for
ever and the others block in the next all_reduce. dist-launch runs with
``--hang-timeout HANG_TIMEOUT``; torchrun has no hang detection, so the job's own gloo
timeout (``GLOO_TIMEOUT``, set in ``init_process_group``) is what ends the attempt
there. Measured: the onset (rank 1's stamp) to the launcher's hang report (dist-launch
only: torchrun prints none) and to the last rank's first all_reduce of attempt 1.

``hang-cost``: 2 ranks, steps of eight 256x256 matmuls and an all_reduce, the time per
step with ``--hang-timeout off`` beside ``auto`` (the default: 2 looks a second); the
best of ``REPEAT`` runs each. Both the wall
time and the main thread's CPU time per step: on a busy machine the wall time moves by
tens of percent from run to run, the CPU time far less.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

from _lib.multinode import RESTART_ENV, LaunchFailed, _cell, _measure, _ratio, _stamps, launcher

HANG_TIMEOUT = 10.0
GLOO_TIMEOUT = 60.0
RUN_SECONDS = 300.0
REPEAT = 5

HANG = """\
import datetime, os, sys, time, torch, torch.distributed as dist
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(sys.argv[2])))
t = torch.ones(1)
dist.all_reduce(t)
print(f"first_all_reduce attempt={attempt} rank={dist.get_rank()} at={time.time():.6f}",
      flush=True)
if attempt == 0:
    if dist.get_rank() == 1:
        with open(sys.argv[1], "w") as f:
            f.write(repr(time.time()))
        time.sleep(3600)
    dist.all_reduce(t)
"""

STEPS = """\
import sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
# argv: steps, matmuls per step (default 8), matrix size (default 256)
matmuls = int(sys.argv[2]) if len(sys.argv) > 2 else 8
size = int(sys.argv[3]) if len(sys.argv) > 3 else 256
a = torch.randn(size, size) / (size ** 0.5)
def step():
    b = a
    for _ in range(matmuls):
        b = torch.tanh(b @ a)
    t = b.sum().reshape(1)
    dist.all_reduce(t)
for _ in range(20):
    step()
steps = int(sys.argv[1])
start, cpu = time.perf_counter(), time.thread_time()
for _ in range(steps):
    step()
wall, cpu = (time.perf_counter() - start) / steps, (time.thread_time() - cpu) / steps
print(f"step_s rank={dist.get_rank()} {wall:.6f} {cpu:.6f}", flush=True)
"""


def _timed_lines(argv: list[str], env: dict[str, str]) -> tuple[int, list[tuple[float, str]]]:
    """Runs ``argv``; its exit status and each output line with the time it came."""
    process = subprocess.Popen(
        argv, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    killer = threading.Timer(RUN_SECONDS, process.kill)
    killer.start()
    lines: list[tuple[float, str]] = []
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append((time.time(), line))
        status = process.wait()
    finally:
        killer.cancel()
    return status, lines


def hang_part(scratch: Path, env: dict[str, str], ranks: int = 4) -> dict[str, object]:
    """A hang's onset to the report and to the restarted group's first all_reduce."""
    print(f"\nhang, {ranks} ranks, --max-restarts 1: rank 1 sleeps for ever after its first "
          "all_reduce, the others block in the next; dist-launch --hang-timeout "
          f"{HANG_TIMEOUT:g}, torchrun waits for the job's gloo timeout of {GLOO_TIMEOUT:g} s "
          "(its own default is 30 min):")  # fmt: skip
    script = scratch / "hang.py"
    script.write_text(HANG)
    stamp = scratch / "hung_at"
    to_report: dict[str, float | None] = {"dist-launch": None, "torchrun": None}
    to_restart: dict[str, float | None] = {}
    for kind in ("dist-launch", "torchrun"):

        def run(kind: str = kind) -> float:
            stamp.unlink(missing_ok=True)
            flags = ["--standalone", "--nproc-per-node", str(ranks), "--max-restarts", "1"]
            if kind == "dist-launch":
                flags += ["--hang-timeout", f"{HANG_TIMEOUT:g}"]
            status, lines = _timed_lines(
                [*launcher(kind), *flags, str(script), str(stamp), f"{GLOO_TIMEOUT:g}"],
                {**env, **RESTART_ENV.get(kind, {})},
            )
            output = "".join(line for _, line in lines)
            restarted = [at for attempt, _, at in _stamps(output) if attempt == 1]
            if status != 0 or len(restarted) != ranks or not stamp.exists():
                raise LaunchFailed(f"expected a hang, then {ranks} ranks again:\n{output[-2000:]}")
            onset = float(stamp.read_text())
            report = next((at for at, line in lines if "dist-launch: hang on" in line), None)
            if report is not None:
                to_report[kind] = round(report - onset, 3)
            return round(max(restarted) - onset, 3)

        to_restart[kind] = _measure(kind, run)
    ours, theirs = to_restart["dist-launch"], to_restart["torchrun"]
    print(f"  onset to report: dist-launch {_cell(to_report['dist-launch'], 6)} s   "
          "torchrun prints no report")  # fmt: skip
    print(f"  onset to the restarted group's first all_reduce: dist-launch {_cell(ours, 6)} s   "
          f"torchrun {_cell(theirs, 6)} s   ratio {_ratio(ours, theirs)}")  # fmt: skip
    return {
        "hang_ranks": ranks,
        "hang_timeout_s": HANG_TIMEOUT,
        "hang_gloo_timeout_s": GLOO_TIMEOUT,
        "hang_to_report_s": to_report,
        "hang_to_restart_s": to_restart,
    }


def best_step_times(
    commands: dict[str, list[str]], envs: dict[str, dict[str, str]], repeat: int
) -> tuple[dict[str, float], dict[str, float]]:
    """The best wall and main-thread CPU seconds per step of each command (STEPS' output).

    The commands run interleaved, ``repeat`` rounds, so that a busy spell hits them all.
    """
    best: dict[str, float] = {}
    best_cpu: dict[str, float] = {}
    for _ in range(repeat):
        for name, argv in commands.items():
            status, lines = _timed_lines(argv, envs[name])
            output = "".join(line for _, line in lines)
            if status != 0:
                raise LaunchFailed(f"{argv} failed:\n{output[-2000:]}")
            rows = [line.split()[-2:] for _, line in lines if "step_s rank=" in line]
            wall = max(float(row[0]) for row in rows)
            cpu = max(float(row[1]) for row in rows)
            best[name] = min(best.get(name, wall), wall)
            best_cpu[name] = min(best_cpu.get(name, cpu), cpu)
    return best, best_cpu


def cost_part(scratch: Path, env: dict[str, str], steps: int = 300) -> dict[str, object]:
    """The time per step with hang detection off and auto."""
    print(f"\nhang detector's cost, 2 ranks, {steps} steps of eight 256x256 matmuls and an "
          f"all_reduce, best of {REPEAT} runs:")  # fmt: skip
    script = scratch / "steps.py"
    script.write_text(STEPS)
    settings = ("off", "auto")
    best, best_cpu = best_step_times(
        {s: [*launcher("dist-launch"), "-n", "2", "--hang-timeout", s, str(script), str(steps)]
         for s in settings},
        {s: env for s in settings},
        REPEAT,
    )  # fmt: skip
    cost = {s: round(100 * (best[s] / best["off"] - 1), 2) for s in settings[1:]}
    cost_cpu = {s: round(100 * (best_cpu[s] / best_cpu["off"] - 1), 2) for s in settings[1:]}
    for name, values, percent in (("wall", best, cost), ("main thread CPU", best_cpu, cost_cpu)):
        print(f"  {name} per step: off {values['off'] * 1e3:.2f} ms, auto "
              f"{values['auto'] * 1e3:.2f} ms ({percent['auto']:+.2f}%)")  # fmt: skip
    print("  target: under 1%")
    return {
        "hang_cost_step_s": {setting: round(best[setting], 6) for setting in settings},
        "hang_cost_percent": cost,
        "hang_cost_cpu_step_s": {setting: round(best_cpu[setting], 6) for setting in settings},
        "hang_cost_cpu_percent": cost_cpu,
    }
