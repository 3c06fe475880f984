"""An unmodified torchrun-style script: env:// init, one all_reduce, print the sum."""

import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print(f"rank={rank} world={dist.get_world_size()} sum={int(value.item())}", flush=True)
if os.environ.get("BLOCK_AFTER_ALLREDUCE"):
    sys.stdout.flush()
    dist.barrier()  # blocks until the peer host goes away
    dist.barrier()
dist.destroy_process_group()
