"""An unmodified torchrun-style script: env:// init, one all_reduce, print the sum."""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print(f"rank={rank} world={dist.get_world_size()} sum={int(value.item())}", flush=True)
if os.environ.get("BLOCK_AFTER_ALLREDUCE"):
    # A receive nobody answers: blocks until a peer goes away (or gloo's 30-min timeout).
    dist.recv(torch.zeros(1), src=(rank + 1) % dist.get_world_size())
dist.barrier()  # nobody tears the group down while a peer still talks to it
dist.destroy_process_group()
