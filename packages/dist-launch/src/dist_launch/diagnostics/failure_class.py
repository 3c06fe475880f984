"""What kind of failure a failed round was: worth a restart, or not. Pure.

- **deterministic**: a restart as is fails the same way, so none is spent on it:
  the root cause raised before its process group existed with an error of the code
  itself (:data:`CODE_ERRORS`: ``SyntaxError``, ``ImportError``, ``NameError``, ...),
  or raised the same exception at the same place (:class:`Fingerprint`) as the root
  cause of the previous failed round;
- **infrastructure**: the root cause was killed by a signal (an OOM kill, SIGKILL,
  SIGSEGV) or only lost its peers: a restart may well succeed;
- **error**: any other error of the script: restarted within ``--max-restarts``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from dist_core.supervisor import GroupOutcome

FailureKind = Literal["deterministic", "infrastructure", "error"]

# Raised by the code itself, whatever the machine: before a process group existed,
# a restart meets the same line again.
CODE_ERRORS = frozenset(
    {
        "SyntaxError",
        "IndentationError",
        "TabError",
        "ImportError",
        "ModuleNotFoundError",
        "NameError",
        "UnboundLocalError",
        "AttributeError",
        "TypeError",
    }
)
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+)', re.MULTILINE)


@dataclass(frozen=True)
class Fingerprint:
    """An error's type and the innermost place of the script it was raised at."""

    exception: str
    where: str  # "train.py:42", the last frame of the traceback; "" when it has none

    def describe(self) -> str:
        """``ValueError at train.py:42``."""
        return f"{self.exception} at {self.where}" if self.where else self.exception


@dataclass(frozen=True)
class FailureClass:
    """How a failed round is classed, with its fingerprint and the reason in words."""

    kind: FailureKind
    fingerprint: Fingerprint | None = None
    why: str = ""


def fingerprint_of(exception: str, traceback: str) -> Fingerprint:
    """The fingerprint of an error from its type and formatted traceback."""
    frames = _FRAME.findall(traceback)
    where = f"{frames[-1][0]}:{frames[-1][1]}" if frames else ""
    return Fingerprint(exception, where)


def classify_failure(outcome: GroupOutcome, previous: Fingerprint | None) -> FailureClass:
    """The class of a failed round (the module docstring's rules).

    Args:
        outcome: The round's outcome; its root cause is read.
        previous: The fingerprint of the previous failed round's root cause, if any.
    """
    root = outcome.root_cause
    if root is None:
        return FailureClass("error")
    if root.record is None:
        if root.returncode is not None and root.returncode < 0:
            return FailureClass("infrastructure", why=f"rank {root.rank} was killed by a signal")
        return FailureClass("error")
    record = root.record
    if root.is_peer_failure:
        return FailureClass("infrastructure", why="the ranks lost a peer")
    fingerprint = fingerprint_of(record.exception, record.traceback)
    if record.in_process_group is False and record.exception in CODE_ERRORS:
        return FailureClass(
            "deterministic",
            fingerprint,
            f"{fingerprint.describe()} before the process group existed",
        )
    if previous is not None and fingerprint == previous:
        return FailureClass(
            "deterministic", fingerprint, f"{fingerprint.describe()} again, as the last time"
        )
    return FailureClass("error", fingerprint)
