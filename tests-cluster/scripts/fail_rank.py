"""Rank 1 (or the rank given: ``fail_rank.py [RANK]``) raises after the first step; the
others block in the next all_reduce.

The failing rank prints ``FAILED_AT <time>`` to stderr first (for compare_launchers.py's timing).
"""

import sys
import time

import torch
import torch.distributed as dist

failing = int(sys.argv[1]) if len(sys.argv) > 1 else 1
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
if dist.get_rank() == failing:
    print(f"FAILED_AT {time.time():.3f}", file=sys.stderr, flush=True)
    raise ValueError(f"rank {failing} fails on purpose")
dist.all_reduce(torch.ones(1))
