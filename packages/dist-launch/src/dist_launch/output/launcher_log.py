"""The launcher's own messages: ``dist-launch: [2026-11-23 01:02:03.456] message``.

Each message names the program and carries the local time to the millisecond in
brackets, as torchrun's messages carry theirs, so that the launcher's lines can be
placed among the ranks' lines and among the logs of other nodes. Warnings and errors
name their level after the time (``... 01:02:03.456] WARNING: ...``); information does
not, to keep the common lines short.
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "dist_launch"

_HANDLER_MARK = "_dist_launch_handler"


class LauncherFormatter(logging.Formatter):
    """Formats ``{prog}: [YYYY-MM-DD HH:MM:SS.mmm] [LEVEL: ]message``."""

    default_time_format = "%Y-%m-%d %H:%M:%S"
    default_msec_format = "%s.%03d"

    def __init__(self, prog: str) -> None:
        super().__init__(f"{prog}: [%(asctime)s] %(message)s")
        self._prog = prog

    def formatMessage(self, record: logging.LogRecord) -> str:
        """Adds the level name to warnings and errors."""
        level = f"{record.levelname}: " if record.levelno >= logging.WARNING else ""
        return f"{self._prog}: [{record.asctime}] {level}{record.message}"


def configure_launcher_logging(prog: str) -> logging.Handler:
    """Sends the ``dist_launch`` loggers' records to stderr in the format above.

    Idempotent: calling it again replaces the handler it installed before (so the
    messages are never printed twice), and leaves other handlers alone.

    Args:
        prog: The program name that starts each line, ``dist-launch``.

    Returns:
        The installed handler.
    """
    package_logger = logging.getLogger(LOGGER_NAME)
    for handler in list(package_logger.handlers):
        if getattr(handler, _HANDLER_MARK, False):
            package_logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    setattr(handler, _HANDLER_MARK, True)
    handler.setFormatter(LauncherFormatter(prog))
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
    return handler
