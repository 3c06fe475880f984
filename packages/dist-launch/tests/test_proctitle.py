"""Process titles: ``ps`` shows each worker as the command it runs, with its rank."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dist_launch.in_worker import proctitle

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc"),
]

PYTHON = os.path.basename(sys.executable)

# Each rank opens the FIFO named by the HOLD variable (the test holds it open for
# writing, so the open does not block), says its pid, and reads until the test closes
# its end: the worker is alive, past its start-up, while the test looks at it.
HOLD_SCRIPT = """\
import os

with open(os.environ["HOLD"], "rb") as hold:
    print("ready", os.getpid(), flush=True)
    hold.read()
"""


def _cmdline(pid: int) -> list[str]:
    """``/proc/PID/cmdline`` as argv: NUL-separated pieces, the padding NULs dropped."""
    data = Path(f"/proc/{pid}/cmdline").read_bytes()
    return data.rstrip(b"\0").decode().split("\0")


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().rstrip("\n")


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _ready_pids(process: subprocess.Popen[bytes], count: int) -> list[int]:
    assert process.stdout is not None
    fd = process.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + 120
    while True:
        pids = [int(pid) for pid in re.findall(rb"ready (\d+)\n", seen)]
        if len(pids) >= count:
            return pids
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"ranks did not start in time; output so far:\n{seen!r}"
        if select.select([fd], [], [], remaining)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"launcher ended early (status {process.wait()}): {seen!r}"
            seen += chunk


def _launch_and_look(
    tmp_path: Path, method: str, target: list[str]
) -> tuple[list[list[str]], set[str], list[list[str]]]:
    """Runs 2 ranks; returns each worker's argv, thread names, and its parent's argv."""
    hold = tmp_path / "hold"
    os.mkfifo(hold)
    writer = os.open(hold, os.O_RDWR)  # O_RDWR: does not wait for a reader
    try:
        launch = ["-n", "2", "--start-method", method, "--timeout", "150"]
        process = subprocess.Popen(
            [sys.executable, "-m", "dist_launch", *launch, *target],
            cwd=tmp_path,
            env={**os.environ, "HOLD": str(hold)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            pids = _ready_pids(process, 2)
            argvs = sorted((_cmdline(pid) for pid in pids), key=lambda argv: argv[-1])
            names = {_comm(pid) for pid in pids}
            parents = [_cmdline(_parent(pid)) for pid in pids]
        finally:
            os.close(writer)  # the workers read to the end and exit
            writer = -1
            try:
                _, stderr = process.communicate(timeout=60)
            finally:
                process.kill()
    finally:
        if writer >= 0:
            os.close(writer)
    assert process.returncode == 0, stderr.decode()
    return argvs, names, parents


@pytest.mark.processes
def test_fork_server_worker_shows_the_script_its_args_and_rank(tmp_path: Path) -> None:
    (tmp_path / "hold.py").write_text(HOLD_SCRIPT)
    argvs, names, parents = _launch_and_look(
        tmp_path, "forkserver", ["hold.py", "--lr", "0.1", "two words"]
    )
    assert argvs == [
        [PYTHON, "hold.py", "--lr", "0.1", "two words", f"[rank {rank}]"] for rank in (0, 1)
    ]
    assert names == {"hold.py"}
    assert parents == [["dist-launch fork server (hold.py)"]] * 2


@pytest.mark.processes
def test_spawned_worker_shows_its_module_and_rank(tmp_path: Path) -> None:
    (tmp_path / "holdmod.py").write_text(HOLD_SCRIPT)
    argvs, names, _ = _launch_and_look(tmp_path, "spawn", ["-m", "holdmod", "x"])
    assert argvs == [[PYTHON, "-m", "holdmod", "x", f"[rank {rank}]"] for rank in (0, 1)]
    assert names == {"holdmod"}


def _in_child(code: str, *args: str) -> str:
    """Runs ``code`` in a fresh interpreter (argv area of known size); returns its stdout."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.processes
def test_a_long_title_is_cut_to_the_argv_area() -> None:
    out = _in_child(
        """\
        import sys
        from dist_launch.in_worker.proctitle import set_process_argv

        size = len(open("/proc/self/cmdline", "rb").read())
        ok = set_process_argv(["python3", "x" * 10_000, "[rank 1]"])
        data = open("/proc/self/cmdline", "rb").read()
        print(ok, size, len(data), repr(data.rstrip(b"\\0")))
        """,
        "padding",
    )
    ok, size, length, title = out.split(" ", 3)
    assert ok == "True"
    assert int(length) == int(size)  # the area keeps its size, ends with a NUL
    assert eval(title) == b"python3\0" + b"x" * (int(size) - len("python3") - 2)


@pytest.mark.processes
def test_a_title_shorter_than_before_leaves_no_trace_of_the_old_one() -> None:
    out = _in_child(
        """\
        from dist_launch.in_worker.proctitle import set_process_title

        print(set_process_title("short"), repr(open("/proc/self/cmdline", "rb").read()))
        """,
        "a-long-argument-that-must-disappear",
    )
    ok, data = out.split(" ", 1)
    assert ok == "True"
    value = eval(data)
    assert value.rstrip(b"\0") == b"short"
    assert set(value[len(b"short") :]) == {0}


def test_no_proc_means_false_not_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proctitle, "PROC_SELF", str(tmp_path / "no-proc"))
    assert proctitle.set_process_title("anything") is False
    assert proctitle.set_process_argv(["python3", "train.py"]) is False


def test_an_area_the_kernel_does_not_vouch_for_is_not_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stat naming addresses the cmdline does not match (it would crash if written).
    fields = ["S"] + ["0"] * 44 + ["16", "116"] + ["0"] * 3
    (tmp_path / "stat").write_text("1 (a) b) " + " ".join(fields) + "\n")
    (tmp_path / "cmdline").write_bytes(b"python3\0")
    monkeypatch.setattr(proctitle, "PROC_SELF", str(tmp_path))
    assert proctitle._argv_area() is None
    assert proctitle.set_process_title("anything") is False


def test_cut_stays_on_a_character_boundary() -> None:
    data = proctitle._fit(["python3", "é" * 10], 16)
    assert len(data) == 16
    assert data.rstrip(b"\0").decode() == "python3\0" + "é" * 3
    assert proctitle._fit(["python3", "x"], 9) == b"python3\0\0"  # no dangling separator


def test_names() -> None:
    assert proctitle.target_name(["dir/train.py", "--lr"]) == "train.py"
    assert proctitle.target_name(["-m", "pkg.mod", "x"]) == "pkg.mod"
    assert proctitle.worker_argv(["-m", "pkg.mod"], 3) == [PYTHON, "-m", "pkg.mod", "[rank 3]"]
    assert proctitle.fork_server_title(["-m", "pkg.mod"]) == "dist-launch fork server (pkg.mod)"
    assert proctitle.fork_server_title() == "dist-launch fork server"
