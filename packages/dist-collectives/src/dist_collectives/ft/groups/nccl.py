"""A reconfigurable NCCL group (CUDA only)."""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]  # public, not re-exported in the stubs

from dist_collectives.ft.groups.process_group import DEFAULT_TIMEOUT
from dist_collectives.ft.groups.wrappers import ProcessGroupWrapper, retire_in_background
from dist_core.devices import cuda_built, cuda_device_count

logger = logging.getLogger(__name__)


def nccl_unavailable_reason() -> str | None:
    """Why NCCL cannot run in this process, or None when it can.

    Counts devices through NVML (:func:`dist_core.devices.cuda_device_count`), so asking
    does not initialise CUDA in a parent process that may still fork.
    """
    if not cuda_built():
        return f"torch {torch.__version__} was built without CUDA"
    if not dist.is_nccl_available():
        return f"torch {torch.__version__} was built without NCCL"
    if cuda_device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
        return f"no CUDA device is visible to this process{where}"
    return None


def create_nccl_backend(store: Store, rank: int, world_size: int, timeout: timedelta) -> Any:
    """A torch NCCL backend on the current CUDA device, with a non-blocking communicator.

    Every member has already arrived on the store when this runs
    (:func:`~dist_collectives.ft.coordination.store.wait_for_arrivals`), so a peer that never came
    was reported by name within the timeout. A peer can still die between its arrival
    and NCCL's connect, and a blocking ``ncclCommInitRank`` then waits for it for ever
    (torch's timeout does not cover it). So the communicator is created non-blocking
    (``ProcessGroupNCCL.Options().config.blocking = 0``, as torchft does): the eager
    connect below returns while NCCL connects in the background, and an operation that
    needs the unfinished communicator is failed by torch's watchdog at ``timeout``.
    """
    options: Any = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    config = getattr(options, "config", None)
    if config is not None and hasattr(config, "blocking"):
        config.blocking = 0
    backend = dist.ProcessGroupNCCL(store, rank, world_size, options)
    # Without it the communicator is created at the first collective; with it, a bad
    # configuration fails here (non-blocking: this starts the connect, it does not
    # wait for it).
    backend.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
    return backend


def abort_backend(backend: Any) -> None:
    """Aborts an NCCL backend's communicators, failing what is pending on them.

    Blocks for about a second (torch joins its watchdog); the groups call it on a
    background thread.
    """
    try:
        backend.abort()
    except Exception:
        logger.warning("aborting an old NCCL communicator failed", exc_info=True)


# A retired communicator holds its GPU memory until its abort ends, about a second
# later (390 MiB at world size 1 on an H100 with NCCL 2.28.9). Reconfigurations in a
# quick loop therefore piled up 26 of them, 10 GiB, before any was freed: a nearly
# full GPU would then fail the next communicator. At most this many aborts run at
# once in a process; a configure beyond that waits for the oldest to end.
MAX_ABORTS_IN_FLIGHT = 2


class _AbortSlots:
    """Counts the aborts in flight; :meth:`take` waits while all slots are taken."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._taken = 0
        self._changed = threading.Condition()

    def take(self, timeout: float) -> float:
        """Takes a slot, waiting at most ``timeout`` for one; returns the seconds waited.

        Past the timeout the slot is taken anyway: an abort that never ends must not
        stop the group from being reconfigured (it is logged).
        """
        started = time.monotonic()
        with self._changed:
            if not self._changed.wait_for(lambda: self._taken < self._limit, timeout):
                logger.warning(
                    "%d NCCL aborts still running after %.0f s; reconfiguring anyway",
                    self._taken,
                    timeout,
                )
            self._taken += 1
        return time.monotonic() - started

    def give_back(self) -> None:
        """Frees a slot taken by :meth:`take`."""
        with self._changed:
            self._taken -= 1
            self._changed.notify()


_abort_slots = _AbortSlots(MAX_ABORTS_IN_FLIGHT)


class ProcessGroupNCCL(ProcessGroupWrapper):
    """An NCCL group that :meth:`configure` can rebuild with new members.

    :meth:`configure` checks its arguments first (a refused call leaves the current
    communicator working), waits until every member arrived on the store (a missing
    one fails the call within the timeout, naming the store address and its rank),
    builds the new communicator on the current CUDA device, and only then retires the
    old one: it is aborted on a background thread, which fails whatever still waits on
    it (an NCCL kernel waiting for a dead peer never returns on its own) without making
    the caller wait the second an abort takes. At most :data:`MAX_ABORTS_IN_FLIGHT`
    aborts run at once in a process, since each old communicator holds its GPU memory
    until its abort ends: a configure that would start another waits for the oldest
    (so reconfigurations less than half a second apart wait; rarer ones never do).
    :meth:`shutdown` aborts in the background too;
    :func:`~dist_collectives.ft.groups.wrappers.wait_for_retirements` waits for those aborts.

    Args:
        timeout: How long one operation and the rendezvous may take.

    Raises:
        RuntimeError: at :meth:`configure` when torch has no NCCL or no GPU (the message
            says which).
    """

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout=timeout)

    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Joins the new group, then aborts the old communicator in the background."""
        reason = nccl_unavailable_reason()
        if reason is not None:
            raise RuntimeError(
                f"ProcessGroupNCCL needs CUDA and a torch built with NCCL: {reason}; use "
                "ProcessGroupGloo on this machine"
            )
        super()._configure(store_addr, rank, world_size)

    def _retire(self, backend: Any) -> None:
        waited = _abort_slots.take(self._timeout.total_seconds())
        if waited > 0.01:
            logger.debug("waited %.3f s for an earlier NCCL abort to end", waited)

        def abort_and_free_the_slot(old: Any) -> None:
            try:
                abort_backend(old)
            finally:
                _abort_slots.give_back()

        retire_in_background(backend, self._timeout, finalize=abort_and_free_the_slot)

    def _create_pg(self, store: Store, rank: int, world_size: int) -> Any:
        return create_nccl_backend(store, rank, world_size, self._timeout)

    def getBackendName(self) -> str:
        """``"ft-nccl"``."""
        return "ft-nccl"
