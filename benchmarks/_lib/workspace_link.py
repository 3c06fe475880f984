"""The link a call travels on, measured alone, and where records leave it.

- ``link handshake`` (a limit): every sender sends an empty head on dist-workspace's
  own link (``dist_workspace.link``, the one its calls use), the receiver answers
  each with an empty verdict. No record, no check: the least a call that tells every
  sender how it ended costs on this link.
- ``gloo handshake``: the same over a gloo group of the ranks (``ProcessGroupGloo``
  send/recv on a ``PrefixStore`` of the default store, one device thread per
  process), the link the issue first suggested: what it would cost before a byte of
  data moved.

``--link-sweep`` times a call whose records travel on the link against one whose
records go through segments (``protocol.LINK_MAX_BYTES`` set above every size, then
to 0), record sizes from 64 KiB to 64 MiB, the receiver reading every byte: where
the two cross is where ``LINK_MAX_BYTES`` belongs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

_TIMEOUT = timedelta(seconds=60)


_gloo: dict[tuple[int, ...], Any] = {}  # ranks -> [backend, next call number]


@contextlib.contextmanager
def link_handshake(value: Any, ranks: list[int]) -> Iterator[list[Any]]:
    """An empty head from every sender, an empty verdict back, on the package's link."""
    import torch.distributed as dist

    from dist_workspace import exchange, link, protocol
    from dist_workspace.jobid import current_job_id

    rank = dist.get_rank()
    call = protocol.Call("link handshake", rank, tuple(ranks), 60.0)
    job = current_job_id() + "/bench"  # a link of its own, beside the calls' one
    state = link.state_for(job, ranks)
    ongoing = exchange.Exchange(call, state.next_seq(), state, job, None)
    the_link = ongoing.open()
    deadline = time.monotonic() + 60
    if rank == ranks[0]:
        got = the_link.receive(ranks[1:], protocol.HEAD, ongoing.seq, deadline)
        assert len(got) == len(ranks) - 1, got
        for sender in ranks[1:]:
            the_link.send(sender, link.Frame(protocol.VERDICT, ongoing.seq, {}), (), deadline)
    else:
        the_link.send(ranks[0], link.Frame(protocol.HEAD, ongoing.seq, {}), (), deadline)
        got = the_link.receive([ranks[0]], protocol.VERDICT, ongoing.seq, deadline)
        assert len(got) == 1, got
    yield []


def _gloo_backend(ranks: list[int]) -> Any:
    import torch.distributed as dist

    key = tuple(sorted(ranks))
    if key not in _gloo:
        store = dist.distributed_c10d._get_default_store()
        store = getattr(store, "_store", store)  # the benchmark's counting wrapper's store
        options: Any = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
        options._timeout = _TIMEOUT
        options._threads = 1
        prefix = dist.PrefixStore(f"bench-gloo/{','.join(map(str, key))}", store)
        backend = dist.ProcessGroupGloo(prefix, key.index(dist.get_rank()), len(key), options)
        _gloo[key] = [backend, 0]
    return _gloo[key]


@contextlib.contextmanager
def gloo_handshake(value: Any, ranks: list[int]) -> Iterator[list[Any]]:
    """One byte from every sender to the receiver, one byte back, over a gloo group."""
    import torch.distributed as dist

    held = _gloo_backend(ranks)
    backend, seq = held
    held[1] += 1
    index = sorted(ranks).index
    head, verdict = seq * 4, seq * 4 + 1
    byte = torch.zeros(1, dtype=torch.uint8)
    if dist.get_rank() == ranks[0]:
        inboxes = [torch.empty(1, dtype=torch.uint8) for _ in ranks[1:]]
        works = [
            backend.recv([inbox], index(sender), head)
            for inbox, sender in zip(inboxes, ranks[1:], strict=True)
        ]
        for work in works:
            work.wait(_TIMEOUT)
        for work in [backend.send([byte], index(s), verdict) for s in ranks[1:]]:
            work.wait(_TIMEOUT)
    else:
        answer = torch.empty(1, dtype=torch.uint8)
        waiting = backend.recv([answer], index(ranks[0]), verdict)
        backend.send([byte], index(ranks[0]), head).wait(_TIMEOUT)
        waiting.wait(_TIMEOUT)
    yield []


def sweep(sizes_kib: list[int], repeats: int) -> dict[str, Any]:
    """Runs on every rank: per record size, ms per call on the link and through segments."""
    import torch.distributed as dist

    from dist_workspace import get_tensors_parallel, protocol

    torch.set_num_threads(1)
    rank = dist.get_rank()
    ranks = list(range(dist.get_world_size()))
    limits = {"link": 1 << 40, "segment": 0}
    results: dict[str, Any] = {}
    for kib in sizes_kib:
        size = kib * 1024
        calls = max(10, min(200, (256 << 20) // size))
        tensor = torch.full((size // 4,), float(rank))
        best: dict[str, float] = {}
        for _ in range(repeats):
            for route, limit in limits.items():
                protocol.LINK_MAX_BYTES = limit
                dist.barrier()
                began = time.perf_counter()
                for _ in range(calls):
                    with get_tensors_parallel(tensor, ranks) as values:
                        for value in values:
                            value.view(torch.uint8).max()
                spent = (time.perf_counter() - began) / calls
                best[route] = min(best.get(route, float("inf")), spent)
                dist.barrier()
        results[str(kib)] = {route: round(1e3 * ms, 4) for route, ms in best.items()}
    return results if rank == 0 else {}
