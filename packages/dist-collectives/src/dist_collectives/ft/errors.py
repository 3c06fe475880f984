"""The base of every ``dist_collectives.ft`` error, the refusal of an operation, the Manager's."""

from __future__ import annotations

from datetime import timedelta


class FTError(Exception):
    """Base of every exception type defined by ``dist_collectives.ft``.

    Each subclass also derives from the builtin type that describes it
    (``ValueError``, ``RuntimeError``, ``TimeoutError``, ``NotImplementedError``), so
    code that catches those keeps working; ``except FTError`` catches them all.
    """


class UnsupportedOperationError(FTError, NotImplementedError):
    """A group does not support a collective; the message names the group and the op.

    Raised instead of reaching torch's base ``ProcessGroup``, whose message
    (``No backend type associated with device type cpu``) says neither. A
    ``NotImplementedError``, hence a ``RuntimeError``, as torch's own refusals are.
    """


class ReplicaError(FTError, RuntimeError):
    """Another replica reported an error in this step, or stopped beating its heartbeat."""


class ManagerConfigError(FTError, ValueError):
    """The Manager was built with arguments or environment it cannot work with."""


class WorkTimeoutError(FTError, TimeoutError, RuntimeError):
    """A Work's ``wait()`` gave up: the result did not come within the group's timeout.

    The message names the operation (``ManagedProcessGroup.allreduce timed out after
    65000ms``). Also a ``RuntimeError``, as torch's own collective timeouts are.
    """


def timed_out_after_ms(timeout: timedelta) -> str:
    """``timed out after 10ms``: how torch and torchft word a timeout in milliseconds."""
    return f"timed out after {round(timeout.total_seconds() * 1000)}ms"


def timed_out_after_seconds(timeout: timedelta) -> str:
    """``timed out after 0.01 seconds``: how torchft's baby groups word a timeout."""
    return f"timed out after {timeout.total_seconds():g} seconds"
