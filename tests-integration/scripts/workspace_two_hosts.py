"""The *_parallel helpers across two hosts: configs through a directory, one-host refusals.

Argument: a directory every rank sees. Rank 0 prints what it received.
"""

import socket
import sys

import torch
import torch.distributed as dist

from dist_workspace import WorkspaceError, get_configs_parallel, get_tensors_parallel

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
ranks = list(range(world))
directory = sys.argv[1]
small = {"rank": rank, "host": socket.gethostname()}
with get_configs_parallel(small, ranks, None, directory) as configs:  # on the link
    if configs:
        hosts = sorted({config["host"] for config in configs})
        print(f"small: ranks={[c['rank'] for c in configs]} hosts={len(hosts)}", flush=True)
large = {"rank": rank, "weights": torch.full((3 << 20,), float(rank))}  # 12 MiB: a file
with get_configs_parallel(large, ranks, None, directory) as configs:
    if configs:
        sums = [int(config["weights"].sum().item()) // (3 << 20) for config in configs]
        print(f"large: ranks={[c['rank'] for c in configs]} values={sums}", flush=True)
try:
    with get_tensors_parallel(torch.ones(2), ranks, timeout=60):
        pass
except WorkspaceError as error:
    if rank == 0:
        print(f"one host: {error}", flush=True)
dist.barrier()
dist.destroy_process_group()
