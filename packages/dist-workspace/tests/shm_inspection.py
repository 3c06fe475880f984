"""What the exchange tests look at from outside: segments left, where a tensor lives."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def own_segments() -> list[str]:
    """This user's segments in the tests' ``DIST_WORKSPACE_SHM_DIR``."""
    directory = os.environ["DIST_WORKSPACE_SHM_DIR"]
    return [
        name for name in os.listdir(directory) if name.startswith(f"dist-workspace.{os.getuid()}.")
    ]


def backing(value: torch.Tensor) -> str:
    """The file a tensor's memory maps, "[heap]" and the like, or "anonymous"."""
    address = value.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, _, _, _, _, *path = line.split(maxsplit=5)
        low, high = (int(part, 16) for part in span.split("-"))
        if low <= address < high:
            return path[0] if path else "anonymous"
    return "unmapped"
