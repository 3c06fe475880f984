"""The dist-launch command with real processes, real signals and real failures."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
from launcher_nodes import LAUNCH, run_nodes
from launcher_scripts import (
    TORCHRUN_SCRIPT,
    WAITING_SCRIPT,
    read_ready_pids,
    read_until,
    write_script,
)
from launcher_signals import default_signal_handling

from dist_core.ports import get_unused_port

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]


# Rank BAD fails in the way named by argv[1]; the other ranks block in a barrier.
FAILING_SCRIPT = """\
import ctypes, os, signal, sys
import torch.distributed as dist

mode, bad = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo")
dist.barrier()  # every rank's connections made: the others' failure is BAD's alone
if dist.get_rank() == bad:
    if mode == "raise":
        raise RuntimeError(f"deliberate failure on rank {bad}")
    if mode == "exit":
        sys.exit(3)
    if mode == "_exit":
        os._exit(7)
    if mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "segfault":
        ctypes.string_at(0)
dist.barrier()
"""


# Each rank prints its pid and blocks opening the FIFO argv[1] on the same line: wherever
# a stack dump finds it after "ready", its innermost Python frame is that one line.
HUNG_SCRIPT = """\
import os, sys
print("ready", os.getpid(), flush=True); open(sys.argv[1]).read(); print("done", flush=True)
"""


def _launch(*args: str, cwd: Path, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LAUNCH, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def _wait_for_output(process: subprocess.Popen[bytes], text: bytes, count: int) -> None:
    read_until(process.stdout, text, count)


def _alive(pid: int) -> bool:
    """True while ``pid`` exists in /proc and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_until_gone(pids: list[int], timeout: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if _alive(pid)]
        if not alive:
            return []
        time.sleep(0.05)
    return [pid for pid in pids if _alive(pid)]


def test_unmodified_torchrun_script_runs(tmp_path: Path) -> None:
    script = write_script(tmp_path, "train.py", TORCHRUN_SCRIPT)
    logs = tmp_path / "logs"
    result = _launch(
        "-n", "2", "--log-dir", str(logs), "--run-id", "r1", script, "--lr", "0.1", cwd=tmp_path
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"[rank{rank}]: sum 1 world 2 argv ['--lr', '0.1']" in result.stdout
        env_line = next(
            line for line in result.stdout.splitlines() if line.startswith(f"[rank{rank}]: env")
        )
        for expected in (
            f"RANK={rank}",
            f"LOCAL_RANK={rank}",
            "GROUP_RANK=0",
            "NODE_RANK=0",
            "WORLD_SIZE=2",
            "LOCAL_WORLD_SIZE=2",
            f"ROLE_RANK={rank}",
            "ROLE_WORLD_SIZE=2",
            "GROUP_WORLD_SIZE=1",
            "MASTER_ADDR=127.0.0.1",
            "TORCHELASTIC_RESTART_COUNT=0",
            "TORCHELASTIC_MAX_RESTARTS=0",
            "OMP_NUM_THREADS=1",
        ):
            assert f" {expected}" in env_line, (expected, env_line)
        assert "<unset>" not in env_line
        log = (logs / "r1" / "attempt_0" / str(rank) / "stdout.log").read_text()
        assert "sum 1 world 2" in log and "[rank" not in log


def test_module_target_and_python_dash_m(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text(
        "import os, sys\nprint('module', __name__, os.environ['RANK'], sys.argv[1:])\n"
    )
    result = _launch("-n", "2", "--start-method", "spawn", "-m", "pkg.job", "x", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[rank1]: module __main__ 1 ['x']" in result.stdout


@pytest.mark.parametrize(
    ("mode", "status", "shown"),
    [
        # The launcher's code is the class (dist_launch.ExitCode), the report the rank's.
        ("raise", 1, "RuntimeError: deliberate failure on rank 1"),
        ("exit", 1, "SystemExit: 3"),
        ("_exit", 1, "exit code 7"),
        ("sigkill", 137, "signal SIGKILL"),
        ("segfault", 137, "string_at"),
    ],
)
def test_failing_rank_stops_the_others_and_comes_first(
    tmp_path: Path, mode: str, status: int, shown: str
) -> None:
    script = write_script(tmp_path, "fail.py", FAILING_SCRIPT)
    result = _launch("-n", "3", "--grace-period", "2", script, mode, "1", cwd=tmp_path)
    assert result.returncode == status, result.stderr
    report = result.stderr[result.stderr.index("dist-launch: rank") :]
    head, _, others = report.partition("other ranks:")
    assert head.startswith("dist-launch: rank 1 (local rank 1, node 0) failed first"), report
    assert shown in head, report
    assert "rank 0 (local rank 0, node 0)" in others and "rank 2 (local rank 2, node 0)" in others


def test_root_cause_through_the_cli(tmp_path: Path) -> None:
    """Rank 2 fails; the others fail after it, because of it. (The library test repeats
    this ten times; both go through the same supervisor.)"""
    script = write_script(tmp_path, "fail.py", FAILING_SCRIPT)
    result = _launch("-n", "3", script, "raise", "2", cwd=tmp_path)
    assert "dist-launch: rank 2 (local rank 2, node 0) failed first" in result.stderr


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_no_worker_outlives_a_sigkilled_launcher(tmp_path: Path, method: str) -> None:
    script = write_script(tmp_path, "wait.py", WAITING_SCRIPT)
    launcher = subprocess.Popen(
        [*LAUNCH, "-n", "2", "--start-method", method, script, str(tmp_path / "never")],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        pids = read_ready_pids(launcher, 2)
        launcher.kill()
        launcher.wait(30)
        assert _wait_until_gone(pids) == [], "workers survived the launcher's SIGKILL"
    finally:
        launcher.kill()
        launcher.wait(30)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_every_rank_and_says_where_each_was(tmp_path: Path, signum: int) -> None:
    script = write_script(tmp_path, "wait.py", WAITING_SCRIPT)
    launcher = subprocess.Popen(
        [*LAUNCH, "-n", "2", script, str(tmp_path / "never")],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=default_signal_handling,
    )
    try:
        pids = read_ready_pids(launcher, 2)
        launcher.send_signal(signum)
        _, raw_stderr = launcher.communicate(timeout=60)
        stderr = raw_stderr.decode()
        assert launcher.returncode == 128 + signum, stderr
        name = signal.Signals(signum).name
        assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
        # What the README shows: the summary, where the ranks were (one stack, or one
        # per rank when they stood on different lines of their loop), the closing
        # line; nothing else from the summary on. (What came before it, the start line
        # and whatever torch's import warned about, e.g. a missing NumPy, is not ours.)
        summary = f"dist-launch: interrupted by {name}; stopped 2 rank(s)"
        all_lines = stderr.splitlines()
        assert summary in all_lines, stderr
        lines = all_lines[all_lines.index(summary) :]
        assert lines[:2] == [summary, "where they were:"], stderr
        assert lines[-1] == f"dist-launch: interrupted by {name}", stderr
        stacks = lines[2:-1]
        assert re.fullmatch(r"  (ranks 0-1: same stack|rank 0:)", stacks[0]), stderr
        assert all(
            line.startswith("      ") or re.fullmatch(r"  rank 1:", line) for line in stacks[1:]
        ), stderr
        assert _wait_until_gone(pids) == []
    finally:
        launcher.kill()
        launcher.wait(30)


def test_ignored_sighup_stays_ignored(tmp_path: Path) -> None:
    """As under nohup: SIGHUP ignored at start is ignored by the launcher and the ranks."""
    script = write_script(tmp_path, "wait.py", WAITING_SCRIPT)
    go = tmp_path / "go"
    launcher = subprocess.Popen(
        [*LAUNCH, "-n", "2", "--start-method", "spawn", script, str(go)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    )
    try:
        pids = read_ready_pids(launcher, 2)
        for pid in [launcher.pid, *pids]:
            os.kill(pid, signal.SIGHUP)
        go.touch()
        stdout, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode == 0, stderr
        assert stdout.count(b"done") == 2
    finally:
        launcher.kill()
        launcher.wait(30)


def test_two_launchers_form_one_group(tmp_path: Path) -> None:
    script = write_script(tmp_path, "train.py", TORCHRUN_SCRIPT)
    port = get_unused_port()
    common = ["-n", "2", "--nnodes", "2", "--master-port", str(port)]
    argvs = [[*common, "--node-rank", str(node), script] for node in (0, 1)]
    nodes, outputs = run_nodes(argvs, tmp_path, timeout=150)
    for node, (stdout, stderr) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, stderr
        assert stdout.count("sum 6 world 4") == 2, stdout
    assert "[rank2]: env RANK=2 LOCAL_RANK=0 GROUP_RANK=1 NODE_RANK=1" in outputs[1][0]


def test_two_nodes_of_one_srun_step_log_one_run_in_a_shared_log_dir(tmp_path: Path) -> None:
    # What srun gives each node's task (SLURM_JOB_NODELIST names this host): the run id
    # comes from the step, and each node writes a folder of its own in the run's.
    script = write_script(tmp_path, "train.py", TORCHRUN_SCRIPT)
    step = {
        "SLURM_JOB_ID": "777",
        "SLURM_STEP_ID": "0",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "localhost",
    }
    envs = [
        {**os.environ, **step, "SLURM_NODEID": str(node), "SLURM_PROCID": str(node)}
        for node in (0, 1)
    ]
    argv = ["-n", "2", "--master-port", str(get_unused_port()), "--log-dir", "logs", script]
    nodes, outputs = run_nodes([argv, argv], tmp_path, timeout=150, envs=envs)
    for node, (_, stderr) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, stderr
        assert "earlier run" not in stderr
    logs = tmp_path / "logs"
    assert [p.name for p in logs.iterdir()] == ["777.0"]
    assert sorted(p.name for p in (logs / "777.0").iterdir()) == ["node0", "node1"]
    for node in (0, 1):
        for local_rank in (0, 1):
            stdout = (logs / f"777.0/node{node}/attempt_0/{local_rank}/stdout.log").read_text()
            assert f"RANK={2 * node + local_rank} " in stdout
            assert "TORCHELASTIC_RUN_ID=777.0 " in stdout


def test_max_restarts_succeeds_on_the_second_attempt(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "flaky.py",
        textwrap.dedent(
            """\
            import os, sys
            attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
            if attempt == 0 and os.environ["RANK"] == "1":
                sys.exit("first attempt fails on purpose")
            print("attempt", attempt, "ok")
            """
        ),
    )
    result = _launch(
        "-n", "2", "--max-restarts", "1", "--start-method", "spawn", script, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "restarting the local worker group (restart 1 of 1)" in result.stderr
    assert "rank 1 failed with exit code 1" in result.stderr
    assert result.stdout.count("attempt 1 ok") == 2


def test_timeout_shows_where_each_rank_was(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "stuck.py",
        textwrap.dedent(
            """\
            import os, threading, time

            def stuck_in_a_loop():
                while True:
                    time.sleep(0.1)

            def waiting_for_the_others():
                threading.Event().wait()

            if os.environ["RANK"] == "0":
                stuck_in_a_loop()
            waiting_for_the_others()
            """
        ),
    )
    result = _launch(
        "-n",
        "2",
        "--start-method",
        "spawn",
        "--timeout",
        "4",
        "--grace-period",
        "1",
        script,
        cwd=tmp_path,
    )
    assert result.returncode == 124, result.stderr
    assert "timed out after 4 s" in result.stderr
    stacks = result.stderr[result.stderr.index("where they were:\n") :]
    rank0 = stacks[stacks.index("\n  rank 0:\n") : stacks.index("\n  rank 1:\n")]
    assert "stuck_in_a_loop" in rank0, result.stderr
    rank1 = stacks[stacks.index("\n  rank 1:\n") :]
    assert "waiting_for_the_others" in rank1, result.stderr


def test_taken_explicit_port_is_named(tmp_path: Path) -> None:
    script = write_script(tmp_path, "train.py", TORCHRUN_SCRIPT)
    with socket.socket() as holder:
        holder.bind(("", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _launch("-n", "2", "--master-port", str(port), script, cwd=tmp_path)
    assert result.returncode == 2
    assert f"--master-port {port} is already in use" in result.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["-n", "0"], "--nproc-per-node=0"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank=2"),
        (["--grace-period", "0"], "--grace-period=0"),
    ],
)
def test_bad_flags_are_named(tmp_path: Path, args: list[str], named: str) -> None:
    script = write_script(tmp_path, "train.py", TORCHRUN_SCRIPT)
    result = _launch(*args, script, cwd=tmp_path)
    assert result.returncode == 2
    assert named in result.stderr


def test_missing_script_is_named(tmp_path: Path) -> None:
    result = _launch("-n", "2", "nope.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "'nope.py' does not exist" in result.stderr


def test_stopping_a_rank_reaches_the_processes_it_started(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "parent.py",
        textwrap.dedent(
            """\
            import os, subprocess, sys, time
            flag = sys.argv[1]
            if os.environ["RANK"] == "0":
                child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
                print("child", child.pid, flush=True)
                open(flag, "w").close()
                time.sleep(120)
            deadline = time.monotonic() + 60
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.05)
            raise RuntimeError("rank 1 fails once rank 0 has started its child")
            """
        ),
    )
    result = _launch(
        "-n",
        "2",
        "--start-method",
        "spawn",
        "--grace-period",
        "2",
        script,
        str(tmp_path / "flag"),
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr
    child = int(re.search(r"\[rank0\]: child (\d+)", result.stdout).group(1))  # type: ignore[union-attr]
    assert _wait_until_gone([child]) == [], "the stopped rank's child survived"
    rank0 = result.stderr[result.stderr.index("  rank 0 (local rank 0, node 0)") :]
    assert "stopped by the launcher (SIGTERM after rank 1 failed)" in rank0
    stacks = result.stderr[result.stderr.index("where they were:\n  rank 0:\n") :]
    assert "parent.py" in stacks, result.stderr  # its live stack


def test_rank_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "stubborn.py",
        textwrap.dedent(
            """\
            import os, signal, sys, time
            flag = sys.argv[1]
            if os.environ["RANK"] == "0":
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                open(flag, "w").close()
                time.sleep(300)
            deadline = time.monotonic() + 60
            while not os.path.exists(flag) and time.monotonic() < deadline:
                time.sleep(0.05)
            raise RuntimeError("rank 1 fails")
            """
        ),
    )
    result = _launch(
        "-n",
        "2",
        "--start-method",
        "spawn",
        "--grace-period",
        "1",
        script,
        str(tmp_path / "flag"),
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    assert "rank 1 (local rank 1, node 0) failed first" in result.stderr
    assert "ended with signal SIGKILL" in result.stderr


def test_second_sigint_does_not_wait_for_the_grace_period(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "stubborn.py",
        textwrap.dedent(
            """\
            import os, signal, threading
            def shrug(*_):  # Ctrl-C is shrugged off
                os.write(1, b"got SIGINT\\n")

            signal.signal(signal.SIGINT, shrug)
            print("ready", os.getpid(), flush=True)
            threading.Event().wait(300)
            """
        ),
    )
    launcher = subprocess.Popen(
        [*LAUNCH, "-n", "2", "--start-method", "spawn", "--grace-period", "300", script],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=default_signal_handling,
    )
    try:
        pids = read_ready_pids(launcher, 2)
        launcher.send_signal(signal.SIGINT)
        _wait_for_output(launcher, b"got SIGINT", 2)
        launcher.send_signal(signal.SIGINT)
        # Without the escalation this would take the 300 s grace period.
        _, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode == 130, stderr
        assert _wait_until_gone(pids) == []
    finally:
        launcher.kill()
        launcher.wait(30)


def test_auto_port_found_taken_is_replaced(tmp_path: Path) -> None:
    """Rank 0 reports torch's EADDRINUSE error once (as when another program took the
    port between the launcher's choice and rank 0's bind): the launcher picks another
    port and starts again, without spending a restart."""
    script = write_script(
        tmp_path,
        "port.py",
        textwrap.dedent(
            """\
            import os, sys
            marker = sys.argv[1]
            print("port", os.environ["MASTER_PORT"], flush=True)
            if os.environ["RANK"] == "0" and not os.path.exists(marker):
                open(marker, "w").close()
                raise RuntimeError(
                    "The server socket has failed to listen on any local network address. "
                    f"port: {os.environ['MASTER_PORT']}, code: -98, name: EADDRINUSE"
                )
            """
        ),
    )
    result = _launch(
        "-n", "2", "--start-method", "spawn", script, str(tmp_path / "marker"), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "was taken meanwhile; retrying on" in result.stderr
    ports = set(re.findall(r"\[rank0\]: port (\d+)", result.stdout))
    assert len(ports) == 2, result.stdout


def test_explicit_port_is_never_replaced(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "port.py",
        'import os\nif os.environ["RANK"] == "0":\n    raise RuntimeError("EADDRINUSE")\n',
    )
    port = get_unused_port()
    result = _launch(
        "-n", "2", "--start-method", "spawn", "--master-port", str(port), script, cwd=tmp_path
    )
    assert result.returncode == 1
    assert "retrying" not in result.stderr


def _hung_launcher(tmp_path: Path, ranks: int) -> tuple[subprocess.Popen[bytes], Path]:
    """``ranks`` ranks of HUNG_SCRIPT, each blocked opening the FIFO it returns."""
    script = write_script(tmp_path, "hung.py", HUNG_SCRIPT)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    launcher = subprocess.Popen(
        [*LAUNCH, "-n", str(ranks), script, str(fifo)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=default_signal_handling,
    )
    return launcher, fifo


def test_sigquit_dumps_grouped_stacks_and_stops_nothing(tmp_path: Path) -> None:
    launcher, fifo = _hung_launcher(tmp_path, 3)
    try:
        pids = read_ready_pids(launcher, 3)
        launcher.send_signal(signal.SIGQUIT)
        seen = read_until(launcher.stderr, b"hung.py")
        assert all(_alive(pid) for pid in pids), "SIGQUIT stopped a rank"
        # Releases every rank blocked in open(): a writer appears, then closes.
        os.close(os.open(fifo, os.O_WRONLY))
        out, err = launcher.communicate(timeout=60)
        text = (seen + err).decode()
        assert launcher.returncode == 0, text
        assert "stacks of 3 ranks (SIGQUIT; nothing stopped)" in text, text
        assert "ranks 0-2: same stack" in text, text
        assert out.count(b"done") == 3
    finally:
        launcher.kill()
        launcher.wait(30)


def test_ctrl_c_on_a_hung_job_shows_where_every_rank_was(tmp_path: Path) -> None:
    launcher, _ = _hung_launcher(tmp_path, 2)
    try:
        read_ready_pids(launcher, 2)
        launcher.send_signal(signal.SIGINT)
        _, raw = launcher.communicate(timeout=60)
        stderr = raw.decode()
        assert launcher.returncode == 130, stderr
        assert "ranks 0-1: same stack" in stderr, stderr
        assert "hung.py" in stderr, stderr
    finally:
        launcher.kill()
        launcher.wait(30)


def test_a_partial_line_is_shown_before_the_line_ends(tmp_path: Path) -> None:
    script = write_script(
        tmp_path,
        "partial.py",
        "import os, sys, time\nsys.stdout.write('loading...'); sys.stdout.flush()\n"
        "deadline = time.monotonic() + 120\n"
        "while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\nprint(' done')\n",
    )
    go = tmp_path / "go"
    launcher = subprocess.Popen(
        [*LAUNCH, "-n", "1", script, str(go)], cwd=tmp_path, stdout=subprocess.PIPE
    )
    try:
        _wait_for_output(launcher, b"[rank0]: loading...", 1)  # while the line is open
        go.write_text("")
        out, _ = launcher.communicate(timeout=60)
        assert launcher.returncode == 0
        assert out == b" done\n"  # the rest of the line, without a second prefix
    finally:
        launcher.kill()
        launcher.wait(30)
