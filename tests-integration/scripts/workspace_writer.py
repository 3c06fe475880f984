"""Writes a large tensor to a workspace again and again until killed; prints its pid."""

import os
import sys

import torch

from dist_workspace import NFSWorkspace

workspace = NFSWorkspace(sys.argv[1])
weights = {"big": torch.arange(32 * 1024 * 1024, dtype=torch.float32)}  # 128 MiB
print(f"pid={os.getpid()}", flush=True)
round_ = 0
while True:
    round_ += 1
    workspace.write_configs_and_weights({"round": round_}, weights)
