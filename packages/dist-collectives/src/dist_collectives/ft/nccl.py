"""A reconfigurable NCCL group (CUDA only)."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from dist_collectives.ft.process_group import DEFAULT_TIMEOUT
from dist_collectives.ft.wrappers import ProcessGroupWrapper

logger = logging.getLogger(__name__)


class ProcessGroupNCCL(ProcessGroupWrapper):
    """An NCCL group that :meth:`configure` can rebuild with new members.

    On reconfiguration the old communicator is aborted first: an NCCL kernel waiting
    for a dead peer never returns on its own, and aborting is what makes pending work on
    the old communicator fail instead of hanging. The new communicator uses the current
    CUDA device.

    Args:
        timeout: How long one operation and the rendezvous may take.

    Raises:
        RuntimeError: at :meth:`configure` when torch has no NCCL or no GPU.
    """

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout=timeout)

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Aborts the old communicator, then joins the new group (see the class doc)."""
        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise RuntimeError(
                "ProcessGroupNCCL needs CUDA and a torch built with NCCL; use "
                "ProcessGroupGloo on this machine"
            )
        old_backend, self._backend = self._backend, None
        if old_backend is not None:
            self._abort(old_backend)
        super().configure(store_addr, rank, world_size)

    def _abort(self, backend: Any) -> None:
        try:
            backend.abort()
        except Exception:
            logger.warning("aborting the old NCCL communicator failed", exc_info=True)

    def _retire(self, backend: Any) -> None:
        self._abort(backend)

    def _create_pg(self, store: Store, rank: int, world_size: int) -> Any:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self._timeout
        backend = dist.ProcessGroupNCCL(store, rank, world_size, options)
        # The first collective would create the communicator lazily; binding the device
        # now makes a bad configuration fail here, in configure, not in a training step.
        backend.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
        return backend

    def getBackendName(self) -> str:
        """``"ft-nccl"``."""
        return "ft-nccl"
