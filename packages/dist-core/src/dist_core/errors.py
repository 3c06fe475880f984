"""The exception type of dist-core."""

from __future__ import annotations


class DistEnvError(ValueError):
    """A distributed-environment variable is missing, malformed or inconsistent.

    The message names the variable and the value found (for example
    ``RANK=5 with WORLD_SIZE=4``), says what was expected, and what to do.
    """
