"""A process group whose collectives go through a :class:`Manager`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.futures import Future

from dist_collectives.ft.groups.process_group import ProcessGroup, reduce_op_name
from dist_collectives.ft.groups.work import FutureWork, all_done
from dist_collectives.ft.replica.manager import Manager

# How much later than the manager's own deadline a wait gives up (at most; the
# manager's timeout itself when shorter): the manager's watcher fails the step at its
# deadline, so this only ends a wait on a manager that is stuck.
_WAIT_GRACE = timedelta(seconds=5)


class ManagedProcessGroup(ProcessGroup):
    """Allreduce through a :class:`Manager`: averaged over the live participants.

    Its size is the number of participants of the current step. Errors never raise
    here: they go to the manager (and through the store to every replica), and
    :meth:`Manager.should_commit` turns them into a discarded step. The manager
    configures the underlying group, so :meth:`configure` refuses.

    Args:
        manager: The manager of this replica.
    """

    def __init__(self, manager: Manager) -> None:
        super().__init__()
        self._manager = manager

    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Refuses: the manager reconfigures the group it was given."""
        raise RuntimeError(
            "ManagedProcessGroup is configured by its Manager at start_quorum(); do not "
            "call configure on it"
        )

    def size(self) -> int:
        """The number of participants of the current step."""
        return self._manager.num_participants()

    def rank(self) -> int:
        """This replica's rank in the current quorum."""
        return self._manager.replica_rank()

    def errored(self) -> Exception | None:
        """The manager's error of the current step, if any."""
        return self._manager.errored()

    def getBackendName(self) -> str:  # torch's name
        """``"ft-managed"``."""
        return "ft-managed"

    def allreduce(self, *args: Any) -> dist.Work:
        """Averages the tensors over the participants (``SUM`` and ``AVG`` both average).

        Accepts torch's overloads: ``(tensors, AllreduceOptions)``, ``(tensors, ReduceOp)``
        or ``(tensor, ReduceOp)``.
        """
        first = args[0]
        tensors = [first] if isinstance(first, torch.Tensor) else list(first)
        op = reduce_op_name(args[1] if len(args) > 1 else dist.ReduceOp.SUM)
        if op not in ("SUM", "AVG"):
            raise ValueError(
                f"ManagedProcessGroup.allreduce averages over live replicas; op={op} is not "
                "supported (use SUM or AVG)"
            )
        # Any: a manager may hand back a Work of its own (see below), not only a future.
        results: list[Any] = [self._manager.allreduce(tensor) for tensor in tensors]
        if len(results) == 1 and not isinstance(results[0], Future):
            # A manager whose allreduce returns a Work of its own (torchft's does) bounds
            # its own wait; it is handed back as torchft's ManagedProcessGroup does.
            return cast(dist.Work, results[0])
        futures = [r if isinstance(r, Future) else r.get_future() for r in results]
        # Every future holds its own tensor, averaged in place; the combined one carries
        # their CUDA devices and completes on a stream that waited for each of them.
        combined: Future[list[torch.Tensor]] = all_done(futures, tensors)
        return FutureWork(combined, "ManagedProcessGroup.allreduce", self._wait_limit())

    def _wait_limit(self) -> timedelta:
        """The manager fails a step at its timeout; a wait gives up a little after that."""
        # A stand-in manager (a test's, torchft-style) may have no timeout of its own.
        timeout = getattr(self._manager, "timeout", None)
        if not isinstance(timeout, timedelta):
            timeout = self._timeout
        return timeout + min(timeout, _WAIT_GRACE)
