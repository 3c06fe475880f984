r"""Relay each worker's output to the console line by line, prefixed with its rank.

A line ends at ``\n``, ``\r\n`` or a lone ``\r``, and keeps its own terminator on the
console, so that a progress bar redrawn with ``\r`` (tqdm) updates in place behind its
rank prefix. A line without a terminator yet (a bar being drawn, a ``print(end="")``)
is forwarded :data:`PARTIAL_LINE_SECONDS` after its first byte arrived; the rest of
that line follows later without a second prefix, since the prefix marks where a line
starts on the console.

When the worker writes to a pseudo-terminal (:mod:`dist_launch.workers.terminals`), a
line may start by moving the cursor or erasing the line it is on (rich redraws its live
display with ``\r`` then "erase line" and "cursor up" sequences); the prefix then goes
after those sequences, so that erasing the line does not erase the prefix drawn just
before it.

The rank's log file, when there is one, receives exactly the bytes the worker wrote,
as they arrive, with no prefix (escape sequences included).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from typing import BinaryIO

# A line longer than this is passed on to the console in pieces, each prefixed and
# ended with a newline, so that one rank's endless line cannot hold the others back.
MAX_LINE_BYTES = 64 * 1024

# How long a line without a terminator waits for the rest before it is shown anyway:
# short enough that a progress bar looks live, long enough that a line written in a
# few pieces usually arrives whole.
PARTIAL_LINE_SECONDS = 0.1

_READ_BYTES = 65536
_LINE_END = re.compile(rb"\r\n|\r|\n")
# Control sequences that move the cursor, erase, or show/hide the cursor (CSI ... A-H,
# J, K, h, l), at the start of a line; colours (CSI ... m) are not among them, so a
# coloured line keeps its prefix uncoloured.
_LEADING_CURSOR_CONTROLS = re.compile(rb"(?:\x1b\[\??[0-9;]*[A-HJKhl])*")


class LineRelay:
    """Reads one pipe, writes ``[rank{r}]: line`` to ``sink`` and the bare bytes to ``log``.

    The launcher's select loop calls :meth:`pump` when the pipe is readable, waits at
    most until :meth:`next_deadline`, and then calls :meth:`flush_due`.

    Args:
        fd: The read end of the worker's stdout or stderr pipe (made non-blocking).
        prefix: The prefix of each line on the console, for example ``b"[rank3]: "``.
        sink: The launcher's stdout or stderr (binary).
        log: The rank's log file (binary), or None: it gets the output without prefix.
        console: Whether the output goes to ``sink`` at all (False for a rank hidden by
            ``--local-ranks-filter`` or a stream sent to its file only by
            ``--redirects``).
        terminal: Whether the worker writes to a pseudo-terminal and ``sink`` is a
            terminal: the prefix then follows a line's leading cursor controls.
    """

    def __init__(
        self,
        fd: int,
        prefix: bytes,
        sink: BinaryIO,
        log: BinaryIO | None = None,
        *,
        console: bool = True,
        terminal: bool = False,
    ) -> None:
        self.fd = fd
        self.prefix = prefix
        self.sink = sink
        self.log = log
        self.console = console
        self.terminal = terminal
        self.closed = False
        # Bytes of the current line not yet shown on the console.
        self._pending = b""
        # When the oldest of those bytes arrived (monotonic), None when there are none.
        self._pending_since: float | None = None
        # The console already shows the start of the current line (and its prefix).
        self._line_started = False
        # The last line ended with a lone "\r" forwarded at its deadline: a "\n" arriving
        # next completes that "\r\n" rather than being an empty line of its own; this
        # is what the console gets for that "\n" (None: no such "\r" before).
        self._lf_after_cr: bytes | None = None
        os.set_blocking(fd, False)

    def pump(self) -> bool:
        """Passes on what the pipe holds now; False once it reached end of file."""
        if self.closed:
            return False
        try:
            chunk = os.read(self.fd, _READ_BYTES)
        except BlockingIOError:
            return True
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
            return False
        self._write_log(chunk)
        if self.console:
            self._console(self._take(chunk))
        return True

    def next_deadline(self) -> float | None:
        """The monotonic time at which the pending partial line is due, None if none."""
        if self.closed or self._pending_since is None:
            return None
        return self._pending_since + PARTIAL_LINE_SECONDS

    def flush_due(self, now: float) -> None:
        """Forwards the pending partial line if its deadline (see above) is at or before ``now``."""
        deadline = self.next_deadline()
        if deadline is None or now < deadline:
            return
        pending, self._pending, self._pending_since = self._pending, b"", None
        if pending.endswith(b"\r"):
            # Held back only to see whether "\n" follows; it did not, so it ends the line.
            out = self._line(pending)
            # An empty "\r" line showed nothing; if it turns out to be "\r\n", show it.
            self._lf_after_cr = b"\n" if out else self.prefix + b"\r\n"
        else:
            out = self._started(pending)
        self._console(out)

    def close(self) -> None:
        """Passes on an unterminated last line (ending it on the console) and closes the pipe."""
        if self.closed:
            return
        self.closed = True
        out = b""
        if self._pending:
            pending, self._pending, self._pending_since = self._pending, b"", None
            out = self._line(pending) if pending.endswith(b"\r") else self._started(pending)
        if self._line_started:
            out += b"\n"
            self._line_started = False
        if self.console:
            self._console(out)
        with contextlib.suppress(OSError):
            os.close(self.fd)

    def _take(self, chunk: bytes) -> bytes:
        """Adds ``chunk`` to the current line; returns what the console gets now."""
        out: list[bytes] = []
        if self._lf_after_cr is not None and chunk.startswith(b"\n"):
            out.append(self._lf_after_cr)
            chunk = chunk[1:]
        self._lf_after_cr = None
        if not chunk:
            return b"".join(out)
        data = self._pending + chunk
        start = 0
        for match in _LINE_END.finditer(data):
            if match.group() == b"\r" and match.end() == len(data):
                break  # a "\n" may still follow in the next read
            body = self._cut(data[start : match.start()], out)
            out.append(self._line(body + match.group()))
            start = match.end()
        rest = self._cut(data[start:], out)
        if not rest:
            self._pending_since = None
        elif len(rest) < len(data) or self._pending_since is None:
            # The older pending bytes were shown: what is left arrived just now.
            self._pending_since = time.monotonic()
        self._pending = rest
        return b"".join(out)

    def _cut(self, body: bytes, out: list[bytes]) -> bytes:
        """Appends to ``out`` the overlong head of a line's ``body``; returns the rest."""
        while len(body) > MAX_LINE_BYTES:
            out.append(self._started(body[:MAX_LINE_BYTES]) + b"\n")
            self._line_started = False
            body = body[MAX_LINE_BYTES:]
        return body

    def _line(self, line: bytes) -> bytes:
        """The console bytes of a complete ``line`` (its terminator included)."""
        started, self._line_started = self._line_started, False
        if started:
            return line
        if line == b"\r":
            # An empty line ended by "\r" (a bar redrawing itself from column 0) would
            # only print a bare prefix, once per redraw, in a captured log.
            return b""
        return self._labelled(line)

    def _started(self, part: bytes) -> bytes:
        """The console bytes of the first or next ``part`` of an unfinished line."""
        if self._line_started:
            return part
        if self._prefix_at(part) is None:
            return part  # cursor controls only: the prefix waits for the line's text
        self._line_started = True
        return self._labelled(part)

    def _labelled(self, line: bytes) -> bytes:
        """``line`` with the prefix where :meth:`_prefix_at` puts it (or none)."""
        at = self._prefix_at(line)
        return line if at is None else line[:at] + self.prefix + line[at:]

    def _prefix_at(self, line: bytes) -> int | None:
        """Where the prefix goes in ``line``; None for a line of cursor controls only.

        At 0, or on a terminal after the line's leading cursor controls.
        """
        if not self.terminal:
            return 0
        controls = _LEADING_CURSOR_CONTROLS.match(line)
        at = 0 if controls is None else controls.end()
        return at if at == 0 or line[at:].strip(b"\r\n") else None

    def _console(self, data: bytes) -> None:
        if not data:
            return
        with contextlib.suppress(OSError, ValueError):  # a closed terminal must not stop us
            self.sink.write(data)
            self.sink.flush()

    def _write_log(self, data: bytes) -> None:
        if self.log is None:
            return
        with contextlib.suppress(OSError, ValueError):  # a full disk must not stop the job
            self.log.write(data)
            self.log.flush()
