"""A reconfigurable gloo group (CPU tensors; CUDA tensors too where torch's gloo has it)."""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]  # public, not re-exported in the stubs

from dist_collectives.ft.groups.process_group import DEFAULT_TIMEOUT
from dist_collectives.ft.groups.wrappers import ProcessGroupWrapper
from dist_core.devices import cuda_device_count

logger = logging.getLogger(__name__)

_device_lock = threading.Lock()
_device: object | None = None


def _gloo_device() -> object:
    """This process's gloo transport device, created once.

    Creating it resolves the host name (or reads ``GLOO_SOCKET_IFNAME``), which takes
    milliseconds that a reconfiguration should not pay every time.
    """
    global _device
    with _device_lock:
        if _device is None:
            _device = dist.ProcessGroupGloo.create_default_device()
        return _device


def create_gloo_backend(
    store: Store,
    rank: int,
    world_size: int,
    timeout: timedelta,
    *,
    group_name: str | None = None,
    global_ranks: list[int] | None = None,
) -> dist.ProcessGroupGloo:
    """A torch gloo backend over ``store``, using this process's cached transport device.

    Reads ``GLOO_SOCKET_IFNAME`` (through torch) the first time it is called.

    Args:
        store: The configuration's store.
        rank: This member's rank.
        world_size: The number of members.
        timeout: How long one operation may take.
        group_name: The backend's name in torch's logs and flight recorder
            (``torchft_<uuid>_rank_<n>``), or None for torch's default.
        global_ranks: The members' job-wide ranks, or None.
    """
    options = gloo_options(timeout)
    if group_name is not None:
        options.group_name = group_name
    if global_ranks is not None:
        options.global_ranks_in_group = global_ranks
    backend = dist.ProcessGroupGloo(store, rank, world_size, options)
    return backend


def gloo_options(timeout: timedelta) -> Any:
    """Options of a torch gloo backend: this process's cached transport device, ``timeout``.

    Reads ``GLOO_SOCKET_IFNAME`` (through torch) the first time it is called.
    """
    options: Any = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009 (not in the stubs)
    options._devices = [_gloo_device()]
    options._timeout = timeout
    return options


def process_group_view(
    store: Store, rank: int, world_size: int, backend: dist.ProcessGroupGloo
) -> dist.ProcessGroup:
    """A torch ProcessGroup that dispatches to the gloo ``backend`` (no connection made).

    torch binds some collectives (``allgather_into_tensor_coalesced``,
    ``reduce_scatter_tensor_coalesced``, ``all_gather_single``, ...) on ProcessGroup
    only; through this view they reach gloo. CUDA tensors go to gloo too where this
    process can use them.
    """
    view = dist.ProcessGroup(store, rank, world_size)
    gloo = dist.ProcessGroup.BackendType.GLOO
    view._set_default_backend(gloo)
    view._register_backend(torch.device("cpu"), gloo, backend)
    if supports_cuda():
        view._register_backend(torch.device("cuda"), gloo, backend)
    return view


class ProcessGroupGloo(ProcessGroupWrapper):
    """A gloo group that :meth:`configure` can rebuild with new members.

    Args:
        timeout: How long one operation, and the rendezvous of a configuration, may take.
    """

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout=timeout)

    def _create_pg(self, store: Store, rank: int, world_size: int) -> dist.ProcessGroupGloo:
        return create_gloo_backend(
            store,
            rank,
            world_size,
            self._timeout,
            group_name=self.backend_group_name(),
            global_ranks=self.backend_global_ranks(),
        )

    def _create_view(
        self, store: Store, rank: int, world_size: int, backend: Any
    ) -> dist.ProcessGroup:
        return process_group_view(store, rank, world_size, backend)

    def getBackendName(self) -> str:
        """``"ft-gloo"``."""
        return "ft-gloo"


def supports_cuda() -> bool:
    """Whether CUDA tensors can go through the gloo groups of this process.

    Counts devices through NVML, so asking does not initialise CUDA.
    """
    return cuda_device_count() > 0  # 0 on a torch built without CUDA
