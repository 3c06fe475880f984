"""The ``dist-workspace`` command: inspect, merge and clean workspaces.

``dist-workspace inspect DIR`` lists each rank's config and tensors (names, dtypes,
shapes, bytes) from the headers alone; ``--verify`` also reads every tensor and
checks its CRC-32. ``dist-workspace merge DIR OUT.safetensors`` streams every rank's
weights into one plain safetensors file. ``dist-workspace clean [DIR]`` removes a
workspace's files and this user's shared-memory segments whose job is dead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from dist_workspace.errors import WorkspaceError
from dist_workspace.merge import merge_workspace, read_rank_files, weights_of
from dist_workspace.reader import load_entries
from dist_workspace.shm import remove_dead_segments, shm_directory
from dist_workspace.workspace import RANK_FILE_PATTERN

logger = logging.getLogger(__name__)


def _inspect(directory: Path, as_json: bool, verify: bool) -> int:
    files = read_rank_files(directory)
    report = []
    for rank_file in files:
        if verify:
            fd = os.open(rank_file.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                load_entries(fd, rank_file.header, rank_file.where)
            finally:
                os.close(fd)
        tensors = [
            {
                "name": info.name,
                "dtype": info.dtype_name,
                "shape": list(info.shape),
                "bytes": info.nbytes,
                "shared": info.view is not None,
            }
            for info in weights_of(rank_file)
        ]
        report.append(
            {
                "rank": rank_file.rank,
                "path": str(rank_file.path),
                "job": rank_file.header.job,
                "file_bytes": rank_file.header.total_size,
                "config": json.loads(rank_file.header.config_text),
                "tensors": tensors,
            }
        )
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    if not report:
        print(f"{directory}: no rank files")
    for item in report:
        total = sum(tensor["bytes"] for tensor in item["tensors"])
        print(
            f"rank {item['rank']}: {item['path']} ({item['file_bytes']} bytes, job {item['job']})"
        )
        print(f"  config: {json.dumps(item['config'])}")
        print(f"  tensors: {len(item['tensors'])}, {total} bytes")
        for tensor in item["tensors"]:
            shared = "  (shares storage)" if tensor["shared"] else ""
            print(
                f"    {tensor['name']}  {tensor['dtype']}  {tuple(tensor['shape'])}  "
                f"{tensor['bytes']} bytes{shared}"
            )
    return 0


def _clean(directory: Path | None) -> int:
    removed: list[Path] = []
    if directory is not None and directory.is_dir():
        for entry in directory.iterdir():
            name = entry.name
            workspace_file = (
                RANK_FILE_PATTERN.match(name)
                or (name.startswith("rank-") and name.endswith(".safetensors.lock"))
                or name in (".dist-workspace-job", ".dist-workspace.lock")
                or (name.startswith(".rank-") and name.endswith(".tmp"))
            )
            if workspace_file and not entry.is_dir():
                with contextlib.suppress(FileNotFoundError):
                    entry.unlink()
                    removed.append(entry)
            elif name.startswith("exchange-") and entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    segments = remove_dead_segments()
    for path in removed:
        print(f"removed {path}")
    for path in segments:
        print(f"removed {path} (its job is dead)")
    where = f"{directory} and " if directory is not None else ""
    print(f"cleaned {where}{shm_directory()}: {len(removed) + len(segments)} removed")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``dist-workspace``."""
    parser = argparse.ArgumentParser(
        prog="dist-workspace", description="Inspect, merge and clean dist-workspace directories."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="list ranks, configs and tensors")
    inspect.add_argument("directory", type=Path)
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.add_argument("--verify", action="store_true", help="read every tensor, check CRCs")
    merge = commands.add_parser("merge", help="merge rank files into one safetensors file")
    merge.add_argument("directory", type=Path)
    merge.add_argument("output", type=Path)
    merge.add_argument("--rank-prefix", action="store_true", help="name tensors rank{r}.{name}")
    clean = commands.add_parser(
        "clean", help="remove workspace files and dead jobs' shared-memory segments"
    )
    clean.add_argument("directory", type=Path, nargs="?")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (2 on a workspace error)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return _inspect(args.directory, args.json, args.verify)
        if args.command == "merge":
            count = merge_workspace(args.directory, args.output, rank_prefix=args.rank_prefix)
            print(f"wrote {count} tensors to {args.output}")
            return 0
        return _clean(args.directory)
    except (WorkspaceError, OSError) as error:
        print(f"dist-workspace: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
