"""get_configs_parallel and get_tensors_parallel: gather values on the first rank.

Protocol (every wait bounded by ``timeout``):

1. Every rank of ``ranks`` but the first (the *receiver*) writes its value as a
   record (see :mod:`dist_workspace.format`) through the call's transport (see
   :mod:`dist_workspace.transport`, chosen once per call by
   :mod:`dist_workspace.transports`): into a fresh shared-memory
   segment when ``workspace_path`` is None (a record of at most 64 KiB,
   ``DIST_WORKSPACE_INLINE_BYTES``, goes inside the status instead, and one of at
   most 8 MiB stays in the sender's memory for the receiver to copy once the
   receiver has shown it can, see :mod:`dist_workspace.shm_transport`), else into a
   file of a per-exchange subdirectory of ``workspace_path``. It then posts a
   status to the process group's store: what the transport needs to find the record
   (a segment's name and size, or where the bytes lie in the sender's memory),
   shape and dtype, host, ``ranks`` and, when anything failed (a config that is not
   JSON, a full /dev/shm, ...), the error instead. The status is posted after the
   record's last byte is written, and nothing writes the record again: a receiver
   never sees a half-written one.
2. The receiver waits for every status at once. A missing one after ``timeout``
   raises naming the ranks that never wrote; an error status raises naming its rank
   (as soon as every sender has posted, else at the timeout). It checks the statuses
   (same ``ranks``, same host when the transport needs one, same shape and dtype for
   tensors), maps or reads every record, then posts a verdict: success, or the error
   that every sender raises too (so no rank is left at a barrier).
3. Senders wait for the verdict, keep what it tells the transport for later calls
   (the receiver's pid, whether it read their memory), release what they wrote (a
   segment is unlinked: the receiver's private mapping keeps the data alive) and get
   an empty list.

The store is the default process group's (a private torch API,
``_get_default_store``, present since torch 1.x), so no object collective, and no
pickle, is involved; ``group`` decides who may take part and, with the ``ranks``
list and the call's number among the calls with them, names the keys. What a call
through the store costs in round trips: a sender posts (a ``set``, which waits for
no reply) and waits for the verdict (one read, through
:mod:`dist_workspace.store_reader`); the receiver deletes the keys of earlier calls
it no longer needs while the senders write, waits for the statuses, reads them in
one ``multi_get`` and posts the verdict. On one host (the shared-memory transport)
only a sender's first call with a list of ranks goes through the store: its verdict
names the receiver's Unix socket, the sender connects, and its later statuses and
verdicts travel over that connection, with no store round trip at all (see
:mod:`dist_workspace.peer_socket`; ``DIST_WORKSPACE_PEER_SOCKETS=0`` keeps the store).
The job id, the host id and this process's start time are read once per process,
and a header byte for byte like one already validated (a loop of calls of one
shape sends the same one) is not parsed again (:func:`dist_workspace.reader.parse_header`).

Why the store (and connections of its own) and fresh segments: the process group
cannot carry the handshake, because only ``ranks`` call (a subset of ``group`` makes
any collective on it hang) and a collective's wait is bounded by the group's
timeout, not the call's, so a missing rank could not be named. A segment is never
reused across calls because the receiver's tensors map it and stay valid after the
context: writing the next call's value into it would change them.

Values given to the receiver from segments are zero-copy, copy-on-write
mappings of the writers' segments (nothing is copied or pre-faulted: the page tables
fill as the tensors are read): writing to them never affects the writer, and they
stay valid after the context exits (the memory is freed when the last tensor is
dropped); values of inline records are over a private copy of their bytes, and
values left in a sender's memory are copied into fresh memory of the receiver's. Segments
are unlinked before the context body runs and, on every error path, in ``finally``
blocks.

Device rule: every value the receiver gets is on CPU, its own included, whatever
device the tensors were on. The receiver's own value is copied as a peer's record
would give it back (see :mod:`dist_workspace.own_value`): into fresh anonymous
memory, never aliasing the caller's tensors, shared storage inside it still shared,
tuples as lists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import socket
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dist_workspace import peer_socket, protocol
from dist_workspace.errors import WorkspaceError
from dist_workspace.jobid import current_job_id, short_tag
from dist_workspace.own_value import own_config, own_tensor
from dist_workspace.store_reader import StoreReader, frees_deleted_values, reader_for
from dist_workspace.transport import CallId, Parcel, Transport
from dist_workspace.transports import open_transport

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 300.0
_VERDICT_MARGIN_SECONDS = 10.0
_sequences: dict[tuple[str, tuple[int, ...]], int] = {}
# Receiver, by key prefix: for each recent call, the senders whose status may be in
# the store (what later calls delete); its verdict went there too when any did.
_in_store: dict[str, dict[int, list[int]]] = {}


def _timeout_seconds(timeout: float | None) -> float:
    if timeout is not None:
        return float(timeout)
    return float(os.environ.get("DIST_WORKSPACE_TIMEOUT", DEFAULT_TIMEOUT_SECONDS))


@functools.cache  # neither the host's name nor its boot changes while a process runs
def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            boot = handle.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclasses.dataclass
class _Exchange:
    """One call: who takes part, its number, its queues, how long to wait, the transport."""

    kind: str
    rank: int
    ranks: list[int]
    store: Any
    reader: StoreReader
    prefix: str  # of the keys of the calls with these ranks and group
    seq: int  # this call's number among them
    timeout: float
    transport: Transport

    @property
    def receiver(self) -> int:
        return self.ranks[0]

    @property
    def senders(self) -> list[int]:
        return self.ranks[1:]

    @property
    def call(self) -> protocol.Call:
        return protocol.Call(self.kind, self.rank, tuple(self.ranks), self.timeout)

    def key(self, name: str, seq: int | None = None) -> str:
        """A key of this call (or of call number ``seq`` of these ranks)."""
        return f"{self.prefix}/{self.seq if seq is None else seq}/{name}"


def _check_ranks(given: Any, rank: int, group_ranks: list[int], what: str) -> list[int]:
    if isinstance(given, int | str) or not all(isinstance(r, int) for r in given):
        raise WorkspaceError(f"rank {rank}: {what} needs a list of int ranks, got {given!r}")
    ranks = [int(r) for r in given]
    if not ranks or len(set(ranks)) != len(ranks):
        raise WorkspaceError(f"rank {rank}: {what} got ranks={ranks}: empty or with repeats")
    if rank not in ranks:
        raise WorkspaceError(
            f"rank {rank}: {what} was called with ranks={ranks}, which does not include the "
            "caller; only the ranks listed may call it"
        )
    outside = [r for r in ranks if r not in group_ranks]
    if outside:
        raise WorkspaceError(
            f"rank {rank}: {what} got ranks {outside} that are not in the group "
            f"(its ranks: {group_ranks})"
        )
    return ranks


def _start(
    kind: str, ranks: Any, group: Any, workspace_path: Any, timeout: float | None
) -> _Exchange | None:
    """Validates the call; returns None when it is a single rank (no exchange needed)."""
    if not (dist.is_available() and dist.is_initialized()):
        from dist_core.ranks import get_rank  # noqa: PLC0415

        rank = get_rank()
        checked = _check_ranks(ranks, rank, list(ranks) if isinstance(ranks, list) else [], kind)
        if checked == [rank]:
            return None
        raise WorkspaceError(
            f"rank {rank}: {kind} with ranks={checked} needs an initialized process group"
        )
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank()
    group_ranks = dist.get_process_group_ranks(group)
    checked = _check_ranks(ranks, rank, group_ranks, kind)
    if len(checked) == 1:
        return None
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:  # pragma: no cover - present in every supported torch
        raise WorkspaceError(f"rank {rank}: this torch has no default store to coordinate with")
    store = getter()
    group_name = getattr(group, "group_name", "") or ",".join(map(str, group_ranks))
    key = (group_name, tuple(checked))
    seq = _sequences.get(key, 0)
    _sequences[key] = seq + 1
    ranks_tag = short_tag(",".join(map(str, checked)), 8)
    group_tag = short_tag(group_name, 8)
    job = short_tag(current_job_id())
    seconds = _timeout_seconds(timeout)
    call = CallId(kind, rank, job, group_tag + ranks_tag, seq, seconds, checked[0])
    return _Exchange(
        kind=kind,
        rank=rank,
        ranks=checked,
        store=store,
        reader=reader_for(store),
        prefix=f"dist_workspace/{job}/{group_tag}/{ranks_tag}",
        seq=seq,
        timeout=seconds,
        transport=open_transport(workspace_path, call, inline=frees_deleted_values(store)),
    )


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _post(exchange: _Exchange, name: str, value: dict[str, Any], payload: bytes = b"") -> None:
    # A set waits for no reply from the store's server: posting costs no round trip.
    # The JSON (which never holds a raw newline) comes first, then any payload.
    text = json.dumps(value).encode()
    exchange.store.set(exchange.key(name), text + b"\n" + payload if payload else text)


def _decoded(raw: bytes | str) -> tuple[dict[str, Any], bytes]:
    """A posted value: its JSON and the payload after the first newline."""
    text, _, payload = (raw if isinstance(raw, bytes) else raw.encode()).partition(b"\n")
    value: dict[str, Any] = json.loads(text)
    return value, payload


def _forget_earlier_calls(exchange: _Exchange) -> None:
    """Receiver: deletes the statuses of the previous call and the verdict before it.

    It read those statuses itself, and every sender read the verdict of the call
    before the previous one before posting a status to the previous one. Done before
    waiting for this call's statuses, in the time the receiver waits for the senders
    anyway; the store keeps the keys of the last two calls only. Statuses and
    verdicts that went over direct connections were never in the store.
    """
    calls = _in_store.setdefault(exchange.prefix, {})
    spent = [exchange.key(f"status/{r}", exchange.seq - 1) for r in calls.get(exchange.seq - 1, [])]
    if calls.pop(exchange.seq - 2, None):
        spent.append(exchange.key("verdict", exchange.seq - 2))
    for key in spent:
        with contextlib.suppress(RuntimeError):
            exchange.store.delete_key(key)


def _listener(exchange: _Exchange) -> peer_socket.Listener | None:
    """The receiver's socket, where senders may connect to it (one host)."""
    if exchange.transport.one_host and peer_socket.enabled():
        return peer_socket.listener(_host_id())
    return None


# ---------------------------------------------------------------- sender


def _send(exchange: _Exchange, weights: dict[str, torch.Tensor], config: Any) -> None:
    """Writes this rank's record, posts its status, waits for the receiver's verdict."""
    parcel: Parcel | None = None
    link = peer_socket.link_for(exchange.prefix) if exchange.transport.one_host else None
    try:
        try:
            status: dict[str, Any] = {"ok": True, "ranks": exchange.ranks, "host": _host_id()}
            parcel = exchange.transport.send(weights, config)
            status.update(parcel.status())
            tensor = weights.get("tensor")
            if tensor is not None:
                status.update(shape=list(tensor.shape), dtype=str(tensor.dtype))
        except BaseException as error:
            with contextlib.suppress(Exception):  # the error raised is this rank's own
                _post_status(exchange, link, {"ok": False, "error": _error_text(error)})
            raise
        _post_status(exchange, link, status, parcel.payload())
        _await_verdict(exchange, link)
    finally:
        if parcel is not None:
            parcel.release()


def _post_status(
    exchange: _Exchange,
    link: peer_socket.Link | None,
    status: dict[str, Any],
    payload: bytes = b"",
) -> None:
    if link is None:
        _post(exchange, f"status/{exchange.rank}", status, payload)
        return
    try:
        link.post(peer_socket.with_seq(exchange.seq, status, payload), exchange.timeout)
    except peer_socket.PeerClosed as error:
        raise _receiver_lost(exchange, error) from None


def _receiver_lost(exchange: _Exchange, error: peer_socket.PeerClosed) -> WorkspaceError:
    """Drops this sender's dead connection; the error to raise, naming this rank."""
    peer_socket.forget(exchange.prefix)
    return WorkspaceError(f"rank {exchange.rank}: {exchange.kind}: {error}")


def _await_verdict(exchange: _Exchange, link: peer_socket.Link | None) -> None:
    """Waits for the receiver's verdict, tells the transport, raises if the call failed.

    A failed call's verdict informs the transport too: a sender whose memory the
    receiver could not read (a receiver restarted under another pid, say) sends
    segments from the next call on instead of failing every call. A successful
    verdict through the store may name the receiver's socket: the sender connects to
    it for its later calls (:mod:`dist_workspace.peer_socket`).
    """
    receiver = exchange.receiver
    # The receiver waits up to the timeout for the slowest sender, then reads: a
    # sender allows it that plus a margin before declaring it gone.
    patience = exchange.timeout + _VERDICT_MARGIN_SECONDS
    if link is None:
        raw = exchange.reader.get(exchange.key("verdict"), patience)
    else:
        try:
            raw = link.verdict(exchange.seq, patience)
        except peer_socket.PeerClosed as error:
            raise _receiver_lost(exchange, error) from None
    if raw is None:
        raise WorkspaceError(protocol.receiver_timed_out(exchange.call, patience))
    verdict, _ = _decoded(raw)
    exchange.transport.settle(verdict)
    failure = protocol.verdict_error(exchange.call, verdict, patience)
    if failure is not None:
        raise WorkspaceError(failure)
    if link is None and exchange.transport.one_host and peer_socket.enabled():
        peer_socket.connect(
            exchange.prefix, exchange.rank, receiver, verdict.get("endpoint"), _host_id()
        )


# ---------------------------------------------------------------- receiver


def _collect_statuses(
    exchange: _Exchange, listener: peer_socket.Listener | None
) -> tuple[dict[int, tuple[dict[str, Any], bytes]], list[int]]:
    """Every sender's status and payload, by rank; and the senders that used the store."""
    if listener is not None and listener.offered(exchange.prefix):
        try:
            raws = listener.collect(
                exchange.prefix,
                exchange.seq,
                exchange.senders,
                exchange.timeout,
                functools.partial(_posted_in_store, exchange),
            )
        except WorkspaceError as error:  # a lost connection, a call out of order
            raise WorkspaceError(
                f"{exchange.kind}: receiver rank {exchange.rank}: {error}"
            ) from None
        linked = listener.linked(exchange.prefix)
        in_store = [r for r in exchange.senders if r not in linked]
    else:
        raws = _wait_in_store(exchange)
        in_store = exchange.senders
    return {sender: _decoded(raw) for sender, raw in raws.items()}, in_store


def _wait_in_store(exchange: _Exchange) -> dict[int, bytes]:
    """One wait for every sender's status in the store, then one read of them all."""
    keys = {sender: exchange.key(f"status/{sender}") for sender in exchange.senders}
    try:
        exchange.store.wait(list(keys.values()), timedelta(seconds=max(exchange.timeout, 0.001)))
    except RuntimeError:  # DistStoreError on timeout: read those that came
        return _posted_in_store(exchange, exchange.senders)
    return dict(zip(keys, exchange.store.multi_get(list(keys.values())), strict=True))


def _posted_in_store(exchange: _Exchange, senders: list[int]) -> dict[int, bytes]:
    """The statuses some of ``senders`` have posted to the store so far (no wait)."""
    keys = {r: exchange.key(f"status/{r}") for r in senders}
    keys = {r: key for r, key in keys.items() if exchange.store.check([key])}
    values = exchange.store.multi_get(list(keys.values())) if keys else []
    return dict(zip(keys, values, strict=True))


def _receive(
    exchange: _Exchange,
    own_value: Callable[[], tuple[Any, dict[str, torch.Tensor]]],
) -> list[tuple[Any, dict[str, torch.Tensor]]]:
    listener = _listener(exchange)
    in_store = exchange.senders
    try:
        own = own_value()
        own_tensor = own[1].get("tensor")
        _forget_earlier_calls(exchange)
        posted, in_store = _collect_statuses(exchange, listener)
        # A failed sender posts its error as its status: it is raised once every
        # sender has posted, or at the timeout beside the ranks that never did.
        failure = protocol.decide_receipt(
            exchange.call,
            {r: status for r, (status, _) in posted.items()},
            host=_host_id(),
            one_host=exchange.transport.one_host,
            own_shape=None
            if own_tensor is None
            else (list(own_tensor.shape), str(own_tensor.dtype)),
        )
        if failure is not None:
            raise WorkspaceError(failure)
        values = [
            own if r == exchange.rank else exchange.transport.receive(r, *posted[r])
            for r in exchange.ranks
        ]
    except BaseException as error:
        with contextlib.suppress(Exception):
            failed = {"ok": False, "error": _error_text(error), **exchange.transport.verdict()}
            _deliver_verdict(exchange, listener, failed, in_store)
        raise
    finally:
        exchange.transport.close()
    _deliver_verdict(exchange, listener, {"ok": True, **exchange.transport.verdict()}, in_store)
    return values


def _deliver_verdict(
    exchange: _Exchange,
    listener: peer_socket.Listener | None,
    verdict: dict[str, Any],
    in_store: list[int],
) -> None:
    """Tells every sender the verdict: over its connection, else through the store.

    A verdict through the store names the receiver's socket, so that its senders
    connect for their next calls.
    """
    if listener is not None:
        listener.sweep()  # a sender that connected meanwhile reads its connection
        # A sender reads the verdict where it posted; one also sent to its connection
        # (it linked while this call waited for it) is skipped there as stale.
        listener.answer(
            exchange.prefix, exchange.senders, peer_socket.with_seq(exchange.seq, verdict)
        )
    if in_store:
        if listener is not None and verdict.get("ok"):
            verdict = {**verdict, "endpoint": listener.offer(exchange.prefix)}
        _post(exchange, "verdict", verdict)
    _in_store.setdefault(exchange.prefix, {})[exchange.seq] = in_store


# ---------------------------------------------------------------- public API


def _own_tensor(tensor: Any, rank: int | None) -> torch.Tensor:
    """This rank's tensor as the receiver gets peers' ones: on CPU, a copy."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"get_tensors_parallel needs a torch.Tensor, got {type(tensor).__name__}")
    return own_tensor(tensor, f"rank {rank}'s own tensor")


def _own_config(config: Any, rank: int | None) -> Any:
    """This rank's config as the receiver gets peers' ones: a copy, tensors on CPU."""
    return own_config(config, f"rank {rank}'s own config")


@contextlib.contextmanager
def get_tensors_parallel(
    tensor: torch.Tensor,
    ranks: list[int],
    group: dist.ProcessGroup | None = None,
    *,
    timeout: float | None = None,
) -> Iterator[list[torch.Tensor]]:
    """Gives the first rank of ``ranks`` every listed rank's tensor, in ``ranks`` order.

    Every rank in ``ranks`` (and only those) calls it; the others get an empty list.
    The tensors must have one shape and dtype. Exchanges through shared memory, so
    all of ``ranks`` must be on one host. Reads ``DIST_WORKSPACE_TIMEOUT`` (seconds,
    300 by default) when ``timeout`` is None, ``DIST_WORKSPACE_SHM_DIR``,
    ``DIST_WORKSPACE_INLINE_BYTES`` (records up to this size, 64 KiB by default, travel
    inside the handshake instead of a segment), ``DIST_WORKSPACE_CROSS_MEMORY``
    (``0``: no copies straight from a sender's memory) and
    ``DIST_WORKSPACE_PEER_SOCKETS`` (``0``: every handshake through the store, none
    over direct connections).

    Args:
        tensor: This rank's tensor, on any device (any dtype safetensors stores).
        ranks: Global ranks taking part; the first one receives.
        group: The process group they belong to; None means the world.
        timeout: Seconds to wait for a peer before raising, naming it.

    Yields:
        On the first rank, the tensors, all on CPU whatever device they were on
        (peers' ones zero-copy views of shared memory, or private copies of records
        small enough to travel inline or copied out of the senders' memory, that
        stay valid after the context; its own a CPU copy that never aliases
        ``tensor``); on the other ranks an empty list.

    Raises:
        WorkspaceError: The caller is not in ``ranks``; a rank failed, timed out, or
            sent a tensor of another shape or dtype (the ranks and shapes are named).
    """
    exchange = _start("get_tensors_parallel", ranks, group, None, timeout)
    if exchange is None:
        yield [_own_tensor(tensor, None)]
        return
    if exchange.rank != exchange.receiver:
        _send(exchange, {"tensor": tensor}, None)
        yield []
        return
    received = _receive(exchange, lambda: (None, {"tensor": _own_tensor(tensor, exchange.rank)}))
    yield [weights["tensor"] for _, weights in received]


@contextlib.contextmanager
def get_configs_parallel(
    config: Any,
    ranks: list[int],
    group: dist.ProcessGroup | None,
    workspace_path: str | os.PathLike[str] | None = None,
    *,
    timeout: float | None = None,
) -> Iterator[list[Any]]:
    """Gives the first rank of ``ranks`` every listed rank's config, in ``ranks`` order.

    A config is any JSON value (tuples come back as lists), tensors inside included.
    Exchanges through shared memory on one host when ``workspace_path`` is None,
    else through files in a subdirectory of ``workspace_path`` that the receiver
    removes afterwards. Reads ``DIST_WORKSPACE_TIMEOUT``, ``DIST_WORKSPACE_SHM_DIR``,
    ``DIST_WORKSPACE_INLINE_BYTES``, ``DIST_WORKSPACE_CROSS_MEMORY`` and
    ``DIST_WORKSPACE_PEER_SOCKETS``.

    Args:
        config: This rank's config.
        ranks: Global ranks taking part; the first one receives.
        group: The process group they belong to; None means the world.
        workspace_path: A directory every rank sees, or None for shared memory.
        timeout: Seconds to wait for a peer before raising, naming it.

    Yields:
        The configs on the first rank, an empty list elsewhere. Every tensor in them
        is on CPU, whatever device it was on, the first rank's own config included;
        its own config is a copy (through the same encoding as the others'), so
        changing it never changes ``config``.

    Raises:
        TypeError: This rank's config is not JSON (naming the key path).
        WorkspaceError: The caller is not in ``ranks``; a rank failed or timed out.
    """
    exchange = _start("get_configs_parallel", ranks, group, workspace_path, timeout)
    if exchange is None:
        yield [_own_config(config, None)]
        return
    if exchange.rank != exchange.receiver:
        _send(exchange, {}, config)
        yield []
        return
    received = _receive(exchange, lambda: (_own_config(config, exchange.rank), {}))
    yield [value for value, _ in received]
