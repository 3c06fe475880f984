"""Hang detection with real processes: stuck ranks, the report, restarts, torch's timers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from launcher_nodes import LAUNCH, run_nodes

pytestmark = pytest.mark.timeout(240)

# The launcher's exit status after a hang with no restart left (ExitCode.HUNG).
HUNG = 75
# Short enough for a quick test, long enough for a loaded machine's start-up.
TIMEOUT = "8"

# Rank 1 waits for a batch for ever; the others block in the next all_reduce.
SLEEPER = """\
import time
import torch
import torch.distributed as dist

def load_next_batch():
    time.sleep(100_000)

dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
print("warm", flush=True)
if dist.get_rank() == 1:
    load_next_batch()
dist.all_reduce(value)
"""

# Ranks 0 and 1 wait in an all_reduce of the world; rank 2 in a barrier of a group it
# shares with rank 1, which never comes.
OTHER_COLLECTIVE = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
pair = dist.new_group([1, 2])
print("warm", flush=True)
if dist.get_rank() == 2:
    dist.barrier(group=pair)
else:
    dist.all_reduce(torch.ones(1))
"""

# Training steps of busy work, every 20th ten times longer (an evaluation pass) and
# longer than the hang timeout; nothing is printed until the end.
EVALUATION = """\
import sys, time

step_seconds = float(sys.argv[1])

def work(seconds):
    end = time.monotonic() + seconds
    total = 0
    while time.monotonic() < end:
        total += sum(range(100))
    return total

def train_step():
    return work(step_seconds)

def evaluate():
    return sum(work(step_seconds) for _ in range(10))

for step in range(22):
    if step % 20 == 19:
        evaluate()
    else:
        train_step()
print("finished", flush=True)
"""

# Rank 1 overstays a torch elastic timer; the others wait in an all_reduce.
FILE_TIMER = """\
import os, time
import torch
import torch.distributed as dist
from torch.distributed.elastic import timer

timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
dist.init_process_group("gloo")
print("warm", flush=True)
if dist.get_rank() == 1:
    with timer.expires(after=1, scope="read_shard"):
        time.sleep(100_000)
dist.all_reduce(torch.ones(1))
"""


def _launch(
    tmp_path: Path,
    text: str,
    *args: str,
    env: dict[str, str] | None = None,
    script_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(text)
    return subprocess.run(
        [*LAUNCH, *args, str(script), *script_args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env={**os.environ, **(env or {})},
    )


def _verdict(stderr: str) -> str:
    """The hang report's first line: the verdict, before the stacks."""
    return next(line for line in stderr.splitlines() if line.startswith("dist-launch: hang"))


def _summary(stderr: str) -> str:
    """The one-line summary under the first hang report."""
    lines = stderr.splitlines()
    index = next(i for i, line in enumerate(lines) if line.startswith("dist-launch: hang on "))
    return lines[index + 1].strip()


@pytest.mark.processes
def test_a_rank_sleeping_for_ever_is_named_and_the_exit_status_says_hung(tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    result = _launch(
        tmp_path,
        SLEEPER,
        "-n", "3", "--hang-timeout", TIMEOUT, "--log-dir", str(log_dir), "--run-id", "r",
    )  # fmt: skip
    assert result.returncode == HUNG, result.stderr
    assert _summary(result.stderr) == (
        "ranks 0, 2 wait in all_reduce at train.py:14; "
        "rank 1 is elsewhere: train.py:6 in load_next_batch"
    ), result.stderr
    assert "exit status 75" in result.stderr
    assert (log_dir / "r" / "attempt_0" / "hang.txt").read_text().startswith("dist-launch: hang")
    error = json.loads((log_dir / "r" / "attempt_0" / "1" / "error.json").read_text())
    assert "rank 1 is elsewhere" in error["message"]["message"]
    assert "load_next_batch" in error["message"]["extraInfo"]["py_callstack"]
    # The flight records say which collective the others wait in, and who never came.
    assert _verdict(result.stderr) == (
        "dist-launch: hang: rank 1 never entered all_reduce #2 on the default group; "
        "ranks 0, 2 wait in it; rank 1 is at train.py:6 in load_next_batch"
    ), result.stderr
    hang = json.loads((log_dir / "r" / "attempt_0" / "hang.json").read_text())
    assert hang["collective"] == {
        "group": "default", "backend": "gloo", "seq": 2, "op": "all_reduce",
        "sizes": [[1]], "members": [0, 1, 2],
    }  # fmt: skip
    assert (hang["waiting"], hang["behind"], hang["unknown"]) == ([0, 2], [1], [])
    assert hang["source"] == "flight recorder"
    assert sorted(hang["ranks"]) == ["0", "1", "2"]
    sleeper = hang["ranks"]["1"]
    assert sleeper["stack"][0].endswith("train.py:6 in load_next_batch"), sleeper["stack"]
    assert sleeper["groups"]["default"] == {
        "backend": "gloo",
        "last_enqueued": 1,
        "last_completed": 1,
    }
    assert hang["ranks"]["0"]["groups"]["default"]["pending"] == {
        "seq": 2,
        "op": "all_reduce",
        "sizes": [[1]],
    }
    assert f"dist-launch: hang details in {log_dir}/r/attempt_0/hang.json" in result.stderr


@pytest.mark.processes
def test_a_hang_restarts_the_group_within_max_restarts(tmp_path: Path) -> None:
    result = _launch(tmp_path, SLEEPER, "-n", "2", "--hang-timeout", TIMEOUT, "--max-restarts", "1")
    assert result.returncode == HUNG, result.stderr
    assert "restarting the local worker group (restart 1 of 1) after: hang:" in result.stderr
    assert result.stderr.count("dist-launch: hang on ") == 2
    assert result.stdout.count("warm") == 4  # two ranks, two attempts


@pytest.mark.processes
def test_pet_hang_timeout_is_read_and_without_records_the_stacks_decide(tmp_path: Path) -> None:
    result = _launch(
        tmp_path,
        SLEEPER,
        "-n", "2", "--grace-period", "1",
        env={"PET_HANG_TIMEOUT": TIMEOUT, "TORCH_FR_BUFFER_SIZE": "0"},
    )  # fmt: skip
    assert result.returncode == HUNG, result.stderr
    assert f"(--hang-timeout {TIMEOUT})" in result.stderr
    # The user's 0 is kept: the verdict falls back to the stacks and says why.
    assert (
        "dist-launch: hang: no flight records (TORCH_FR_BUFFER_SIZE=0 turns torch's flight "
        "recorder off on ranks 0-1); from the stacks: rank 1 is at train.py:6 in load_next_batch"
    ) in result.stderr.splitlines(), result.stderr


@pytest.mark.processes
def test_a_rank_in_another_collective_is_named(tmp_path: Path) -> None:
    result = _launch(tmp_path, OTHER_COLLECTIVE, "-n", "3", "--hang_timeout", TIMEOUT)
    assert result.returncode == HUNG, result.stderr
    assert _summary(result.stderr) == (
        "ranks 0-1 wait in all_reduce at train.py:10; rank 2 is elsewhere: barrier at train.py:8"
    ), result.stderr


def _hung_with_records(
    tmp_path: Path, script: str, nproc: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Launches a script that hangs, with a log directory; the run and its hang.json."""
    log_dir = tmp_path / "logs"
    result = _launch(
        tmp_path,
        script,
        "-n", nproc, "--hang-timeout", TIMEOUT, "--grace-period", "1",
        "--log-dir", str(log_dir), "--run-id", "h",
    )  # fmt: skip
    assert result.returncode == HUNG, result.stderr
    return result, json.loads((log_dir / "h" / "attempt_0" / "hang.json").read_text())


# Every rank at the same line; rank 2 passes the wrong process group.
WRONG_GROUP = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
pair = dist.new_group([1, 2])
value = torch.ones(4)
for _ in range(5):
    dist.all_reduce(value)
print("warm", flush=True)
group = pair if dist.get_rank() == 2 else None
dist.all_reduce(value, group=group)
"""


@pytest.mark.processes
def test_a_rank_passing_another_group_is_named_behind(tmp_path: Path) -> None:
    result, hang = _hung_with_records(tmp_path, WRONG_GROUP, "4")
    assert _verdict(result.stderr) == (
        "dist-launch: hang: rank 2 never entered all_reduce #6 on the default group; "
        "ranks 0-1, 3 wait in it; rank 2 waits in all_reduce #1 on group 1"
    ), result.stderr
    # The stacks alone cannot tell: every rank is at the same line.
    assert _summary(result.stderr) == "ranks 0-3 wait in all_reduce at train.py:11"
    assert {key: hang["collective"][key] for key in ("group", "seq", "op")} == {
        "group": "default", "seq": 6, "op": "all_reduce"
    }  # fmt: skip
    assert (hang["waiting"], hang["behind"]) == ([0, 1, 3], [2])
    (pair,) = [group for group in hang["groups"] if group["group"] != "default"]
    assert (pair["members"], pair["waiting"], pair["behind"]) == ([1, 2], [2], [1])


# Rank 1 never comes; rank 2 runs the collective with another size than ranks 0 and 3.
DESYNC = """\
import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.all_reduce(torch.ones(4))
print("warm", flush=True)
rank = dist.get_rank()
if rank == 1:
    time.sleep(100_000)
dist.all_reduce(torch.ones(8 if rank == 2 else 4))
"""


@pytest.mark.processes
def test_a_desync_is_reported(tmp_path: Path) -> None:
    result, hang = _hung_with_records(tmp_path, DESYNC, "4")
    assert (
        "dist-launch: hang: desync on the default group at #2: "
        "ranks 0, 3 run all_reduce [4], rank 2 runs all_reduce [8]"
    ) in result.stderr.splitlines(), result.stderr
    assert hang["behind"] == [1]
    assert hang["desync"] == [
        {
            "group": "default",
            "seq": 2,
            "ops": {"0": "all_reduce [4]", "2": "all_reduce [8]", "3": "all_reduce [4]"},
        }
    ]


@pytest.mark.processes
def test_an_evaluation_pass_longer_than_the_timeout_is_not_a_hang(tmp_path: Path) -> None:
    # Steps of 0.5 s, the evaluation 5 s: a detector watching the step rate alone
    # would call the evaluation hung at 4 s.
    log_dir = tmp_path / "logs"
    result = _launch(
        tmp_path,
        EVALUATION,
        "-n", "2", "--hang-timeout", "4", "--log-dir", str(log_dir), "--run-id", "e",
        script_args=("0.5",),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "dist-launch: hang" not in result.stderr
    assert result.stdout.count("finished") == 2
    assert (log_dir / "e" / "attempt_0").is_dir()
    assert not list(log_dir.rglob("hang.*"))


# examples/quiet_loops.py: healthy loops whose main thread sits in one native call
# between collectives; each loop's quiet interval is at most 2.5 s.
QUIET_LOOPS = Path(__file__).resolve().parents[3] / "examples" / "quiet_loops.py"


@pytest.mark.processes
@pytest.mark.parametrize(
    ("loop", "steps"), [("sleeps", 5), ("queue", 5), ("evaluation", 3), ("checkpoint", 3)]
)
def test_a_quiet_loop_whose_collectives_complete_is_not_hung(
    tmp_path: Path, loop: str, steps: int
) -> None:
    # Each loop runs for at least 1.5 times the timeout with one stack and no output:
    # only its completed collectives show that it makes progress.
    log_dir = tmp_path / "logs"
    result = subprocess.run(
        [*LAUNCH, "-n", "2", "--hang-timeout", "5", "--log-dir", str(log_dir),
         str(QUIET_LOOPS), loop, str(steps)],
        cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "dist-launch: hang" not in result.stderr
    assert result.stdout.count(f"finished {loop}") == 2
    assert not list(log_dir.rglob("hang.*"))


# Both ranks complete two all_reduces, then sleep for ever outside any collective.
STUCK_OUTSIDE = """import time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
dist.all_reduce(value)
time.sleep(100_000)
"""


@pytest.mark.processes
def test_ranks_stuck_outside_collectives_are_named_with_no_collective_pending(
    tmp_path: Path,
) -> None:
    log_dir = tmp_path / "logs"
    result = _launch(
        tmp_path,
        STUCK_OUTSIDE,
        "-n", "2", "--hang-timeout", "4", "--log-dir", str(log_dir), "--run-id", "s",
    )  # fmt: skip
    assert result.returncode == HUNG, result.stderr
    assert _verdict(result.stderr) == (
        "dist-launch: hang: no collective is pending; ranks 0-1 are at train.py:9 in <module>; "
        "the last collective completed was all_reduce #2 on the default group"
    ), result.stderr
    hang = json.loads((log_dir / "s" / "attempt_0" / "hang.json").read_text())
    assert hang["collective"] is None
    assert hang["source"] == "flight recorder"


@pytest.mark.processes
def test_an_expired_torch_elastic_timer_is_handled_as_a_hang(tmp_path: Path) -> None:
    result = _launch(
        tmp_path,
        FILE_TIMER,
        "-n", "2", "--hang-timeout", "off",
        env={"TORCHELASTIC_ENABLE_FILE_TIMER": "1"},
    )  # fmt: skip
    assert result.returncode == HUNG, result.stderr
    assert "rank 1's torch elastic timer 'read_shard' expired" in result.stderr
    assert _summary(result.stderr) == (
        "rank 0 waits in all_reduce at train.py:12; rank 1 is elsewhere: train.py:11 in <module>"
    ), result.stderr


# Which signals the launcher's sampler thread blocks, read from the kernel.
SAMPLER_MASK = """\
import signal, threading

(sampler,) = [t for t in threading.enumerate() if t.name == "dist-launch-progress"]
with open(f"/proc/self/task/{sampler.native_id}/status") as status:
    line = next(line for line in status if line.startswith("SigBlk:"))
blocked = int(line.split()[1], 16)
for sig in (signal.SIGWINCH, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGSEGV):
    print(f"{sig.name} blocked={bool(blocked >> (sig - 1) & 1)}", flush=True)
print(f"main blocks {sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))}", flush=True)
"""


@pytest.mark.processes
def test_the_sampler_thread_takes_no_signal_meant_for_the_script(tmp_path: Path) -> None:
    # A script that blocks SIGWINCH to sigtimedwait() for it would otherwise lose the
    # signal to the sampler, the one thread of the process that does not block it.
    result = _launch(tmp_path, SAMPLER_MASK, "-n", "1", "--hang-timeout", "60")
    assert result.returncode == 0, result.stderr
    for name in ("SIGWINCH", "SIGTERM", "SIGINT", "SIGUSR1"):
        assert f"{name} blocked=True" in result.stdout, result.stdout
    assert "SIGSEGV blocked=False" in result.stdout, result.stdout  # faulthandler's
    assert "main blocks []" in result.stdout, result.stdout


# Every step is one call that keeps the stack as it is for longer than the timeout (a
# native call, here a sleep): only report_progress() tells the launcher it is alive.
ONE_LONG_CALL_PER_STEP = """\
import sys, time
import dist_launch

for step in range(4):
    time.sleep(3)
    if sys.argv[1] == "report":
        dist_launch.report_progress()
print("finished", flush=True)
"""


@pytest.mark.processes
@pytest.mark.parametrize("report", [True, False], ids=["reported", "silent"])
def test_report_progress_keeps_a_rank_of_long_native_calls_alive(
    tmp_path: Path, report: bool
) -> None:
    result = _launch(
        tmp_path,
        ONE_LONG_CALL_PER_STEP,
        "-n", "2", "--hang-timeout", "5",
        script_args=("report" if report else "silent",),
    )  # fmt: skip
    if report:
        assert result.returncode == 0, result.stderr
        assert result.stdout.count("finished") == 2
    else:
        # The limit report_progress() is for: the same stack, step after step.
        assert result.returncode == HUNG, result.stderr


def test_report_progress_outside_dist_launch_does_nothing() -> None:
    import dist_launch

    assert "report_progress" in dist_launch.__all__
    assert dist_launch.report_progress() is None


# Rank 0 (node 0) evaluates alone for longer than the timeout; rank 1 (node 1) waits
# for it in a barrier, its stack unchanged.
ONE_NODE_EVALUATES = """\
import time
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 0:
    end = time.monotonic() + 8
    while time.monotonic() < end:
        sum(range(1000))
dist.barrier()
print("finished", flush=True)
"""


@pytest.mark.processes
def test_a_node_waiting_for_another_nodes_progress_is_not_hung(tmp_path: Path) -> None:
    from dist_core.ports import get_unused_port

    script = tmp_path / "train.py"
    script.write_text(ONE_NODE_EVALUATES)
    common = [
        "-n", "1", "--nnodes", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{get_unused_port()}", "--rdzv-id", "eval",
        "--hang-timeout", "4",
    ]  # fmt: skip
    nodes, outputs = run_nodes([[*common, str(script)]] * 2, tmp_path, timeout=150)
    for node, (stdout, stderr) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, stderr
        assert "dist-launch: hang" not in stderr
        assert "finished" in stdout
