"""A healing replica's state transfer against the machine's limit for the same bytes.

Two processes on this machine, one gloo group (``dist_collectives.ft.ProcessGroupGloo``)
between them. The state is ``--transfer-gib`` GiB (1 by default) shaped like a model
and its optimizer: float32 weights of 64 MiB, bfloat16 copies, small biases and an
int64 step counter each. Per repeat, interleaved so that all three see the same load:

- ``send_state`` / ``recv_state``: the product, as the Manager calls it today: the
  receiver allocates fresh tensors, checks every checksum and rebuilds the dict.
- ``recv_state(..., into=own)``: the product receiving in place into the receiver's
  own state of the same shapes (a restarted replica has built its model and
  optimizer before it heals): no fresh memory to map, nothing for
  ``load_state_dict`` to copy; the same checks.
- limit ``gloo``: raw ``send``/``recv`` of the same byte count on the same group, in
  messages of the product's size with the same number in flight, into a receive
  buffer already mapped, nothing checked: what gloo moves here at best.
- limit ``socket``: one loopback TCP connection, ``sendall`` / ``recv_into`` of the same
  bytes into a mapped buffer: the kernel's copy through the loopback alone.
- limit ``map``: the receiver maps fresh memory of the same size, as ``recv_state`` does
  for fresh tensors, and nothing else: what receiving into fresh tensors pays on top.

Time: the receiver's, from a barrier to its last byte (for the product: until
``recv_state`` returned the state). The median over repeats, and the median of the
per-repeat ratios product / limit (the load drifts between repeats).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time
from datetime import timedelta
from typing import Any

import torch

from _lib.processes import collect, reap

MIB = 1 << 20
KINDS = ("gloo", "fresh", "in place", "socket", "map")  # interleaved in this order
PRODUCT = ("fresh", "in place")
WEIGHT_BYTES = 64 * MIB


def make_state(total_bytes: int) -> dict[str, Any]:
    """A model-and-optimizer-shaped state of about ``total_bytes`` (never less)."""
    # Per layer: a float32 weight, its bfloat16 copy (half the size), a bias, a counter.
    layer_bytes = WEIGHT_BYTES + WEIGHT_BYTES // 2
    layers = max(1, -(-total_bytes // layer_bytes))
    generator = torch.Generator().manual_seed(0)
    model = {}
    optimizer = {}
    for index in range(layers):
        weight = torch.randn(WEIGHT_BYTES // 4, generator=generator)
        model[f"layers.{index}.weight"] = weight
        model[f"layers.{index}.bias"] = torch.randn(4096, generator=generator)
        optimizer[index] = {
            "step": torch.tensor(float(index)),
            "master": weight.to(torch.bfloat16),
            "count": torch.tensor([index], dtype=torch.int64),
        }
    return {"model": model, "optimizer": {"state": optimizer, "lr": 0.01}}


def tensors_of(state: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) state."""
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for value in state.values() for t in tensors_of(value)]
    return []


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state."""
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def _barrier(store: Any, name: str) -> None:
    if store.add(f"xfer/{name}", 1) == 2:
        store.set(f"xfer/{name}/done", "1")
    store.wait([f"xfer/{name}/done"], timedelta(seconds=300))


def _raw_gloo(pg: Any, rank: int, buffer: torch.Tensor) -> None:
    from dist_collectives.ft import state_transfer

    chunk, window = state_transfer.CHUNK_BYTES, state_transfer.WINDOW
    works: list[Any] = []
    for index, start in enumerate(range(0, buffer.numel(), chunk)):
        part = buffer[start : start + chunk]
        works.append(pg.send([part], 1, index) if rank == 0 else pg.recv([part], 0, index))
        if len(works) >= window:
            works.pop(0).wait()
    for work in works:
        work.wait()


def _raw_socket(conn: socket.socket, rank: int, buffer: torch.Tensor) -> None:
    view = memoryview(buffer.numpy()).cast("B")
    if rank == 0:
        conn.sendall(view)
        return
    received = 0
    while received < len(view):
        got = conn.recv_into(view[received:])
        if got == 0:
            raise ConnectionError("the sender closed the connection early")
        received += got


def _map_fresh(nbytes: int) -> None:
    """Maps fresh memory of ``nbytes`` as ``recv_state`` does for fresh tensors, then frees it."""
    from dist_collectives.ft import host_pages

    fresh = torch.empty(nbytes, dtype=torch.uint8)
    host_pages.prefer_huge_pages(fresh)
    if not host_pages.populate(fresh):
        fresh.zero_()  # where the kernel does not map ahead, the first write does


def _worker(rank: int, port: int, total_bytes: int, repeats: int, queue: Any) -> None:
    import logging

    import torch.distributed as dist

    from dist_collectives.ft import ProcessGroupGloo
    from dist_collectives.ft.state_transfer import recv_state, send_state

    torch.set_num_threads(1)
    logging.getLogger("dist_collectives.ft").setLevel(logging.WARNING)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=300))
    pg.configure(f"127.0.0.1:{port}/xfer/pg", rank, 2)
    state = make_state(total_bytes) if rank == 0 else None
    nbytes = state_bytes(state) if state is not None else int(store.get("xfer/bytes"))
    if rank == 0:
        store.set("xfer/bytes", str(nbytes))
    buffer = torch.ones(nbytes, dtype=torch.uint8)  # mapped on both sides
    if rank == 0:
        listener = socket.create_server(("127.0.0.1", 0))
        store.set("xfer/socket", str(listener.getsockname()[1]))
        conn, _ = listener.accept()
        listener.close()
    else:
        conn = socket.create_connection(("127.0.0.1", int(store.get("xfer/socket"))))
    own = None
    if rank == 1:  # the receiver's own state, built (and its memory mapped) before it heals
        own = make_state(total_bytes)
        for tensor in tensors_of(own):
            tensor.zero_()
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for repeat in range(repeats + 1):  # the first repeat warms up and is not counted
        for kind in KINDS:
            _barrier(store, f"{kind}/{repeat}")
            started = time.perf_counter()
            received = None
            if kind == "gloo":
                _raw_gloo(pg, rank, buffer)
            elif kind == "socket":
                _raw_socket(conn, rank, buffer)
            elif kind == "map":
                if rank == 1:
                    _map_fresh(nbytes)
            elif rank == 0:
                send_state(pg, state, 7, 1)
            else:
                received, step = recv_state(pg, 0, into=own if kind == "in place" else None)
            if repeat > 0:
                times[kind].append(time.perf_counter() - started)
            if received is not None:  # a spot check; the checksums covered every byte
                weight = received["model"]["layers.0.weight"]
                assert step == 7 and float(weight[1]) != 0.0, (step, float(weight[1]))
                del received
    conn.close()
    pg.shutdown()
    if rank == 1:
        queue.put({"bytes": nbytes, "times": times})


def measure(port: int, total_bytes: int, repeats: int) -> dict[str, Any]:
    """Runs both processes; returns the rates, their medians and the ratios."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [
        context.Process(target=_worker, args=(rank, port, total_bytes, repeats, queue))
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        (result,) = collect(queue, procs, 1, 120 + 60 * repeats)
    finally:
        reap(procs, 60)
    nbytes, times = result["bytes"], result["times"]
    rates = {kind: [nbytes / t / 1e9 for t in values] for kind, values in times.items()}

    def ratio(kind: str, limit: str) -> float:
        pairs = zip(rates[kind], rates[limit], strict=True)
        return round(statistics.median(p / q for p, q in pairs), 3)

    return {
        "state_bytes": nbytes,
        "repeats": repeats,
        "gbps": {kind: round(statistics.median(values), 3) for kind, values in rates.items()},
        "gbps_all": {kind: [round(v, 3) for v in values] for kind, values in rates.items()},
        "ratio_to_gloo": {kind: ratio(kind, "gloo") for kind in PRODUCT},
        "ratio_to_socket": {kind: ratio(kind, "socket") for kind in PRODUCT},
    }
