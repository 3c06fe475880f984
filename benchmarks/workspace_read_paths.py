"""Reading the same record files through our reader and through ``safetensors.safe_open``.

A measurement behind the README's choice of
read path. Run from the repository root:

    python benchmarks/workspace_read_paths.py [DIR] [--repeat N]

DIR defaults to a temporary directory on the local disk; pass one on /dev/shm for
tmpfs. Every file is read warm (from the page cache), ``--repeat`` times (default 5),
and the fastest time is printed, in ms and GB/s of tensor data. Every path checks
every entry's CRC-32, as a reader of this package must.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from dist_workspace import NFSWorkspace
from dist_workspace.format import byte_view
from dist_workspace.reader import parse_header, read_record_fd

CASES: dict[str, Callable[[], dict[str, torch.Tensor]]] = {
    "256 MiB, 1 tensor": lambda: {"w": torch.ones(64 * 1024 * 1024)},
    "1 GiB, 4 tensors": lambda: {f"w{i}": torch.ones(64 * 1024 * 1024) for i in range(4)},
    "20000 x 1 KiB": lambda: {f"layer.{i}.w": torch.ones(256) for i in range(20000)},
}


def _crc_all(tensors: dict[str, torch.Tensor]) -> int:
    crc = 0
    for tensor in tensors.values():
        if tensor.numel():
            crc ^= zlib.crc32(memoryview(byte_view(tensor).numpy()))  # type: ignore[arg-type]
    return crc


def _through_ours(path: Path, *, mappable: bool) -> dict[str, torch.Tensor]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        _, tensors = read_record_fd(fd, str(path), mappable=mappable)
    finally:
        os.close(fd)
    return tensors


def _header_ours(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        header = parse_header(lambda offset, length: os.pread(fd, length, offset), size, "f")
    finally:
        os.close(fd)
    return len(header.entries)


def _through_library(path: Path, backend: str, *, crc: bool) -> dict[str, torch.Tensor]:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        with safe_open(f"/proc/self/fd/{fd}", framework="pt", backend=backend) as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.offset_keys()}
    finally:
        os.close(fd)
    if crc:
        _crc_all(tensors)
    return tensors


def _header_library(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        with safe_open(f"/proc/self/fd/{fd}", framework="pt") as handle:
            handle.metadata()
            return len(handle.offset_keys())
    finally:
        os.close(fd)


def _best(function: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
        del result
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", type=Path)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.directory) as scratch:
        workspace = NFSWorkspace(Path(scratch), durable=False)
        paths = {
            name: workspace.write_configs_and_weights({"case": name}, make(), rank=index)
            for index, (name, make) in enumerate(CASES.items())
        }
        paths_list = list(paths.items())
        print(f"{'file':<20} {'path':<44} {'ms':>9} {'GB/s':>7}")
        for name, path in paths_list:
            data = path.stat().st_size
            runs: dict[str, Callable[[], object]] = {
                "ours: map + CRC (local fs)": lambda p=path: _through_ours(p, mappable=True),
                "ours: pread + CRC (network fs)": lambda p=path: _through_ours(p, mappable=False),
                "safe_open mmap + CRC": lambda p=path: _through_library(p, "mmap", crc=True),
                "safe_open pread + CRC": lambda p=path: _through_library(p, "pread", crc=True),
                "safe_open mmap, no CRC": lambda p=path: _through_library(p, "mmap", crc=False),
                "header: ours": lambda p=path: _header_ours(p),
                "header: safe_open": lambda p=path: _header_library(p),
            }
            timed: dict[str, float] = {}
            for label, run in runs.items():
                seconds = timed[label] = _best(run, args.repeat)
                rate = "" if label.startswith("header") else f"{data / seconds / 1e9:7.2f}"
                print(f"{name:<20} {label:<44} {seconds * 1e3:9.2f} {rate:>7}")
            # Time ratios, ours over the library's on the same path (below 1: we are faster).
            for ours, theirs in (
                ("ours: map + CRC (local fs)", "safe_open mmap + CRC"),
                ("ours: pread + CRC (network fs)", "safe_open pread + CRC"),
                ("header: ours", "header: safe_open"),
            ):
                ratio = timed[ours] / timed[theirs]
                print(f"{name:<20} {'ratio ' + ours + ' / safe_open':<44} {ratio:8.2f}x")


if __name__ == "__main__":
    main()
