"""get_configs_parallel and get_tensors_parallel: gather values on the first rank.

Protocol (every wait bounded by ``timeout``):

1. Every rank of ``ranks`` but the first (the *receiver*) writes its value as a
   record (see :mod:`dist_workspace.format`) through the call's transport (see
   :mod:`dist_workspace.transport`, chosen once per call by
   :mod:`dist_workspace.transports`): a record of at most 8 MiB
   (:func:`dist_workspace.protocol.route`) travels in its frame; a larger one goes
   into a fresh shared-memory segment when ``workspace_path`` is None, else into a
   file of a per-exchange subdirectory of ``workspace_path``. It then sends a frame
   to the receiver over the link between ``ranks`` (:mod:`dist_workspace.link`,
   opened by the first call with these ranks): a head saying what the transport
   needs to find the record, shape and dtype, host, ``ranks`` and, when anything
   failed (a config that is not JSON, a full /dev/shm, ...), the error instead. The
   frame goes after the record's last byte is written, and nothing writes the record
   again: a receiver never sees a half-written one.
2. The receiver waits for every sender's frame at once. A missing one after
   ``timeout`` raises naming the ranks that never wrote; an error raises naming its
   rank (as soon as every sender has sent, else at the timeout); a connection that
   closes (a sender exited) raises at once, naming it. It checks the heads (see
   :func:`dist_workspace.protocol.decide_receipt`), maps or reads every record, then
   sends every sender its verdict: success, or the error that every sender raises
   too (so no rank is left waiting).
3. Senders wait for the verdict, keep what it tells the transport for later calls,
   release what they wrote (a segment is unlinked: the receiver's private mapping
   keeps the data alive) and get an empty list.

No call uses the process group or its store, except to open the link; ``group``
decides who may take part. A frame of an earlier call that failed (a sender that
came late) is answered with that call's error and never taken for a later call's.
A segment is never reused across calls because the receiver's tensors map it and
stay valid after the context: writing the next call's value into it would change
them.

Values given to the receiver from segments are zero-copy, copy-on-write mappings of
the writers' segments (nothing is copied or pre-faulted: the page tables fill as the
tensors are read): writing to them never affects the writer, and they stay valid
after the context exits (the memory is freed when the last tensor is dropped);
values of records in their frame view the memory the receiver read the frame into,
its own. Segments are unlinked before the context body runs and, on every error path, in ``finally``
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
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dist_workspace import link, protocol
from dist_workspace.errors import WorkspaceError
from dist_workspace.jobid import current_job_id, short_tag
from dist_workspace.own_value import own_config, own_tensor
from dist_workspace.transport import CallId, Parcel, Transport
from dist_workspace.transports import open_transport

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 300.0


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
    """One call: who takes part and its number, its link, the store, the transport."""

    call: protocol.Call
    seq: int  # this call's number on the link
    state: link.LinkState
    store: Any  # opens the link at the first call
    job: str
    transport: Transport

    def open(self) -> link.Link:
        """The link between the call's ranks, opened by the first call that needs it."""
        if self.state.link is None:
            self.state.link = link.open_link(
                self.store, self.job, self.call, self.state, _host_id()
            )
        return self.state.link

    def answer_stale(self, peer: int, frame: link.Frame) -> None:
        """A frame of an earlier call came: a late sender's head gets that call's error."""
        if frame.kind != protocol.HEAD or self.state.link is None:
            return  # a verdict this rank stopped waiting for
        verdict = protocol.stale_verdict(frame.seq, self.state.failures)
        deadline = time.monotonic() + protocol.VERDICT_MARGIN_SECONDS
        self.state.link.send(peer, link.Frame(protocol.VERDICT, frame.seq, verdict), (), deadline)


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
    checked = _check_ranks(ranks, rank, dist.get_process_group_ranks(group), kind)
    if len(checked) == 1:
        return None
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:  # pragma: no cover - present in every supported torch
        raise WorkspaceError(f"rank {rank}: this torch has no default store to coordinate with")
    job = current_job_id()
    state = link.state_for(job, checked)
    seq = state.next_seq()
    call = protocol.Call(kind, rank, tuple(checked), _timeout_seconds(timeout))
    ranks_tag = short_tag(",".join(map(str, sorted(checked))), 16)
    call_id = CallId(kind, rank, short_tag(job), ranks_tag, seq, call.timeout, checked[0])
    transport = open_transport(workspace_path, call_id)
    return _Exchange(call, seq, state, getter(), job, transport)


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# ---------------------------------------------------------------- sender


def _send(exchange: _Exchange, weights: dict[str, torch.Tensor], config: Any) -> None:
    """Writes this rank's record, sends its head, waits for the receiver's verdict."""
    call = exchange.call
    parcel: Parcel | None = None
    try:
        try:
            parcel = exchange.transport.send(weights, config)
        except BaseException as error:
            with contextlib.suppress(Exception):  # the error raised is this rank's own
                _post_head(exchange, {"ok": False, "error": _error_text(error)}, ())
            raise
        head: dict[str, Any] = {"ok": True, "ranks": list(call.ranks), "host": _host_id()}
        head.update(parcel.status())
        tensor = weights.get("tensor")
        if tensor is not None:
            head.update(shape=list(tensor.shape), dtype=str(tensor.dtype))
        deadline = _post_head(exchange, head, parcel.body())
        _await_verdict(exchange, deadline)
    finally:
        if parcel is not None:
            parcel.release()


def _post_head(exchange: _Exchange, head: dict[str, Any], body: Sequence[Any]) -> float:
    """Sends this sender's frame; returns the deadline of its wait for the verdict.

    The receiver waits up to the timeout for the slowest sender, then reads: a sender
    allows it that plus a margin before declaring it gone.
    """
    call = exchange.call
    deadline = time.monotonic() + call.timeout + protocol.VERDICT_MARGIN_SECONDS
    frame = link.Frame(protocol.HEAD, exchange.seq, head)
    closed = exchange.open().send(call.receiver, frame, body, deadline)
    if closed is not None:
        raise WorkspaceError(protocol.receiver_closed(call, closed.why))
    return deadline


def _await_verdict(exchange: _Exchange, deadline: float) -> None:
    """Waits for the receiver's verdict; raises if the call failed."""
    call = exchange.call
    the_link = exchange.open()
    got = the_link.receive(
        [call.receiver], protocol.VERDICT, exchange.seq, deadline, exchange.answer_stale
    ).get(call.receiver)
    if isinstance(got, link.Closed):
        raise WorkspaceError(protocol.receiver_closed(call, got.why))
    verdict = None if got is None else got.head
    failure = protocol.verdict_error(call, verdict, call.timeout + protocol.VERDICT_MARGIN_SECONDS)
    if failure is not None:
        raise WorkspaceError(failure)


# ---------------------------------------------------------------- receiver


def _receive(
    exchange: _Exchange,
    own_value: Callable[[], tuple[Any, dict[str, torch.Tensor]]],
) -> list[tuple[Any, dict[str, torch.Tensor]]]:
    call = exchange.call
    the_link: link.Link | None = None
    closed: set[int] = set()
    try:
        the_link = exchange.open()
        own = own_value()
        own_tensor = own[1].get("tensor")
        deadline = time.monotonic() + call.timeout
        frames = the_link.receive(
            call.senders, protocol.HEAD, exchange.seq, deadline, exchange.answer_stale
        )
        for sender, frame in frames.items():
            if isinstance(frame, link.Closed):
                closed.add(sender)
                raise WorkspaceError(protocol.connection_lost(call, sender, frame.why))
        came = {r: f for r, f in frames.items() if isinstance(f, link.Frame)}
        heads = {r: frame.head for r, frame in came.items()}
        failure = protocol.decide_receipt(
            call,
            heads,
            host=_host_id(),
            one_host=exchange.transport.one_host,
            own_shape=None
            if own_tensor is None
            else (list(own_tensor.shape), str(own_tensor.dtype)),
        )
        if failure is not None:
            raise WorkspaceError(failure)
        values = [
            own if r == call.rank else exchange.transport.receive(r, heads[r], came[r].body)
            for r in call.ranks
        ]
    except BaseException as error:
        text = _error_text(error)
        exchange.state.remember_failure(exchange.seq, text)
        if the_link is not None:
            _deliver_verdict(exchange, the_link, {"ok": False, "error": text}, closed)
        raise
    finally:
        exchange.transport.close()
    _deliver_verdict(exchange, the_link, {"ok": True}, closed)
    return values


def _deliver_verdict(
    exchange: _Exchange, the_link: link.Link, verdict: dict[str, Any], closed: set[int]
) -> None:
    """Sends the verdict to every sender whose connection lives.

    A sender that failed to write does not wait for it: it reads it as an earlier
    call's verdict at its next call, and drops it.
    """
    frame = link.Frame(protocol.VERDICT, exchange.seq, verdict)
    deadline = time.monotonic() + protocol.VERDICT_MARGIN_SECONDS
    for sender in exchange.call.senders:
        if sender not in closed:
            gone = the_link.send(sender, frame, (), deadline)
            if gone is not None:
                logger.debug(
                    "rank %s: no verdict sent to rank %s: %s", exchange.call.rank, sender, gone.why
                )


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
    The tensors must have one shape and dtype. Records of at most 8 MiB travel on the
    link between the ranks, larger ones through shared memory; all of ``ranks`` must
    be on one host. Reads ``DIST_WORKSPACE_TIMEOUT`` (seconds, 300 by default) when
    ``timeout`` is None and ``DIST_WORKSPACE_SHM_DIR``.

    Args:
        tensor: This rank's tensor, on any device (any dtype safetensors stores).
        ranks: Global ranks taking part; the first one receives.
        group: The process group they belong to; None means the world.
        timeout: Seconds to wait for a peer before raising, naming it.

    Yields:
        On the first rank, the tensors, all on CPU whatever device they were on
        (peers' ones zero-copy views of shared memory, or of this process's copy of
        records small enough for the link, that stay valid after the context; its
        own a CPU copy that never aliases ``tensor``); on the other ranks an empty
        list.

    Raises:
        WorkspaceError: The caller is not in ``ranks``; a rank failed, timed out, or
            sent a tensor of another shape or dtype (the ranks and shapes are named).
    """
    exchange = _start("get_tensors_parallel", ranks, group, None, timeout)
    if exchange is None:
        yield [_own_tensor(tensor, None)]
        return
    if exchange.call.rank != exchange.call.receiver:
        _send(exchange, {"tensor": tensor}, None)
        yield []
        return
    received = _receive(
        exchange, lambda: (None, {"tensor": _own_tensor(tensor, exchange.call.rank)})
    )
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
    Records of at most 8 MiB travel on the link between the ranks; larger ones
    through shared memory on one host when ``workspace_path`` is None, else through
    files in a subdirectory of ``workspace_path`` that the receiver removes
    afterwards (the ranks may then be on several hosts). Reads
    ``DIST_WORKSPACE_TIMEOUT`` and ``DIST_WORKSPACE_SHM_DIR``.

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
    if exchange.call.rank != exchange.call.receiver:
        _send(exchange, {}, config)
        yield []
        return
    received = _receive(exchange, lambda: (_own_config(config, exchange.call.rank), {}))
    yield [value for value, _ in received]
