"""Per-rank logging: a ``[rank r/w]`` prefix, and INFOALL for messages every rank logs.

``INFO`` (and ``DEBUG``) records are kept on rank 0 only, so that N ranks do not print
the same line N times; ``INFOALL`` (between INFO and WARNING) and everything from
``WARNING`` up are kept on every rank.

Under a launcher that already starts every line of a rank's output with the rank
(``dist-launch`` writes ``[rank3]: ``), the ``[rank r/w]`` prefix would say it twice:
the launcher sets :data:`LAUNCHER_PREFIXES_VARIABLE` in each worker, and
:func:`configure_logging` then leaves the rank out.
"""

from __future__ import annotations

import logging
import os
import sys

INFOALL = logging.INFO + 5
logging.addLevelName(INFOALL, "INFOALL")

_HANDLER_MARK = "_dist_core_handler"

# Set to "1" by a launcher that prefixes every line of a worker's output with its rank.
LAUNCHER_PREFIXES_VARIABLE = "DIST_LAUNCH_PREFIXES_OUTPUT"


class RankZeroFilter(logging.Filter):
    """Drops records below INFOALL on every rank but rank 0."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        """Keeps every record on rank 0, and INFOALL and above elsewhere."""
        return self.rank == 0 or record.levelno >= INFOALL


def configure_logging(
    rank: int | None = None, world_size: int | None = None, level: int = logging.INFO
) -> logging.Handler:
    """Sets up the root logger of a rank's process; call it once per process.

    Library code never calls this: applications and launchers do. Calling it again
    replaces the handler it installed before, so a rank can reconfigure after it
    learns its rank.

    Each line reads ``[rank r/w] LEVEL logger: message``, or ``LEVEL logger: message``
    when ``DIST_LAUNCH_PREFIXES_OUTPUT`` (:data:`LAUNCHER_PREFIXES_VARIABLE`) is ``1``,
    as ``dist-launch`` sets it in its workers: the launcher puts the rank in front of
    every line already.

    Reads ``DIST_LAUNCH_PREFIXES_OUTPUT``, and ``RANK``/``WORLD_SIZE`` (or SLURM's and
    Open MPI's equivalents, see :meth:`dist_core.DistEnv.from_environ`) when ``rank``
    or ``world_size`` is None.

    Args:
        rank: This process's global rank.
        world_size: The number of ranks.
        level: The root logger's level.

    Returns:
        The installed handler (writing to stderr).
    """
    if rank is None or world_size is None:
        from dist_core.env import DistEnv  # noqa: PLC0415 - keep this module light

        env = DistEnv.from_environ()
        rank = env.rank if rank is None else rank
        world_size = env.world_size if world_size is None else world_size
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_MARK, False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    setattr(handler, _HANDLER_MARK, True)
    prefix = "" if launcher_prefixes_output() else f"[rank {rank}/{world_size}] "
    handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RankZeroFilter(rank))
    root.addHandler(handler)
    root.setLevel(level)
    return handler


def launcher_prefixes_output() -> bool:
    """Whether this process runs under a launcher that prefixes its lines with the rank.

    Reads ``DIST_LAUNCH_PREFIXES_OUTPUT`` (:data:`LAUNCHER_PREFIXES_VARIABLE`).
    """
    return os.environ.get(LAUNCHER_PREFIXES_VARIABLE) == "1"
