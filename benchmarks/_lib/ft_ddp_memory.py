"""Peak memory and time of a DDP step: torch's DDP on plain gloo, and through a Manager.

The same MLP and batch as the large model of the step benchmark, ``WORLD`` processes
per kind; each kind runs in processes of its own, one kind after the other, so that a
process's peak is that kind's alone:

- ``plain``: ``torch.nn.parallel.DistributedDataParallel`` on a gloo group;
- ``managed``: ``dist_collectives.ft.DistributedDataParallel`` through a ``Manager``
  (quorum, the comm hook's allreduce, commit vote).

Memory: each process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` where Linux allows it, else ``ru_maxrss``) over the steps,
less its resident set once the model, optimizer, batch (and for ``managed`` the
Manager) exist, before DDP wraps the model. That covers what a step adds: DDP's
buckets, the gradients, activations, and the exchange's copies of the gradients.
The median over ranks; the gradients' own size is printed beside it. Time: the
median step, after ``WARMUP`` steps, per rank, then the median over ranks. The kinds
do not alternate here (a process has one peak), so their times see different load;
the paired comparison with its 1.05x target is the step benchmark's.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from _lib.processes import collect, reap

WARMUP = 3
KINDS = ("plain", "managed")


def _status_kib(field: str) -> int | None:
    """A ``VmRSS``/``VmHWM``-like field of /proc/self/status in KiB (None elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_peak() -> bool:
    """Resets this process's peak resident set to its current one (Linux 4.0+)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _peak_kib(reset: bool) -> int:
    peak = _status_kib("VmHWM") if reset else None
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _worker(
    kind: str, rank: int, world: int, port: int, shape: Any, steps: int, queue: Any
) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    width, batch = shape
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
    manager: Any = None
    if kind == "plain":
        prefixed = dist.PrefixStore("ddp-memory/plain", store)
        dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world)
    else:
        from dist_collectives.ft import Manager, ProcessGroupGloo

        manager = Manager(
            ProcessGroupGloo(timeout=timedelta(seconds=60)),
            load_state_dict=model.load_state_dict,
            state_dict=model.state_dict,
            min_replica_size=world,
            replica_id=f"ddp-memory-{rank}",
            store_addr="127.0.0.1",
            store_port=port,
            timeout=timedelta(seconds=60),
            namespace="ddp-memory-managed",
        )
    baseline = _status_kib("VmRSS") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reset = _reset_peak()
    if kind == "plain":
        ddp: nn.Module = nn.parallel.DistributedDataParallel(model)
    else:
        from dist_collectives.ft import DistributedDataParallel

        ddp = DistributedDataParallel(manager, model)
    times = []
    for step in range(WARMUP + steps):
        started = time.perf_counter()
        if manager is not None:
            manager.start_quorum()
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        if manager is None or manager.should_commit():
            optimizer.step()
        if step >= WARMUP:
            times.append(time.perf_counter() - started)
    peak = _peak_kib(reset)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    queue.put(
        {
            "rank": rank,
            "peak_above_kib": peak - baseline,
            "step_s": statistics.median(times),
            "grad_bytes": grad_bytes,
            "peak_source": "VmHWM" if reset else "ru_maxrss",
        }
    )
    if manager is not None:
        manager.shutdown()
    else:
        dist.destroy_process_group()


def _run(kind: str, world: int, port: int, shape: Any, steps: int) -> list[dict[str, Any]]:
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [
        context.Process(target=_worker, args=(kind, rank, world, port, shape, steps, queue))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    try:
        return collect(queue, procs, world, 300)
    finally:
        reap(procs, 60)


def measure(port: int, world: int, shape: tuple[int, int], steps: int) -> dict[str, Any]:
    """Each kind's median peak above its model (MiB) and median step (ms)."""
    result: dict[str, Any] = {"width": shape[0], "batch": shape[1], "processes": world}
    for kind in KINDS:
        reports = _run(kind, world, port, shape, steps)
        result[kind] = {
            "peak_above_model_mib": round(
                statistics.median(r["peak_above_kib"] for r in reports) / 1024, 2
            ),
            "step_ms": round(statistics.median(r["step_s"] for r in reports) * 1000, 3),
        }
        result["grad_mib"] = round(reports[0]["grad_bytes"] / 2**20, 2)
        result["peak_source"] = reports[0]["peak_source"]
    return result
