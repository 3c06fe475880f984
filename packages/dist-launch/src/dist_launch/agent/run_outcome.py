"""How a ``dist-launch`` run ended: one typed value, one exit status, one report.

The agent's decisions return a :class:`RunOutcome`; :func:`report_run_outcome` is the
one place that prints it and turns it into the exit status. Each status, what it
means, and its exit status:

- ``succeeded``: every rank of the last round exited 0; 0.
- ``failed``: a rank failed and no restart was left; the rank's own exit code, or
  128 + N after signal N (1 when it has none).
- ``timed_out``: ``--timeout`` expired; 124, as coreutils' timeout(1).
- ``hung``: the group was found hung (``--hang-timeout``, or an expired torch elastic
  timer) and no restart was left; :data:`HANG_EXIT_STATUS` (75, ``EX_TEMPFAIL`` of
  sysexits.h: a temporary failure, worth a retry), whatever the stopped ranks' own
  statuses.
- ``interrupted``: a handled signal N stopped the run; 128 + N.
- ``closed``: another node (or the end of the restart budget) closed the job; 1.
- ``rendezvous_failed``: the rendezvous could not be reached or formed; 1.
- ``start_failed``: the workers (or the fork server) could not be started; 1.
- ``usage``: the command line cannot run as given; 2.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from typing import Literal, TextIO

from dist_core.supervisor import GroupOutcome
from dist_launch.diagnostics.failure_report import format_report, group_exit_status
from dist_launch.plan.hang_policy import HANG_EXIT_STATUS

__all__ = [
    "HANG_EXIT_STATUS",
    "USAGE_EXIT_STATUS",
    "RunOutcome",
    "RunStatus",
    "format_run_outcome",
    "report_run_outcome",
    "run_exit_status",
]

RunStatus = Literal[
    "succeeded",
    "failed",
    "timed_out",
    "hung",
    "interrupted",
    "closed",
    "rendezvous_failed",
    "start_failed",
    "usage",
]

USAGE_EXIT_STATUS = 2
_EXIT_STATUS: dict[RunStatus, int] = {
    "succeeded": 0,
    "hung": HANG_EXIT_STATUS,
    "closed": 1,
    "rendezvous_failed": 1,
    "start_failed": 1,
    "usage": USAGE_EXIT_STATUS,
}


@dataclass(frozen=True)
class RunOutcome:
    """How the run ended.

    Attributes:
        status: What happened (see the module docstring).
        group: The last round's outcome when it is part of the report (failed,
            timed out, or interrupted while workers ran).
        signum: The signal that stopped the run (``interrupted``).
        message: The launcher's closing words after the report, without the program
            name (``the job was closed by another node: ...``); empty for none.
    """

    status: RunStatus
    group: GroupOutcome | None = None
    signum: int | None = None
    message: str = ""

    @property
    def rank(self) -> int | None:
        """The global rank that failed first, if one did."""
        root = None if self.group is None else self.group.root_cause
        return None if root is None else root.rank

    @property
    def returncode(self) -> int | None:
        """That rank's exit code, or ``-N`` after signal N."""
        root = None if self.group is None else self.group.root_cause
        return None if root is None else root.returncode


def run_exit_status(outcome: RunOutcome) -> int:
    """The exit status of ``outcome`` (the table in the module docstring)."""
    if outcome.status == "interrupted":
        assert outcome.signum is not None
        return 128 + outcome.signum
    if outcome.status in ("failed", "timed_out"):
        return 1 if outcome.group is None else group_exit_status(outcome.group)
    return _EXIT_STATUS[outcome.status]


def format_run_outcome(outcome: RunOutcome, prog: str) -> str:
    """The report of ``outcome``: the group's report, then the launcher's closing line.

    Empty for a run that succeeded.
    """
    lines: list[str] = []
    if outcome.group is not None and outcome.status not in ("succeeded", "hung"):
        # A hang's report (the grouped stacks) is printed when the hang is found.
        lines.append(format_report(outcome.group, prog))
    if outcome.status == "interrupted":
        assert outcome.signum is not None
        lines.append(f"{prog}: interrupted by {signal.Signals(outcome.signum).name}")
    elif outcome.message:
        lines.append(f"{prog}: {outcome.message}")
    return "\n".join(lines)


def report_run_outcome(outcome: RunOutcome, prog: str, stream: TextIO | None = None) -> int:
    """Prints the report of ``outcome`` (stderr by default); returns its exit status."""
    text = format_run_outcome(outcome, prog)
    if text:
        print(text, file=sys.stderr if stream is None else stream, flush=True)
    return run_exit_status(outcome)
