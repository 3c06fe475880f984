"""A gloo group that torch itself reconfigures (torch 2.14's reconfigurable process groups).

torch 2.14 builds a gloo backend with ``enable_reconfigure=True`` once and then moves it
to a new set of peers in place: every member hands out an opaque handle
(``get_reconfigure_handle()``), the members exchange them out of band, and each calls
``reconfigure`` with the same fresh ``uuid`` and the handles in rank order. A member
left out is simply not named; a peer that died mid-collective does not stop the
survivors' next ``reconfigure``. :class:`ProcessGroupReconfigurableGloo` does that
exchange on the store address each :meth:`~ProcessGroup.configure` gets, so a
:class:`~dist_collectives.ft.Manager` drives it like any other group. Where torch lacks
these groups (before 2.14), building one raises
:class:`~dist_collectives.ft.UnsupportedOperationError` saying so by name.

Protocol of one configuration, on the configuration's own ``host:port/prefix``:

1. each member sets ``handle/<rank>`` to its backend's handle, then marks itself
   arrived and waits for the others
   (:func:`~dist_collectives.ft.coordination.store.wait_for_arrivals`:
   a member that never comes fails the call within the timeout, naming its rank);
2. each reads every handle in one ``multi_get`` and calls ``reconfigure`` with them and
   a ``uuid`` derived from the store address (unique per configuration, the same on
   every member, since a prefix is never used twice).

The backend itself rendezvouses on ``dist_collectives/reconfigurable-gloo`` of the
first configuration's store; its identity in the handles is a member number the store
hands out once (``add``), so handles are unique across the job.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]  # public, not re-exported in the stubs

from dist_collectives.ft.coordination.store import (
    connect_tcp_store,
    parse_store_addr,
    rendezvous_store,
    wait_for_arrivals,
)
from dist_collectives.ft.errors import UnsupportedOperationError
from dist_collectives.ft.groups.gloo import gloo_options, process_group_view
from dist_collectives.ft.groups.process_group import DEFAULT_TIMEOUT
from dist_collectives.ft.groups.reconfigure import configuration_uuid
from dist_collectives.ft.groups.wrappers import ProcessGroupWrapper

logger = logging.getLogger(__name__)

BACKEND_PREFIX = "dist_collectives/reconfigurable-gloo"
_MEMBER_COUNTER = f"{BACKEND_PREFIX}/members"
_HANDLE_KEY = "handle/"


def torch_reconfigure_missing() -> str | None:
    """What this torch lacks for reconfigurable groups, by name; None when it has them."""
    c10d: Any = torch._C._distributed_c10d
    missing = [
        name
        for name, present in (
            ("torch._C._distributed_c10d.ReconfigureOptions", hasattr(c10d, "ReconfigureOptions")),
            (
                "ProcessGroupGloo.get_reconfigure_handle",
                hasattr(dist.ProcessGroupGloo, "get_reconfigure_handle"),
            ),
            ("ProcessGroupGloo.reconfigure", hasattr(dist.ProcessGroupGloo, "reconfigure")),
        )
        if not present
    ]
    if not missing:
        return None
    return (
        f"torch {torch.__version__} has no reconfigurable process groups (torch 2.14 added "
        f"them: init_process_group(..., enable_reconfigure=True), dist._reconfigure); it "
        f"lacks {', '.join(missing)}"
    )


class ProcessGroupReconfigurableGloo(ProcessGroupWrapper):
    """A gloo group built once and moved to new members by torch's ``reconfigure``.

    The same interface as :class:`~dist_collectives.ft.ProcessGroupGloo`: each
    :meth:`configure` names a new ``host:port/prefix``, a rank and a world size; but
    instead of building a new gloo backend per configuration, one backend (created with
    ``enable_reconfigure=True``) is reconfigured in place (see the module doc).

    Args:
        timeout: How long one operation, and the exchange of handles, may take.

    Raises:
        UnsupportedOperationError: this torch has no reconfigurable process groups; the
            message names what it lacks.
    """

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        missing = torch_reconfigure_missing()
        if missing is not None:
            raise UnsupportedOperationError(
                f"{missing}; use ProcessGroupGloo, which configure() rebuilds instead"
            )
        super().__init__(timeout=timeout)
        self._backend_store: tuple[str, int] | None = None

    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Exchanges handles on ``store_addr`` and reconfigures the one backend.

        Raises:
            RendezvousTimeoutError: the store was not reached, or some members did not
                arrive, within the timeout; the group keeps its last configuration.
            RuntimeError: torch's ``reconfigure`` failed (a peer died during it).
        """
        self._claim_configuration(store_addr, rank, world_size)
        address = parse_store_addr(store_addr)
        backend = self._backend_on(address.host, address.port)
        who = f"{type(self).__name__}.configure"
        with rendezvous_store(store_addr, self._timeout, who) as store:
            store.set(f"{_HANDLE_KEY}{rank}", backend.get_reconfigure_handle())
            wait_for_arrivals(store, store_addr, rank, world_size, self._timeout, who)
            raw = store.multi_get([f"{_HANDLE_KEY}{peer}" for peer in range(world_size)])
        options: Any = torch._C._distributed_c10d.ReconfigureOptions()  # type: ignore[attr-defined]  # torch>=2.14
        options.uuid = configuration_uuid(store_addr)
        options.handles = [bytes(handle).decode() for handle in raw]
        options.timeout = self._timeout
        backend.reconfigure(options).wait()
        old_view, self._view = self._view, process_group_view(store, rank, world_size, backend)
        del old_view  # a view holds no connection of its own: the backend is the same
        self._set_configuration(rank, world_size)
        logger.debug("%s reconfigured on %s as %d/%d", self, store_addr, rank, world_size)

    def _backend_on(self, host: str, port: int) -> Any:
        """The backend, created at the first configuration (again if the store moved)."""
        if self._backend is not None and self._backend_store == (host, port):
            return self._backend
        if self._backend is not None:
            self._retire(self._backend)
        client = connect_tcp_store(host, port, self._timeout)
        member = client.add(_MEMBER_COUNTER, 1) - 1
        options = gloo_options(self._timeout)
        options.enable_reconfigure = True
        self._backend = dist.ProcessGroupGloo(
            PrefixStore(BACKEND_PREFIX, client), member, member + 1, options
        )
        self._backend_store = (host, port)
        return self._backend

    def _create_pg(self, store: Store, rank: int, world_size: int) -> Any:
        raise AssertionError("unreachable: _configure reconfigures the one backend instead")

    def getBackendName(self) -> str:
        """``"ft-reconfigurable-gloo"``."""
        return "ft-reconfigurable-gloo"
