"""Rank 1 raises after the first step; the others block in the next all_reduce."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
if dist.get_rank() == 1:
    raise ValueError("rank 1 fails on purpose")
dist.all_reduce(torch.ones(1))
