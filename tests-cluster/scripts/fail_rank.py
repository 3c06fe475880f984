"""Rank 1 raises after the first step; the others block in the next all_reduce.

Rank 1 prints ``FAILED_AT <time>`` to stderr first (for compare_launchers.py's timing).
"""

import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
if dist.get_rank() == 1:
    print(f"FAILED_AT {time.time():.3f}", file=sys.stderr, flush=True)
    raise ValueError("rank 1 fails on purpose")
dist.all_reduce(torch.ones(1))
