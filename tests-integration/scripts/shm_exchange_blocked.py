"""Every rank enters a shared-memory exchange; one rank never arrives (it blocks)."""

import os
import sys
import time

import torch

import dist_core
from dist_workspace import get_tensors_parallel

dist_core.init_process_group_from_backend("gloo")  # CPU tensors, on any host
rank = dist_core.get_rank()
print(f"rank={rank} pid={os.getpid()}", flush=True)
tensor = torch.full((4 * 1024 * 1024,), float(rank))
if rank == int(sys.argv[1]):
    time.sleep(3600)  # stands for a rank stuck elsewhere: never joins the exchange
with get_tensors_parallel(tensor, list(range(dist_core.get_world_size()))) as received:
    print(f"rank={rank} got {len(received)}", flush=True)
