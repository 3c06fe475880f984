"""benchmarks/launch.py's diagnosis parts: the hang verdict, the recorder's cost, slow ranks.

``verdict``: 4 ranks on gloo; every rank calls the same line, but rank 2 passes another
process group, so the stacks cannot tell who is wrong. dist-launch runs with
``--hang-timeout VERDICT_TIMEOUT``. Measured: the onset (rank 2's stamp as it enters
the wrong collective) to the verdict line on stderr, and the collection alone (from
the alarm to every rank's records in hand: ``collect_s`` in hang.json). The floor is the
timeout itself: nothing can report a hang before it. torchrun has no verdict (null); its
peer here is torch's own analyser, ``python -m torch.distributed.flight_recorder.fr_trace``,
run on the four ranks' own dumps (``_dump_fr_trace``, taken by a thread in each rank
while the hang is on): the result says whether it names the rank or crashes on gloo's
records.

``recorder-cost``: what the recorder and the reports cost a rank, three ways. (1) One
rank (gloo, world size 1), ``RECORDER_OPS`` all_reduces of one float with torch's flight
recorder off (``TORCH_FR_BUFFER_SIZE=0``) and on (2000): the time it adds to each
collective, against a 50 ms step with one collective. (2) The dump a window's request
costs a rank holding 2000 entries (the GIL is held meanwhile), against the default
60 s window and a 5 s one. (3) End to end: 2 ranks, steps of about 50 ms (matmuls, then
one all_reduce), nothing on (``TORCH_FR_BUFFER_SIZE=0 --hang-timeout off --slow-ranks
off``) against the defaults (recorder, ``--hang-timeout auto``, ``--slow-ranks 60``),
the best of ``COST_REPEAT`` interleaved runs, wall and main-thread CPU per step; on a
shared 2-core machine this moves by several percent from run to run, so (1) and (2)
are what resolve 1%.

``slow-rank``: 3 ranks, 50 ms steps, rank 1 sleeps 100, 200 or 400 ms before each
all_reduce, ``--slow-ranks SLOW_WINDOW``: the lag the report gives against the one
injected, and a balanced run, which must name no rank.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from _lib.hang import STEPS, _timed_lines, best_step_times
from _lib.multinode import LaunchFailed, launcher

VERDICT_TIMEOUT = 10.0
COST_STEPS = 120
COST_REPEAT = 3
SLOW_WINDOW = 5.0
SLOW_INJECTED_MS = (100, 200, 400)

WRONG_GROUP = """\
import os, sys, threading, time
import torch
import torch.distributed as dist

def dump_later(directory):
    time.sleep(3)  # the hang is on by then
    data = torch._C._distributed_c10d._dump_fr_trace(includeCollectives=True, onlyActive=False)
    with open(os.path.join(directory, f"rank_{dist.get_rank()}"), "wb") as f:
        f.write(data)

dist.init_process_group("gloo")
pair = dist.new_group([1, 2])
value = torch.ones(4)
for _ in range(5):
    dist.all_reduce(value)
group = pair if dist.get_rank() == 2 else None
if dist.get_rank() == 2:
    with open(sys.argv[1], "w") as f:
        f.write(repr(time.time()))
threading.Thread(target=dump_later, args=(sys.argv[2],), daemon=True).start()
dist.all_reduce(value, group=group)
"""

LATE = """\
import sys, time
import torch
import torch.distributed as dist

delay, steps = float(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
value = torch.ones(4)
for _ in range(steps):
    time.sleep(0.05)
    if dist.get_rank() == 1:
        time.sleep(delay)
    dist.all_reduce(value)
"""


def _fr_trace(directory: Path) -> str:
    """What torch's own analyser makes of the dumps: ``ok: ...`` or ``crashed: ...``."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
         str(directory), "--prefix", "rank_"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    if result.returncode != 0:
        error = next((line for line in reversed(lines) if "Error" in line), lines[-1:] or [""])
        return f"crashed: {error if isinstance(error, str) else error[0]}"
    return "ok: " + " / ".join(lines[-3:])


def verdict_part(scratch: Path, env: dict[str, str], ranks: int = 4) -> dict[str, object]:
    """A hang's onset to the verdict, the records' collection, and torch's analyser."""
    print(f"\nhang verdict, {ranks} ranks, rank 2 passes another process group (every stack at "
          f"the same line), --hang-timeout {VERDICT_TIMEOUT:g}:")  # fmt: skip
    script = scratch / "wrong_group.py"
    script.write_text(WRONG_GROUP)
    stamp = scratch / "wrong_at"
    dumps = scratch / "fr_dumps"
    dumps.mkdir(exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="verdict-logs-", dir=scratch))
    argv = [*launcher("dist-launch"), "-n", str(ranks), "--hang-timeout",
            f"{VERDICT_TIMEOUT:g}", "--grace-period", "1", "--log-dir", str(logs),
            "--run-id", "v", str(script), str(stamp), str(dumps)]  # fmt: skip
    status, lines = _timed_lines(argv, env)
    output = "".join(line for _, line in lines)
    verdict = next(
        ((at, line) for at, line in lines if line.startswith("dist-launch: hang: ")), None
    )
    if status != 75 or verdict is None or not stamp.exists():
        raise LaunchFailed(f"expected a hang's verdict:\n{output[-2000:]}")
    onset = float(stamp.read_text())
    hang = json.loads((logs / "v" / "attempt_0" / "hang.json").read_text())
    to_verdict = round(verdict[0] - onset, 3)
    analyser = _fr_trace(dumps)
    print(f"  {verdict[1].strip()}")
    print(f"  onset to verdict: dist-launch {to_verdict:.2f} s (floor: the timeout, "
          f"{VERDICT_TIMEOUT:g} s; ratio {to_verdict / VERDICT_TIMEOUT:.2f}); "
          f"records collected in {hang['collect_s']:.3f} s; torchrun: no verdict")  # fmt: skip
    print(f"  torch's fr_trace on the same ranks' dumps: {analyser}")
    return {
        "verdict_ranks": ranks,
        "verdict_floor_s": VERDICT_TIMEOUT,
        "hang_to_verdict_s": {"dist-launch": to_verdict, "torchrun": None},
        "verdict_collect_s": hang["collect_s"],
        "verdict_line": verdict[1].strip(),
        "fr_trace_on_gloo": analyser,
    }


def _calibrate(env: dict[str, str]) -> int:
    """How many 512x512 matmuls make a step of about 50 ms here (one rank, no launcher)."""
    code = (
        "import time, torch\ntorch.set_num_threads(1)\na = torch.randn(512, 512)\n"
        "b = a\nfor _ in range(20): b = torch.tanh(b @ a)\n"
        "start = time.perf_counter()\nfor _ in range(50): b = torch.tanh(b @ a)\n"
        "print((time.perf_counter() - start) / 50)"
    )
    per = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True, env=env, timeout=120).stdout)  # fmt: skip
    return max(1, round(0.05 / per))


RECORDER_OPS = 20000
COST_SETTINGS = {
    "off": (["--hang-timeout", "off", "--slow-ranks", "off"], {"TORCH_FR_BUFFER_SIZE": "0"}),
    "defaults": ([], {}),
}

PER_COLLECTIVE = """\
import sys, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
value = torch.ones(1)
for _ in range(1000):
    dist.all_reduce(value)
ops = int(sys.argv[2])
start = time.perf_counter()
for _ in range(ops):
    dist.all_reduce(value)
per_op = (time.perf_counter() - start) / ops
for _ in range(2000 - (1000 + ops) % 2000):  # a full ring of 2000 entries to dump
    dist.all_reduce(value)
dump = torch._C._distributed_c10d._dump_fr_trace_json
best = float("inf")
for _ in range(5):
    started = time.perf_counter()
    dump(includeCollectives=True, onlyActive=False)
    best = min(best, time.perf_counter() - started)
print(f"per_op {per_op:.9f} dump {best:.6f}", flush=True)
# Without it gloo's threads can outlive the interpreter's teardown: std::terminate.
dist.destroy_process_group()
"""


def _per_collective(scratch: Path, env: dict[str, str], buffer: str) -> tuple[float, float]:
    """Seconds per all_reduce of one float, and per dump of the ring, with ``buffer``."""
    store = scratch / f"store-{buffer}"
    store.unlink(missing_ok=True)
    result = subprocess.run(
        [sys.executable, "-c", PER_COLLECTIVE, f"file://{store}", str(RECORDER_OPS)],
        capture_output=True, text=True, timeout=300, check=False,
        env={**env, "TORCH_FR_BUFFER_SIZE": buffer},
    )  # fmt: skip
    if result.returncode != 0:
        raise LaunchFailed(f"the per-collective run failed:\n{result.stderr[-2000:]}")
    _, per_op, _, dump = result.stdout.split()
    return float(per_op), float(dump)


def recorder_cost_part(scratch: Path, env: dict[str, str]) -> dict[str, object]:
    """The recorder's cost per collective, a window's dump, and the defaults end to end."""
    base_env = {k: v for k, v in env.items() if "BUFFER_SIZE" not in k}
    print(f"\nflight recorder's cost, one rank (gloo), {RECORDER_OPS} all_reduces of one "
          "float, best of 5 interleaved runs:")  # fmt: skip
    per_op: dict[str, float] = {}
    dump = 0.0
    for _ in range(5):
        for buffer in ("0", "2000"):
            op_s, dump_s = _per_collective(scratch, base_env, buffer)
            per_op[buffer] = min(per_op.get(buffer, op_s), op_s)
            if buffer == "2000":
                dump = dump_s if not dump else min(dump, dump_s)
    added = per_op["2000"] - per_op["0"]
    print(
        f"  per all_reduce: off {per_op['0'] * 1e6:.2f} us, on {per_op['2000'] * 1e6:.2f} us: "
        f"{added * 1e6:+.2f} us, {100 * added / 0.05:+.4f}% of a 50 ms step with one collective"
    )
    print(
        f"  a window's dump of 2000 entries: {dump * 1e3:.1f} ms of the GIL: "
        f"{100 * dump / 60:.3f}% of the default 60 s window, {100 * dump / 5:.2f}% of a 5 s one"
    )
    matmuls = _calibrate(env)
    print(
        f"\nend to end, 2 ranks, {COST_STEPS} steps of {matmuls} 512x512 matmuls (~50 ms) "
        f"and an all_reduce, best of {COST_REPEAT} runs, nothing on against the defaults:"
    )
    script = scratch / "steps50.py"
    script.write_text(STEPS)
    commands = {
        name: [*launcher("dist-launch"), "-n", "2", *flags, str(script), str(COST_STEPS),
               str(matmuls), "512"]
        for name, (flags, _) in COST_SETTINGS.items()
    }  # fmt: skip
    envs = {name: {**base_env, **extra} for name, (_, extra) in COST_SETTINGS.items()}
    best, best_cpu = best_step_times(commands, envs, COST_REPEAT)
    wall_percent = round(100 * (best["defaults"] / best["off"] - 1), 2)
    cpu_percent = round(100 * (best_cpu["defaults"] / best_cpu["off"] - 1), 2)
    print(f"  off {best['off'] * 1e3:.2f} ms wall, {best_cpu['off'] * 1e3:.2f} ms CPU; defaults "
          f"{best['defaults'] * 1e3:.2f} ms wall ({wall_percent:+.2f}%), "
          f"{best_cpu['defaults'] * 1e3:.2f} ms CPU ({cpu_percent:+.2f}%)")  # fmt: skip
    print("  target: under 1%")
    return {
        "recorder_cost_per_collective_us": {
            "off": round(per_op["0"] * 1e6, 3),
            "on": round(per_op["2000"] * 1e6, 3),
        },
        "recorder_cost_step_percent": round(100 * added / 0.05, 4),
        "recorder_dump_ms": round(dump * 1e3, 2),
        "recorder_dump_window_percent": {
            "60": round(100 * dump / 60, 4),
            "5": round(100 * dump / 5, 3),
        },
        "defaults_cost_step_s": {name: round(value, 6) for name, value in best.items()},
        "defaults_cost_percent": wall_percent,
        "defaults_cost_cpu_step_s": {name: round(value, 6) for name, value in best_cpu.items()},
        "defaults_cost_cpu_percent": cpu_percent,
    }


_WARNING = re.compile(r"WARNING: rank (\d+) enters \S+ (\d+) ms after the others")


def _reported(
    delay_ms: int, steps: int, scratch: Path, env: dict[str, str]
) -> list[tuple[int, int]]:
    script = scratch / "late.py"
    script.write_text(LATE)
    argv = [*launcher("dist-launch"), "-n", "3", "--slow-ranks", f"{SLOW_WINDOW:g}",
            str(script), f"{delay_ms / 1000:g}", str(steps)]  # fmt: skip
    status, lines = _timed_lines(argv, env)
    output = "".join(line for _, line in lines)
    if status != 0:
        raise LaunchFailed(f"{argv} failed:\n{output[-2000:]}")
    return [(int(m[1]), int(m[2])) for _, line in lines if (m := _WARNING.search(line))]


def slow_rank_part(scratch: Path, env: dict[str, str]) -> dict[str, object]:
    """The slow-rank report's lag against an injected delay; a balanced run names nobody."""
    print(f"\nslow-rank report, 3 ranks, 50 ms steps, rank 1 late by a known delay, "
          f"--slow-ranks {SLOW_WINDOW:g}:")  # fmt: skip
    reported_ms: list[float | None] = []
    for delay in SLOW_INJECTED_MS:
        steps = int(2.5 * SLOW_WINDOW / (0.05 + delay / 1000)) + 10  # two windows or more
        found = _reported(delay, steps, scratch, env)
        lags = [lag for rank, lag in found if rank == 1]
        others = sorted({rank for rank, _ in found if rank != 1})
        lag = sum(lags) / len(lags) if lags else None
        reported_ms.append(None if lag is None else round(lag, 1))
        shown = "not reported" if lag is None else f"{lag:.0f} ms ({100 * (lag / delay - 1):+.1f}%)"
        print(
            f"  injected {delay} ms: reported {shown}"
            + (f"; also named {others}" if others else "")
        )
    balanced = _reported(0, int(2.5 * SLOW_WINDOW / 0.05) + 10, scratch, env)
    named = sorted({rank for rank, _ in balanced})
    print(f"  balanced run: named {named or 'no rank'}")
    errors = [
        round(100 * abs(lag / delay - 1), 1)
        for lag, delay in zip(reported_ms, SLOW_INJECTED_MS, strict=True)
        if lag is not None
    ]
    return {
        "slow_rank_window_s": SLOW_WINDOW,
        "slow_rank_injected_ms": list(SLOW_INJECTED_MS),
        "slow_rank_reported_ms": reported_ms,
        "slow_rank_error_percent": max(errors) if errors else None,
        "balanced_named_ranks": named,
    }
