"""The exception type of dist-collectives."""

from __future__ import annotations


class CollectivesError(RuntimeError):
    """The distributed state does not allow the requested operation.

    Raised when the environment describes several ranks but no process group is
    initialized, when ranks disagree on a plan they must share (for example the
    parallel layout), or when a group built by this package does not hold the ranks
    its layout says. Bad arguments (shapes, split sizes, ranks) raise ``ValueError``.
    """
