"""A worker sees a terminal when the launcher has one: real launches under a real pseudo-terminal.

The test drives ``dist-launch`` with its stdout and stderr on a pseudo-terminal of a
size it chose (as ``script`` or a terminal emulator would), reads everything the
launcher shows there, and checks what each worker saw and what reached the screen.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from launcher_signals import default_signal_handling

pytestmark = pytest.mark.timeout(240)

LAUNCH = [sys.executable, "-m", "dist_launch"]
BOUND = 120.0
ROWS, COLUMNS = 31, 97
PREFIX_WIDTH = len("[rank0]: ")

# What the worker's streams are, then a coloured line and a bar redrawn with "\r".
SEEN_SCRIPT = """\
import os, sys
size = os.get_terminal_size() if sys.stdout.isatty() else None
print(f"isatty stdout={sys.stdout.isatty()} stderr={sys.stderr.isatty()} "
      f"size={size and (size.columns, size.lines)}", flush=True)
print("\\x1b[31mred\\x1b[0m", flush=True)
try:  # a controlling terminal would add a Ctrl-C and SIGHUP path besides the launcher
    os.close(os.open("/dev/tty", os.O_RDWR))
    print("controlling terminal", flush=True)
except OSError:
    pass
for step in range(1, 4):
    sys.stderr.write(f"\\rstep {step}/3")
    sys.stderr.flush()
sys.stderr.write("\\n")
"""

TQDM_SCRIPT = """\
from tqdm import tqdm
for _ in tqdm(range(5), desc="bar", mininterval=0):
    pass
"""

RICH_SCRIPT = """\
from rich.console import Console
from rich.progress import Progress
console = Console()
print(f"rich terminal={console.is_terminal} width={console.width}", flush=True)
with Progress(console=console, auto_refresh=False) as progress:
    task = progress.add_task("rich-bar", total=3)
    for _ in range(3):
        progress.advance(task)
        progress.refresh()
"""

# Says it is ready, then waits to be stopped (bounded).
WAITING_SCRIPT = """\
import os, time
print("ready", os.getpid(), flush=True)
time.sleep(120)
"""

# Prints its size, waits (bounded) for SIGWINCH, prints its size again.
RESIZE_SCRIPT = """\
import os, signal
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGWINCH])
size = os.get_terminal_size()
print(f"before {size.columns}x{size.lines}", flush=True)
got = signal.sigtimedwait([signal.SIGWINCH], 60)
size = os.get_terminal_size()
print(f"after {size.columns}x{size.lines} signalled={got is not None}", flush=True)
"""


def _set_size(fd: int, rows: int, columns: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))


class Terminal:
    """A launcher whose stdout (and stderr, unless ``stderr`` is given) is a fresh pty."""

    def __init__(self, args: list[str], cwd: Path, stderr: int | None = None) -> None:
        self.master, slave = os.openpty()
        _set_size(slave, ROWS, COLUMNS)
        self.output = b""
        try:
            # A session of its own, as under `script`; the pty is not its controlling
            # terminal, which the launcher does not need. The environment is passed
            # as Python sees it: a module that loaded readline here (pytest's) has set
            # COLUMNS and LINES in the C environment a child would inherit otherwise.
            # Without them, as a shell that does not export them: pytest-xdist's
            # workers have COLUMNS=80 in os.environ, which would win over the pty's size.
            env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
            self.process = subprocess.Popen(
                [*LAUNCH, *args],
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=slave,
                stderr=slave if stderr is None else stderr,
                start_new_session=True,
                preexec_fn=default_signal_handling,
            )
        finally:
            os.close(slave)

    def read_until(self, done: Callable[[bytes], bool], timeout: float = BOUND) -> bytes:
        """Reads what the launcher shows until ``done(output)`` or end of file (bounded)."""
        deadline = time.monotonic() + timeout
        while not done(self.output):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out; the terminal showed:\n{self.output!r}")
            ready, _, _ = select.select([self.master], [], [], remaining)
            if not ready:
                continue
            try:
                chunk = os.read(self.master, 65536)
            except OSError as error:
                if error.errno != errno.EIO:  # EIO: every writer closed its end
                    raise
                chunk = b""
            if not chunk:
                break
            self.output += chunk
        return self.output

    def finish(self) -> tuple[int, bytes]:
        """Reads to the end; returns the launcher's exit status and what it showed."""
        self.read_until(lambda _: False)
        return self.process.wait(BOUND), self.output

    def close(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(BOUND)
        os.close(self.master)


@contextlib.contextmanager
def terminal(*args: str, cwd: Path, stderr: int | None = None) -> Iterator[Terminal]:
    term = Terminal(list(args), cwd, stderr)
    try:
        yield term
    finally:
        term.close()


def _script(tmp_path: Path, text: str) -> str:
    path = tmp_path / "worker.py"
    path.write_text(text)
    return str(path)


def _shown(tmp_path: Path, text: str, *args: str, stderr: int | None = None) -> bytes:
    """What the launcher shows on its terminal for ``dist-launch ARGS worker.py``."""
    script = _script(tmp_path, text)
    with terminal(*args, script, cwd=tmp_path, stderr=stderr) as term:
        status, shown = term.finish()
    assert status == 0, shown
    return shown


def _seen(rank: int, stdout: bool, stderr: bool, size: tuple[int, int] | None) -> bytes:
    return f"[rank{rank}]: isatty stdout={stdout} stderr={stderr} size={size}".encode()


@pytest.mark.processes
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_worker_writes_to_a_terminal_when_the_launcher_does(tmp_path: Path, method: str) -> None:
    shown = _shown(tmp_path, SEEN_SCRIPT, "-n", "2", "--start-method", method)
    # Rows as the launcher's terminal; columns less the prefix, so a full-width bar fits.
    size = (COLUMNS - PREFIX_WIDTH, ROWS)
    for rank in (0, 1):
        assert _seen(rank, True, True, size) in shown, shown
        # Colours pass through; "\n" is not turned into "\r\n" twice (ONLCR is off).
        assert f"[rank{rank}]: \x1b[31mred\x1b[0m\r\n".encode() in shown, shown
        assert f"[rank{rank}]: step 3/3\r\n".encode() in shown, shown
    assert b"\r\r\n" not in shown, shown
    # The launcher has no controlling terminal here; its workers' pseudo-terminals are
    # not theirs either.
    assert b"controlling terminal" not in shown, shown


@pytest.mark.processes
def test_without_a_terminal_workers_write_to_pipes_as_before(tmp_path: Path) -> None:
    script = _script(tmp_path, SEEN_SCRIPT)
    result = subprocess.run(
        [*LAUNCH, "-n", "2", script], cwd=tmp_path, capture_output=True, timeout=BOUND, check=False
    )
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert _seen(rank, False, False, None) in result.stdout, result.stdout
        assert f"[rank{rank}]: \x1b[31mred\x1b[0m\n".encode() in result.stdout


@pytest.mark.processes
def test_each_stream_follows_the_launchers_own(tmp_path: Path) -> None:
    # The launcher's stderr is a file: its workers' stderr is a pipe, as under torchrun.
    errors = tmp_path / "stderr.txt"
    with errors.open("wb") as sink:
        shown = _shown(tmp_path, SEEN_SCRIPT, "-n", "2", stderr=sink.fileno())
    size = (COLUMNS - PREFIX_WIDTH, ROWS)
    assert _seen(0, True, False, size) in shown, shown
    assert b"[rank0]: step 3/3\n" in errors.read_bytes()


@pytest.mark.processes
def test_redirected_stream_is_a_file_and_teed_log_keeps_the_text(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    args = ("-n", "2", "--log-dir", str(logs), "--run-id", "r", "--redirects", "0:1")
    shown = _shown(tmp_path, SEEN_SCRIPT, *args, "--tee", "1:1")
    # Rank 0's stdout goes to its file only: no terminal for it, as torchrun's file.
    stdout0 = (logs / "r" / "attempt_0" / "0" / "stdout.log").read_bytes()
    assert b"isatty stdout=False stderr=True size=None" in stdout0
    # Rank 1's stdout is tee'd: a terminal, and its file keeps the bytes with colours.
    stdout1 = (logs / "r" / "attempt_0" / "1" / "stdout.log").read_bytes()
    assert b"isatty stdout=True stderr=True" in stdout1
    assert b"\x1b[31mred\x1b[0m\n" in stdout1
    assert b"[rank" not in stdout1
    assert b"[rank0]: isatty" not in shown and b"[rank1]: isatty stdout=True" in shown, shown


@pytest.mark.processes
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_window_size_follows_the_launchers_terminal(tmp_path: Path, method: str) -> None:
    script = _script(tmp_path, RESIZE_SCRIPT)
    before = f"before {COLUMNS - PREFIX_WIDTH}x{ROWS}".encode()
    with terminal("-n", "2", "--start-method", method, script, cwd=tmp_path) as term:
        term.read_until(lambda shown: shown.count(before) == 2)
        _set_size(term.master, 40, 120)
        # Not the launcher's controlling terminal: the resize signal is sent by hand,
        # as a terminal sends it to its foreground process group.
        os.kill(term.process.pid, signal.SIGWINCH)
        status, shown = term.finish()
    assert status == 0, shown
    for rank in (0, 1):
        expected = f"[rank{rank}]: after {120 - PREFIX_WIDTH}x40 signalled=True"
        assert expected.encode() in shown, shown


@pytest.mark.processes
def test_tqdm_bar_is_relayed_behind_its_prefix(tmp_path: Path) -> None:
    shown = _shown(tmp_path, TQDM_SCRIPT, "-n", "2")
    for rank in (0, 1):
        finals = re.findall(rf"\[rank{rank}\]: (bar: 100%[^\r\n]*)".encode(), shown)
        assert finals, shown
        # tqdm fills the worker's terminal but its last column (with no terminal it
        # draws a short bar): with the prefix, the launcher's line.
        widths = {PREFIX_WIDTH + len(bar.decode()) for bar in finals}
        assert widths <= {COLUMNS - 1, COLUMNS}, (widths, finals)


@pytest.mark.processes
def test_rich_live_progress_keeps_its_prefix_when_it_redraws(tmp_path: Path) -> None:
    shown = _shown(tmp_path, RICH_SCRIPT, "-n", "1")
    assert f"rich terminal=True width={COLUMNS - PREFIX_WIDTH}".encode() in shown, shown
    # rich redraws with "\r" and "erase line": the prefix comes after the erase, not
    # before it, so it stays on the screen.
    assert re.search(rb"\r\x1b\[2K\[rank0\]: rich-bar", shown), shown
    assert not re.search(rb"\[rank0\]: \x1b\[2K", shown), shown


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.processes
def test_sigint_under_a_terminal_stops_every_worker_through_the_launcher(tmp_path: Path) -> None:
    script = _script(tmp_path, WAITING_SCRIPT)
    with terminal("-n", "2", script, cwd=tmp_path) as term:
        shown = term.read_until(lambda shown: shown.count(b"]: ready ") == 2)
        pids = [int(pid) for pid in re.findall(rb"\]: ready (\d+)", shown)]
        os.kill(term.process.pid, signal.SIGINT)
        status, shown = term.finish()
    assert status == 130, shown
    assert b"interrupted by SIGINT" in shown, shown
    # The launcher reaped them before it exited.
    assert all(_gone(pid) for pid in pids), shown
