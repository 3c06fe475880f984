"""The root exception of dist-workspace."""

from __future__ import annotations


class WorkspaceError(RuntimeError):
    """A workspace file or shared-memory exchange is missing, broken or foreign.

    The message names the rank and the file or segment at fault, says what was expected
    and what was found, and what to do about it.
    """
