"""Moved to :mod:`dist_core.supervisor` (dist-core 0.3); these names stay importable here."""

from __future__ import annotations

from dist_core.supervisor import (
    KILL_WAIT_SECONDS,
    STACK_DUMP_SECONDS,
    GroupOutcome,
    GroupStatus,
    ProcessWorker,
    RankOutcome,
    RankStatus,
    Supervisor,
    Worker,
    pick_root_cause,
)

__all__ = [
    "KILL_WAIT_SECONDS",
    "STACK_DUMP_SECONDS",
    "GroupOutcome",
    "GroupStatus",
    "ProcessWorker",
    "RankOutcome",
    "RankStatus",
    "Supervisor",
    "Worker",
    "pick_root_cause",
]
