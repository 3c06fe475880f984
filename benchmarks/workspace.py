"""dist-workspace: 4 ranks send a tensor to rank 0, side by side with peers and the limit.

Methods, all in one run, for 64 MiB, 256 MiB and 1 GiB per rank (3 senders, so rank 0
receives 3x that):

- ``shm``: ``get_tensors_parallel`` through shared memory (dist-workspace).
- ``nfsworkspace``: ``NFSWorkspace`` on a local directory: senders write (atomic,
  fsynced, CRC-32), rank 0 reads and verifies (dist-workspace).
- ``gloo-gather``: ``torch.distributed.gather`` on gloo.
- ``torch.save``: the exchange Model Optimizer's NFSWorkspace does: every sender
  ``torch.save``s its value to ``rank{r}.pt``, a barrier, rank 0 ``torch.load``s them.
  Written here (modelopt is not installed).
- ``memcpy``: one process copying 3x the size between two pre-faulted buffers: the
  ceiling for moving the bytes once.

Two more limits of this machine, each as one process doing only that step, show
what the issue's targets ask of it:

- ``fresh tmpfs``: writing 3x the size into new files in /dev/shm (pwrite). Every
  exchange through new shared memory pays this: fresh pages are allocated and
  zeroed by the kernel, which on a VM may also fault them in on the host.
- ``write+fsync``: writing 3x the size to the local directory and fsyncing it. A
  durable NFSWorkspace pays this; torch.save does not fsync.

Reader memory: rank 0 resets its peak RSS (``/proc/self/clear_refs``) before each
exchange and reports ``peak RSS above the start / bytes received``.

Sizes shrink automatically (and the run says so) when /dev/shm or available memory
cannot hold about 12x the largest size. ``--sizes 64,256`` picks sizes in MiB;
``--repeats N`` repeats each measurement and keeps the fastest. The measurements also
go to ``docs/_data/bench/workspace.json`` (``--json``), which the docs draw as a figure.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

MIB = 1024 * 1024
WORLD = 4
SENDERS = WORLD - 1


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> int:
    """Resets VmHWM to the current RSS (Linux 4.0+); returns the RSS in bytes."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        pass
    return _status_kib("VmRSS") * 1024


def _peak() -> int:
    return _status_kib("VmHWM") * 1024


def _mem_available() -> int:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _tensor(size: int, rank: int) -> torch.Tensor:
    tensor = torch.empty(size // 4, dtype=torch.float32)
    tensor.fill_(float(rank))
    return tensor


def _measure(method: str, size: int, directory: str) -> dict[str, float] | None:
    """One exchange; returns rank 0's seconds, peak bytes above start and bytes received."""
    import torch.distributed as dist

    from dist_workspace import NFSWorkspace, get_tensors_parallel

    rank = dist.get_rank()
    tensor = _tensor(size, rank)
    start_rss = _reset_peak()
    dist.barrier()
    began = time.perf_counter()
    received: list[torch.Tensor] = []
    if method == "shm":
        with get_tensors_parallel(tensor, list(range(WORLD))) as tensors:
            received = tensors[1:]
    elif method in ("nfsworkspace", "nfsws-nofsync"):
        workspace = NFSWorkspace(directory, durable=method == "nfsworkspace")
        if rank:
            workspace.write_configs_and_weights({"rank": rank}, {"tensor": tensor})
        dist.barrier()
        if rank == 0:
            for peer in range(1, WORLD):
                _, weights = workspace.read_configs_and_weights_from_rank(peer)
                assert weights is not None
                received.append(weights["tensor"])
    elif method == "torch.save":
        path = Path(directory)
        if rank:
            torch.save(
                {"config": {"rank": rank}, "weights": {"tensor": tensor}}, path / f"rank{rank}.pt"
            )
        dist.barrier()
        if rank == 0:
            for peer in range(1, WORLD):
                state = torch.load(path / f"rank{peer}.pt", map_location="cpu")
                received.append(state["weights"]["tensor"])
    elif method == "gloo-gather":
        if rank == 0:
            buffers = [torch.empty_like(tensor) for _ in range(WORLD)]
            dist.gather(tensor, buffers, dst=0)
            received = buffers[1:]
        else:
            dist.gather(tensor, None, dst=0)
    else:
        raise ValueError(method)
    elapsed = time.perf_counter() - began
    peak = _peak() - start_rss
    dist.barrier()
    if rank != 0:
        return None
    for peer, value in enumerate(received, start=1):
        if value.numel() != tensor.numel() or float(value[-1]) != float(peer):
            raise AssertionError(f"{method}: wrong data from rank {peer}")
    return {"seconds": elapsed, "peak": float(peak), "bytes": float(SENDERS * size)}


def _run_all(sizes: list[int], repeats: int, methods: list[str], root: str) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for size in sizes:
        for method in methods:
            times: list[dict[str, float]] = []
            for attempt in range(repeats):
                directory = os.path.join(root, f"{method}-{size}-{attempt}")
                if rank == 0:
                    os.makedirs(directory, exist_ok=True)
                dist.barrier()
                measured = _measure(method, size, directory)
                if measured is not None:
                    times.append(measured)
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(directory, ignore_errors=True)
                gc.collect()
            if rank == 0:
                results[f"{method}/{size}"] = min(times, key=lambda item: item["seconds"])
    return results


def _memcpy_bandwidth(size: int, repeats: int) -> float:
    total = SENDERS * size
    source = torch.empty(total, dtype=torch.uint8).fill_(1)
    target = torch.empty(total, dtype=torch.uint8).fill_(0)  # pre-faulted
    best = float("inf")
    for _ in range(max(repeats, 2)):
        began = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - began)
    return total / best


def _fresh_tmpfs_bandwidth(size: int, repeats: int) -> float:
    """Bytes per second one process writes into new /dev/shm files (3x ``size``)."""
    source = memoryview(torch.ones(size, dtype=torch.uint8).numpy()).cast("B")
    best = float("inf")
    for _ in range(max(repeats, 2)):
        paths = [f"/dev/shm/dist-workspace-bench-{os.getpid()}-{i}" for i in range(SENDERS)]
        began = time.perf_counter()
        for path in paths:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            try:
                os.pwrite(fd, source, 0)
            finally:
                os.close(fd)
        best = min(best, time.perf_counter() - began)
        for path in paths:
            os.unlink(path)
    return SENDERS * size / best


def _fsync_seconds(size: int, root: str) -> float:
    """Seconds to write 3x ``size`` to files under ``root`` and fsync them."""
    source = memoryview(torch.ones(size, dtype=torch.uint8).numpy()).cast("B")
    paths = [os.path.join(root, f"fsync-floor-{i}") for i in range(SENDERS)]
    began = time.perf_counter()
    descriptors = [os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600) for path in paths]
    try:
        for fd in descriptors:
            os.pwrite(fd, source, 0)
        for fd in descriptors:  # after all writes, as three ranks would: writeback merges
            os.fsync(fd)
    finally:
        for fd in descriptors:
            os.close(fd)
    elapsed = time.perf_counter() - began
    for path in paths:
        os.unlink(path)
    return elapsed


def _choose_sizes(requested: list[int]) -> tuple[list[int], list[str]]:
    notes = []
    shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    available = _mem_available()
    chosen = []
    for size in requested:
        original = size
        # Peak: 4 source tensors, 3 segments, 3 received, page cache of 3 files, slack.
        while size > 16 * MIB and (12 * size > available or 3.3 * size > shm_free):
            size //= 2
        if size != original:
            notes.append(
                f"scaled {original // MIB} MiB down to {size // MIB} MiB: "
                f"{available / 2**30:.1f} GiB memory available, "
                f"{shm_free / 2**30:.1f} GiB free in /dev/shm"
            )
        chosen.append(size)
    return chosen, notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1024", help="MiB per rank, comma separated")
    parser.add_argument("--repeats", type=int, default=2)
    from _lib.results import add_json_argument, write_results

    add_json_argument(parser, "workspace")
    args = parser.parse_args()
    sizes, notes = _choose_sizes([int(text) * MIB for text in args.sizes.split(",")])
    methods = ["shm", "nfsworkspace", "nfsws-nofsync", "torch.save", "gloo-gather"]
    from dist_core.testing import run_ranks

    print(
        f"dist-workspace benchmark: {WORLD} ranks, {SENDERS} send to rank 0, {os.cpu_count()} CPUs"
    )
    for note in notes:
        print(f"NOTE: {note}")
    root = tempfile.mkdtemp(prefix="dist-workspace-bench-")
    try:
        results = run_ranks(_run_all, WORLD, sizes, args.repeats, methods, root, timeout=3000)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    root_for_limits = tempfile.mkdtemp(prefix="dist-workspace-bench-limits-")
    print(f"local directory: {root} (file system of {tempfile.gettempdir()})")
    header = (
        f"{'method':<14}{'MiB/rank':>9}{'seconds':>10}{'GB/s':>8}{'x memcpy':>10}{'peak/data':>11}"
    )
    print(header)
    print("-" * len(header))
    summary: dict[str, list[float]] = {
        "shm_vs_copy": [],
        "nfs_vs_save": [],
        "nofsync_vs_save": [],
        "shm_vs_fresh": [],
        "fresh_vs_copy": [],
        "save_vs_fsync": [],
        "shm_peak": [],
        "nfs_peak": [],
        "save_peak": [],
    }
    # For the docs' figure: GB/s of the pre-faulted copy, and every method and limit as
    # a fraction of it (the "x memcpy" column), per size.
    copy_gbps: list[float] = []
    x_copy: dict[str, list[float]] = {}
    for size in sizes:
        ceiling = _memcpy_bandwidth(size, args.repeats)
        copy_seconds = SENDERS * size / ceiling
        print(
            f"{'memcpy':<14}{size // MIB:>9}{copy_seconds:>10.3f}{ceiling / 1e9:>8.2f}"
            f"{1.0:>10.2f}{'-':>11}"
        )
        copy_gbps.append(round(ceiling / 1e9, 3))
        fresh = _fresh_tmpfs_bandwidth(size, args.repeats)
        x_copy.setdefault("fresh tmpfs", []).append(round(fresh / ceiling, 4))
        print(
            f"{'fresh tmpfs':<14}{size // MIB:>9}{SENDERS * size / fresh:>10.3f}"
            f"{fresh / 1e9:>8.2f}{fresh / ceiling:>10.2f}{'-':>11}"
        )
        fsync_seconds = _fsync_seconds(size, root_for_limits)
        x_copy.setdefault("write+fsync", []).append(
            round(SENDERS * size / fsync_seconds / ceiling, 4)
        )
        print(
            f"{'write+fsync':<14}{size // MIB:>9}{fsync_seconds:>10.3f}"
            f"{SENDERS * size / fsync_seconds / 1e9:>8.2f}"
            f"{SENDERS * size / fsync_seconds / ceiling:>10.2f}{'-':>11}"
        )
        for method in methods:
            item = results[f"{method}/{size}"]
            bandwidth = item["bytes"] / item["seconds"]
            x_copy.setdefault(method, []).append(round(bandwidth / ceiling, 4))
            print(
                f"{method:<14}{size // MIB:>9}{item['seconds']:>10.3f}{bandwidth / 1e9:>8.2f}"
                f"{bandwidth / ceiling:>10.2f}{item['peak'] / item['bytes']:>11.2f}"
            )
        shm = results[f"shm/{size}"]
        nfs = results[f"nfsworkspace/{size}"]
        save = results[f"torch.save/{size}"]
        summary["shm_vs_copy"].append(shm["bytes"] / shm["seconds"] / ceiling)
        summary["shm_vs_fresh"].append(shm["bytes"] / shm["seconds"] / fresh)
        summary["fresh_vs_copy"].append(fresh / ceiling)
        summary["save_vs_fsync"].append(save["seconds"] / fsync_seconds)
        summary["nfs_vs_save"].append(save["seconds"] / nfs["seconds"])
        summary["nofsync_vs_save"].append(
            save["seconds"] / results[f"nfsws-nofsync/{size}"]["seconds"]
        )
        summary["save_peak"].append(save["peak"] / save["bytes"])
        summary["shm_peak"].append(shm["peak"] / shm["bytes"])
        summary["nfs_peak"].append(nfs["peak"] / nfs["bytes"])
        print()
    print("ratios (per size, smallest to largest; targets from the issue):")
    print(f"  shm bandwidth / memcpy:              {_fmt(summary['shm_vs_copy'])}  target >= 0.50")
    print(f"  NFSWorkspace speed-up vs torch.save: {_fmt(summary['nfs_vs_save'])}  target >= 2.0")
    print(f"  same, durable=False (no fsync):      {_fmt(summary['nofsync_vs_save'])}")
    print(
        f"  limits: fresh tmpfs / memcpy:        {_fmt(summary['fresh_vs_copy'])}"
        "  (one core; an exchange into new shared memory cannot beat 2 cores of it)"
    )
    print(f"  shm bandwidth / fresh tmpfs:         {_fmt(summary['shm_vs_fresh'])}")
    print(
        f"  limits: torch.save+load / fsync:     {_fmt(summary['save_vs_fsync'])}"
        "  (the most a durable NFSWorkspace could gain over torch.save)"
    )
    print(f"  shm reader peak / data returned:     {_fmt(summary['shm_peak'])}  target <= 1.2")
    print(f"  NFSWorkspace reader peak / data:     {_fmt(summary['nfs_peak'])}  target <= 1.2")
    print(f"  torch.load reader peak / data:       {_fmt(summary['save_peak'])}")
    print(f"  (median shm/memcpy {statistics.median(summary['shm_vs_copy']):.2f})")
    shutil.rmtree(root_for_limits, ignore_errors=True)
    write_results(
        args.json,
        "workspace",
        {
            "senders": SENDERS,
            "sizes_mib": [size // MIB for size in sizes],
            "copy_gbps": copy_gbps,
            "x_copy": x_copy,
            "speedup_over_torch_save": {
                "nfsworkspace": [round(v, 3) for v in summary["nfs_vs_save"]],
                "nfsws-nofsync": [round(v, 3) for v in summary["nofsync_vs_save"]],
                "write+fsync": [round(v, 3) for v in summary["save_vs_fsync"]],
            },
            "reader_peak_per_data": {
                "shm": [round(v, 3) for v in summary["shm_peak"]],
                "nfsworkspace": [round(v, 3) for v in summary["nfs_peak"]],
                "torch.save": [round(v, 3) for v in summary["save_peak"]],
            },
            "targets": {"shm_x_copy": 0.5, "nfs_speedup": 2.0, "reader_peak_per_data": 1.2},
        },
    )
    return 0


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{value:5.2f}" for value in values)


if __name__ == "__main__":
    sys.exit(main())
