"""Rank 1 crashes inside all_to_all_v (bad split sizes) while the others wait in it."""

import torch

import dist_collectives
import dist_core

dist_core.init_process_group_from_backend("gloo")  # CPU tensors, on any host
rank, world = dist_core.get_rank(), dist_core.get_world_size()
rows = torch.arange(world * 2, dtype=torch.float32).unsqueeze(1)
splits = [2] * world
if rank == 1:
    splits[0] = 3  # sums to 2 * world + 1: all_to_all_v refuses, naming the sizes
dist_collectives.all_to_all_v(rows, input_split_sizes=splits)
