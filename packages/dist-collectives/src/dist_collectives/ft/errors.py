"""The base of every ``dist_collectives.ft`` error, the refusal of an operation, the Manager's."""

from __future__ import annotations


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
