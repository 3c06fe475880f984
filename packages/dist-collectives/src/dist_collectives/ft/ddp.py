"""Data-parallel gradient averaging for torch's DDP through a :class:`Manager`."""

from __future__ import annotations

from typing import Any

import torch
from torch.futures import Future

from dist_collectives.ft.dummy import ProcessGroupDummy
from dist_collectives.ft.manager import Manager


def ft_allreduce_hook(manager: Manager, bucket: Any) -> Future[torch.Tensor]:
    """A DDP communication hook that averages a bucket over the live replicas.

    The future it returns always holds the bucket's tensor: after a peer fails mid-step
    the values are this replica's own, and :meth:`Manager.should_commit` answers False,
    so the step is thrown away instead of crashing the backward pass.

    Use it as ``ddp_model.register_comm_hook(manager, ft_allreduce_hook)``.
    """
    return manager.allreduce(bucket.buffer())


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
        self.register_comm_hook(manager, ft_allreduce_hook)
