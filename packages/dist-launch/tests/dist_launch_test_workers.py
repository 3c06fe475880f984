"""Worker functions of dist-launch's library tests (imported by name in the workers)."""

from __future__ import annotations

import os
from pathlib import Path


def write_rank_and_sum(out_dir: str, scale: int = 1) -> None:
    import torch
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank() * scale)])
    dist.all_reduce(value)
    Path(out_dir, f"rank{dist.get_rank()}").write_text(
        f"{dist.get_rank()} {dist.get_world_size()} {int(value.item())} {os.environ['LOCAL_RANK']}"
    )


def fail_on_rank(bad_rank: int) -> None:
    """``bad_rank`` raises; the others block in a barrier, then fail *because of it*.

    The others raise an error of their own (with the peer's message dropped), so only
    the workers' timestamps can tell which rank failed first.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {rank}")
    try:
        dist.barrier()
    except Exception:
        raise RuntimeError(f"rank {rank} lost its barrier") from None
    raise AssertionError("the barrier cannot complete without the failed rank")


def print_pid_and_wait() -> None:
    import time

    os.write(1, f"ready {os.getpid()}\n".encode())  # one write: lines of ranks never mix
    time.sleep(120)


def write_cuda_sum(out_dir: str) -> None:
    """Sums a CUDA tensor over the group (gloo or nccl, whichever the launch chose)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    value = torch.ones(2, device=device) * (dist.get_rank() + 1)
    dist.all_reduce(value)
    Path(out_dir, f"rank{dist.get_rank()}").write_text(
        f"{dist.get_backend()} {value.device.type} {int(value[0].item())}"
    )
