"""benchmarks/launch.py's quiet-job parts: false alarms on healthy quiet loops, a look's cost.

``quiet-soak``: every loop of ``examples/quiet_loops.py`` (collectives with sleeps
between, a data loader's queue, an evaluation pass, a checkpoint written in one native
call), ``--soak-runs`` times each (20 by default), 2 ranks under ``dist-launch
--hang-timeout 5`` (twice the longest quiet interval), with two busy processes (one
per CPU of a 2-core machine) spinning beside them all the while. Counted: runs that
ended with a hang report or status 75 (false alarms; the target is 0), and any other
failure. torchrun has no hang detection, so it has nothing to compare here; the peer
is the dist-launch installed in another interpreter (``--soak-python``), e.g. an
earlier release. Not in the default parts: about 12 s a run, 16 minutes for 80 runs
(``nox -s hang_soak``).

``look-cost``: what one look of a worker's beacon costs (the stack, and torch's count
of completed collectives read from a dump without entries), in one rank (gloo, world
size 1) holding a full flight recorder of 2000 entries, the best of 5 rounds of
``LOOKS`` looks; as a share of the rank's time at the fastest look rate (2 a second)
and of a 50 ms training step. The recorder's own cost per collective is
``recorder-cost``'s.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from _lib.multinode import LaunchFailed

ROOT = Path(__file__).resolve().parents[2]
QUIET_LOOPS = ROOT / "examples" / "quiet_loops.py"
# Each loop's steps: long enough that a detector blind to completed collectives fires.
LOOP_STEPS = {"sleeps": 5, "queue": 5, "evaluation": 3, "checkpoint": 3}
SOAK_TIMEOUT = "5"
HUNG = 75
LOOKS = 20000
FASTEST_LOOK_PERIOD = 0.5

LOOK_COST = """\
import sys, time
import torch
import torch.distributed as dist
from dist_launch.in_worker.beacon import _PythonRunning, _stack_key
from dist_launch.in_worker.completed_collectives import CompletedCollectives
import threading

dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
value = torch.ones(1)
for _ in range(2000):  # a full recorder: the dump without entries must not grow with it
    dist.all_reduce(value)
looks = int(sys.argv[2])
counter = CompletedCollectives()
main_id = threading.main_thread().ident
running = _PythonRunning(main_id)
best_stack = best_count = float("inf")
for _ in range(5):
    start = time.perf_counter()
    for _ in range(looks):
        _stack_key(sys._current_frames().get(main_id))
        running.since_last_look()
    best_stack = min(best_stack, (time.perf_counter() - start) / looks)
    start = time.perf_counter()
    for _ in range(looks):
        counter.read()
    best_count = min(best_count, (time.perf_counter() - start) / looks)
assert counter.read() == 2000, counter.read()
print(f"stack {best_stack:.9f} count {best_count:.9f}", flush=True)
dist.destroy_process_group()
"""


def look_cost_part(scratch: Path, env: dict[str, str]) -> dict[str, object]:
    """One beacon look's cost: the stack, the completed collectives, as shares of time."""
    store = scratch / "store-look"
    store.unlink(missing_ok=True)
    result = subprocess.run(
        [sys.executable, "-c", LOOK_COST, f"file://{store}", str(LOOKS)],
        capture_output=True, text=True, timeout=300, check=False,
        env={**env, "TORCH_FR_BUFFER_SIZE": "2000"},
    )  # fmt: skip
    if result.returncode != 0:
        raise LaunchFailed(f"the look-cost run failed:\n{result.stderr[-2000:]}")
    _, stack, _, count = result.stdout.split()
    stack_s, count_s = float(stack), float(count)
    look = stack_s + count_s
    share = look / FASTEST_LOOK_PERIOD
    print(f"\na beacon's look, one rank (gloo), 2000 recorded collectives, best of 5 x {LOOKS}:")
    print(
        f"  stack {stack_s * 1e6:.2f} us + completed collectives {count_s * 1e6:.2f} us = "
        f"{look * 1e6:.2f} us a look: {100 * share:.4f}% of the rank's time at 2 looks a "
        f"second, {100 * share:.4f}% of a 50 ms step (target: under 1%)"
    )
    return {
        "look_cost_us": {"stack": round(stack_s * 1e6, 3), "collectives": round(count_s * 1e6, 3)},
        "look_cost_percent": round(100 * share, 5),
    }


@contextmanager
def _busy(processes: int) -> Iterator[None]:
    """``processes`` Python processes spinning on a CPU each, stopped on the way out."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)
    ]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait(timeout=30)


def _soak_run(python: str, loop: str, scratch: Path, env: dict[str, str]) -> tuple[str, float]:
    """One run of ``loop``: ``ok``, ``false alarm`` or ``failed (status N)``; seconds."""
    started = time.monotonic()
    result = subprocess.run(
        [python, "-m", "dist_launch", "-n", "2", "--hang-timeout", SOAK_TIMEOUT,
         str(QUIET_LOOPS), loop, str(LOOP_STEPS[loop])],
        cwd=scratch, capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip
    seconds = time.monotonic() - started
    if result.returncode == HUNG or "dist-launch: hang" in result.stderr:
        return "false alarm", seconds
    if result.returncode != 0 or result.stdout.count(f"finished {loop}") != 2:
        return f"failed (status {result.returncode})", seconds
    return "ok", seconds


def quiet_soak_part(
    scratch: Path, env: dict[str, str], runs: int, python: str | None = None
) -> dict[str, object]:
    """Every quiet loop ``runs`` times beside two busy processes; false alarms counted."""
    python = python or sys.executable
    version = subprocess.run(
        [python, "-c", "import dist_launch; print(dist_launch.__version__)"],
        capture_output=True, text=True, check=True, timeout=120, env=env,
    ).stdout.strip()  # fmt: skip
    print(
        f"\nquiet loops (examples/quiet_loops.py), dist-launch {version}, 2 ranks, "
        f"--hang-timeout {SOAK_TIMEOUT}, {runs} runs each, 2 busy processes beside them:"
    )
    results: dict[str, dict[str, object]] = {}
    with _busy(2):
        for loop in LOOP_STEPS:
            endings: dict[str, int] = {}
            longest = 0.0
            for _ in range(runs):
                ending, seconds = _soak_run(python, loop, scratch, env)
                endings[ending] = endings.get(ending, 0) + 1
                longest = max(longest, seconds)
            alarms = endings.get("false alarm", 0)
            print(
                f"  {loop:<11} {alarms} false alarms in {runs} runs; "
                + ", ".join(f"{n} {ending}" for ending, n in sorted(endings.items()))
                + f"; longest run {longest:.1f} s"
            )
            results[loop] = {"runs": runs, "false_alarms": alarms, "endings": endings}
    total = sum(int(str(r["false_alarms"])) for r in results.values())
    print(f"  false alarms: {total} in {runs * len(LOOP_STEPS)} runs (target: 0)")
    return {"quiet_soak": {"dist_launch": version, "loops": results, "false_alarms": total}}
