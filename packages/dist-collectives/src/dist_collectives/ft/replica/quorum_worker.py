"""The Manager's quorum worker: one long-lived thread for every quorum round and group call.

As torchft's Manager has one quorum thread, a :class:`QuorumWorker` is started once
per Manager and runs, one request after the other, everything a step's quorum needs:
the round on the store, the group's reconfiguration and the state transfer of healing.
Nothing starts a thread per step, and since only this thread ever configures the
group, two configurations of it never overlap (they could when each step had a thread
of its own that outlived its step).

The training thread hands in a :class:`QuorumRequest` and gets a future of the quorum;
it waits for that future with a deadline, and when the worker is still busy past it
(in a call torch does not bound: gloo's own rendezvous in a backend's constructor) it
fails the step with a :class:`QuorumWorkerTimeoutError` naming what the worker was
doing. A request whose step was superseded by the time the worker gets to it is
dropped without a store call
(:func:`~dist_collectives.ft.replica.manager_decisions.request_is_stale`).

Threads: the worker thread owns everything the requests do; the training thread
submits, and reads :attr:`QuorumWorker.doing`, which the worker sets (a str, replaced
whole) for the timeout message.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from dist_collectives.ft.errors import FTError

_R = TypeVar("_R")


class QuorumWorkerTimeoutError(FTError, TimeoutError):
    """The quorum worker did not finish a step's quorum in time; names what it was doing."""


class StaleRequestError(FTError, RuntimeError):
    """A quorum request whose step had been superseded when the worker got to it."""


@dataclasses.dataclass(frozen=True)
class QuorumRequest:
    """What ``start_quorum`` asks the worker for."""

    generation: int  # the step's generation (StepState.generation)
    number: int  # this rank's count of requests: the key group rank 0 publishes under
    step: int  # the last step this replica committed


class QuorumWorker(Generic[_R]):
    """The one thread that serves a Manager's quorum requests, in order (see the module doc).

    Args:
        name: The thread's name (``ft-quorum-<replica>``).
        serve: Serves one request on the worker thread; returns its result.
        is_stale: Whether a request's step was superseded (checked before serving it).
        drop: Called on the worker thread with a stale request instead of ``serve``.
        log: Where a failure to serve is logged at debug level.
    """

    def __init__(
        self,
        name: str,
        serve: Callable[[QuorumRequest], _R],
        *,
        is_stale: Callable[[QuorumRequest], bool],
        drop: Callable[[QuorumRequest], None],
        log: logging.Logger,
    ) -> None:
        self._serve = serve
        self._is_stale = is_stale
        self._drop = drop
        self._log = log
        self._inbox: queue.SimpleQueue[
            tuple[QuorumRequest, concurrent.futures.Future[_R]] | None
        ] = queue.SimpleQueue()
        # Written by the worker only (a str is replaced whole): what it does now.
        self.doing = "nothing"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: QuorumRequest) -> concurrent.futures.Future[_R]:
        """Queues ``request``; a future of its result (or of the error that ended it)."""
        future: concurrent.futures.Future[_R] = concurrent.futures.Future()
        self._inbox.put((request, future))
        return future

    def stop(self, timeout: float) -> bool:
        """Ends the thread after its current request; False if still busy after ``timeout``."""
        self._inbox.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (item := self._inbox.get()) is not None:
            request, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                if self._is_stale(request):
                    self.doing = f"dropping the stale request of generation {request.generation}"
                    self._drop(request)
                    future.set_exception(
                        StaleRequestError(f"generation {request.generation} was superseded")
                    )
                    continue
                future.set_result(self._serve(request))
            except BaseException as error:  # handed to the training thread, whatever it is
                self._log.debug("quorum request %s failed", request, exc_info=True)
                future.set_exception(error)
            finally:
                self.doing = "nothing"
