"""Groups that forward to another group: the generic wrapper and the error-swallowing one."""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]  # public, not re-exported in the stubs
from torch.futures import Future

from dist_collectives.ft.coordination.store import rendezvous_store, wait_for_arrivals
from dist_collectives.ft.errors import UnsupportedOperationError
from dist_collectives.ft.groups.process_group import (
    DEFAULT_TIMEOUT,
    OPERATIONS,
    ProcessGroup,
    refuse,
    tensors_of,
)
from dist_collectives.ft.groups.work import DummyWork, completed_future, future_for

logger = logging.getLogger(__name__)

# How long the interpreter's exit waits, at least, for groups still being torn down. A
# group destroyed while the interpreter finalises aborts the process (a joinable C++
# thread), so the wait grows to the longest timeout of a retired group: a gloo group
# whose operation waits on a peer that moved on holds its threads that long.
EXIT_DRAIN_SECONDS = 10.0
_drain_seconds = EXIT_DRAIN_SECONDS

_graveyard: queue.SimpleQueue[object] = queue.SimpleQueue()
_reaper: threading.Thread | None = None
_reaper_lock = threading.Lock()
_finalizers: set[threading.Thread] = set()
_STOP = object()


class _Marker:
    """Put in the graveyard to learn when everything retired before it is gone."""

    def __init__(self) -> None:
        self.reached = threading.Event()


def _reap_forever() -> None:
    while True:
        retired = _graveyard.get()
        if retired is _STOP:
            return
        if isinstance(retired, _Marker):
            retired.reached.set()
            continue
        # The last reference goes here: a gloo group's destructor joins its worker
        # threads, which may sit in an operation on a dead peer until the group's
        # timeout. torch releases the GIL in that destructor, so only this thread waits.
        del retired


def _drain_at_exit() -> None:
    deadline = time.monotonic() + _drain_seconds
    with _reaper_lock:
        reaper = _reaper
        finalizers = list(_finalizers)
    for thread in finalizers:
        thread.join(max(0.0, deadline - time.monotonic()))
    if reaper is None:
        return
    _graveyard.put(_STOP)
    reaper.join(max(0.0, deadline - time.monotonic()))
    if reaper.is_alive():
        logger.warning(
            "a retired process group is still being torn down after %.0f s (a peer died "
            "mid-operation); the interpreter may abort on exit",
            _drain_seconds,
        )


def retire_in_background(
    backend: object,
    timeout: timedelta | None = None,
    finalize: Callable[[Any], None] | None = None,
) -> None:
    """Drops the last reference to ``backend`` on a background thread.

    Tearing down a group whose peers died can take as long as its timeout; doing it here
    lets the caller go on with the new configuration at once. At the interpreter's exit
    the teardown is awaited for up to the longest ``timeout`` given (plus a margin), so
    that the process exits cleanly instead of aborting.

    Args:
        backend: The retired backend.
        timeout: Its timeout (how long its teardown may take).
        finalize: Called with ``backend`` first (an NCCL communicator's ``abort``, which
            blocks for about a second). Each such teardown gets a thread of its own, so
            that quick reconfigurations do not queue their aborts one behind the other
            while the old communicators still hold GPU memory.
    """
    global _reaper, _drain_seconds
    with _reaper_lock:
        if timeout is not None:
            _drain_seconds = max(_drain_seconds, timeout.total_seconds() + 5.0)
        if _reaper is None:
            _reaper = threading.Thread(target=_reap_forever, name="ft-group-reaper", daemon=True)
            _reaper.start()
            atexit.register(_drain_at_exit)
    if finalize is None:
        _graveyard.put(backend)
        return
    holder = [backend]
    del backend

    def run() -> None:
        try:
            finalize(holder[0])
        except Exception:
            logger.warning("tearing down a retired process group failed", exc_info=True)
        finally:
            holder.clear()  # the last reference, dropped on this thread
            with _reaper_lock:
                _finalizers.discard(threading.current_thread())

    thread = threading.Thread(target=run, name="ft-group-finalizer", daemon=True)
    with _reaper_lock:
        _finalizers.add(thread)
    thread.start()


def wait_for_retirements(timeout: float) -> bool:
    """Waits until every group retired so far is torn down; False if ``timeout`` passed.

    For tests and benchmarks that measure what the old groups held (GPU memory).
    """
    deadline = time.monotonic() + timeout
    with _reaper_lock:
        reaper = _reaper
        finalizers = list(_finalizers)
    for thread in finalizers:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            return False
    if reaper is None:
        return True
    marker = _Marker()
    _graveyard.put(marker)
    return marker.reached.wait(max(0.0, deadline - time.monotonic()))


class ProcessGroupWrapper(ProcessGroup):
    """Forwards every operation to the group of the current configuration.

    Either wraps another :class:`ProcessGroup` (``pg``), to which :meth:`configure` is
    forwarded, or, in subclasses, builds a torch backend per configuration in
    :meth:`_create_pg`.

    Args:
        pg: The group to wrap, or None when a subclass builds its own backend.
        timeout: How long an operation and the store rendezvous may take.
    """

    def __init__(self, pg: ProcessGroup | None = None, timeout: timedelta = DEFAULT_TIMEOUT):
        super().__init__()
        self._wrapped = pg
        self._timeout = timeout
        self._backend: Any = None
        # A torch ProcessGroup over the same backend, for the collectives that torch
        # binds on ProcessGroup but not on the backend (see _create_view).
        self._view: dist.ProcessGroup | None = None
        # Per operation, whether this backend's Work has a future (gloo's reduce_scatter
        # has none): found at the first call; those without get _FutureOnDemandWork.
        self._has_future: dict[str, bool] = {}

    def __repr__(self) -> str:
        """``ProcessGroupWrapper(pg=ProcessGroupDummy())`` when wrapping a group, as in torchft."""
        if self._wrapped is None:
            return super().__repr__()
        return f"{type(self).__name__}(pg={self._wrapped!r})"

    def set_rank_info(
        self,
        replica_id: str,
        group_rank: int,
        group_world_size: int,
        global_rank: int | None = None,
    ) -> None:
        """See :meth:`ProcessGroup.set_rank_info`; a wrapped group is told too."""
        super().set_rank_info(replica_id, group_rank, group_world_size, global_rank)
        if self._wrapped is not None:
            self._wrapped.set_rank_info(replica_id, group_rank, group_world_size, global_rank)

    def _handle_id(self) -> str:
        """The wrapped group's handle id (a wrapper and its group are one member)."""
        if self._wrapped is not None:
            return self._wrapped._handle_id()
        return super()._handle_id()

    def get_reconfigure_handle(self) -> str:
        """The wrapped group's handle, or this group's own over a torch backend."""
        if self._wrapped is not None:
            return self._wrapped.get_reconfigure_handle()
        return super().get_reconfigure_handle()

    @property
    def parent(self) -> Any:
        """The object operations go to: the wrapped group, or the current torch backend."""
        return self._wrapped if self._wrapped is not None else self._backend

    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """See :meth:`ProcessGroup.configure`.

        The arguments are checked before anything changes: a refused call
        (:class:`StoreAddressReusedError`, a bad rank) leaves the current
        configuration working. Then every member's arrival is awaited on the store
        (:func:`~dist_collectives.ft.coordination.store.wait_for_arrivals`: a missing peer fails
        within the timeout, naming its rank), a new backend is built, and only then is
        the old one released, torn down in the background, so a group whose peers
        died does not hold this call up.

        Raises:
            RendezvousTimeoutError: the store could not be reached, or some members did
                not arrive, within the timeout; the old configuration is left in place.
        """
        if self._wrapped is None and type(self)._create_pg is ProcessGroupWrapper._create_pg:
            raise NotImplementedError(
                f"{type(self).__name__} needs a group to wrap (pg=...) or must implement _create_pg"
            )
        if self._wrapped is not None:
            self._check_configuration(store_addr, rank, world_size)
            communicator = self._communicator
            if communicator is None:  # a subclass called _configure directly
                self._wrapped.configure(store_addr, rank, world_size)
            else:
                self._wrapped._build(store_addr, rank, world_size, communicator)
            self._claim_configuration(store_addr, rank, world_size)
            self._set_configuration(rank, world_size)
            return
        self._claim_configuration(store_addr, rank, world_size)
        who = f"{type(self).__name__}.configure"
        with rendezvous_store(store_addr, self._timeout, who) as store:
            wait_for_arrivals(store, store_addr, rank, world_size, self._timeout, who)
            new_backend = self._create_pg(store, rank, world_size)
            new_view = self._create_view(store, rank, world_size, new_backend)
        old_backend, self._backend = self._backend, new_backend
        old_view, self._view = self._view, new_view
        self._set_configuration(rank, world_size)
        if old_view is not None:
            retire_in_background(old_view, self._timeout)
        if old_backend is not None:
            self._retire(old_backend)
        logger.debug("%s configured on %s as %d/%d", self, store_addr, rank, world_size)

    def _create_pg(self, store: Store, rank: int, world_size: int) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__} needs a group to wrap (pg=...) or must implement _create_pg"
        )

    def _create_view(
        self, store: Store, rank: int, world_size: int, backend: Any
    ) -> dist.ProcessGroup | None:
        """A torch ProcessGroup dispatching to ``backend``, or None (the default).

        torch binds some collectives only on ProcessGroup, not on the backend
        (``allgather_into_tensor_coalesced``, ``reduce_scatter_tensor_coalesced``,
        ...); a subclass that returns a view here gets those too. The others still
        go to the backend directly.
        """
        return None

    def _retire(self, backend: Any) -> None:
        retire_in_background(backend, self._timeout)

    def shutdown(self) -> None:
        """Releases the current configuration (in the background) and the wrapped group's."""
        if self._wrapped is not None:
            self._wrapped.shutdown()
        view, self._view = self._view, None
        if view is not None:
            retire_in_background(view, self._timeout)
        backend, self._backend = self._backend, None
        if backend is not None:
            self._retire(backend)

    def set_timeout(self, timeout: timedelta) -> None:
        """See :meth:`ProcessGroup.set_timeout`; a wrapped group gets it too."""
        super().set_timeout(timeout)
        if self._wrapped is not None:
            self._wrapped.set_timeout(timeout)

    def errored(self) -> Exception | None:
        """The wrapped group's :meth:`~ProcessGroup.errored`; None over a torch backend."""
        return self._wrapped.errored() if self._wrapped is not None else None

    def getBackendName(self) -> str:
        """The wrapped group's backend name."""
        parent = self.parent
        if isinstance(parent, ProcessGroup):
            return parent.getBackendName()
        return f"ft-{type(self).__name__}"

    def _call(self, operation: str, *args: Any) -> dist.Work:
        parent = self.parent
        if parent is None:
            raise RuntimeError(
                f"{type(self).__name__}.{operation}: the group is not configured; call "
                "configure(store_addr, rank, world_size) first"
            )
        method = getattr(parent, operation, None)
        if method is None and self._view is not None:
            method = getattr(self._view, operation, None)
        if method is None or (operation in _COALESCING and not _coalesces(parent)):
            raise refuse(self, operation)
        if self._wrapped is not None:
            try:
                forwarded: dist.Work = method(*args)
            except UnsupportedOperationError as error:
                raise UnsupportedOperationError(f"{type(self).__name__}: {error}") from None
            return forwarded  # our own groups' Works have futures already
        work: dist.Work = method(*args)
        has_future = self._has_future.get(operation)
        if has_future is None and work is not None:  # _start_coalescing returns None
            try:
                work.get_future()
                has_future = True
            except RuntimeError:  # "Work::getFuture not implemented"
                has_future = False
            self._has_future[operation] = has_future
        if has_future is False:
            return _FutureOnDemandWork(work, tensors_of(args[:1]))
        return work


_COALESCING = ("_start_coalescing", "_end_coalescing")


def _coalesces(parent: Any) -> bool:
    """Whether ``parent`` (a group or a backend) supports coalescing."""
    if isinstance(parent, ProcessGroup):
        return True  # it answers for itself
    return bool(getattr(parent, "supports_coalescing", False))


class _FutureOnDemandWork(dist.Work):
    """A backend's Work that has no future, with one made when it is asked for.

    gloo's reduce-scatter Works (and its send/recv) raise ``Work::getFuture not
    implemented``. Here ``get_future`` starts a thread that waits for the Work and then
    completes a future of ``outputs`` (or fails it with the Work's error); nothing
    waits until somebody asks for the future. The backend's Work is waited on once
    (waiting twice on a gloo recv waits for a second message), by whoever comes first.
    """

    def __init__(self, inner: dist.Work, outputs: list[Any]) -> None:
        super().__init__()
        self._inner = inner
        self._outputs = outputs
        self._future: Future[Any] | None = None
        self._lock = threading.Lock()
        self._waited = False
        self._done = threading.Event()
        self._error: Exception | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Waits for the backend's Work; raises its error."""
        with self._lock:
            first, self._waited = not self._waited, True
        if first:
            try:
                self._inner.wait() if timeout is None else self._inner.wait(timeout)
            except Exception as error:
                self._error = error
            finally:
                self._done.set()
        else:
            self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        """Whether the backend's Work is done."""
        return self._done.is_set() or bool(self._inner.is_completed())

    def is_success(self) -> bool:
        """Whether the backend's Work is done without an error."""
        return self.is_completed() and self._error is None and bool(self._inner.is_success())

    def exception(self) -> Any:
        """The backend's Work's error, if any."""
        return self._error if self._error is not None else self._inner.exception()

    def source_rank(self) -> int:
        """The sender of a ``recv_anysource``."""
        return int(self._inner.source_rank())

    def get_future(self) -> Future[Any]:
        """A future of the output tensors, completed once the backend's Work is done."""
        with self._lock:
            if self._future is not None:
                return self._future
            future: Future[Any] = future_for(self._outputs)
            self._future = future

        def complete() -> None:
            try:
                self.wait()
            except Exception as error:
                future.set_exception(error)
                return
            future.set_result(self._outputs)

        threading.Thread(target=complete, name="ft-work-future", daemon=True).start()
        return future


def _forwarding(operation: str) -> Any:
    def forward(self: ProcessGroupWrapper, *args: Any) -> dist.Work:
        return self._call(operation, *args)

    forward.__name__ = operation
    forward.__doc__ = f"Forwards ``{operation}`` to the current configuration."
    return forward


for _operation in OPERATIONS:
    setattr(ProcessGroupWrapper, _operation, _forwarding(_operation))


class ErrorSwallowingProcessGroupWrapper(ProcessGroupWrapper):
    """Turns failures into a recorded error instead of exceptions.

    The first failure (raised by an operation, or by its Work) is recorded; from then on
    until the next :meth:`configure`, every operation returns an already-completed
    :class:`DummyWork` and leaves its tensors unchanged. A caller checks :meth:`error`
    once per step instead of guarding every collective.

    Args:
        pg: The group to wrap.
    """

    def __init__(self, pg: ProcessGroup) -> None:
        super().__init__(pg)
        self._error: Exception | None = None
        self._error_lock = threading.Lock()

    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Configures the wrapped group and forgets the recorded error.

        A refused or failed configuration keeps the recorded error, as it keeps the
        old configuration.
        """
        super()._configure(store_addr, rank, world_size)
        with self._error_lock:
            self._error = None

    def error(self) -> Exception | None:
        """The first error since the last :meth:`configure`, or None."""
        return self._error

    def errored(self) -> Exception | None:
        """The same as :meth:`error` (torchft's name)."""
        return self._error

    def report_error(self, error: Exception) -> None:
        """Records ``error`` (the first one wins) so that later operations are skipped."""
        with self._error_lock:
            if self._error is None:
                logger.warning("%s: swallowing error until reconfigured: %s", self, error)
                self._error = error

    def _call(self, operation: str, *args: Any) -> dist.Work:
        if self._error is not None:
            return DummyWork(tensors_of(args))
        try:
            work = super()._call(operation, *args)
        except NotImplementedError:
            raise  # a refused operation is the caller's mistake, not a failure to swallow
        except Exception as error:
            self.report_error(error)
            return DummyWork(tensors_of(args))
        return _SwallowingWork(work, tensors_of(args), self.report_error)


class _SwallowingWork(dist.Work):
    """Waits on ``inner``; a failure goes to ``report`` and the tensors stay as they were."""

    def __init__(
        self, inner: dist.Work, fallback: list[Any], report: Callable[[Exception], None]
    ) -> None:
        super().__init__()
        self._inner = inner
        self._fallback = fallback
        self._report = report

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Waits for the wrapped work; never raises its error."""
        try:
            if timeout is None:
                self._inner.wait()
            else:
                self._inner.wait(timeout)
        except Exception as error:
            self._report(error)
        return True

    def is_completed(self) -> bool:
        """Whether the wrapped work is done."""
        return bool(self._inner.is_completed())

    def get_future(self) -> Future[Any]:
        """A future of the result, or of the unchanged tensors when the work failed."""
        try:
            inner_future = self._inner.get_future()
        except RuntimeError:
            # gloo's send/recv have no future: wait now, then hand back a completed one.
            self.wait()
            return completed_future(self._fallback)

        def swallow(future: Future[Any]) -> Any:
            try:
                return future.value()
            except Exception as error:
                self._report(error)
                return self._fallback

        return inner_future.then(swallow)
