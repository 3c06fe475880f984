"""LineRelay on real pipes and pseudo-terminals: line ends, partial lines, console, log."""

from __future__ import annotations

import io
import os
import random
import selectors
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator

import pytest

from dist_launch.output.line_relay import MAX_LINE_BYTES, LineRelay
from dist_launch.workers.terminals import WindowSize, open_output

pytestmark = pytest.mark.timeout(60)

P = b"[rank3]: "


class Pipe:
    """A real pipe whose read end a LineRelay relays into in-memory sink and log."""

    def __init__(self, *, console: bool = True, log: bool = True) -> None:
        read_fd, self.write_fd = os.pipe()
        self.sink = io.BytesIO()
        self.log = io.BytesIO() if log else None
        self.relay = LineRelay(read_fd, P, self.sink, self.log, console=console)

    def send(self, data: bytes) -> None:
        """Writes ``data`` and pumps until the relay has read all of it."""
        os.write(self.write_fd, data)
        self.relay.pump()  # a pipe write below PIPE_BUF is read whole

    def flush(self) -> None:
        """Forwards the pending partial line as if its deadline had passed."""
        deadline = self.relay.next_deadline()
        assert deadline is not None, "no partial line is pending"
        self.relay.flush_due(deadline)

    def end(self) -> bytes:
        """Closes the write end, relays to the end of file, returns the console output."""
        os.close(self.write_fd)
        while self.relay.pump():
            pass
        return self.sink.getvalue()


@pytest.fixture
def pipe() -> Iterator[Pipe]:
    p = Pipe()
    yield p
    if not p.relay.closed:
        os.close(p.write_fd)
        p.relay.close()


def test_carriage_return_ends_a_line_and_keeps_its_terminator(pipe: Pipe) -> None:
    pipe.send(b"a\rb\rc\n")
    assert pipe.sink.getvalue() == P + b"a\r" + P + b"b\r" + P + b"c\n"


def test_crlf_is_one_line_end_even_when_split_between_reads(pipe: Pipe) -> None:
    pipe.send(b"a\r\nb\r")
    assert pipe.sink.getvalue() == P + b"a\r\n"  # "b\r" waits: a "\n" may follow
    pipe.send(b"\nc\n")
    assert pipe.sink.getvalue() == P + b"a\r\n" + P + b"b\r\n" + P + b"c\n"


def test_lone_carriage_return_forwarded_at_its_deadline_then_lf_adds_no_line(
    pipe: Pipe,
) -> None:
    pipe.send(b"b\r")
    pipe.flush()
    assert pipe.sink.getvalue() == P + b"b\r"
    pipe.send(b"\nc\n")
    assert pipe.sink.getvalue() == P + b"b\r\n" + P + b"c\n"


def test_partial_line_waits_for_its_deadline_then_rest_has_no_second_prefix(
    pipe: Pipe,
) -> None:
    assert pipe.relay.next_deadline() is None
    pipe.send(b"done\nabc")
    assert pipe.sink.getvalue() == P + b"done\n"
    deadline = pipe.relay.next_deadline()
    assert deadline is not None
    pipe.relay.flush_due(deadline - 0.05)
    assert pipe.sink.getvalue() == P + b"done\n", "flushed before its deadline"
    pipe.relay.flush_due(deadline)
    assert pipe.sink.getvalue() == P + b"done\n" + P + b"abc"
    assert pipe.relay.next_deadline() is None
    pipe.send(b"def")
    pipe.flush()
    pipe.send(b"ghi\nnext\n")
    assert pipe.end() == P + b"done\n" + P + b"abcdefghi\n" + P + b"next\n"


def test_progress_bar_redraws_in_place_behind_one_prefix(pipe: Pipe) -> None:
    # tqdm draws each frame as "\r" + bar, without a line end, and "\n" at the end.
    for frame in (b"\r 10%", b"\r 20%"):
        pipe.send(frame)
        pipe.flush()
    pipe.send(b"\r100%\n")
    assert pipe.end() == P + b" 10%\r" + P + b" 20%\r" + P + b"100%\n"


def test_unterminated_last_line_is_ended_on_the_console_only(pipe: Pipe) -> None:
    pipe.send(b"x\npartial")
    assert pipe.end() == P + b"x\n" + P + b"partial\n"
    assert pipe.log is not None
    assert pipe.log.getvalue() == b"x\npartial"


def test_log_gets_the_exact_bytes_without_prefix(pipe: Pipe) -> None:
    pipe.send(b"a\r")
    pipe.send(b"b\r\nc")
    assert pipe.log is not None
    assert pipe.log.getvalue() == b"a\rb\r\nc", "the log lags behind the pipe"
    pipe.end()
    assert pipe.log.getvalue() == b"a\rb\r\nc"


def test_console_off_writes_only_the_log() -> None:
    pipe = Pipe(console=False)
    pipe.send(b"hidden\npartial")
    assert pipe.relay.next_deadline() is None
    assert pipe.end() == b""
    assert pipe.log is not None
    assert pipe.log.getvalue() == b"hidden\npartial"


def test_console_only_without_log() -> None:
    pipe = Pipe(log=False)
    pipe.send(b"line\n")
    assert pipe.end() == P + b"line\n"


def test_positional_constructor_of_0_1_still_works() -> None:
    read_fd, write_fd = os.pipe()
    sink, log = io.BytesIO(), io.BytesIO()
    relay = LineRelay(read_fd, P, sink, log)
    os.write(write_fd, b"x\n")
    os.close(write_fd)
    while relay.pump():
        pass
    assert (sink.getvalue(), log.getvalue()) == (P + b"x\n", b"x\n")


def test_overlong_line_is_shown_in_prefixed_pieces(pipe: Pipe) -> None:
    line = b"y" * (2 * MAX_LINE_BYTES + 10) + b"\n"
    for begin in range(0, len(line), 16384):
        pipe.send(line[begin : begin + 16384])
    out = pipe.end()
    pieces = out.split(b"\n")[:-1]
    assert [len(piece) for piece in pieces] == [len(P) + MAX_LINE_BYTES] * 2 + [len(P) + 10]
    assert all(piece.startswith(P) for piece in pieces)
    assert pipe.log is not None
    assert pipe.log.getvalue() == line


STREAM = (
    b"plain\r\n\r\nlines\n\n\rbar 1\rbar 2\r\rbar 3\nno end yet\r\nx\r\r\n\rtail\r"
    b"another\n\r\n" + b"z\r" * 5 + b"\n"
)


def _whole(stream: bytes) -> bytes:
    pipe = Pipe()
    pipe.send(stream)
    return pipe.end()


@pytest.mark.parametrize("seed", range(20))
def test_console_output_does_not_depend_on_how_the_bytes_arrive(seed: int) -> None:
    # The same bytes, cut into reads at random places, with partial lines forwarded at
    # random moments, must show the same console text as when they arrive at once.
    rng = random.Random(seed)
    pipe = Pipe()
    cuts = sorted(rng.sample(range(1, len(STREAM)), rng.randint(1, 25)))
    for begin, end in zip([0, *cuts], [*cuts, len(STREAM)], strict=True):
        pipe.send(STREAM[begin:end])
        if rng.random() < 0.6 and pipe.relay.next_deadline() is not None:
            pipe.flush()
    assert pipe.end() == _whole(STREAM)
    assert pipe.log is not None
    assert pipe.log.getvalue() == STREAM


BAR_WORKER = textwrap.dedent(
    """
    import sys
    out = sys.stdout
    for percent in (10, 20):
        out.write(f"\\r{percent:3d}%"); out.flush()
        if sys.stdin.readline() != "go\\n":  # waits until the launcher showed the frame
            sys.exit(3)
    out.write("\\r100%\\n"); out.flush()
    """
)


def _relay_until(relay: LineRelay, done: Callable[[], bool], timeout: float) -> None:
    """A launcher's select loop: pump when readable, flush partial lines when due."""
    limit = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(relay.fd, selectors.EVENT_READ)
        while not done():
            now = time.monotonic()
            assert now < limit, "the relay did not show the expected output in time"
            deadline = relay.next_deadline()
            wait = limit - now if deadline is None else max(0.0, min(deadline, limit) - now)
            if selector.select(wait) and not relay.pump():
                return
            relay.flush_due(time.monotonic())


def _shows(sink: io.BytesIO, tail: bytes) -> Callable[[], bool]:
    return lambda: sink.getvalue().endswith(tail)


@pytest.mark.processes
def test_a_live_workers_partial_frame_appears_before_the_worker_goes_on() -> None:
    read_fd, write_fd = os.pipe()
    worker = subprocess.Popen(
        [sys.executable, "-c", BAR_WORKER], stdin=subprocess.PIPE, stdout=write_fd
    )
    os.close(write_fd)
    assert worker.stdin is not None
    sink = io.BytesIO()
    relay = LineRelay(read_fd, P, sink)
    try:
        for frame in (b" 10%", b" 20%"):
            _relay_until(relay, _shows(sink, P + frame), timeout=20)
            worker.stdin.write(b"go\n")
            worker.stdin.flush()
        _relay_until(relay, lambda: relay.closed, timeout=20)
        assert worker.wait(timeout=20) == 0
    finally:
        worker.kill()
        worker.wait(timeout=20)
        relay.close()
    assert sink.getvalue() == P + b" 10%\r" + P + b" 20%\r" + P + b"100%\n"


def _relay_to_end(relay: LineRelay, timeout: float = 30) -> None:
    """Pumps ``relay`` until end of file (bounded), as the launcher's select loop does."""
    deadline = time.monotonic() + timeout
    selector = selectors.DefaultSelector()
    selector.register(relay.fd, selectors.EVENT_READ)
    try:
        while not relay.closed:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "the relay did not reach the end of file"
            if selector.select(remaining) and not relay.pump():
                break
    finally:
        selector.close()


def test_terminal_relay_puts_the_prefix_after_a_lines_cursor_controls() -> None:
    master, slave = open_output(WindowSize(rows=24, columns=80))
    sink, log = io.BytesIO(), io.BytesIO()
    relay = LineRelay(master, P, sink, log, terminal=True)
    # What rich writes for a live display: hide the cursor, draw, go back to column 0,
    # erase the line, move up and erase, draw again, show the cursor.
    written = b"\x1b[31mred\x1b[0m\n\x1b[?25l\r\x1b[2K\x1b[1A\x1b[2Kbar 50%\n\x1b[?25h"
    os.write(slave, written)
    os.close(slave)
    _relay_to_end(relay)
    assert (
        sink.getvalue()
        == (
            P + b"\x1b[31mred\x1b[0m\n"  # a colour is text: the prefix stays uncoloured before it
            b"\x1b[?25l\r"  # nothing but controls: no prefix to erase or leave behind
            b"\x1b[2K\x1b[1A\x1b[2K" + P + b"bar 50%\n"
            b"\x1b[?25h"
        )
    )
    # The log has the bytes as written: no "\r\n" from the pseudo-terminal (ONLCR off).
    assert log.getvalue() == written


def test_pipe_relay_keeps_the_prefix_first_whatever_the_line_holds(pipe: Pipe) -> None:
    pipe.send(b"\x1b[2Kbar\n\x1b[?25l\r")
    assert pipe.end() == P + b"\x1b[2Kbar\n" + P + b"\x1b[?25l\r"


@pytest.mark.processes
def test_terminal_relay_reads_everything_before_the_end_of_file() -> None:
    # After the worker exits, reading the launcher's end fails with EIO: that is the end
    # of file, and what the worker wrote before it is all there.
    master, slave = open_output(WindowSize(rows=24, columns=80))
    sink = io.BytesIO()
    relay = LineRelay(master, P, sink, terminal=True)
    lines = 20000
    code = f"import sys\nfor i in range({lines}): sys.stdout.write(f'line {{i}}\\n')\n"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=slave)
    os.close(slave)
    try:
        _relay_to_end(relay)
    finally:
        assert child.wait(30) == 0
    assert relay.closed
    assert sink.getvalue() == b"".join(P + b"line %d\n" % i for i in range(lines))
