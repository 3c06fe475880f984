"""The exception type of dist-launch."""

from __future__ import annotations


class LaunchError(RuntimeError):
    """A launched worker group failed, timed out or was interrupted.

    The message is the launcher's report: the rank that failed first (its local
    rank, node, exit code or signal and its own traceback), then one line per other
    rank saying what became of it.

    Attributes:
        rank: Global rank of the root cause, or None when no rank failed (a timeout).
        exitcode: The exit status the CLI would use for this failure (0-255).
    """

    def __init__(self, message: str, rank: int | None = None, exitcode: int = 1) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
