"""Reconfiguration by handles, torchft 0.3's form: options, handles, and their exchange.

torchft 0.3 (and torch 2.14's reconfigurable process groups) move a group to new
members in three steps: each member hands out an opaque handle
(``get_reconfigure_handle()``), the members exchange the handles out of band (a
Manager's quorum, or :func:`reconfigure_with_store` on a store), and every member calls
``reconfigure(options)`` with the same ``uuid`` and the handles in rank order. A
member's rank is the index of its own handle.

A ``dist_collectives.ft`` group's handle is torchft's JSON,
``{"id": <hex>, "store": "host:port", "global_rank": <int or null>}``: ``id`` names the
group object for its lifetime, ``store`` is a store the group hosts itself, and the
members of one reconfiguration rendezvous on ``<store of the first handle>/torchft/<uuid>``
(:func:`rendezvous_of`), where the group then builds its backend as ``configure`` does.

:func:`reconfigure_with_store` works on any group with that interface, torch's own
reconfigurable groups (``init_process_group(..., enable_reconfigure=True)``, torch
2.14+) included. Protocol, on the caller's ``host:port/prefix`` (unique per call):
every member sets ``handle/<rank>`` to its handle, rank 0 sets ``uuid`` to a fresh
63-bit number, every member waits for ``uuid`` and every ``handle/<r>``, reads them in
one ``multi_get`` and reconfigures.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore  # type: ignore[attr-defined]  # public, not re-exported in the stubs

from dist_collectives.ft.coordination.store import (
    RendezvousTimeoutError,
    connect_tcp_store,
    parse_store_addr,
)
from dist_collectives.ft.errors import timed_out_after_ms

logger = logging.getLogger(__name__)

DEFAULT_RECONFIGURE_TIMEOUT = timedelta(seconds=60)

UUID_KEY = "uuid"
HANDLE_KEY = "handle/"


@dataclasses.dataclass
class ReconfigureOptions:
    """The options of one reconfiguration, as torch 2.14 names them.

    Where torch has its own ``ReconfigureOptions`` (2.14+), this name is torch's class,
    so that torch's reconfigurable groups accept it too; before that, this dataclass
    with the same fields.

    Attributes:
        uuid: The same on every member; names the reconfiguration.
        handles: Every member's ``get_reconfigure_handle()``, in rank order.
        timeout: How long the reconfiguration may take (None: the group's own).
        hints: Backend hints; unused by these groups.
    """

    uuid: int = 0
    handles: list[str] | set[str] = dataclasses.field(default_factory=list)
    timeout: timedelta | None = None
    hints: dict[str, str] = dataclasses.field(default_factory=dict)


_TORCH_RECONFIGURE_OPTIONS = getattr(torch._C._distributed_c10d, "ReconfigureOptions", None)
if _TORCH_RECONFIGURE_OPTIONS is not None:
    ReconfigureOptions = _TORCH_RECONFIGURE_OPTIONS  # type: ignore[misc]  # torch 2.14+'s


class HandleExchangeTimeoutError(RendezvousTimeoutError, dist.DistStoreError):
    """Some members' handles did not reach the store within the timeout.

    Names the missing ranks. A torch ``DistStoreError`` too, as the failed store wait
    of torchft's ``reconfigure_with_store`` is.
    """


@dataclasses.dataclass(frozen=True)
class Rendezvous:
    """Where and as what one member joins a reconfiguration (:func:`rendezvous_of`).

    Attributes:
        store_addr: ``<store of the first handle>/torchft/<uuid>``.
        rank: The index of this member's handle.
        world_size: The number of handles.
        uuid: The reconfiguration's ``uuid``.
        global_ranks: Every member's job-wide rank, in rank order; None when a handle
            carries none.
    """

    store_addr: str
    rank: int
    world_size: int
    uuid: int
    global_ranks: list[int] | None


def make_handle(handle_id: str, store: str, global_rank: int | None) -> str:
    """A handle in torchft's JSON form (see the module doc)."""
    return json.dumps({"id": handle_id, "store": store, "global_rank": global_rank})


def rendezvous_of(options: Any, handle_id: str) -> Rendezvous:
    """Reads ordered handles: this member's rank, the members, their store.

    Args:
        options: A :class:`ReconfigureOptions` (anything with ``uuid`` and ``handles``).
        handle_id: The ``id`` in this member's handle.

    Raises:
        ValueError: ``handles`` is not a list (a set has no order to give ranks), a
            handle is not torchft's JSON, or none of them is this member's.
    """
    handles = options.handles
    if not isinstance(handles, list):
        raise ValueError(
            f"reconfigure: handles must be a list in rank order, got {type(handles).__name__}"
        )
    peers = [_parse_handle(handle) for handle in handles]
    ids = [peer["id"] for peer in peers]
    if handle_id not in ids:
        raise ValueError(
            f"reconfigure: this group's handle (id {handle_id!r}) is not among the "
            f"{len(ids)} handles given ({ids}); pass every member's get_reconfigure_handle()"
        )
    global_ranks = [peer.get("global_rank") for peer in peers]
    known = [int(r) for r in global_ranks if r is not None]
    return Rendezvous(
        store_addr=f"{peers[0]['store']}/torchft/{options.uuid}",
        rank=ids.index(handle_id),
        world_size=len(peers),
        uuid=int(options.uuid),
        global_ranks=known if len(known) == len(peers) else None,
    )


def _parse_handle(handle: str) -> dict[str, Any]:
    try:
        peer = json.loads(handle)
    except (TypeError, json.JSONDecodeError):
        peer = None
    if not isinstance(peer, dict) or not {"id", "store"} <= peer.keys():
        raise ValueError(
            f"reconfigure: {handle!r} is not a reconfigure handle of these groups "
            '(JSON with "id", "store" and "global_rank")'
        )
    return peer


def new_communicator_uuid() -> int:
    """A fresh ``uuid`` for a reconfiguration: the low 63 bits of a random UUID."""
    return uuid.uuid4().int & ((1 << 63) - 1)


def configuration_uuid(store_addr: str) -> int:
    """The ``uuid`` of the configuration on ``store_addr``: the same on every member.

    A 63-bit digest of the address; prefixes are never reused, so neither are uuids.
    ``configure(store_addr, ...)`` names its configuration with it.
    """
    digest = hashlib.blake2b(store_addr.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def backend_group_name(communicator_uuid: int, group_rank: int, group_world_size: int) -> str:
    """``torchft_<uuid>_rank_<n>``: the name torchft gives a configuration's backend.

    ``n`` is the rank within the replica group, so the backends of rank ``n`` of every
    replica group carry one name (torch's flight recorder groups by it).
    """
    return f"torchft_{communicator_uuid}_rank_{group_rank % group_world_size}"


def exchange_store(store_addr: str, timeout: timedelta) -> PrefixStore:
    """A store client of its own for one exchange of handles on ``host:port/prefix``.

    Not the process's shared connection: a TCPStore client holds its lock while it
    blocks in ``wait``, so members exchanging in threads of one process would block
    each other's ``set`` until the timeout.

    Raises:
        StoreAddressError: ``store_addr`` is malformed.
        RuntimeError: torch could not reach the store within ``timeout``.
    """
    address = parse_store_addr(store_addr)
    client = connect_tcp_store(address.host, address.port, timeout, shared=False)
    return PrefixStore(address.prefix, client)


def reconfigure_with_store(
    pg: Any,
    store_addr: str,
    rank: int,
    world_size: int,
    timeout: timedelta = DEFAULT_RECONFIGURE_TIMEOUT,
    *,
    communicator_uuid: int | None = None,
) -> None:
    """Exchanges handles on ``store_addr`` and reconfigures ``pg`` as ``rank`` of ``world_size``.

    For use without a :class:`~dist_collectives.ft.Manager` (see the module doc for
    the protocol). Works on these groups and on torch's reconfigurable ones.

    Args:
        pg: The group: anything with ``get_reconfigure_handle()`` and
            ``reconfigure(options)``.
        store_addr: ``host:port/prefix`` of a running store, with a prefix no other
            call has used (every member of this reconfiguration passes the same).
        rank: This member's rank in the new group.
        world_size: The number of members.
        timeout: How long the exchange, and then the reconfiguration, may take.
        communicator_uuid: The ``uuid`` rank 0 hands every member (the group is then
            named ``torchft_<uuid>_rank_<n>``); None for a fresh random one. The
            Manager passes its quorum's (:attr:`Quorum.communicator_uuid`).

    Raises:
        HandleExchangeTimeoutError: some members' handles (or rank 0's ``uuid``) did
            not arrive within ``timeout``; ``pg`` was not touched.
        Exception: what ``pg.reconfigure`` or its Work raised.
    """
    store = exchange_store(store_addr, timeout)
    store.set(f"{HANDLE_KEY}{rank}", pg.get_reconfigure_handle())
    if rank == 0:
        chosen = new_communicator_uuid() if communicator_uuid is None else communicator_uuid
        store.set(UUID_KEY, str(chosen))
    keys = [UUID_KEY, *(f"{HANDLE_KEY}{peer}" for peer in range(world_size))]
    started = time.monotonic()
    try:
        store.wait(keys, timeout)
    except dist.DistStoreError as error:
        raise _exchange_timeout(store, store_addr, keys, rank, timeout, started, error) from None
    communicator_id, *handles = store.multi_get(keys)
    options = ReconfigureOptions()
    options.uuid = int(communicator_id)
    options.handles = [bytes(handle).decode() for handle in handles]
    options.timeout = timeout
    pg.reconfigure(options).wait()
    logger.debug("reconfigured %r on %s as %d/%d", pg, store_addr, rank, world_size)


def _exchange_timeout(
    store: Any,
    store_addr: str,
    keys: Sequence[str],
    rank: int,
    timeout: timedelta,
    started: float,
    error: Exception,
) -> Exception:
    """The error for a failed wait: the ranks whose handles are missing, by name."""
    try:
        absent = [key for key in keys if not store.check([key])]
    except Exception:
        return error
    missing = [int(key[len(HANDLE_KEY) :]) for key in absent if key.startswith(HANDLE_KEY)]
    what = [f"rank(s) {missing}'s handles"] if missing else []
    if UUID_KEY in absent and 0 not in missing:
        what.append("rank 0's uuid")
    return HandleExchangeTimeoutError(
        f"reconfigure_with_store {timed_out_after_ms(timeout)}: {' and '.join(what) or 'keys'} "
        f"did not arrive at store address {store_addr} (waited "
        f"{time.monotonic() - started:.1f} s as rank {rank}; the store said: {error})",
        store_addr,
        missing,
    )
