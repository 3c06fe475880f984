"""Relay each worker's output line by line, prefixed with its rank, to a log file too."""

from __future__ import annotations

import contextlib
import os
from typing import BinaryIO

# A line longer than this is passed on in pieces (each piece prefixed).
MAX_LINE_BYTES = 64 * 1024


class LineRelay:
    """Reads one pipe, writes ``[rank{r}]: line`` to ``sink`` and the bare line to ``log``.

    Args:
        fd: The read end of the worker's stdout or stderr pipe (non-blocking).
        prefix: The prefix of each line, for example ``b"[rank3]: "``.
        sink: The launcher's stdout or stderr (binary).
        log: The rank's log file, or None.
    """

    def __init__(self, fd: int, prefix: bytes, sink: BinaryIO, log: BinaryIO | None) -> None:
        self.fd = fd
        self.prefix = prefix
        self.sink = sink
        self.log = log
        self._partial = b""
        self.closed = False
        os.set_blocking(fd, False)

    def _emit(self, lines: list[bytes]) -> None:
        if not lines:
            return
        with contextlib.suppress(OSError, ValueError):  # a closed terminal must not stop us
            self.sink.write(b"".join(self.prefix + line + b"\n" for line in lines))
            self.sink.flush()
        if self.log is not None:
            with contextlib.suppress(OSError, ValueError):
                self.log.write(b"".join(line + b"\n" for line in lines))
                self.log.flush()

    def pump(self) -> bool:
        """Passes on what the pipe holds now; False once it reached end of file."""
        if self.closed:
            return False
        try:
            chunk = os.read(self.fd, 65536)
        except BlockingIOError:
            return True
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
            return False
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        while len(self._partial) > MAX_LINE_BYTES:
            lines.append(self._partial[:MAX_LINE_BYTES])
            self._partial = self._partial[MAX_LINE_BYTES:]
        self._emit(lines)
        return True

    def close(self) -> None:
        """Passes on an unterminated last line and closes the pipe."""
        if self.closed:
            return
        self.closed = True
        if self._partial:
            self._emit([self._partial])
            self._partial = b""
        with contextlib.suppress(OSError):
            os.close(self.fd)
