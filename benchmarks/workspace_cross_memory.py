"""Cross-memory copies against segments, by record size: the measurement behind the cap.

A measurement behind ``shm_transport.CROSS_MEMORY_MAX_BYTES``. Run from the
repository root:

    python benchmarks/workspace_cross_memory.py [--sizes 1,4,8,16,32]

For each size (MiB per rank), 4 gloo ranks make ``get_tensors_parallel`` calls of one
tensor each, and rank 0 reads every byte it received; once with cross-memory copies
(``DIST_WORKSPACE_CROSS_MEMORY=1``, every call after the first two a copy) and once
with segments only (``=0``). Copies are measured above the cap too (the ranks lift
it), to show where they stop paying. Prints rank 0's time per call, the fastest of 3
loops, and the ratio: below 1, copying beats mapping the senders' fresh segments.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from dist_core.testing import run_ranks

WORLD = 4


def _loop(size: int, calls: int) -> float:
    import torch.distributed as dist

    from dist_workspace import get_tensors_parallel, shm_transport

    shm_transport.CROSS_MEMORY_MAX_BYTES = 1 << 40  # measure copies at every size

    torch.set_num_threads(1)  # as under torchrun
    tensor = torch.full((size // 4,), float(dist.get_rank()))
    best = float("inf")
    for _ in range(3):
        dist.barrier()
        began = time.perf_counter()
        for _ in range(calls):
            with get_tensors_parallel(tensor, list(range(WORLD))) as values:
                for value in values:
                    value.view(torch.uint8).max()
        best = min(best, (time.perf_counter() - began) / calls)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,8,16,32", help="MiB per rank, comma separated")
    args = parser.parse_args()
    from dist_workspace.shm_transport import CROSS_MEMORY_MAX_BYTES

    print(
        f"cross-memory copies against segments: {WORLD} ranks, {os.cpu_count()} CPUs "
        f"(the cap: records of at most {CROSS_MEMORY_MAX_BYTES >> 20} MiB are copied)"
    )
    print(f"{'MiB':>5}  {'copies ms':>10}  {'segments ms':>12}  {'ratio':>6}")
    for mib in (int(text) for text in args.sizes.split(",")):
        times = []
        for setting in ("1", "0"):
            os.environ["DIST_WORKSPACE_CROSS_MEMORY"] = setting  # the ranks inherit it
            calls = max(4, 64 // mib)
            times.append(run_ranks(_loop, WORLD, mib << 20, calls, timeout=600)[0] * 1e3)
        print(f"{mib:>5}  {times[0]:>10.2f}  {times[1]:>12.2f}  {times[0] / times[1]:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
