"""Work objects that a reconfigurable group hands back without a torch backend behind them.

Futures and CUDA streams: a :class:`torch.futures.Future` created without ``devices``
knows nothing of the GPU, so whoever waits on it (DDP's reducer, ``Work.wait``) reads
its CUDA tensors on its own stream while the kernels that wrote them may still be
queued on another: the values read are whatever was there before (replicas that
diverge silently). A future created with the tensors' CUDA devices records an event on
the current stream when its result is set, and makes the waiter's current stream wait
for that event. Every future in ``dist_collectives.ft`` that carries tensors is made
by :func:`future_for` (or :func:`completed_future`), and its result is set on the
stream that wrote the tensors (or on one that waited for it).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, TypeVar, overload

import torch
import torch.distributed as dist
from torch.futures import Future

from dist_collectives.ft.errors import WorkTimeoutError, timed_out_after_ms

# gloo's own default timeout: the longest any Work of ours waits when nothing bounds it.
UNBOUNDED_WAIT_LIMIT = timedelta(minutes=30)


def _tensors_in(value: Any, found: list[torch.Tensor], depth: int = 0) -> None:
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif depth < 4 and isinstance(value, list | tuple):
        for item in value:
            _tensors_in(item, found, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            _tensors_in(item, found, depth + 1)


def cuda_devices(value: Any) -> list[torch.device]:
    """The CUDA devices of the tensors in ``value``, sorted, each once; empty if none.

    ``value`` is a tensor, or lists, tuples and dicts of them.

    Does not initialise CUDA: it reads each tensor's ``device``.
    """
    found: list[torch.Tensor] = []
    _tensors_in(value, found)
    indices = {t.device.index for t in found if t.device.type == "cuda"}
    return [torch.device("cuda", index) for index in sorted(i for i in indices if i is not None)]


_F = TypeVar("_F", bound=Future[Any])


@overload
def future_for(value: Any) -> Future[Any]: ...


@overload
def future_for(value: Any, future_type: type[_F]) -> _F: ...


def future_for(value: Any, future_type: type[Future[Any]] = Future) -> Future[Any]:
    """An empty future that may carry the tensors in ``value`` (see the module doc).

    With CUDA tensors in ``value`` the future is created with their devices, so that
    setting its result records an event on the current stream and waiting on it makes
    the waiter's stream wait for that event; without, it is a plain CPU future.

    Args:
        value: What the future will hold (or something with the same tensors).
        future_type: :class:`torch.futures.Future` or a subclass (:class:`WorkFuture`).
    """
    devices: list[int | str | torch.device] = list(cuda_devices(value))
    return future_type(devices=devices) if devices else future_type()


def completed_future(value: Any) -> Future[Any]:
    """A future that already holds ``value``, set on the current stream (see the module doc)."""
    future = future_for(value)
    future.set_result(value)
    return future


def all_done(futures: Sequence[Future[Any]], value: Any) -> Future[Any]:
    """A future of ``value`` that completes once every one of ``futures`` is done.

    It fails with the first error among them. Unlike :func:`torch.futures.collect_all`,
    which needs every future to have the same devices, it accepts CPU and CUDA futures
    mixed: before setting the result it waits on each future, which makes the current
    stream wait for that future's CUDA events, so the result's event covers them all.
    """
    combined = future_for(value)
    if not futures:
        combined.set_result(value)
        return combined
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[Any]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0] > 0:
                return
        try:
            for future in futures:
                future.wait()  # raises its error; makes this stream wait for its events
        except Exception as error:
            combined.set_exception(error)
            return
        combined.set_result(value)

    for future in futures:
        future.add_done_callback(one_done)
    return combined


def wait_within(future: Future[Any], timeout: timedelta, operation: str) -> Any:
    """Waits for ``future`` at most ``timeout``; returns its value or raises its error.

    Raises:
        WorkTimeoutError: ``future`` was not done within ``timeout``; the message
            names ``operation``.
    """
    if not future.done():
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        if not done.wait(timeout.total_seconds()):
            raise WorkTimeoutError(
                f"{operation} {timed_out_after_ms(timeout)}: its result never arrived "
                f"(waited {timeout})"
            )
    return future.wait()


class FutureWork(dist.Work):
    """A :class:`~torch.distributed.Work` driven by a :class:`torch.futures.Future`.

    ``wait`` raises what the future raised; on a future made by :func:`future_for` it
    also makes the caller's current CUDA stream wait for the result. ``is_completed``
    says whether it is done.

    Args:
        future: What the Work waits for.
        operation: What produced it, for the timeout's message
            (``"ProcessGroupBabyGloo.allreduce"``).
        timeout: The longest :meth:`wait` blocks when not given one; None for a future
            that something else is bound to complete (a default of 30 minutes then
            still ends the wait).
    """

    def __init__(
        self, future: Future[Any], operation: str = "operation", timeout: timedelta | None = None
    ) -> None:
        super().__init__()
        self._future = future
        self._operation = operation
        self._timeout = timeout or UNBOUNDED_WAIT_LIMIT

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Blocks until the future is done, then raises its error, if any.

        With CUDA tensors the caller's current stream then waits for the result's event
        (the CPU does not wait for the GPU).

        Args:
            timeout: The longest to wait; the Work's own timeout when None.

        Raises:
            WorkTimeoutError: the future was not done within the timeout.
        """
        wait_within(self._future, timeout or self._timeout, self._operation)
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


class WorkFuture(Future[Any]):
    """A :class:`torch.futures.Future` that also answers like a :class:`~torch.distributed.Work`.

    What :meth:`Manager.allreduce` returns: code written for its future (``wait()``
    returns the tensor, ``then``, ``value``, ``done``) and code written for torchft,
    whose ``allreduce`` returns a Work (``wait()``, ``get_future()``,
    ``is_completed()``, ``synchronize()``, ``block_current_stream()``), both work.
    """

    def get_future(self) -> Future[Any]:
        """This future itself."""
        return self

    def is_completed(self) -> bool:
        """Whether the future is done."""
        return bool(self.done())

    def is_success(self) -> bool:
        """Whether the future is done without an error."""
        return self.done() and self.exception() is None

    def exception(self) -> BaseException | None:
        """The future's error, or None (also while it is not done)."""
        if not self.done():
            return None
        try:
            self.value()
        except BaseException as error:
            return error
        return None

    def synchronize(self) -> None:
        """Waits for the future; with CUDA tensors, the current stream waits for them."""
        self.wait()

    def block_current_stream(self) -> None:
        """The same as :meth:`synchronize`: the CPU waits for completion, then the stream."""
        self.wait()
