"""What a Manager's step API reuses and hands out: exchange buffers, wrapped futures.

Each class here is used from the training thread and from the threads that complete
operations (a group's callbacks, the futures given to ``wrap_future``), and says how
it stays consistent between them.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import torch


class BufferPool:
    """Communication buffers reused from step to step, by shape, dtype and device.

    A fresh buffer per allreduce cost more than the copy into it (new pages fault in).
    A buffer goes back only after its operation succeeded: one that a failed operation
    used may still be written by gloo until that group's timeout, so it is dropped.
    The training thread takes buffers and the group's callback threads give them back:
    one lock guards the free lists.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[torch.Size, torch.dtype, torch.device], list[torch.Tensor]] = {}

    def take(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous buffer of this shape, dtype and device (its values unset)."""
        with self._lock:
            free = self._free.get((shape, dtype, device))
            buffer = free.pop() if free else None
        if buffer is None:
            buffer = torch.empty(shape, dtype=dtype, device=device)
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        """Returns a buffer whose operation completed successfully."""
        with self._lock:
            self._free.setdefault((buffer.shape, buffer.dtype, buffer.device), []).append(buffer)


class WrappedFutures:
    """The futures given to ``Manager.wrap_future`` that are not done yet, with deadlines.

    Registered by the training thread, forgotten by the future's own callback, expired
    by the watcher: one lock guards the registry; the failure callbacks run outside it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self._open: dict[int, tuple[float, Callable[[Exception], None]]] = {}

    def register(self, seconds: float, fail: Callable[[Exception], None]) -> int:
        """Remembers a future that ``fail`` fails unless it is done within ``seconds``."""
        with self._lock:
            key = next(self._keys)
            self._open[key] = (time.monotonic() + seconds, fail)
        return key

    def forget(self, key: int) -> None:
        """The future of ``key`` is done: it no longer expires."""
        with self._lock:
            self._open.pop(key, None)

    def expire(self) -> None:
        """Fails the futures that are overdue."""
        now = time.monotonic()
        with self._lock:
            overdue = [key for key, (deadline, _) in self._open.items() if deadline < now]
            failures = [self._open.pop(key)[1] for key in overdue]
        for fail in failures:
            fail(
                TimeoutError(
                    "a future given to Manager.wrap_future was not done within its timeout"
                )
            )
