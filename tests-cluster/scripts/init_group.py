"""The README's call under a real launcher: init_process_group_from_backend, all_reduce.

With ``--meet DIR COUNT`` every rank waits, once its group is formed, until COUNT groups
(jobs or steps) have written their ``ready`` file in DIR: the groups are then alive at
the same time, so two that share a master port cannot both have formed. Each rank
prints ``rank R/W port P sum S host H master M``: its host name and the master's. With
``--from-dist-env`` the group is formed by ``init_dist(...)`` with the values of
``DistEnv.from_environ()``: it writes the variables ``env://`` reads first.
"""

import argparse
import socket
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from dist_core import DistEnv, destroy_dist, init_dist, init_process_group_from_backend

parser = argparse.ArgumentParser()
parser.add_argument("--meet", nargs=2, metavar=("DIR", "COUNT"))
parser.add_argument("--from-dist-env", action="store_true")
args = parser.parse_args()

env = DistEnv.from_environ()
if args.from_dist_env:
    init_dist(
        env.rank,
        env.local_rank,
        env.world_size,
        env.local_world_size,
        env.master_addr,
        env.master_port,
        timeout=timedelta(seconds=20),
    )
else:
    init_process_group_from_backend(timeout=timedelta(seconds=20))
if args.meet:
    directory, count = Path(args.meet[0]), int(args.meet[1])
    if dist.get_rank() == 0:
        (directory / f"ready-{uuid.uuid4().hex}").touch()
    deadline = time.monotonic() + 15
    while len(list(directory.glob("ready-*"))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(directory.glob('ready-*')))} of {count} groups met")
        time.sleep(0.05)
value = torch.tensor([float(dist.get_rank())])
dist.all_reduce(value)
print(
    f"rank {dist.get_rank()}/{dist.get_world_size()} port {env.master_port} "
    f"sum {int(value.item())} host {socket.gethostname()} master {env.master_addr}",
    flush=True,
)
destroy_dist()
