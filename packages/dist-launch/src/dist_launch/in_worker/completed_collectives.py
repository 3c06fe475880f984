"""How many collectives this rank has completed: progress the stack cannot show.

A rank that spends its step in one C call (a collective, a ``sleep`` between steps, a
data loader's ``queue.get``) keeps one Python stack, so the stack sampler alone sees it
stand still although its collectives complete. torch keeps, per process group, the
sequence number of the last collective the rank completed (the ``pg_status`` of its
flight recorder's dump, also for NCCL, where the watchdog thread keeps it). The dump
without its entries (``includeCollectives=False``) is a few hundred bytes and costs
microseconds, so the beacon reads it at every look; the sum over the rank's groups
moves whenever any group completes a collective.

What it cannot see: gloo records no completion of point-to-point operations
(``send``/``recv``), and ``TORCH_FR_BUFFER_SIZE=0`` turns gloo's recorder, and with it
these counters, off. Standard library only at import; torch is touched only when the
script imported ``torch.distributed`` and initialised it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

# "last_completed_collective":"12" (torch writes the counters as strings).
_LAST_COMPLETED = re.compile(rb'"last_completed_collective"\s*:\s*"?(-?\d+)')


def count_completed(dump: bytes) -> int:
    """The sum of every group's last completed sequence number in one dump (-1 counts 0)."""
    return sum(max(0, int(match.group(1))) for match in _LAST_COMPLETED.finditer(dump))


class CompletedCollectives:
    """Reads the number of collectives this rank completed, over all its groups."""

    def __init__(self) -> None:
        self._dumps: list[Callable[[], bytes]] | None = None

    def _find_dumps(self, torch: Any) -> list[Callable[[], bytes]]:
        c10d = torch._C._distributed_c10d
        dumps: list[Callable[[], bytes]] = []
        generic = getattr(c10d, "_dump_fr_trace_json", None)
        if generic is not None:
            dumps.append(lambda: bytes(generic(includeCollectives=False, onlyActive=False)))
        nccl = getattr(c10d, "_dump_nccl_trace_json", None)
        cuda = getattr(torch, "cuda", None)
        if nccl is not None and cuda is not None:
            # NCCL's counters live in its own dump; only a rank that uses CUDA has them.
            def nccl_dump() -> bytes:
                if not cuda.is_initialized():
                    return b""
                return bytes(nccl(includeCollectives=False, onlyActive=False))

            dumps.append(nccl_dump)
        return dumps

    def read(self) -> int | None:
        """The count, or None while ``torch.distributed`` is not initialised (or has no dump)."""
        distributed = sys.modules.get("torch.distributed")
        torch = sys.modules.get("torch")
        if distributed is None or torch is None:
            return None
        try:
            if not distributed.is_available() or not distributed.is_initialized():
                return None
            if self._dumps is None:
                self._dumps = self._find_dumps(torch)
            if not self._dumps:
                return None
            return sum(count_completed(dump()) for dump in self._dumps)
        except Exception:  # a private API in a worker that may be tearing down: no sign
            return None
