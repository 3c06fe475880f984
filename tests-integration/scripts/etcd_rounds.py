"""A worker that marks each round it runs in, for the etcd survival tests.

Each round is named by its ``MASTER_PORT`` (a fresh port per round). A worker writes the
file ``<port>-<rank>`` in the folder ``argv[1]`` (its node's tag, the world size,
TORCHELASTIC_RESTART_COUNT, the wall time it started, its PID), then all-reduces until its round
breaks or, in a round of ``FINISH_WORLD`` ranks, for 20 steps and exits 0.

Read from the environment:
    NODE_TAG: the node's name, written in the marker (default: the host name).
    FINISH_WORLD: the world size of the round that finishes (default 2).
"""

import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

out = Path(sys.argv[1])
started = time.time()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
name = f"{os.environ['MASTER_PORT']}-{rank}"
restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
node = os.environ.get("NODE_TAG") or socket.gethostname()
(out / (name + ".tmp")).write_text(f"{node} {world} {restarts} {started} {os.getpid()}")
(out / (name + ".tmp")).rename(out / name)
deadline = time.monotonic() + 150
steps = 0
while time.monotonic() < deadline:
    dist.all_reduce(torch.ones(1))
    steps += 1
    if world == int(os.environ.get("FINISH_WORLD", "2")) and steps == 20:
        print("finished", rank, "of", world, flush=True)
        sys.exit(0)
    time.sleep(0.05)  # pacing: the test host may have two cores
sys.exit(3)
