"""get_configs_parallel and get_tensors_parallel: gather values on the first rank.

The first of ``ranks`` (the *receiver*) gets every value; the others (the *senders*)
send theirs, each laid out as a record (:mod:`dist_workspace.writer`) that goes where
its size alone says (:func:`dist_workspace.protocol.route`): in the sender's frame on
the link between ``ranks`` (:mod:`dist_workspace.link`), or in a shared-memory segment
(:mod:`dist_workspace.shm`) or, given ``workspace_path``, a file
(:mod:`dist_workspace.call_directory`).

A sender writes its record whole before its frame (a head: ranks, host, route, size,
segment, shape and dtype, or its error) announces it, so a receiver never sees a
half-written one; it then waits for the verdict and unlinks its segment. The receiver
reads its own value back as a peer's (:func:`own_values`), waits for every frame at
once, decides from the heads (:func:`dist_workspace.protocol.decide_receipt`), reads
every record and sends every sender the verdict: success, or the error all raise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import mmap
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dist_workspace import link, protocol, shm
from dist_workspace.call_directory import CallDirectory
from dist_workspace.errors import WorkspaceError
from dist_workspace.jobid import current_job_id, short_tag
from dist_workspace.reader import assemble, parse_header, view_entries
from dist_workspace.writer import prepare_record, record_buffers

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 300.0
Values = tuple[Any, dict[str, torch.Tensor]]  # (config, weights) of one rank
_POPULATE_FROM_BYTES = 1 << 20  # below, a buffer comes from torch's allocator
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux's, in Python's mmap from 3.10


@dataclasses.dataclass
class Exchange:
    """One call of several ranks: who takes part, its number on their link, its files."""

    call: protocol.Call
    seq: int  # this call's number on the link
    state: link.LinkState  # the link between the call's ranks, in this process
    job: str  # the job id: names the link's store keys, segments and directories
    workspace_path: Path | None

    @functools.cached_property
    def names(self) -> dict[str, Any]:
        """What names this call's segment or directory: job, ranks and call number."""
        ranks = short_tag(",".join(map(str, sorted(self.call.ranks))), 16)
        return {"job": short_tag(self.job), "group": ranks, "seq": self.seq}

    @functools.cached_property
    def directory(self) -> CallDirectory | None:
        """The call's directory under ``workspace_path``, if given."""
        path = self.workspace_path
        return None if path is None else CallDirectory(path, **self.names)

    def open(self) -> link.Link:
        """The link between the call's ranks, opened by the first call that needs it."""
        if self.state.link is None:
            store = dist.distributed_c10d._get_default_store()
            name = f"{self.names['job']}/{self.names['group']}"
            self.state.link = link.open_link(store, name, self.call, self.state)
        return self.state.link


def _check_call(kind: str, given: Any, group: Any, timeout: float | None) -> protocol.Call:
    """The call, its ranks checked: distinct ints of ``group``, the caller among them.

    Reads ``DIST_WORKSPACE_TIMEOUT`` when ``timeout`` is None.
    """
    from dist_core.ranks import get_rank  # noqa: PLC0415 - keeps import light

    grouped = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if grouped else get_rank()
    if isinstance(given, int | str) or not all(isinstance(r, int) for r in given):
        raise WorkspaceError(f"rank {rank}: {kind} needs a list of int ranks, got {given!r}")
    ranks = [int(r) for r in given]
    if not ranks or len(set(ranks)) != len(ranks):
        raise WorkspaceError(f"rank {rank}: {kind} got ranks={ranks}: empty or with repeats")
    if rank not in ranks:
        raise WorkspaceError(
            f"rank {rank}: {kind} was called with ranks={ranks}, which does not include the "
            "caller; only the ranks listed may call it"
        )
    if grouped:
        members = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
        outside = [r for r in ranks if r not in members]
        if outside:
            raise WorkspaceError(
                f"rank {rank}: {kind} got ranks {outside} that are not in the group "
                f"(its ranks: {members})"
            )
    elif len(ranks) > 1:
        raise WorkspaceError(
            f"rank {rank}: {kind} with ranks={ranks} needs an initialized process group"
        )
    if timeout is None:
        timeout = float(os.environ.get("DIST_WORKSPACE_TIMEOUT", DEFAULT_TIMEOUT_SECONDS))
    return protocol.Call(kind, rank, tuple(ranks), float(timeout))


def _gather(
    kind: str,
    weights: dict[str, torch.Tensor],
    config: Any,
    ranks: Any,
    group: Any,
    workspace_path: Any,
    timeout: float | None,
) -> list[Values]:
    """Every rank's values on the receiver, in ``ranks`` order; ``[]`` on a sender."""
    call = _check_call(kind, ranks, group, timeout)
    if len(call.ranks) == 1:
        return [own_values(weights, config, call.rank, "")]
    job = current_job_id()
    state = link.state_for(job, call.ranks)
    path = None if workspace_path is None else Path(workspace_path)
    exchange = Exchange(call, state.next_seq(), state, job, path)
    if call.rank != call.receiver:
        send(exchange, weights, config)
        return []
    return receive(exchange, weights, config)


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _shape(weights: dict[str, torch.Tensor]) -> tuple[list[int], str] | None:
    """The shape and dtype a head announces for a tensor call; None for a config."""
    tensor = weights.get("tensor")
    return None if tensor is None else (list(tensor.shape), str(tensor.dtype))


def send(exchange: Exchange, weights: dict[str, torch.Tensor], config: Any) -> None:
    """Writes this rank's record, sends its frame, waits for the receiver's verdict.

    A value that cannot be written sends its error instead, and raises it here.
    """
    call = exchange.call
    segment: shm.Segment | None = None
    try:
        try:
            record = prepare_record(
                weights, config, rank=call.rank, job=exchange.job, checksums=False
            )
            route = protocol.route(record.total_size, exchange.workspace_path)
            head: dict[str, Any] = {"ok": True, "ranks": list(call.ranks), "route": route}
            head.update(host=exchange.state.host, size=record.total_size)
            if (shape := _shape(weights)) is not None:
                head.update(shape=shape[0], dtype=shape[1])
            body: Sequence[Any] = ()
            if route == "link":
                body = record_buffers(record)
            elif exchange.directory is None:
                segment = shm.write_segment(record, rank=call.rank, **exchange.names)
                head["segment"] = segment.name
            else:  # a file has checksums: laid out again for it
                exchange.directory.write(call.rank, weights, config)
        except BaseException as error:
            with contextlib.suppress(Exception):  # the error raised is this rank's own
                _send_head(exchange, {"ok": False, "error": _error_text(error)}, ())
            raise
        deadline = _send_head(exchange, head, body)
        got = exchange.open().receive([call.receiver], protocol.VERDICT, exchange.seq, deadline)
        verdict = got.get(call.receiver)
        if isinstance(verdict, link.Closed):
            raise WorkspaceError(protocol.receiver_closed(call, verdict.why))
        failure = protocol.verdict_error(call, None if verdict is None else verdict.head)
        if failure is not None:
            raise WorkspaceError(failure)
    finally:
        if segment is not None:
            segment.unlink()


def _send_head(exchange: Exchange, head: dict[str, Any], body: Sequence[Any]) -> float:
    """Sends this sender's frame; returns the deadline of its wait for the verdict.

    The receiver waits the timeout for the slowest sender, then reads: a sender allows
    it that plus a margin.
    """
    call = exchange.call
    deadline = time.monotonic() + call.timeout + protocol.VERDICT_MARGIN_SECONDS
    frame = link.Frame(protocol.HEAD, exchange.seq, head)
    closed = exchange.open().send(call.receiver, frame, body, deadline)
    if closed is not None:
        raise WorkspaceError(protocol.receiver_closed(call, closed.why))
    return deadline


def receive(exchange: Exchange, weights: dict[str, torch.Tensor], config: Any) -> list[Values]:
    """Every rank's values in ``ranks`` order, this rank's from ``weights`` and ``config``."""
    call = exchange.call
    try:
        the_link = exchange.open()
        own = own_values(weights, config, call.rank, exchange.job)
        deadline = time.monotonic() + call.timeout
        came: dict[int, link.Frame] = {}
        for sender, frame in the_link.receive(
            call.senders, protocol.HEAD, exchange.seq, deadline
        ).items():
            if isinstance(frame, link.Closed):
                raise WorkspaceError(protocol.connection_lost(call, sender, frame.why))
            came[sender] = frame
        failure = protocol.decide_receipt(
            call,
            {sender: frame.head for sender, frame in came.items()},
            host=exchange.state.host,
            one_host=exchange.workspace_path is None,
            own_shape=_shape(own[1]),
        )
        if failure is not None:
            raise WorkspaceError(failure)
        values = [own if r == call.rank else _read(exchange, r, came[r]) for r in call.ranks]
    except BaseException as error:
        _send_verdicts(exchange, {"ok": False, "error": _error_text(error)})
        raise
    finally:
        if exchange.directory is not None:
            exchange.directory.remove()
    _send_verdicts(exchange, {"ok": True})
    return values


def _read(exchange: Exchange, sender: int, frame: link.Frame) -> Values:
    """A sender's values, from where its head says the record lies."""
    head = frame.head
    route = head.get("route")
    size = head.get("size")
    if route == "file" and exchange.directory is not None:
        return exchange.directory.read(sender, exchange.call.timeout, exchange.call.kind)
    if route == "segment" and isinstance(size, int):
        where = f"rank {sender}'s segment {head.get('segment')}"
        return _values(shm.map_segment(str(head.get("segment")), size, where), size, sender, where)
    where = f"rank {sender}'s record in its frame"
    body = frame.body
    got = 0 if body is None else body.numel()
    if route != "link" or body is None or got != size:
        raise WorkspaceError(f"{where}: {got} bytes by route {route!r:.20}, announced {size!r:.20}")
    return _values(body.numpy(), got, sender, where)


def _values(buffer: Any, size: int, sender: int, where: str) -> Values:
    """The record in ``buffer`` (writable, private), checked to be ``sender``'s."""
    header = parse_header(lambda at, length: bytes(buffer[at : at + length]), size, where)
    if header.rank != sender:
        raise WorkspaceError(f"{where} says it was written by rank {header.rank}")
    return assemble(view_entries(buffer, header), header, where)


def _send_verdicts(exchange: Exchange, verdict: dict[str, Any]) -> None:
    """Sends the verdict to every sender whose connection lives, late ones included.

    A late sender reads it at once; one that failed to write drops it at its next call.
    """
    if exchange.state.link is None:
        return  # the link never opened: no sender is waiting on it
    frame = link.Frame(protocol.VERDICT, exchange.seq, verdict)
    deadline = time.monotonic() + protocol.VERDICT_MARGIN_SECONDS
    for sender in exchange.call.senders:
        gone = exchange.state.link.send(sender, frame, (), deadline)
        if gone is not None:
            logger.debug("no verdict sent to rank %s: %s", sender, gone.why)


def host_buffer(nbytes: int) -> torch.Tensor:
    """A fresh, writable 1-D uint8 CPU tensor of ``nbytes`` bytes, its pages allocated.

    From 1 MiB on, a private anonymous mapping whose pages ``MAP_POPULATE`` allocates
    at once (cheaper than faulting them in during the copy), held by the tensor.

    Raises:
        MemoryError: The system cannot map ``nbytes`` bytes.
    """
    if nbytes < _POPULATE_FROM_BYTES or not _MAP_POPULATE:
        return torch.empty(nbytes, dtype=torch.uint8)
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE)
    except OSError as error:
        raise MemoryError(f"cannot map {nbytes} bytes for a CPU copy: {error}") from None
    return torch.frombuffer(mapping, dtype=torch.uint8)


def own_values(weights: dict[str, torch.Tensor], config: Any, rank: int, job: str) -> Values:
    """This rank's values as a peer's record gives them back, made the same way.

    Its record is copied into fresh memory and read as a peer's: on CPU, tuples as
    lists, shared storages still shared, aliasing nothing of the caller's.

    Raises:
        TypeError: A config that is not JSON or a tensor a record cannot hold (named).
    """
    record = prepare_record(weights, config, rank=rank, job=job, checksums=False)
    buffer = host_buffer(record.total_size).numpy()
    at = 0
    for part in record_buffers(record):
        data = memoryview(part).cast("B")
        buffer[at : at + len(data)] = data
        at += len(data)
    return _values(buffer, at, rank, f"rank {rank}'s own value")


@contextlib.contextmanager
def get_tensors_parallel(
    tensor: torch.Tensor,
    ranks: list[int],
    group: dist.ProcessGroup | None = None,
    *,
    timeout: float | None = None,
) -> Iterator[list[torch.Tensor]]:
    """Gives the first rank of ``ranks`` every listed rank's tensor, in ``ranks`` order.

    Every rank in ``ranks`` (and only those) calls it, with tensors of one shape and
    dtype, all on one host: records up to 8 MiB travel on the link between the ranks,
    larger ones through shared memory. Reads ``DIST_WORKSPACE_TIMEOUT`` (seconds, 300
    by default) when ``timeout`` is None and ``DIST_WORKSPACE_SHM_DIR``.

    Args:
        tensor: This rank's tensor, on any device (any dtype safetensors stores).
        ranks: Global ranks taking part; the first one receives.
        group: The process group they belong to; None means the world.
        timeout: Seconds to wait for a peer before raising, naming it.

    Yields:
        On the first rank the tensors, on CPU whatever their device: peers' ones
        zero-copy views (of shared memory, or of the record received on the link) valid
        after the context, its own a copy that never aliases ``tensor``. Elsewhere ``[]``.

    Raises:
        WorkspaceError: The caller is not in ``ranks``; a rank failed, timed out, or
            sent a tensor of another shape or dtype (the ranks and shapes are named).
    """
    kind = "get_tensors_parallel"
    received = _gather(kind, {"tensor": tensor}, None, ranks, group, None, timeout)
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
    Records up to 8 MiB travel on the link between the ranks; larger ones through
    shared memory on one host, or given ``workspace_path`` through files in a
    subdirectory of it that the receiver removes (the ranks may then be on several
    hosts). Reads ``DIST_WORKSPACE_TIMEOUT`` and ``DIST_WORKSPACE_SHM_DIR``.

    Args:
        config: This rank's config.
        ranks: Global ranks taking part; the first one receives.
        group: The process group they belong to; None means the world.
        workspace_path: A directory every rank sees, or None for shared memory.
        timeout: Seconds to wait for a peer before raising, naming it.

    Yields:
        The configs on the first rank, ``[]`` elsewhere; every tensor in them on CPU.
        Its own config is a copy made through the same encoding as the others'.

    Raises:
        TypeError: This rank's config is not JSON (naming the key path).
        WorkspaceError: The caller is not in ``ranks``; a rank failed or timed out.
    """
    received = _gather("get_configs_parallel", {}, config, ranks, group, workspace_path, timeout)
    yield [value for value, _ in received]
