"""Work objects that a reconfigurable group hands back without a torch backend behind them."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.futures import Future


def completed_future(value: Any) -> Future[Any]:
    """A future that already holds ``value``."""
    future: Future[Any] = Future()
    future.set_result(value)
    return future


class FutureWork(dist.Work):
    """A :class:`~torch.distributed.Work` driven by a :class:`torch.futures.Future`.

    ``wait`` raises what the future raised; ``is_completed`` says whether it is done.
    """

    def __init__(self, future: Future[Any]) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Blocks until the future is done, then raises its error, if any."""
        self._future.wait()
        return True

    def is_completed(self) -> bool:
        """Whether the future is done."""
        return bool(self._future.done())

    def is_success(self) -> bool:
        """Whether the future is done without an error."""
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def get_future(self) -> Future[Any]:
        """The future itself."""
        return self._future


class DummyWork(FutureWork):
    """An already-completed Work whose future holds ``result`` (tensors left unchanged)."""

    def __init__(self, result: Any = None) -> None:
        super().__init__(completed_future(result))
