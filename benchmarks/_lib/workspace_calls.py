"""The cost of a call: the exchanges a real export makes, many small ones, on 4 ranks.

Model Optimizer's TensorRT-LLM export merges tensor-parallel shards with about seven
``get_tensors_parallel`` calls per linear layer, each with one shard per rank, for
every layer: what it waits for is the cost of a call. Workloads, all in one run:

- ``layer loop``: 80 layers x 7 calls, a 0.5 MiB float32 shard per rank.
- ``tiny``: 1000 calls of 4 KiB per rank.
- ``configs``: 80 ``get_configs_parallel`` calls of a small layer config (a dozen
  fields and one 512-byte tensor).

Methods, interleaved (one full workload each, repeat after repeat; the fastest kept):

- ``dist-workspace``: ``get_tensors_parallel`` / ``get_configs_parallel``.
- ``dist.gather``: torch's gather on gloo into fresh tensors (the floor: what moving the
  same bytes between these processes costs without any of the guarantees), and
  ``gather_object`` for configs (pickle: what a user would reach for).
- ``link handshake`` (a limit) and ``gloo handshake``: see ``_lib/workspace_link.py``.
- ``Model Optimizer``: its own ``modelopt.torch.export.distribute.get_tensors_parallel``,
  when ``nvidia-modelopt`` is installed (it is not a requirement of the benchmark; the
  run says when it is missing). Not for configs: its ``get_configs_parallel`` takes its
  own config classes only.

Rank 0's time from a barrier to the end of the loop, divided by the calls; ``+read``
adds one pass over every value it received (a mapping fills its page tables then).
The store round trips per call (every operation that waits for the server's reply:
not ``set``) are counted on every rank, all ranks together, through a counting
wrapper around the default store, for dist-workspace's calls. Each rank runs one
intra-op thread, as under torchrun (``OMP_NUM_THREADS=1``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

KIB = 1024
MIB = 1024 * KIB
WORLD = 4

# name: (calls, bytes per rank per call, what is sent)
WORKLOADS: dict[str, tuple[int, int, str]] = {
    "layer loop": (80 * 7, MIB // 2, "tensor"),
    "tiny": (1000, 4 * KIB, "tensor"),
    "configs": (80, 0, "config"),
}


# Not round trips: a TCPStore set goes out without waiting for the server's reply, and
# a timeout is a setting of this client.
_NOT_ROUND_TRIPS = frozenset({"set", "set_timeout", "timeout"})


METHODS = (
    "dist-workspace",
    "dist.gather",
    "link handshake",
    "gloo handshake",
    "Model Optimizer",
)


class _CountingStore:
    """Forwards every call to a store and counts it (clones count into the same tally)."""

    def __init__(self, store: Any, tally: list[int]) -> None:
        self._store = store
        self._tally = tally

    def clone(self) -> _CountingStore:
        return _CountingStore(self._store.clone(), self._tally)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._store, name)
        if not callable(attribute) or name in _NOT_ROUND_TRIPS:
            return attribute

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._tally[0] += 1
            return attribute(*args, **kwargs)

        return counted


def _layer_config(layer: int, rank: int) -> dict[str, Any]:
    return {
        "name": f"model.layers.{layer}.mlp",
        "rank": rank,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "activation": "silu",
        "tp_rank": rank,
        "quantization": {"algo": "fp8", "block": [128, 128], "kv_cache": None},
        # Model Optimizer's configs carry tensors (and its shared-memory path fails on
        # a config with none: its buffer is sized for the weights' bytes only).
        "weights_scaling_factor": torch.full((128,), float(rank)),
    }


def _modelopt() -> Any | None:
    try:
        from modelopt.torch.export import distribute  # type: ignore[import-not-found]
    except Exception:  # any failure to import means: not comparable here
        return None
    return distribute


def _modelopt_version() -> str | None:
    """The installed nvidia-modelopt's version, when its export helpers import."""
    from importlib.metadata import version

    return None if _modelopt() is None else version("nvidia-modelopt")


@contextlib.contextmanager
def _gather(tensor: torch.Tensor, ranks: list[int]) -> Iterator[list[torch.Tensor]]:
    import torch.distributed as dist

    if dist.get_rank() == ranks[0]:
        buffers = [torch.empty_like(tensor) for _ in ranks]
        dist.gather(tensor, buffers, dst=ranks[0])
        yield buffers
    else:
        dist.gather(tensor, None, dst=ranks[0])
        yield []


@contextlib.contextmanager
def _gather_object(config: Any, ranks: list[int]) -> Iterator[list[Any]]:
    import torch.distributed as dist

    if dist.get_rank() == ranks[0]:
        objects: list[Any] = [None] * len(ranks)
        dist.gather_object(config, objects, dst=ranks[0])
        yield objects
    else:
        dist.gather_object(config, None, dst=ranks[0])
        yield []


def _calls_of(method: str, kind: str) -> Callable[..., Any] | None:
    """The context manager ``method`` offers for ``kind`` (None: it has none)."""
    from dist_workspace import get_configs_parallel, get_tensors_parallel

    if method == "dist-workspace":
        if kind == "tensor":
            return get_tensors_parallel
        return lambda config, ranks: get_configs_parallel(config, ranks, None)
    if method == "dist.gather":
        return _gather if kind == "tensor" else _gather_object
    if method in ("link handshake", "gloo handshake"):
        from _lib import workspace_link

        if method == "gloo handshake":
            return workspace_link.gloo_handshake
        return workspace_link.link_handshake
    distribute = _modelopt()
    if distribute is None or kind != "tensor":
        # Its get_configs_parallel takes its own config classes only (LinearConfig, ...):
        # a dict raises NotImplementedError on the receiver, and the senders then wait
        # at its barrier for ever.
        return None
    return distribute.get_tensors_parallel  # type: ignore[no-any-return]


def _read(values: list[Any]) -> None:
    for value in values:
        if isinstance(value, torch.Tensor):
            value.view(torch.uint8).max()


def _one_workload(workload: str, method: str, tally: list[int]) -> dict[str, float] | None:
    import torch.distributed as dist

    calls, size, kind = WORKLOADS[workload]
    call = _calls_of(method, kind)
    if call is None:
        return None
    rank = dist.get_rank()
    ranks = list(range(WORLD))
    tensor = torch.full((size // 4,), float(rank))
    spent = 0.0
    counted_before = tally[0]
    dist.barrier()
    began = time.perf_counter()
    for index in range(calls):
        value: Any = tensor if kind == "tensor" else _layer_config(index, rank)
        entered = time.perf_counter()
        with call(value, ranks) as values:
            got = time.perf_counter()
            _read(values)
            done_reading = time.perf_counter()
            if values and kind == "tensor" and float(values[-1][-1]) != float(WORLD - 1):
                raise AssertionError(f"{method}: wrong data in call {index}")
        spent += got - entered + time.perf_counter() - done_reading
    total = time.perf_counter() - began
    round_trips = tally[0] - counted_before
    dist.barrier()
    return {
        "call_ms": 1e3 * spent / calls,
        "with_read_ms": 1e3 * total / calls,
        "round_trips": round_trips / calls,
    }


def measure(repeats: int) -> dict[str, Any]:
    """Runs on every rank (``run_ranks``): every workload and method; rank 0's results."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    # One intra-op thread per rank, as under torchrun (OMP_NUM_THREADS=1): 4 ranks with
    # a thread per core each on 2 cores made every read of a value wait on the others.
    torch.set_num_threads(1)
    tally = [0]
    counting = _CountingStore(c10d._get_default_store(), tally)
    original = c10d._get_default_store
    results: dict[str, Any] = {}
    gathered_round_trips: dict[str, float] = {}
    for workload in WORKLOADS:
        best: dict[str, dict[str, float]] = {}
        for _ in range(repeats):
            for method in METHODS:
                c10d._get_default_store = lambda: counting  # type: ignore[assignment]
                try:
                    measured = _one_workload(workload, method, tally)
                finally:
                    c10d._get_default_store = original
                if measured is None:
                    continue
                kept = best.get(method)
                if kept is None or measured["with_read_ms"] < kept["with_read_ms"]:
                    best[method] = measured
        # Round trips: every rank's own count, summed (rank 0's and the senders' differ).
        mine = torch.tensor([best["dist-workspace"]["round_trips"]], dtype=torch.float64)
        dist.all_reduce(mine)
        gathered_round_trips[workload] = float(mine.item())
        results[workload] = best
    if dist.get_rank() != 0:
        return {}
    for workload, per_method in results.items():
        per_method["dist-workspace"]["round_trips_all_ranks"] = gathered_round_trips[workload]
    return results


def report(results: dict[str, Any]) -> dict[str, Any]:
    """Prints the table and the ratios; returns what goes into the JSON file."""
    print()
    print(f"the cost of a call ({WORLD} ranks, one host, gloo; ms per call on rank 0)")
    modelopt_version = _modelopt_version()
    if modelopt_version is not None:
        print(f"Model Optimizer: nvidia-modelopt {modelopt_version}")
    header = (
        f"{'workload':<12}{'method':<19}{'call ms':>9}{'+read ms':>10}{'x floor':>9}"
        f"{'store trips/call':>18}"
    )
    print(header)
    print("-" * len(header))
    data: dict[str, Any] = {}
    for workload, per_method in results.items():
        calls, size, kind = WORKLOADS[workload]
        floor = per_method["dist.gather"]["with_read_ms"]
        row: dict[str, Any] = {
            "calls": calls,
            "kib_per_rank": size // KIB,
            "floor": "dist.gather" if kind == "tensor" else "gather_object",
        }
        for method in METHODS:
            item = per_method.get(method)
            label = method if method != "dist.gather" or kind == "tensor" else "gather_object"
            if item is None:
                why = (
                    "takes its own config classes only, not a dict"
                    if kind == "config" and _modelopt() is not None
                    else "not installed (pip install nvidia-modelopt)"
                )
                print(f"{workload:<12}{label:<19}{why}")
                row[method] = None
                continue
            trips = item.get("round_trips_all_ranks")
            trips_text = f"{trips:.1f}" if trips is not None else "-"
            print(
                f"{workload:<12}{label:<19}{item['call_ms']:>9.3f}{item['with_read_ms']:>10.3f}"
                f"{item['with_read_ms'] / floor:>9.2f}{trips_text:>18}"
            )
            row[method] = {
                "call_ms": round(item["call_ms"], 4),
                "with_read_ms": round(item["with_read_ms"], 4),
                "x_floor": round(item["with_read_ms"] / floor, 3),
            }
            if trips is not None:
                row[method]["store_round_trips_per_call"] = round(trips, 2)
        data[workload] = row
    print(
        "x floor: +read time over the floor's (targets: layer loop <= 1.5, tiny <= 2.0); "
        "store trips: all ranks together"
    )
    print(
        "link/gloo handshake: the two hops alone (an empty head from every sender, an empty "
        "verdict back), no data, on dist-workspace's link or over a gloo group of the ranks"
    )
    for workload, per_method in results.items():
        ours = per_method["dist-workspace"]["with_read_ms"]
        floor = per_method["dist.gather"]["with_read_ms"]
        for method in ("link handshake", "gloo handshake"):
            handshake = per_method.get(method)
            if handshake is not None:
                print(
                    f"  {workload}: dist-workspace / {method} "
                    f"{ours / handshake['with_read_ms']:.2f}, {method} / floor "
                    f"{handshake['with_read_ms'] / floor:.2f}"
                )
    return {
        "workloads": data,
        "targets": {"layer loop": 1.5, "tiny": 2.0},
        "modelopt_version": modelopt_version,
    }
