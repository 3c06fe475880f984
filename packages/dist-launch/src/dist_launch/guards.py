"""Moved to :mod:`dist_core.worker_guards` (dist-core 0.3); these names stay importable here."""

from __future__ import annotations

from dist_core.worker_guards import (
    ORPHANED_EXIT_STATUS,
    die_quietly_of_sigint,
    install_worker_guards,
    record_and_print,
)

__all__ = [
    "ORPHANED_EXIT_STATUS",
    "die_quietly_of_sigint",
    "install_worker_guards",
    "record_and_print",
]
