"""Ranks exchange tensors in a loop; one rank kills itself (SIGKILL) before its third call."""

import os
import signal
import sys

import torch

import dist_core
from dist_workspace import get_tensors_parallel

dist_core.init_process_group_from_backend("gloo")  # CPU tensors, on any host
rank = dist_core.get_rank()
ranks = list(range(dist_core.get_world_size()))
for call in range(3):
    if rank == int(sys.argv[1]) and call == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    # Far beyond the test's limit: only the closed connection ends the others' wait.
    with get_tensors_parallel(torch.full((1024,), float(rank)), ranks, timeout=3600):
        pass
