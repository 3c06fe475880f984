"""How long the scheduler waits between its SIGTERM and its SIGKILL, where cheaply known.

The launcher's ``--grace-period`` must end before it, with time left to report. The
first of these that says gives it:

1. ``DIST_LAUNCH_KILL_WAIT`` (seconds): set it where the launcher cannot read the
   scheduler's value, e.g. in a pod spec to its ``terminationGracePeriodSeconds``, or
   to the partition's ``GraceTime`` of a SLURM preemption;
2. in a SLURM job (``SLURM_JOB_ID`` set) with ``scontrol`` on ``PATH``: ``KillWait``
   from ``scontrol show config`` (bounded by :data:`SCONTROL_TIMEOUT_SECONDS`);
3. in a Kubernetes pod (``KUBERNETES_SERVICE_HOST`` set): the default of
   ``terminationGracePeriodSeconds``, 30 s, as an assumption (the pod spec, which the
   pod's environment does not show, may change it).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from dist_launch.plan.values import seconds_from_variable

logger = logging.getLogger(__name__)

KILL_WAIT_VARIABLE = "DIST_LAUNCH_KILL_WAIT"
# scontrol asks slurmctld; a start must not wait long for an answer that only informs.
SCONTROL_TIMEOUT_SECONDS = 2.0
# Kubernetes' default terminationGracePeriodSeconds.
KUBERNETES_DEFAULT_SECONDS = 30.0

_KILL_WAIT_LINE = re.compile(r"^\s*KillWait\s*=\s*(\d+)\s*sec", re.MULTILINE)


@dataclass(frozen=True)
class KillWait:
    """The scheduler's wait from SIGTERM to SIGKILL.

    Attributes:
        seconds: The wait.
        source: Where it came from, for messages.
        user_set: True when the user said it (``DIST_LAUNCH_KILL_WAIT``).
        assumed: True for a default the launcher cannot check (Kubernetes').
    """

    seconds: float
    source: str
    user_set: bool = False
    assumed: bool = False


def parse_kill_wait(config: str) -> float | None:
    """``KillWait`` of ``scontrol show config``'s output (``KillWait = 30 sec``); None if absent."""
    match = _KILL_WAIT_LINE.search(config)
    return None if match is None else float(match.group(1))


def _from_scontrol(timeout: float) -> float | None:
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        done = subprocess.run(
            [scontrol, "show", "config"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        logger.debug("scontrol show config: %s", error)
        return None
    if done.returncode != 0:
        logger.debug("scontrol show config exited %d: %s", done.returncode, done.stderr.strip())
        return None
    return parse_kill_wait(done.stdout)


def read_kill_wait(
    environ: Mapping[str, str], scontrol_timeout: float = SCONTROL_TIMEOUT_SECONDS
) -> KillWait | None:
    """The scheduler's kill wait; None when nothing says (see the module docstring).

    Reads ``DIST_LAUNCH_KILL_WAIT``, ``SLURM_JOB_ID``, ``PATH`` (for ``scontrol``) and
    ``KUBERNETES_SERVICE_HOST``.

    Raises:
        UsageError: ``DIST_LAUNCH_KILL_WAIT`` is not a positive number of seconds.
    """
    declared = seconds_from_variable(environ, KILL_WAIT_VARIABLE)
    if declared is not None:
        return KillWait(declared, KILL_WAIT_VARIABLE, user_set=True)
    if environ.get("SLURM_JOB_ID"):
        seconds_or_none = _from_scontrol(scontrol_timeout)
        if seconds_or_none is not None:
            return KillWait(seconds_or_none, "SLURM's KillWait (scontrol show config)")
    if environ.get("KUBERNETES_SERVICE_HOST"):
        return KillWait(
            KUBERNETES_DEFAULT_SECONDS,
            "Kubernetes' default terminationGracePeriodSeconds",
            assumed=True,
        )
    return None
