"""How a ``dist-launch`` run ended: one typed value, one exit code, one report.

The agent's decisions return a :class:`RunOutcome`; :func:`report_run_outcome` is the
one place that prints it and turns it into the exit code (:func:`exit_code_of`, one
:class:`~dist_launch.exit_codes.ExitCode` per class of ending). Each status, what it
means, and its exit code:

- ``succeeded``: every rank of the last round exited 0; ``SUCCESS`` (0).
- ``failed``: a rank failed and no restart was spent on it (a deterministic error) or
  none was left: ``INFRASTRUCTURE`` (137) when the root cause was killed by a signal
  or only lost its peers (:mod:`dist_launch.diagnostics.failure_class`), else
  ``FAILED`` (1). The rank's own exit code is in the report and ``error.json``.
- ``timed_out``: ``--timeout`` expired; ``TIMEOUT`` (124), as coreutils' timeout(1).
- ``hung``: the group was found hung (``--hang-timeout``, or an expired torch elastic
  timer) and no restart was left; ``HUNG`` (75, ``EX_TEMPFAIL`` of sysexits.h: a
  temporary failure, worth a retry), whatever the stopped ranks' own statuses.
- ``interrupted``: a handled signal stopped the run; ``INTERRUPTED`` (130) for SIGINT
  (a person), ``PREEMPTED`` (143) for SIGTERM, SIGHUP or another (stopped from outside).
- ``closed``: another node (or the end of the restart budget) closed the job;
  ``FAILED`` (1): the node that closed it exits with the class of its own ending.
- ``rendezvous_failed``: the rendezvous could not be reached or formed;
  ``INFRASTRUCTURE`` (137).
- ``start_failed``: the workers (or the fork server) could not be started;
  ``INFRASTRUCTURE`` (137).
- ``usage``: the command line cannot run as given; ``USAGE`` (2).
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass
from typing import Literal, TextIO

from dist_core.supervisor import GroupOutcome
from dist_launch.diagnostics.failure_class import FailureKind
from dist_launch.diagnostics.failure_report import describe_returncode, format_report
from dist_launch.exit_codes import ExitCode

__all__ = [
    "RunOutcome",
    "RunStatus",
    "error_file_fields",
    "exit_code_of",
    "format_run_outcome",
    "report_run_outcome",
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

_EXIT_CODE: dict[RunStatus, ExitCode] = {
    "succeeded": ExitCode.SUCCESS,
    "timed_out": ExitCode.TIMEOUT,
    "hung": ExitCode.HUNG,
    "closed": ExitCode.FAILED,
    "rendezvous_failed": ExitCode.INFRASTRUCTURE,
    "start_failed": ExitCode.INFRASTRUCTURE,
    "usage": ExitCode.USAGE,
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
        failure: For ``failed``, the kind of failure
            (:mod:`dist_launch.diagnostics.failure_class`).
    """

    status: RunStatus
    group: GroupOutcome | None = None
    signum: int | None = None
    message: str = ""
    failure: FailureKind | None = None

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


def exit_code_of(outcome: RunOutcome) -> ExitCode:
    """The exit code of ``outcome`` (the list in the module docstring)."""
    if outcome.status == "interrupted":
        return ExitCode.INTERRUPTED if outcome.signum == signal.SIGINT else ExitCode.PREEMPTED
    if outcome.status == "failed":
        if outcome.failure == "infrastructure":
            return ExitCode.INFRASTRUCTURE
        return ExitCode.FAILED
    return _EXIT_CODE[outcome.status]


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


def error_file_fields(outcome: RunOutcome) -> tuple[str, str, float]:
    """What the run's ``error.json`` says: a one-line message, a traceback, a time.

    The root cause's error where a rank failed (its traceback, its own time), else
    how the run ended.
    """
    root = None if outcome.group is None else outcome.group.root_cause
    if root is not None and root.record is not None:
        record = root.record
        return f"{record.exception}: {record.message}", record.traceback, record.timestamp
    if root is not None:
        what = f"rank {root.rank} failed with {describe_returncode(root.returncode)}"
        return what, root.crash_stack, root.failure_time
    if outcome.status == "interrupted" and outcome.signum is not None:
        return f"interrupted by {signal.Signals(outcome.signum).name}", "", time.time()
    return outcome.message or outcome.status, "", time.time()


def report_run_outcome(outcome: RunOutcome, prog: str, stream: TextIO | None = None) -> ExitCode:
    """Prints the report of ``outcome`` (stderr by default); returns its exit code."""
    text = format_run_outcome(outcome, prog)
    if text:
        print(text, file=sys.stderr if stream is None else stream, flush=True)
    return exit_code_of(outcome)
