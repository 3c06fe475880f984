"""dist_collectives.ft against torchft 0.2.0: reconfiguration time and per-step overhead.

Four real processes on this machine share one TCPStore hosted by this script.

1. ``ProcessGroupGloo.configure`` on a new prefix with 4 ranks, and with 3 survivors
   after one rank leaves: ours and torchft's, in the same processes, interleaved.
2. Per-step time of a small model whose gradients are averaged by a plain gloo group,
   and by a :class:`dist_collectives.ft.Manager` (quorum, allreduce, commit vote), in
   many short alternating blocks so that both see the same load from other jobs (with
   4 processes on 2 cores the step time drifts by 20 % within seconds). The first step
   of a block is not counted: it pays for the skew the other kind left between ranks.

Prints the medians and the ratios with the targets (reconfigure <= 0.25x torchft's,
managed overhead <= 10 %), and the commit vote's own cost per step: the time spent in
``should_commit()`` once the step's allreduces are done (one ``add`` on the store, the
last voter's ``compare_set``, and the wait for the decision, which also holds the
ranks' skew). Without torchft installed it measures ours alone and says so.
The measurements also go to ``docs/_data/bench/ft.json`` (``--json``), which the docs
draw as a figure.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from datetime import timedelta
from importlib.metadata import version
from typing import Any

WORLD = 4
REPEATS = 15
WARMUP_STEPS = 5
BLOCKS = 30
BLOCK_STEPS = 6


def _barrier(store: Any, name: str, count: int) -> None:
    if store.add(f"barrier/{name}", 1) == count:
        store.set(f"barrier/{name}/done", "1")
    store.wait([f"barrier/{name}/done"], timedelta(seconds=120))


def _reconfigure_times(
    make_pg: Any, configure: Any, rank: int, world: int, tag: str, store: Any, port: int
) -> list[float]:
    import torch
    import torch.distributed as dist

    pg = make_pg()
    configure(pg, f"127.0.0.1:{port}/{tag}/warm", rank, world)
    times = []
    for i in range(REPEATS):
        _barrier(store, f"{tag}/{i}", world)
        started = time.perf_counter()
        configure(pg, f"127.0.0.1:{port}/{tag}/{i}", rank, world)
        times.append(time.perf_counter() - started)
        check = torch.ones(1)
        pg.allreduce([check], dist.AllreduceOptions()).wait()
        assert float(check) == world, f"{tag}: allreduce gave {float(check)}"
    return times


def _train_steps(rank: int, port: int, store: Any) -> dict[str, list[float]]:
    """Plain and managed steps in short alternating blocks, so both see the same load."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from dist_collectives.ft import Manager, ProcessGroupGloo

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    plain_pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
    plain_pg.configure(f"127.0.0.1:{port}/plain", rank, WORLD)
    manager = Manager(
        ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=model.load_state_dict,
        state_dict=model.state_dict,
        min_replica_size=WORLD,
        replica_id=f"bench{rank}",
        store_addr="127.0.0.1",
        store_port=port,
        timeout=timedelta(seconds=60),
        namespace="bench-managed",
    )
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))

    def plain_step() -> None:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        works = [plain_pg.allreduce([g], dist.AllreduceOptions()) for g in grads]
        for work, grad in zip(works, grads, strict=True):
            work.wait()
            grad.div_(WORLD)
        optimizer.step()

    times: dict[str, list[float]] = {"plain": [], "managed": [], "vote": []}

    def managed_step() -> None:
        manager.start_quorum()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for future in [manager.allreduce(g) for g in grads]:
            future.wait()
        voting = time.perf_counter()
        committed = manager.should_commit()
        times["vote"].append(time.perf_counter() - voting)
        if committed:
            optimizer.step()

    _barrier(store, "train/start", WORLD)
    for _ in range(WARMUP_STEPS):
        plain_step()
        managed_step()
    times["vote"].clear()
    for _ in range(BLOCKS):
        for kind, step in (("plain", plain_step), ("managed", managed_step)):
            for i in range(BLOCK_STEPS):
                started = time.perf_counter()
                step()
                if i > 0:
                    times[kind].append(time.perf_counter() - started)
                elif kind == "managed":
                    times["vote"].pop()  # the block's first step is not counted
    manager.shutdown()
    plain_pg.shutdown()
    _barrier(store, "train/end", WORLD)
    return times


def _worker(rank: int, port: int, queue: Any, with_torchft: bool) -> None:
    import torch
    import torch.distributed as dist

    from dist_collectives.ft import ProcessGroupGloo

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    ours_make = lambda: ProcessGroupGloo(timeout=timedelta(seconds=30))  # noqa: E731
    ours_configure = lambda pg, addr, r, w: pg.configure(addr, r, w)  # noqa: E731
    results: dict[str, list[float]] = {}
    if with_torchft:
        from torchft.process_group import ProcessGroupGloo as TorchftGloo

        tf_make = lambda: TorchftGloo(timeout=timedelta(seconds=30))  # noqa: E731
        tf_configure = lambda pg, addr, r, w: pg.configure(addr, f"replica{r}", r, w)  # noqa: E731
    for world in (WORLD, WORLD - 1):
        if rank < world:
            results[f"ours/{world}"] = _reconfigure_times(
                ours_make, ours_configure, rank, world, f"ours{world}", store, port
            )
            if with_torchft:
                results[f"torchft/{world}"] = _reconfigure_times(
                    tf_make, tf_configure, rank, world, f"torchft{world}", store, port
                )
        _barrier(store, f"phase-{world}", WORLD)
    results.update(_train_steps(rank, port, store))
    queue.put((rank, results))


def main() -> None:
    import torch.distributed as dist
    from _lib.results import add_json_argument, write_results

    from dist_core.ports import get_unused_port

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_json_argument(parser, "ft")
    args = parser.parse_args()

    try:
        import torchft  # noqa: F401

        with_torchft = True
    except ImportError:
        with_torchft = False
    port = get_unused_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [
        context.Process(target=_worker, args=(r, port, queue, with_torchft)) for r in range(WORLD)
    ]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join(60)
    del store

    def slowest_median(key: str) -> float:
        """Median over repeats of the slowest rank: a reconfiguration is done when all are."""
        per_rank = [results[r][key] for r in results if key in results[r]]
        return statistics.median(max(values) for values in zip(*per_rank, strict=True))

    print(f"dist_collectives.ft benchmark: {WORLD} processes, {mp.cpu_count()} CPU cores")
    print(f"{'measurement':<44}{'ours':>10}{'torchft 0.2.0':>15}{'ratio':>9}  target")
    reconfigure = []
    for world in (WORLD, WORLD - 1):
        label = (
            f"gloo configure, {world} ranks, new prefix"
            if world == WORLD
            else f"gloo configure, {world} survivors"
        )
        ours = slowest_median(f"ours/{world}") * 1000
        theirs = slowest_median(f"torchft/{world}") * 1000 if with_torchft else None
        reconfigure.append(
            {
                "ranks": world,
                "case": "new prefix" if world == WORLD else "survivors after one left",
                "ours_ms": round(ours, 3),
                "torchft_ms": None if theirs is None else round(theirs, 3),
            }
        )
        if theirs is not None:
            print(f"{label:<44}{ours:>8.2f}ms{theirs:>13.2f}ms{ours / theirs:>8.2f}x  <= 0.25x")
        else:
            print(f"{label:<44}{ours:>8.2f}ms{'n/a':>15}{'n/a':>9}  (torchft not installed)")
    plain = statistics.median(statistics.median(results[r]["plain"]) for r in results) * 1000
    managed = statistics.median(statistics.median(results[r]["managed"]) for r in results) * 1000
    print(f"{'step, plain gloo allreduce (small MLP)':<44}{plain:>8.2f}ms")
    vote = statistics.median(statistics.median(results[r]["vote"]) for r in results) * 1000
    print(
        f"{'step, Manager (quorum+allreduce+commit)':<44}{managed:>8.2f}ms"
        f"{'':>15}{managed / plain:>8.2f}x  overhead {100 * (managed / plain - 1):.0f}%"
        " (target <= 10%)"
    )
    print(
        f"{'  of which the commit vote (should_commit)':<44}{vote:>8.2f}ms"
        f"{'':>15}{'':>9}  {100 * vote / managed:.0f}% of the managed step"
    )
    sys.stdout.flush()
    write_results(
        args.json,
        "ft",
        {
            "torchft": version("torchft") if with_torchft else None,
            "reconfigure": reconfigure,
            "step_ms": {"plain gloo": round(plain, 3), "Manager": round(managed, 3)},
            "vote_ms": round(vote, 3),
            "targets": {"reconfigure_ratio": 0.25, "step_ratio": 1.10},
        },
    )


if __name__ == "__main__":
    main()
