r"""A pseudo-terminal per worker stream, so that a worker sees a terminal when the launcher has one.

Under torchrun a worker writes to the launcher's terminal itself, so ``isatty()`` is
true and libraries draw colours and live progress bars (rich, Lightning's bar). Here
each line is prefixed with its rank, so the launcher must read what the worker writes;
a pipe would make the worker believe it writes to a file. Instead, each stream of a
worker that the console shows gets a pseudo-terminal of its own, when the launcher's
own stream of that name (fd 1 for stdout, 2 for stderr) is a terminal; any other stream
(a launcher writing to a file or a pipe, a stream redirected to its log file only, a
rank hidden by ``--local-ranks-filter``) gets a pipe, as before. The choices:

- One pseudo-terminal per stream, not one shared by stdout and stderr: the two stay
  apart, as pipes keep them, so that ``--redirects``/``--tee`` per stream, the
  ``stdout.log``/``stderr.log`` files and the launcher's own ``2>file`` mean what they
  meant. (The order of one rank's stdout and stderr lines is, as with pipes, the order
  in which the launcher reads them.)
- Not the worker's controlling terminal: workers run in their own process group of the
  launcher's session, and the launcher delivers Ctrl-C and SIGTERM to them. A
  controlling pseudo-terminal would add a second path (SIGHUP when the launcher
  closes it, SIGTTOU, a ``^C`` byte turned into SIGINT); so the worker only writes to
  it. Its standard input is not the pseudo-terminal either.
- Output translation of ``\n`` to ``\r\n`` (``ONLCR``) is off, so the launcher reads the
  bytes the worker wrote; the launcher's own terminal translates them when shown.
- The window size is the launcher's terminal's, less the width of the rank prefix, so
  that a bar drawn to the full width still fits on one line behind its prefix and
  redraws in place. On ``SIGWINCH`` (:class:`WindowSizeFollower`) every worker's size
  follows the launcher's and its process group gets ``SIGWINCH`` too, since a terminal
  that is nobody's controlling terminal signals no one.
- Reading the launcher's side after the worker and its children closed theirs fails
  with ``EIO``: that is end of file (:class:`dist_launch.output.line_relay.LineRelay` reads it so).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import struct
import termios
from collections.abc import Callable
from dataclasses import dataclass

from dist_launch.output.routing import STREAMS, Stream

# The launcher's own descriptor whose terminal a worker's stream of that name gets.
CONSOLE_FD: dict[Stream, int] = {"stdout": 1, "stderr": 2}


@dataclass(frozen=True)
class WindowSize:
    """A terminal's size in character cells (0 where the terminal does not know it)."""

    rows: int
    columns: int

    def less_columns(self, width: int) -> WindowSize:
        """This size with ``width`` fewer columns (at least 1), unknown staying unknown."""
        if self.columns <= 0:
            return self
        return WindowSize(self.rows, max(1, self.columns - width))


def terminal_size(fd: int) -> WindowSize | None:
    """The size of the terminal ``fd`` writes to; None when ``fd`` is not a terminal."""
    if not os.isatty(fd):
        return None
    try:
        packed = fcntl.ioctl(fd, termios.TIOCGWINSZ, b"\0" * 8)
    except OSError:
        return None
    rows, columns, _, _ = struct.unpack("HHHH", packed)
    return WindowSize(rows, columns)


def set_terminal_size(fd: int, size: WindowSize) -> None:
    """Sets the size of the pseudo-terminal ``fd`` belongs to (either side)."""
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", size.rows, size.columns, 0, 0))


def open_output(size: WindowSize | None) -> tuple[int, int]:
    """The (launcher's end, worker's end) of one output stream of a worker.

    A pseudo-terminal of ``size`` with ``ONLCR`` off (see the module docstring), or a
    pipe when ``size`` is None. The worker's end is not anyone's controlling terminal:
    ``os.openpty`` opens it with ``O_NOCTTY``, and a worker is never a session leader.
    """
    if size is None:
        return os.pipe()
    master, slave = os.openpty()
    try:
        attributes = termios.tcgetattr(slave)
        attributes[1] &= ~termios.ONLCR  # oflag
        termios.tcsetattr(slave, termios.TCSANOW, attributes)
        set_terminal_size(slave, size)
    except BaseException:
        os.close(master)
        os.close(slave)
        raise
    return master, slave


@dataclass(frozen=True)
class WorkerTerminals:
    """The size of each stream's pseudo-terminal of one worker; None for a pipe."""

    stdout: WindowSize | None = None
    stderr: WindowSize | None = None

    def of(self, stream: Stream) -> WindowSize | None:
        """The size for ``stream``."""
        return self.stdout if stream == "stdout" else self.stderr


PIPES_ONLY = WorkerTerminals()


def open_outputs(terminals: WorkerTerminals) -> tuple[tuple[int, int], tuple[int, int]]:
    """:func:`open_output` for a worker's stdout, then for its stderr."""
    stdout = open_output(terminals.stdout)
    try:
        return stdout, open_output(terminals.stderr)
    except BaseException:
        for fd in stdout:
            os.close(fd)
        raise


def worker_terminals(shown: dict[Stream, bool], prefix_width: int) -> WorkerTerminals:
    """Which streams of one worker get a pseudo-terminal, and of what size.

    Args:
        shown: Per stream, whether the console shows it
            (:meth:`dist_launch.output.routing.OutputRouting.route`).
        prefix_width: The width of the rank prefix on each console line.
    """
    sizes: dict[Stream, WindowSize | None] = {}
    for stream in STREAMS:
        size = terminal_size(CONSOLE_FD[stream]) if shown[stream] else None
        sizes[stream] = None if size is None else size.less_columns(prefix_width)
    return WorkerTerminals(stdout=sizes["stdout"], stderr=sizes["stderr"])


@dataclass(frozen=True)
class _Followed:
    fd: int  # a copy of the launcher's end, so that its number is never someone else's
    stream: Stream
    prefix_width: int
    process_group: Callable[[], int | None]  # the worker's pid (its group), once known


class WindowSizeFollower:
    """Keeps the workers' pseudo-terminals as wide as the launcher's terminal.

    A context manager: until the end of the block, :meth:`resize` (called when the
    launcher receives ``SIGWINCH``: its terminal was resized) sets each followed
    pseudo-terminal's size anew and sends ``SIGWINCH`` to its worker's process group
    (workers run in their own). It holds a copy of each launcher's end, closed when
    the block ends (a copy does not delay the end of file, which comes when the
    worker's ends close). The launcher's signal inbox receives the signal
    (:mod:`dist_launch.agent.signal_inbox`); this class installs no handler.
    """

    def __init__(self) -> None:
        self._followed: list[_Followed] = []

    def __enter__(self) -> WindowSizeFollower:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for item in self._followed:
            os.close(item.fd)
        self._followed.clear()

    def add(
        self,
        fd: int,
        stream: Stream,
        prefix_width: int,
        process_group: Callable[[], int | None],
    ) -> None:
        """Follows the pseudo-terminal whose launcher's end is ``fd``.

        Called as soon as the worker's terminal exists, while ``fd`` is surely open: a
        worker that ends while the others start has its relay close that end.
        ``process_group`` is read at each resize (a forked worker's pid arrives later).
        """
        self._followed.append(_Followed(os.dup(fd), stream, prefix_width, process_group))

    def resize(self) -> None:
        """Sets every followed pseudo-terminal to the launcher's size now."""
        groups: set[int] = set()
        for item in self._followed:
            size = terminal_size(CONSOLE_FD[item.stream])
            if size is None:
                continue
            with contextlib.suppress(OSError):
                set_terminal_size(item.fd, size.less_columns(item.prefix_width))
                group = item.process_group()
                if group is not None:
                    groups.add(group)
        for group in groups:
            with contextlib.suppress(OSError):  # the worker may have ended
                os.killpg(group, signal.SIGWINCH)
