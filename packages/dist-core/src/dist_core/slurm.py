"""SLURM's compressed host lists and task counts, and the master port of a SLURM job.

SLURM writes node lists such as ``gpu[01-04,07],cpu3`` and per-node task counts
such as ``4(x2),2``; this module expands both. It reads no environment variable
itself: callers pass the variable's name so that errors can name it.

:func:`slurm_master_port` is the one rule every dist-* package uses for a job step that
names no master port (dist-core's :class:`~dist_core.DistEnv`, dist-launch under
``srun``), so that every task of a step agrees on it without talking first.
"""

from __future__ import annotations

import itertools
import re

from dist_core.errors import DistEnvError

# Below Linux's default ephemeral range (32768-60999), where the kernel picks the local
# port of every outgoing connection: a port in it may be taken by any client on the node.
SLURM_PORT_BASE = 12000
SLURM_PORT_SPAN = 20000
# Each step moves the port by this much (about 0.618 x the span, the golden ratio's
# stride): coprime with the span, so the steps of one job never share a port.
SLURM_STEP_STRIDE = 12361

_REPEAT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str, variable: str) -> list[str]:
    """Splits on commas that are not inside brackets."""
    parts: list[str] = []
    depth = 0
    current: list[str] = []
    for char in text:
        if char == "[":
            depth += 1
            if depth > 1:
                raise DistEnvError(f"{variable}={text}: nested brackets are not a SLURM host list")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise DistEnvError(f"{variable}={text}: ']' without a matching '['")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth != 0:
        raise DistEnvError(f"{variable}={text}: '[' without a matching ']'")
    parts.append("".join(current))
    return parts


def _expand_range_list(body: str, whole: str, variable: str) -> list[str]:
    """Expands ``01-04,07`` into ``['01', '02', '03', '04', '07']``, keeping zero padding."""
    values: list[str] = []
    for item in body.split(","):
        match = _RANGE.match(item.strip())
        if match is None:
            raise DistEnvError(
                f"{variable}={whole}: '{item}' is not a number or a range like 01-04"
            )
        first, last = match.group(1), match.group(2)
        if last is None:
            values.append(first)
            continue
        start, stop = int(first), int(last)
        if stop < start:
            raise DistEnvError(f"{variable}={whole}: range {item} runs backwards")
        width = len(first)
        values.extend(str(number).zfill(width) for number in range(start, stop + 1))
    return values


def _expand_host_pattern(pattern: str, whole: str, variable: str) -> list[str]:
    """Expands one host pattern, which may hold several bracket groups."""
    pieces: list[list[str]] = []
    rest = pattern
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            pieces.append([rest])
            break
        close_at = rest.find("]", open_at)
        if open_at > 0:
            pieces.append([rest[:open_at]])
        pieces.append(_expand_range_list(rest[open_at + 1 : close_at], whole, variable))
        rest = rest[close_at + 1 :]
    return ["".join(combination) for combination in itertools.product(*pieces)]


def expand_hostlist(hostlist: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Expands a SLURM host list into host names, in SLURM's order.

    Args:
        hostlist: The compressed list, e.g. ``gpu[01-04,07],cpu3``.
        variable: The environment variable it came from, named in errors.

    Returns:
        The host names, e.g. ``['gpu01', 'gpu02', 'gpu03', 'gpu04', 'gpu07', 'cpu3']``.

    Raises:
        DistEnvError: The list is empty or malformed.
    """
    text = hostlist.strip()
    if not text:
        raise DistEnvError(f"{variable}={hostlist}: the host list is empty")
    hosts: list[str] = []
    for pattern in _split_top_level(text, variable):
        pattern = pattern.strip()
        if not pattern:
            raise DistEnvError(f"{variable}={hostlist}: empty entry between commas")
        hosts.extend(_expand_host_pattern(pattern, hostlist, variable))
    return hosts


def parse_tasks_per_node(value: str, variable: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expands SLURM's per-node task counts, e.g. ``4(x2),2`` into ``[4, 4, 2]``.

    Args:
        value: The compressed counts.
        variable: The environment variable it came from, named in errors.

    Returns:
        One task count per node, in node order.

    Raises:
        DistEnvError: The value is empty or malformed.
    """
    counts: list[int] = []
    for item in value.split(","):
        match = _REPEAT.match(item.strip())
        if match is None:
            raise DistEnvError(f"{variable}={value}: '{item}' is not a count like 4 or 4(x2)")
        repeat = int(match.group(2)) if match.group(2) is not None else 1
        counts.extend([int(match.group(1))] * repeat)
    return counts


def slurm_master_port(job_id: int, step_id: int | None = None) -> int:
    """The master port of a SLURM job step that sets no ``MASTER_PORT``.

    ``12000 + (job_id + 12361 * step_id) % 20000``: every task of a step derives the
    same port; two steps of one job never share one (12361 is coprime with 20000), so
    concurrent steps of an allocation do not collide; step 0 of two jobs differs unless
    their ids differ by a multiple of 20000; and every port lies below Linux's
    ephemeral range. ``step_id`` None (or 0) gives ``12000 + job_id % 20000``. Reads no
    variable: the caller passes ``SLURM_JOB_ID`` and ``SLURM_STEP_ID``.

    Args:
        job_id: The job's id, ``SLURM_JOB_ID``.
        step_id: The step's id, ``SLURM_STEP_ID``; None outside a step.

    Returns:
        A TCP port in ``[12000, 32000)``.
    """
    offset = 0 if step_id is None else SLURM_STEP_STRIDE * step_id
    return SLURM_PORT_BASE + (job_id + offset) % SLURM_PORT_SPAN
