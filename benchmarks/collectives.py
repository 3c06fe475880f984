"""all_to_all / all_to_all_v against raw torch.distributed.all_to_all_single (gloo, 4 ranks).

Run: ``python benchmarks/collectives.py`` (``nox -s bench -- collectives``). Prints, for
1 KiB, 1 MiB and 64 MiB per rank, the median time per exchange of each method and its
ratio to the raw torch call that it wraps, plus a local memcpy of the same bytes as
the machine's floor. Every call is timed on its own, the methods interleaved in a new
order each iteration, so that load from other processes on the machine falls on all of
them alike; a ratio is the median of per-iteration ratios (each call over its peer's
call of the same iteration), averaged over the ranks. The calling thread's CPU time
per call is printed too: it is the wrappers' own cost, much less sensitive to other
processes' load than wall time on a small machine.

Methods:
  raw                    all_to_all_single into a freshly allocated output (what a
                         caller writes by hand; the peer the target is measured against)
  raw (again)            the same as raw: an A/A control whose ratio shows how much
                         of a difference the machine's noise alone makes
  raw (prealloc)         all_to_all_single into an output allocated once (the floor of
                         the torch call itself)
  all_to_all             dist_collectives.all_to_all, input not requiring grad
  all_to_all (autograd)  the same with an input that requires grad (graph recorded)
  raw v                  all_to_all_single with explicit split sizes (uneven)
  all_to_all_v           dist_collectives.all_to_all_v with both split sizes given
  all_to_all_v (exch.)   output sizes exchanged by all_to_all_v (one extra tiny exchange)

Target: at 1 MiB and above, all_to_all within 5% of raw and all_to_all_v (sizes given)
within 5% of raw v. The ratios also go to ``docs/_data/bench/collectives.json``
(``--json``), which the docs draw as a figure.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from dist_collectives import all_to_all, all_to_all_v
from dist_core.testing import run_ranks

WORLD = 4
SIZES = {"1 KiB": 1 << 10, "1 MiB": 1 << 20, "64 MiB": 64 << 20}
# Timed calls per method, by size: enough for a stable median on a loaded 2-core
# machine, few enough that the whole run takes about a minute there.
PLAN = {"1 KiB": 400, "1 MiB": 600, "64 MiB": 20}
# Each method's ratio is taken to the raw torch call it wraps.
PEERS = {
    "raw": "raw",
    "raw (again)": "raw",
    "raw (prealloc)": "raw",
    "all_to_all": "raw",
    "all_to_all (autograd)": "raw",
    "raw v": "raw v",
    "all_to_all_v": "raw v",
    "all_to_all_v (exch.)": "raw v",
}


def _uneven_splits(elements: int, world: int, rank: int) -> list[int]:
    """Splits of ``elements`` that differ per destination (and per rank), summing right."""
    weights = [1 + (rank + dst) % world for dst in range(world)]
    splits = [elements * w // sum(weights) for w in weights]
    splits[-1] += elements - sum(splits)
    return splits


def _time_local(fn: Callable[[], object], repeats: int) -> float:
    """Per-call time of a local operation (no barrier inside), slowest rank's."""
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    elapsed = torch.tensor([(time.perf_counter() - start) / repeats], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def _bench_size(nbytes: int, iterations: int) -> dict[str, float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    elements = nbytes // 4
    elements -= elements % world
    data = torch.randn(elements)
    grad_data = data.clone().requires_grad_()
    prealloc = torch.empty_like(data)
    copy_target = torch.empty_like(data)
    send = _uneven_splits(elements, world, rank)
    receive_sizes = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(receive_sizes, torch.tensor(send, dtype=torch.int64))
    receive = [int(v) for v in receive_sizes.tolist()]

    def raw() -> object:
        out = torch.empty_like(data)
        dist.all_to_all_single(out, data)
        return out

    def raw_again() -> object:
        out = torch.empty_like(data)
        dist.all_to_all_single(out, data)
        return out

    def raw_v() -> object:
        out = data.new_empty(sum(receive))
        dist.all_to_all_single(out, data, receive, send)
        return out

    methods: dict[str, Callable[[], object]] = {
        "raw": raw,
        "raw (again)": raw_again,
        "raw (prealloc)": lambda: dist.all_to_all_single(prealloc, data),
        "all_to_all": lambda: all_to_all(data),
        "all_to_all (autograd)": lambda: all_to_all(grad_data),
        "raw v": raw_v,
        "all_to_all_v": lambda: all_to_all_v(data, receive, send),
        "all_to_all_v (exch.)": lambda: all_to_all_v(data, None, send),
    }
    for fn in methods.values():  # warm-up: connections, allocator
        fn()
    samples: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    dist.barrier()
    for iteration in range(iterations):
        # Every call timed on its own, in a new order each iteration (the same on every
        # rank): load from other processes and any order effect fall on all methods.
        random.Random(iteration).shuffle(names)
        for name in names:
            cpu_start = time.thread_time()
            start = time.perf_counter()
            methods[name]()
            samples[name].append(time.perf_counter() - start)
            cpu[name].append(time.thread_time() - cpu_start)
    result = {name: statistics.median(times) for name, times in samples.items()}
    result.update({f"cpu:{name}": statistics.median(times) for name, times in cpu.items()})
    # Paired ratios: each call over its peer's call of the same iteration.
    for name, peer in PEERS.items():
        ratios = [a / b for a, b in zip(samples[name], samples[peer], strict=True)]
        result[f"ratio:{name}"] = statistics.median(ratios)
    result["memcpy (floor)"] = _time_local(lambda: copy_target.copy_(data), iterations)
    return result


def bench_rank(sizes: dict[str, int], plan: dict[str, int]) -> dict[str, dict[str, float]]:
    # Four ranks share the machine's cores: one intra-op thread each, or the memcpy
    # floor measures OpenMP threads waiting for a core rather than memory bandwidth.
    torch.set_num_threads(1)
    return {label: _bench_size(nbytes, plan[label]) for label, nbytes in sizes.items()}


def _format(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:8.1f} us"
    return f"{seconds * 1e3:8.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (smoke test)")
    from _lib.results import add_json_argument, write_results

    add_json_argument(parser, "collectives")
    args = parser.parse_args()
    plan = {label: max(3, n // 10) for label, n in PLAN.items()} if args.quick else PLAN
    print(
        f"dist_collectives.all_to_all vs torch.distributed.all_to_all_single, gloo, "
        f"{WORLD} ranks of 1 intra-op thread each, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs"
    )
    per_rank = run_ranks(bench_rank, WORLD, SIZES, plan, timeout=600)
    table = {
        label: {key: statistics.fmean(r[label][key] for r in per_rank) for key in row}
        for label, row in per_rank[0].items()
    }
    verdicts = []
    for label, row in table.items():
        print(
            f"\n{label} per rank: median wall time per exchange, median of per-iteration "
            "ratios, and the calling thread's CPU time per call (the wrapper's own cost: "
            "gloo moves the bytes on its own threads)"
        )
        for name, peer in PEERS.items():
            print(
                f"  {name:24s} {_format(row[name])}   x{row['ratio:' + name]:5.3f} of "
                f"{peer:5s}   cpu {_format(row['cpu:' + name])}"
            )
        floor = row["memcpy (floor)"]
        print(f"  {'memcpy (floor)':24s} {_format(floor)}   x{floor / row['raw']:5.3f} of raw")
        if SIZES[label] >= 1 << 20:
            for name in ("all_to_all", "all_to_all_v"):
                ratio = row["ratio:" + name]
                verdicts.append(
                    f"{label:>6} {name:13s} x{ratio:5.3f} of {PEERS[name]:5s} "
                    f"{'within' if ratio <= 1.05 else 'OVER'} the 5% target"
                )
    print("\nTarget (<= 5% slower at >= 1 MiB):")
    for line in verdicts:
        print(f"  {line}")
    write_results(
        args.json,
        "collectives",
        {
            "ranks": WORLD,
            "sizes": list(table),
            "ratio": {
                name: [round(row["ratio:" + name], 4) for row in table.values()]
                for name in ("all_to_all", "all_to_all_v", "raw (again)")
            },
            "targets": {"ratio_from_1_mib": 1.05},
        },
    )


if __name__ == "__main__":
    main()
