"""Waiting for a benchmark's worker processes: their report, then their end."""

from __future__ import annotations

import queue as queues
import time
from typing import Any


def collect(queue: Any, procs: list[Any], count: int, timeout: float) -> list[Any]:
    """``count`` reports from ``queue``; fails at once when a worker died without one."""
    deadline = time.monotonic() + timeout
    reports: list[Any] = []
    while len(reports) < count:
        try:
            reports.append(queue.get(timeout=1.0))
        except queues.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                raise RuntimeError(
                    f"workers failed (exit codes {failed}) or timed out after {timeout:.0f} s"
                ) from None
    return reports


def reap(procs: list[Any], grace: float) -> None:
    """Joins every worker, killing those still alive after ``grace`` seconds."""
    for proc in procs:
        proc.join(grace)
        if proc.is_alive():
            proc.kill()
            proc.join()
