"""Entry point of ``dist-launch`` and ``python -m dist_launch``.

Parses the command line, starts the fork server before anything else (its import of
torch is the longest step of a start), then hands the plan to the agent.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, NoReturn

from dist_launch.cli.parser import PROG, plan_from_args
from dist_launch.output.launcher_log import configure_launcher_logging
from dist_launch.plan.launch_plan import UsageError

if TYPE_CHECKING:
    from dist_launch.agent.run_outcome import RunStatus


def _ended_early(status: RunStatus, message: str) -> int:
    """Reports a run that ended before the agent started; returns its exit status."""
    # Imported only here: nothing may delay the fork server's start.
    from dist_launch.agent.run_outcome import RunOutcome, report_run_outcome  # noqa: PLC0415

    return report_run_outcome(RunOutcome(status, message=message), PROG)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``dist-launch`` and ``python -m dist_launch``; returns the exit status."""
    configure_launcher_logging(PROG)
    try:
        plan = plan_from_args(argv)
    except UsageError as error:
        return _ended_early("usage", f"error: {error}")
    # The fork server first: its import of torch is the longest step of a start, and
    # it runs while this process imports the rest of the launcher.
    from dist_launch.agent.event_loop import EventLoop  # noqa: PLC0415
    from dist_launch.workers.fork_server_client import start_fork_server  # noqa: PLC0415

    loop = EventLoop()
    try:
        fork_server = start_fork_server(plan, loop)
    except OSError as error:
        loop.close()
        return _ended_early("start_failed", f"error: could not start the fork server: {error}")
    from dist_launch.agent.agent import Agent  # noqa: PLC0415 - after the fork server started

    return Agent(plan, loop=loop, fork_server=fork_server).run()


def run() -> NoReturn:
    """The ``dist-launch`` program: :func:`main`, then the process ends at once.

    Once :func:`main` returns, the report is out, every worker reaped and every thread
    of the launcher joined; what is left is the interpreter's own teardown, torch's
    included, which took 1-3 s on a loaded host (a node of a failed job ended that
    much after the others, past the 2 s the job's end is promised in). So the exit
    handlers run and the streams are flushed here, and the process exits without it.
    """
    code = main()
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
