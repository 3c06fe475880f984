"""dist-workspace: 4 ranks send a tensor to rank 0, side by side with peers and the limit.

Methods, all in one run, for 64 MiB, 256 MiB and 1 GiB per rank (3 senders, so rank 0
receives 3x that):

- ``shm``: ``get_tensors_parallel`` through shared memory (dist-workspace).
- ``nfsworkspace``: ``NFSWorkspace`` on a local directory: senders write (atomic,
  fsynced, CRC-32), rank 0 reads and verifies (dist-workspace).
- ``nfsws-nofsync``: the same with ``durable=False``.
- ``gloo-gather``: ``torch.distributed.gather`` on gloo.
- ``torch.save``: the exchange Model Optimizer's NFSWorkspace does: every sender
  ``torch.save``s its value to ``rank{r}.pt``, a barrier, rank 0 ``torch.load``s them.
  Written here (modelopt is not installed).

Limits of this machine, in the same run:

- ``memcpy``: one process copying 3x the size between two pre-faulted buffers: the
  ceiling for moving the bytes once.
- ``fresh tmpfs/3`` (method ``fresh-shm``): the three sender processes, timed like the
  exchange (rank 0 from a barrier until it knows all are done), each writing its
  value with ``pwrite`` into a new file in /dev/shm, nothing else. Every exchange
  through new shared memory pays this: the kernel hands out (and, on a VM with free
  page reporting, the host backs) a fresh page for every byte. It is the limit the
  shared-memory target is measured against: same bytes, same processes, same cores.
- ``fresh tmpfs/3+own`` (method ``fresh-shm-own``): the same, while rank 0 copies its
  own value into new private memory (one anonymous mapping, its pages allocated by
  ``MAP_POPULATE``, then ``memmove``: on this VM the cheapest way found, cheaper under
  load than ``pwrite`` into /dev/shm or faulting pages in one by one). An exchange
  that gives the receiver a copy of its own value (dist-workspace's contract: it
  never aliases the caller's tensor) needs fresh pages for that copy as well; where
  the senders already hold every core (4 ranks on 2 cores), that copy costs time the
  3-writer limit does not count, and ``fresh tmpfs/3`` over this line is what it
  leaves of the target on this machine.
- ``fresh tmpfs/1``: one process writing 3x the size into new /dev/shm files: what one
  core can do (the previous releases' "limit").
- ``write+fsync``: writing 3x the size to the local directory and fsyncing it. A
  durable NFSWorkspace pays this; torch.save does not fsync.

A checkpoint-shaped exchange follows (``--checkpoint-mib``, 1024 by default; 0 skips
it): each rank sends a decoder-only transformer's state dict of hundreds of bfloat16
tensors from 2 KiB to 64 MiB, through ``get_configs_parallel`` (shared memory), the
directory methods and torch.save, against the same limits measured with those
tensors.

Then the cost of a call, the way real exports call (an 80-layer loop of 0.5 MiB
shards, tiny 4 KiB calls, small configs), beside ``dist.gather`` and Model Optimizer
when installed, with the store round trips per call: see ``_lib/workspace_calls.py``.
``--calls only`` runs just that part and replaces just its part of the JSON file.
Then a 2 GiB model held by 4 ranks exported as one Hugging Face checkpoint, every rank
writing its shard (``export_sharded``), against gathering to rank 0 and writing one
file, with the disk's limits (``--export also|only|skip``, ``--export-gib``): see
``_lib/workspace_export.py``.

Reader: after the timed exchange, rank 0 reads every byte it received once (``read
s``: a shared-memory mapping fills its page tables then) and reports its peak RSS
above its start (reset through ``/proc/self/clear_refs``) per byte it holds (peers'
values and, where the method hands it one, a copy of its own).

Sizes shrink automatically (and the run says so) when /dev/shm or available memory
cannot hold about 12x the largest size. ``--sizes 64,256`` picks sizes in MiB,
``--methods shm`` runs a subset (shm and fresh-shm always run); ``--repeats N`` repeats
each measurement, methods interleaved, and keeps the fastest. The measurements also
go to ``docs/_data/bench/workspace.json`` (``--json``), which the docs draw as a figure.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import mmap
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


def _checkpoint(size: int, rank: int) -> dict[str, torch.Tensor]:
    """A decoder-only transformer's state dict in bfloat16, about ``size`` bytes.

    Hidden size 1024, MLP 2816, as many layers as fill ``size`` after the embedding
    and the output head: hundreds of tensors from 2 KiB (norms, biases) to 64 MiB.
    """
    hidden, mlp, vocab = 1024, 2816, 32000
    element = 2
    per_layer = (4 * hidden * hidden + 3 * hidden * mlp + 3 * hidden + 2 * hidden) * element
    while vocab > 1000 and 2 * vocab * hidden * element > size // 4:
        vocab //= 2
    layers = max(1, round((size - 2 * vocab * hidden * element) / per_layer))
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (vocab, hidden)}
    for layer in range(layers):
        prefix = f"layers.{layer}."
        for name in ("q", "k", "v", "o"):
            shapes[f"{prefix}self_attn.{name}_proj.weight"] = (hidden, hidden)
        for name in ("q", "k", "v"):
            shapes[f"{prefix}self_attn.{name}_proj.bias"] = (hidden,)
        shapes[f"{prefix}mlp.gate_proj.weight"] = (mlp, hidden)
        shapes[f"{prefix}mlp.up_proj.weight"] = (mlp, hidden)
        shapes[f"{prefix}mlp.down_proj.weight"] = (hidden, mlp)
        shapes[f"{prefix}input_layernorm.weight"] = (hidden,)
        shapes[f"{prefix}post_attention_layernorm.weight"] = (hidden,)
    shapes["norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return {
        name: torch.full(shape, float(rank), dtype=torch.bfloat16) for name, shape in shapes.items()
    }


def _value(shape: str, size: int, rank: int) -> dict[str, torch.Tensor]:
    """What each rank sends: one tensor (``tensor``) or a checkpoint's state dict."""
    if shape == "checkpoint":
        return _checkpoint(size, rank)
    return {"tensor": _tensor(size, rank)}


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def _write_fresh_shm(tensors: dict[str, torch.Tensor], path: str) -> None:
    """Writes every tensor's bytes, in order, into a new file on the tmpfs (pwrite)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    try:
        position = 0
        for tensor in tensors.values():
            view = tensor.reshape(-1).view(torch.uint8).numpy().data
            for begin in range(0, len(view), 16 * MIB):
                chunk = view[begin : begin + 16 * MIB]
                done = 0
                while done < len(chunk):
                    done += os.pwrite(fd, chunk[done:], position + begin + done)
            position += len(view)
    finally:
        os.close(fd)


def _populated_mapping(nbytes: int) -> mmap.mmap:
    """A new private anonymous mapping of ``nbytes`` (at least 1), every page allocated."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    return mmap.mmap(-1, max(nbytes, 1), flags=flags)


def _copy_fresh_private(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Copies every tensor's bytes, in order, into one new populated private mapping."""
    target = torch.frombuffer(_populated_mapping(_nbytes(tensors)), dtype=torch.uint8)
    position = 0
    for tensor in tensors.values():
        nbytes = tensor.numel() * tensor.element_size()
        ctypes.memmove(target.data_ptr() + position, tensor.data_ptr(), nbytes)
        position += nbytes
    return target


def _warm_pages(nbytes: int) -> None:
    """Touches ``nbytes`` of new memory and frees it, so the next allocations find warm pages.

    On a VM whose host takes free guest memory back (virtio-balloon free page
    reporting, as on the development VM) the first touch of such a page costs several
    times a warm one, and which method found warm pages depended on how much the one
    before it had freed: measured in the benchmark's order, ``fresh tmpfs/3+own`` took
    1.6-2.1 s at 1 GiB right after ``fresh tmpfs/3``, and the shared-memory exchange,
    doing the same work and more, 0.9-1.6 s. Each measurement now starts alike.
    """
    _populated_mapping(nbytes).close()


def _read_once(values: list[dict[str, torch.Tensor]]) -> None:
    """Reads every byte the receiver got once (faulting in whatever is still unmapped)."""
    for value in values:
        for tensor in value.values():
            if tensor.numel():
                tensor.reshape(-1).view(torch.uint8).max()  # no temporary copy


def _measure(method: str, shape: str, size: int, directory: str) -> dict[str, float] | None:
    """One exchange; returns rank 0's seconds, peak bytes above start and bytes received."""
    import torch.distributed as dist

    from dist_workspace import NFSWorkspace, get_configs_parallel, get_tensors_parallel

    rank = dist.get_rank()
    value = _value(shape, size, rank)
    tensor = value.get("tensor")
    _warm_pages(2 * _nbytes(value))  # the most any method allocates per rank, and slack
    start_rss = _reset_peak()
    fresh_path = f"/dev/shm/dist-workspace-bench-{os.getpid()}-{rank}"
    dist.barrier()
    began = time.perf_counter()
    received: list[dict[str, torch.Tensor]] = []  # the peers' values, on rank 0
    own: list[dict[str, torch.Tensor]] = []  # rank 0's own value, where the method copies it
    context: contextlib.ExitStack = contextlib.ExitStack()
    try:
        if method == "shm" and tensor is not None:
            tensors = context.enter_context(get_tensors_parallel(tensor, list(range(WORLD))))
            if tensors:
                own = [{"tensor": tensors[0]}]
                received = [{"tensor": peer} for peer in tensors[1:]]
        elif method == "shm":
            configs = context.enter_context(get_configs_parallel(value, list(range(WORLD)), None))
            if configs:
                own, received = configs[:1], configs[1:]
        elif method == "fresh-shm":  # the limit: every sender writes fresh tmpfs pages
            if rank:
                _write_fresh_shm(value, fresh_path)
            dist.barrier()
        elif method == "fresh-shm-own":  # the same, and rank 0 copies its own value
            if rank:
                _write_fresh_shm(value, fresh_path)
            else:
                own = [{"copy": _copy_fresh_private(value)}]
            dist.barrier()
        elif method in ("nfsworkspace", "nfsws-nofsync"):
            workspace = NFSWorkspace(directory, durable=method == "nfsworkspace")
            if rank:
                workspace.write_configs_and_weights({"rank": rank}, value)
            dist.barrier()
            if rank == 0:
                for peer in range(1, WORLD):
                    _, weights = workspace.read_configs_and_weights_from_rank(peer)
                    assert weights is not None
                    received.append(weights)
        elif method == "torch.save":
            path = Path(directory)
            if rank:
                torch.save({"config": {"rank": rank}, "weights": value}, path / f"rank{rank}.pt")
            dist.barrier()
            if rank == 0:
                for peer in range(1, WORLD):
                    state = torch.load(path / f"rank{peer}.pt", map_location="cpu")
                    received.append(state["weights"])
        elif method == "gloo-gather" and tensor is not None:
            if rank == 0:
                buffers = [torch.empty_like(tensor) for _ in range(WORLD)]
                dist.gather(tensor, buffers, dst=0)
                own = [{"tensor": buffers[0]}]
                received = [{"tensor": buffer} for buffer in buffers[1:]]
            else:
                dist.gather(tensor, None, dst=0)
        else:
            raise ValueError(f"{method} cannot send a {shape}")
        elapsed = time.perf_counter() - began
        # Read what arrived once (a mapping is filled now if it was not yet), so that
        # the peak counts every page the receiver holds and the read shows what a
        # first pass over the data costs after each method.
        read_began = time.perf_counter()
        _read_once(received)
        read_seconds = time.perf_counter() - read_began
        peak = _peak() - start_rss
    finally:
        context.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(fresh_path)
    dist.barrier()
    if rank != 0:
        return None
    for peer, got in enumerate(received, start=1):
        if any(float(got[name].reshape(-1)[-1]) != float(peer) for name in value):
            raise AssertionError(f"{method}: wrong data from rank {peer}")
    sent = _nbytes(value)
    return {
        "seconds": elapsed,
        "read_seconds": read_seconds,
        "peak": float(peak),
        "bytes": float(SENDERS * sent),  # what crossed from the senders
        "held": float(sum(_nbytes(item) for item in received + own)),  # what rank 0 got
        "tensors": float(len(value)),
    }


def _run_all(
    cases: list[tuple[str, int]], repeats: int, methods: dict[str, list[str]], root: str
) -> dict[str, Any]:
    """Each (shape, size) case: every method once per repeat, interleaved; the fastest."""
    import torch.distributed as dist

    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for shape, size in cases:
        times: dict[str, list[dict[str, float]]] = {method: [] for method in methods[shape]}
        # Interleaved (method after method, repeat after repeat) so that a noisy
        # stretch of the machine's time hits every method alike.
        for attempt in range(repeats):
            for method in methods[shape]:
                directory = os.path.join(root, f"{method}-{shape}-{size}-{attempt}")
                if rank == 0:
                    os.makedirs(directory, exist_ok=True)
                dist.barrier()
                measured = _measure(method, shape, size, directory)
                if measured is not None:
                    times[method].append(measured)
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(directory, ignore_errors=True)
                gc.collect()
        if rank == 0:
            for method, measured_times in times.items():
                results[f"{method}/{shape}/{size}"] = min(
                    measured_times, key=lambda item: item["seconds"]
                )
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
    source = torch.ones(size, dtype=torch.uint8).numpy().data
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
    source = torch.ones(size, dtype=torch.uint8).numpy().data
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


ALL_METHODS = [
    "shm",
    "fresh-shm",
    "fresh-shm-own",
    "nfsworkspace",
    "nfsws-nofsync",
    "torch.save",
    "gloo-gather",
]
# A checkpoint goes through get_configs_parallel (a state dict is a config of tensors);
# gloo's gather takes one tensor, so it has no checkpoint line.
CHECKPOINT_METHODS = ["shm", "fresh-shm", "fresh-shm-own", "nfsworkspace", "torch.save"]
LIMIT_METHODS = {"shm", "fresh-shm", "fresh-shm-own"}  # always run: the targets are ratios


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256,1024", help="MiB per rank, comma separated")
    parser.add_argument(
        "--checkpoint-mib",
        type=int,
        default=1024,
        help="size per rank of the checkpoint-shaped exchange (0: skip it)",
    )
    parser.add_argument(
        "--methods",
        default=",".join(ALL_METHODS),
        help="comma separated subset of " + ",".join(ALL_METHODS) + " (shm and the fresh-shm "
        "limits are always run: the targets are their ratios)",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--calls",
        choices=("also", "only", "skip"),
        default="also",
        help="the cost-of-a-call workloads (see benchmarks/_lib/workspace_calls.py): run them "
        "after the bandwidth table (also), alone, updating only their part of the JSON file "
        "(only), or not at all (skip)",
    )
    parser.add_argument(
        "--export",
        choices=("also", "only", "skip"),
        default="also",
        help="the sharded export against gathering to rank 0 (see "
        "benchmarks/_lib/workspace_export.py), as --calls",
    )
    parser.add_argument("--export-gib", type=float, default=2.0, help="model size to export")
    parser.add_argument(
        "--link-sweep",
        default="",
        help="KiB per rank, comma separated: time records on the link against a segment per "
        "call at each size (see benchmarks/_lib/workspace_link.py), print, write nothing",
    )
    from _lib import workspace_calls, workspace_export
    from _lib.results import add_json_argument, describe_run, write_results

    add_json_argument(parser, "workspace")
    args = parser.parse_args()
    if args.link_sweep:
        return _run_link_sweep(args)
    if args.calls == "only" or args.export == "only":
        parts: dict[str, Any] = {}
        if args.calls != "skip":
            parts["calls"] = lambda: _run_calls(args, workspace_calls)
        if args.export != "skip":
            parts["export"] = lambda: _run_export(args, workspace_export)
        return _parts_only(args, parts, describe_run)
    chosen = {*LIMIT_METHODS, *args.methods.split(",")}
    unknown = chosen - set(ALL_METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; known: {ALL_METHODS}")
    methods = [method for method in ALL_METHODS if method in chosen]
    if methods != ALL_METHODS and args.json == parser.get_default("json"):
        # The docs draw every method from the default file: a partial run keeps it.
        print(f"NOTE: --methods left some out; not writing {args.json} (pass --json PATH)")
        args.json = "-"
    requested = [int(text) * MIB for text in args.sizes.split(",") if text]
    if args.checkpoint_mib:
        requested.append(args.checkpoint_mib * MIB)
    scaled, notes = _choose_sizes(requested)
    sizes = scaled[: len(scaled) - 1] if args.checkpoint_mib else scaled
    checkpoint_size = scaled[-1] if args.checkpoint_mib else 0
    cases = [("tensor", size) for size in sizes]
    if checkpoint_size:
        cases.append(("checkpoint", checkpoint_size))
    by_shape = {
        "tensor": methods,
        "checkpoint": [method for method in methods if method in CHECKPOINT_METHODS],
    }
    from dist_core.testing import run_ranks

    print(
        f"dist-workspace benchmark: {WORLD} ranks, {SENDERS} send to rank 0, {os.cpu_count()} CPUs"
    )
    for note in notes:
        print(f"NOTE: {note}")
    root = tempfile.mkdtemp(prefix="dist-workspace-bench-")
    try:
        results = run_ranks(_run_all, WORLD, cases, args.repeats, by_shape, root, timeout=3000)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    calls: dict[str, Any] | None = None
    if args.calls == "also":
        calls = _run_calls(args, workspace_calls)
    exported: dict[str, Any] | None = None
    if args.export == "also":
        exported = _run_export(args, workspace_export)
    root_for_limits = tempfile.mkdtemp(prefix="dist-workspace-bench-limits-")
    try:
        return _report(
            args, results, cases, by_shape, root, root_for_limits, write_results, calls, exported
        )
    finally:
        shutil.rmtree(root_for_limits, ignore_errors=True)


def _run_calls(args: argparse.Namespace, workspace_calls: Any) -> dict[str, Any]:
    from dist_core.testing import run_ranks

    measured = run_ranks(workspace_calls.measure, WORLD, args.repeats, timeout=3000)[0]
    reported: dict[str, Any] = workspace_calls.report(measured)
    return reported


def _run_link_sweep(args: argparse.Namespace) -> int:
    from _lib import workspace_link

    from dist_core.testing import run_ranks

    sizes = [int(text) for text in args.link_sweep.split(",") if text]
    measured = run_ranks(workspace_link.sweep, WORLD, sizes, args.repeats, timeout=3000)[0]
    print(f"link against a segment per call ({WORLD} ranks; ms per call, receiver reads all)")
    print(f"{'KiB/rank':>10}{'link ms':>10}{'segment ms':>12}{'link/segment':>14}")
    for kib, row in measured.items():
        ratio = row["link"] / row["segment"]
        print(f"{kib:>10}{row['link']:>10.3f}{row['segment']:>12.3f}{ratio:>14.2f}")
    return 0


def _run_export(args: argparse.Namespace, workspace_export: Any) -> dict[str, Any]:
    from dist_core.testing import run_ranks

    total = int(args.export_gib * 2**30)
    root = tempfile.mkdtemp(prefix="dist-workspace-bench-export-", dir=os.getcwd())
    try:
        best = run_ranks(workspace_export.measure, WORLD, total, args.repeats, root, timeout=3000)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    reported: dict[str, Any] = workspace_export.report(best[0], total)
    return reported


def _parts_only(args: argparse.Namespace, parts: dict[str, Any], describe_run: Any) -> int:
    """Runs some parts alone and replaces only their part of the JSON file."""
    import json

    print(
        f"dist-workspace benchmark, {' and '.join(parts)} only: {WORLD} ranks, "
        f"{os.cpu_count()} CPUs"
    )
    measured = {name: run() for name, run in parts.items()}
    if args.json == "-":
        return 0
    path = Path(args.json)
    data = json.loads(path.read_text()) if path.exists() else {"benchmark": "workspace"}
    for name, value in measured.items():
        data[name] = {"run": describe_run(), **value}
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"\nthe measurements of {' and '.join(parts)} written to {path}")
    return 0


def _row(
    label: str,
    limits: tuple[float, float, float],
    name: str,
    seconds: float,
    moved: float,
    read: str,
    peak: str,
) -> float:
    """Prints one line of the table; returns the bandwidth in bytes per second."""
    ceiling, fresh1, fresh3 = limits
    bandwidth = moved / seconds
    print(
        f"{name:<16}{label:>9}{seconds:>9.3f}{bandwidth / 1e9:>7.2f}"
        f"{bandwidth / ceiling:>9.2f}{bandwidth / fresh1:>10.2f}"
        f"{bandwidth / fresh3:>10.2f}{read:>8}{peak:>10}"
    )
    return bandwidth


def _report(
    args: argparse.Namespace,
    results: dict[str, Any],
    cases: list[tuple[str, int]],
    by_shape: dict[str, list[str]],
    root: str,
    root_for_limits: str,
    write_results: Any,
    calls: dict[str, Any] | None,
    exported: dict[str, Any] | None,
) -> int:
    print(f"local directory: {root} (file system of {tempfile.gettempdir()})")
    print(
        "seconds: rank 0, barrier to having every value; read: one pass over what it got "
        "(a mapping fills its page tables then); peak/data: rank 0's peak RSS above its "
        "start / bytes it holds"
    )
    header = (
        f"{'method':<16}{'MiB/rank':>9}{'seconds':>9}{'GB/s':>7}{'x memcpy':>9}"
        f"{'x fresh/1':>10}{'x fresh/3':>10}{'read s':>8}{'peak/data':>10}"
    )
    print(header)
    print("-" * len(header))
    summary: dict[str, list[float]] = {
        key: []
        for key in (
            "shm_vs_copy",
            "shm_vs_fresh1",
            "shm_vs_fresh3",
            "shm_vs_fresh_own",
            "own_copy_bound",
            "fresh1_vs_copy",
            "fresh3_vs_copy",
            "nfs_vs_save",
            "nofsync_vs_save",
            "save_vs_fsync",
            "shm_peak",
            "nfs_peak",
            "save_peak",
        )
    }
    # For the docs' figure: GB/s of the pre-faulted copy, and every method and limit as
    # a fraction of it (the "x memcpy" column), per size.
    copy_gbps: list[float] = []
    x_copy: dict[str, list[float]] = {}
    checkpoint: dict[str, Any] = {}
    for shape, size in cases:
        ceiling = _memcpy_bandwidth(size, args.repeats)
        fresh1 = _fresh_tmpfs_bandwidth(size, args.repeats)
        fresh3_item = results[f"fresh-shm/{shape}/{size}"]
        fresh3 = fresh3_item["bytes"] / fresh3_item["seconds"]
        fresh_own_item = results[f"fresh-shm-own/{shape}/{size}"]
        # The same bytes crossing (3x size), in the time it takes with rank 0's copy.
        fresh_own = fresh_own_item["bytes"] / fresh_own_item["seconds"]
        label = f"{size // MIB}" if shape == "tensor" else f"{size // MIB}*"

        limits = (ceiling, fresh1, fresh3)
        _row(label, limits, "memcpy", SENDERS * size / ceiling, SENDERS * size, "-", "-")
        _row(label, limits, "fresh tmpfs/1", SENDERS * size / fresh1, SENDERS * size, "-", "-")
        _row(label, limits, "fresh tmpfs/3", fresh3_item["seconds"], fresh3_item["bytes"], "-", "-")
        _row(
            label,
            limits,
            "fresh tmpfs/3+own",
            fresh_own_item["seconds"],
            fresh_own_item["bytes"],
            "-",
            "-",
        )
        fsync_seconds = _fsync_seconds(size, root_for_limits)
        _row(label, limits, "write+fsync", fsync_seconds, SENDERS * size, "-", "-")
        ratios: dict[str, float] = {}
        for method in by_shape[shape]:
            if method in ("fresh-shm", "fresh-shm-own"):
                continue
            item = results[f"{method}/{shape}/{size}"]
            bandwidth = _row(
                label,
                limits,
                method,
                item["seconds"],
                item["bytes"],
                f"{item['read_seconds']:.3f}",
                f"{item['peak'] / item['held']:.2f}",
            )
            ratios[method] = bandwidth / ceiling
        shm = results[f"shm/{shape}/{size}"]
        shm_bandwidth = shm["bytes"] / shm["seconds"]
        if shape == "checkpoint":
            checkpoint = {
                "mib_per_rank": size // MIB,
                "tensors_per_rank": int(shm["tensors"]),
                "copy_gbps": round(ceiling / 1e9, 3),
                "x_copy": {
                    "fresh tmpfs": round(fresh1 / ceiling, 4),
                    "fresh tmpfs, 3 writers": round(fresh3 / ceiling, 4),
                    **{method: round(value, 4) for method, value in ratios.items()},
                },
                "shm_x_fresh": round(shm_bandwidth / fresh3, 3),
                "shm_x_fresh_with_own_copy": round(shm_bandwidth / fresh_own, 3),
                "own_copy_bound": round(fresh_own / fresh3, 3),
                "shm_x_fresh_one_core": round(shm_bandwidth / fresh1, 3),
                "reader_peak_per_data": round(shm["peak"] / shm["held"], 3),
            }
            print(
                f"  (* a checkpoint's state dict: {int(shm['tensors'])} bfloat16 tensors "
                "per rank, through get_configs_parallel)"
            )
            print()
            continue
        copy_gbps.append(round(ceiling / 1e9, 3))
        x_copy.setdefault("fresh tmpfs", []).append(round(fresh1 / ceiling, 4))
        x_copy.setdefault("fresh tmpfs, 3 writers", []).append(round(fresh3 / ceiling, 4))
        x_copy.setdefault("fresh tmpfs, 3 writers + own copy", []).append(
            round(fresh_own / ceiling, 4)
        )
        x_copy.setdefault("write+fsync", []).append(
            round(SENDERS * size / fsync_seconds / ceiling, 4)
        )
        for method, value in ratios.items():
            x_copy.setdefault(method, []).append(round(value, 4))
        summary["shm_vs_copy"].append(shm_bandwidth / ceiling)
        summary["shm_vs_fresh1"].append(shm_bandwidth / fresh1)
        summary["shm_vs_fresh3"].append(shm_bandwidth / fresh3)
        summary["shm_vs_fresh_own"].append(shm_bandwidth / fresh_own)
        summary["own_copy_bound"].append(fresh_own / fresh3)
        summary["fresh1_vs_copy"].append(fresh1 / ceiling)
        summary["fresh3_vs_copy"].append(fresh3 / ceiling)
        summary["shm_peak"].append(shm["peak"] / shm["held"])
        if "nfsworkspace" in by_shape[shape] and "torch.save" in by_shape[shape]:
            nfs = results[f"nfsworkspace/{shape}/{size}"]
            save = results[f"torch.save/{shape}/{size}"]
            summary["save_vs_fsync"].append(save["seconds"] / fsync_seconds)
            summary["nfs_vs_save"].append(save["seconds"] / nfs["seconds"])
            summary["save_peak"].append(save["peak"] / save["held"])
            summary["nfs_peak"].append(nfs["peak"] / nfs["held"])
            if "nfsws-nofsync" in by_shape[shape]:
                summary["nofsync_vs_save"].append(
                    save["seconds"] / results[f"nfsws-nofsync/{shape}/{size}"]["seconds"]
                )
        print()
    print("ratios (per size, smallest to largest; targets from the issues):")
    print(
        f"  shm bandwidth / fresh tmpfs, 3 writers: {_fmt(summary['shm_vs_fresh3'])}"
        "  target >= 0.80 (the limit: the senders writing the same bytes into new"
    )
    print("      shared memory at once, nothing else; every exchange through new segments pays it)")
    print(
        f"  limit: fresh tmpfs, 3 writers + own / 3: {_fmt(summary['own_copy_bound'])}"
        "  (what the receiver's copy of its own value leaves"
    )
    print("      of the line above on this machine: the most shm can reach against it; 1.00 where")
    print("      a core is free for the copy)")
    print(f"  shm bandwidth / fresh tmpfs, 3 + own:   {_fmt(summary['shm_vs_fresh_own'])}")
    print(f"  shm bandwidth / fresh tmpfs, 1 writer:  {_fmt(summary['shm_vs_fresh1'])}")
    print(f"  shm reader peak / data it holds:        {_fmt(summary['shm_peak'])}  target <= 1.1")
    print(f"  shm bandwidth / memcpy:                 {_fmt(summary['shm_vs_copy'])}")
    print(f"  limits: fresh tmpfs, 1 writer / memcpy: {_fmt(summary['fresh1_vs_copy'])}")
    print(f"  limits: fresh tmpfs, 3 writers / memcpy:{_fmt(summary['fresh3_vs_copy'])}")
    if checkpoint:
        print(
            f"  checkpoint ({checkpoint['tensors_per_rank']} tensors, "
            f"{checkpoint['mib_per_rank']} MiB per rank): shm / fresh tmpfs, 3 writers "
            f"{checkpoint['shm_x_fresh']:.2f} (limit {checkpoint['own_copy_bound']:.2f}), "
            f"/ 3 writers + own {checkpoint['shm_x_fresh_with_own_copy']:.2f}, "
            f"/ 1 writer {checkpoint['shm_x_fresh_one_core']:.2f}"
            f", reader peak / data {checkpoint['reader_peak_per_data']:.2f}"
        )
    if summary["nfs_vs_save"]:
        speedup = _fmt(summary["nfs_vs_save"])
        print(f"  NFSWorkspace speed-up vs torch.save:    {speedup}  target >= 2.0")
        if summary["nofsync_vs_save"]:
            print(f"  same, durable=False (no fsync):         {_fmt(summary['nofsync_vs_save'])}")
        print(
            f"  limits: torch.save+load / fsync:        {_fmt(summary['save_vs_fsync'])}"
            "  (the most a durable NFSWorkspace could gain over torch.save)"
        )
        print(f"  NFSWorkspace reader peak / data:        {_fmt(summary['nfs_peak'])}")
        print(f"  torch.load reader peak / data:          {_fmt(summary['save_peak'])}")
    if summary["shm_vs_fresh3"]:
        median = statistics.median(summary["shm_vs_fresh3"])
        print(f"  (median shm / fresh tmpfs, 3 writers: {median:.2f})")
    tensor_sizes = sum(1 for shape, _ in cases if shape == "tensor")

    def per_size(key: str) -> list[float | None]:
        """One value per size (null for a method this run left out: --methods)."""
        values = summary[key]
        if len(values) != tensor_sizes:
            return [None] * tensor_sizes
        return [round(value, 3) for value in values]

    write_results(
        args.json,
        "workspace",
        {
            "senders": SENDERS,
            "sizes_mib": [size // MIB for shape, size in cases if shape == "tensor"],
            "copy_gbps": copy_gbps,
            "x_copy": x_copy,
            "shm_x_fresh": {
                "3 writers": per_size("shm_vs_fresh3"),
                "3 writers + own copy": per_size("shm_vs_fresh_own"),
                "1 writer": per_size("shm_vs_fresh1"),
            },
            "speedup_over_torch_save": {
                "nfsworkspace": per_size("nfs_vs_save"),
                "nfsws-nofsync": per_size("nofsync_vs_save"),
                "write+fsync": per_size("save_vs_fsync"),
            },
            "reader_peak_per_data": {
                "shm": per_size("shm_peak"),
                "nfsworkspace": per_size("nfs_peak"),
                "torch.save": per_size("save_peak"),
            },
            "own_copy_bound": per_size("own_copy_bound"),
            "checkpoint": checkpoint or None,
            "calls": None if calls is None else {"run": "the run above", **calls},
            "export": None if exported is None else {"run": "the run above", **exported},
            "targets": {
                "shm_x_copy": 0.5,
                "shm_x_fresh": 0.8,
                "nfs_speedup": 2.0,
                "reader_peak_per_data": 1.1,
            },
        },
    )
    return 0


def _fmt(values: list[float]) -> str:
    return ", ".join(f"{value:5.2f}" for value in values)


if __name__ == "__main__":
    sys.exit(main())
