"""Data-parallel gradient averaging for torch's DDP through a :class:`Manager`."""

# No `from __future__ import annotations`: DDP compares the hook's annotations with
# the real dist.GradBucket and Future[torch.Tensor] types.

from typing import Any

import torch
from torch.distributed import GradBucket  # type: ignore[attr-defined]  # public, not re-exported in the stubs
from torch.futures import Future

from dist_collectives.ft.groups.dummy import ProcessGroupDummy
from dist_collectives.ft.groups.work import future_for
from dist_collectives.ft.replica.manager import Manager


class ReplicaAveraging:
    """State of :func:`ft_allreduce_hook`: averages the whole gradient once per backward.

    DDP lays gradients out in buckets, and rebuilds that layout after its first
    iteration, so a replica that just joined has a different layout from the others.
    Reducing bucket by bucket would then pair unequal buffers (gloo aborts the process,
    or worse, sums unrelated values). So the hook only collects the buckets; at the last
    one it reduces every gradient at once in the order of ``module.parameters()``,
    which all replicas share, and then completes every bucket's future. The gradients
    go from the buckets straight into the manager's one exchange buffer and back, so
    the step keeps one extra copy of them (that buffer, reused from step to step).

    Args:
        manager: The manager of this replica.
        module: The model whose gradients are averaged.
    """

    def __init__(self, manager: Manager, module: torch.nn.Module) -> None:
        self.manager = manager
        self._order = {id(p): i for i, p in enumerate(module.parameters())}
        self._pending: list[tuple[GradBucket, Future[torch.Tensor]]] = []

    def add(self, bucket: GradBucket) -> Future[torch.Tensor]:
        """Takes one bucket; reduces them all when it is the last one.

        The bucket's future is created with the buffer's CUDA device (if any): DDP's
        reducer waits on it and then reads the buffer on its own stream, which must
        first wait for the copies of the average into the buffer on another stream.
        """
        future: Future[torch.Tensor] = future_for(bucket.buffer())
        self._pending.append((bucket, future))
        if bucket.is_last():
            pending, self._pending = self._pending, []
            self._reduce(pending)
        return future

    def _reduce(self, pending: list[tuple[GradBucket, Future[torch.Tensor]]]) -> None:
        # Each parameter's gradient is a view of its bucket's buffer; the manager gathers
        # them, in the order of ``module.parameters()``, into the one buffer it exchanges
        # and writes the average back into these views: no copy of the gradients here.
        views: list[tuple[int, torch.Tensor]] = []
        for bucket, _ in pending:
            buffer, offset = bucket.buffer(), 0
            for param in bucket.parameters():
                size = param.numel()
                views.append((self._order[id(param)], buffer[offset : offset + size]))
                offset += size
        views.sort(key=lambda view: view[0])
        reduced = self.manager.allreduce([view for _, view in views])

        def complete(_: Future[list[torch.Tensor]]) -> None:
            # The manager's future carries the CUDA devices of the views: this callback
            # runs on a stream that waited for the copies into them, and each bucket's
            # future records its event on it when set here.
            for bucket, future in pending:
                future.set_result(bucket.buffer())

        reduced.then(complete)


def ft_allreduce_hook(state: ReplicaAveraging, bucket: GradBucket) -> Future[torch.Tensor]:
    """A DDP communication hook that averages gradients over the live replicas.

    The futures it returns always hold the bucket's tensor: after a peer fails mid-step
    the values are this replica's own, and :meth:`Manager.should_commit` answers False,
    so the step is thrown away instead of crashing the backward pass. Register it with
    ``ddp.register_comm_hook(ReplicaAveraging(manager, module), ft_allreduce_hook)``.
    """
    return state.add(bucket)


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """torch's DDP with gradients averaged across replicas by a :class:`Manager`.

    Within one replica there is a single process, so DDP's own group is a
    :class:`ProcessGroupDummy`; the replicas exchange gradients through the manager's
    reconfigurable group in :func:`ft_allreduce_hook`.

    Args:
        manager: The manager of this replica.
        module: The model.
        **kwargs: Passed on to torch's DistributedDataParallel (not ``process_group``).
    """

    def __init__(self, manager: Manager, module: torch.nn.Module, **kwargs: Any) -> None:
        if "process_group" in kwargs:
            raise TypeError("the manager provides the process group; do not pass process_group")
        super().__init__(module, process_group=ProcessGroupDummy(0, 1), **kwargs)
        self.register_comm_hook(ReplicaAveraging(manager, module), ft_allreduce_hook)
