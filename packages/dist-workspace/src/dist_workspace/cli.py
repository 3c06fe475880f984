"""The ``dist-workspace`` command: inspect, merge and clean workspaces.

``dist-workspace inspect DIR`` lists each rank's config and tensors (names, dtypes,
shapes, sizes) from the headers alone; ``--verify`` also reads every tensor, checks
its CRC-32 and ends with one line saying what was checked and whether it is intact.
``dist-workspace merge DIR OUT`` streams every rank's weights into one safetensors
file, or with ``--max-shard-size`` into a Hugging Face model directory, optionally
casting with ``--dtype``. ``dist-workspace clean [DIR]`` removes what it can prove is
a workspace's file or a dead job's shared-memory segment (``--dry-run`` lists it).

This module only parses arguments and prints; the work is in :mod:`dist_workspace.merge`,
:mod:`dist_workspace.verify` and :mod:`dist_workspace.clean`. Progress is drawn on
stderr only when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dist_workspace.clean import carry_out, plan_clean
from dist_workspace.errors import WorkspaceError
from dist_workspace.merge import (
    RankFile,
    merge_workspace,
    parse_dtype,
    read_rank_files,
    weights_of,
)
from dist_workspace.progress import terminal_progress
from dist_workspace.shm import shm_directory
from dist_workspace.units import format_bytes, format_size, parse_size
from dist_workspace.verify import verify_directory

EXIT_DAMAGED = 1
EXIT_ERROR = 2


def _rank_report(rank_file: RankFile) -> dict[str, Any]:
    header = rank_file.header
    infos = weights_of(rank_file)
    members: dict[str, list[str]] = {}
    for info in infos:
        if info.view is not None:
            members.setdefault(info.view.blob, []).append(info.name)
    blob_bytes = {entry.name: entry.end - entry.begin for entry in header.entries}
    stored = sum(info.nbytes for info in infos if info.view is None) + sum(
        blob_bytes[blob] for blob in members
    )
    tensors = []
    for info in infos:
        tensors.append(
            {
                "name": info.name,
                "dtype": info.dtype_name,
                "shape": list(info.shape),
                "bytes": info.nbytes,
                "shared": info.view is not None,
            }
        )
    return {
        "rank": rank_file.rank,
        "path": str(rank_file.path),
        "job": header.job,
        "file_bytes": header.total_size,
        "tensor_bytes": sum(info.nbytes for info in infos),
        "stored_bytes": stored,
        "shared_with": {
            name: [other for other in group if other != name]
            for group in members.values()
            for name in group
        },
        "config": json.loads(header.config_text),
        "tensors": tensors,
    }


def _print_rank(item: dict[str, Any]) -> None:
    print(
        f"rank {item['rank']}: {item['path']}, {format_size(item['file_bytes'])}, job {item['job']}"
    )
    print(f"  config: {json.dumps(item['config'])}")
    line = f"  tensors: {len(item['tensors'])}, {format_size(item['stored_bytes'])}"
    if item["stored_bytes"] != item["tensor_bytes"]:
        line += (
            ", shared storage counted once; "
            f"{format_bytes(item['tensor_bytes'])} if each were stored on its own"
        )
    print(line)
    for tensor in item["tensors"]:
        others = item["shared_with"].get(tensor["name"])
        shared = f"  (shares storage with {', '.join(others)})" if others else ""
        print(
            f"    {tensor['name']}  {tensor['dtype']}  {tuple(tensor['shape'])}  "
            f"{format_size(tensor['bytes'])}{shared}"
        )


def _inspect(directory: Path, as_json: bool, verify: bool) -> int:
    if not directory.is_dir():
        raise WorkspaceError(f"{directory} is not a directory")
    verdict = None
    if verify:
        with terminal_progress("verifying", sys.stderr) as progress:
            verdict = verify_directory(directory, progress)
        files = verdict.files
    else:
        files = read_rank_files(directory)
    report = [_rank_report(rank_file) for rank_file in files]
    if as_json:
        for item in report:
            del item["shared_with"]
        print(json.dumps(report, indent=2))
    else:
        if not report:
            print(f"{directory}: no rank files")
        for item in report:
            _print_rank(item)
        if report:
            stored = sum(item["stored_bytes"] for item in report)
            count = sum(len(item["tensors"]) for item in report)
            print(f"total: {len(report)} ranks, {count} tensors, {format_size(stored)}")
    if verdict is None:
        return 0
    print(verdict.summary(), file=sys.stderr if as_json else sys.stdout)
    return 0 if verdict.intact else EXIT_DAMAGED


def _merge(args: argparse.Namespace) -> int:
    with terminal_progress("merging", sys.stderr) as progress:
        result = merge_workspace(
            args.directory,
            args.output,
            rank_prefix=args.rank_prefix,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            overwrite=args.force,
            progress=progress,
        )
    files = "file" if len(result.files) == 1 else "files"
    print(
        f"wrote {result.tensors} tensors, {format_size(result.nbytes)}, to {args.output}"
        + ("" if args.max_shard_size is None else f" ({len(result.files)} {files})")
    )
    return 0


def _clean(directory: Path | None, dry_run: bool) -> int:
    if directory is not None and (directory.is_symlink() or not directory.is_dir()):
        raise WorkspaceError(f"{directory} is not a directory (clean does not follow symlinks)")
    plan = plan_clean(directory)
    where = f"{directory} and {shm_directory()}" if directory is not None else str(shm_directory())
    running = [kept for kept in plan.kept if kept.expected]
    for kept in plan.kept:
        if not kept.expected:
            print(f"kept {kept.path}: {kept.reason}")
    if running:
        print(f"kept {len(running)} shared-memory segments of running processes")
    if dry_run:
        for removal in plan.remove:
            print(f"would remove {removal.path} ({removal.reason})")
        print(f"dry run in {where}: would remove {len(plan.remove)}; nothing was removed")
        return 0
    removed, skipped = carry_out(plan)
    for kept in skipped:
        print(f"kept {kept.path}: {kept.reason}")
    for removal in removed:
        print(f"removed {removal.path} ({removal.reason})")
    print(f"cleaned {where}: {len(removed)} removed")
    return 0


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _dtype(text: str) -> Any:
    try:
        return parse_dtype(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``dist-workspace``."""
    parser = argparse.ArgumentParser(
        prog="dist-workspace",
        description="Inspect, merge and clean dist-workspace directories.",
        epilog="Exit status: 0 done, 1 inspect --verify found damage, 2 an error.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser(
        "inspect",
        help="list ranks, configs and tensors with their sizes",
        description="List each rank's config and tensors (sizes in binary units and "
        "bytes; storage shared between tensors counted once).",
    )
    inspect.add_argument("directory", type=Path)
    inspect.add_argument("--json", action="store_true", help="print JSON")
    inspect.add_argument(
        "--verify",
        action="store_true",
        help="also check every header and every tensor's CRC-32; end with one line saying "
        "what was checked and whether it is intact (exit status 1 if not)",
    )
    merge = commands.add_parser(
        "merge",
        help="merge rank files into safetensors (one file or a Hugging Face directory)",
        description="Stream every rank's weights into one safetensors file, or with "
        "--max-shard-size into a Hugging Face model directory (model.safetensors, or "
        "model-0000x-of-0000n.safetensors plus model.safetensors.index.json). Progress "
        "is shown when stderr is a terminal.",
    )
    merge.add_argument("directory", type=Path)
    merge.add_argument(
        "output", type=Path, help="the .safetensors file, or with --max-shard-size the directory"
    )
    merge.add_argument("--rank-prefix", action="store_true", help="name tensors rank{r}.{name}")
    merge.add_argument(
        "--dtype",
        type=_dtype,
        default=None,
        help="cast floating-point tensors (float16, bfloat16, float32, float64) to this dtype: "
        "bfloat16/bf16, float16/fp16/half, float32/fp32, float64/fp64; integer, bool, "
        "complex and float8 tensors are written as they are",
    )
    merge.add_argument(
        "--max-shard-size",
        type=_size,
        default=None,
        metavar="SIZE",
        help="write a Hugging Face model directory with shards of at most SIZE tensor bytes: "
        "5GB, 500MB (decimal, as transformers), 2GiB (binary) or a number of bytes",
    )
    merge.add_argument(
        "--force",
        action="store_true",
        help="replace an existing output (atomically); without it an existing output is "
        "refused before anything is read",
    )
    clean = commands.add_parser(
        "clean",
        help="remove a workspace's files and dead jobs' shared-memory segments",
        description="Remove only what is provably a workspace file of DIR or a "
        "shared-memory segment of this user whose creating process has ended; files in "
        "use (locked) and anything else are left alone.",
    )
    clean.add_argument("directory", type=Path, nargs="?")
    clean.add_argument(
        "--dry-run", action="store_true", help="print what would be removed; remove nothing"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns the exit status (1: damage found, 2: an error)."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return _inspect(args.directory, args.json, args.verify)
        if args.command == "merge":
            return _merge(args)
        return _clean(args.directory, args.dry_run)
    except (WorkspaceError, OSError, ValueError) as error:
        print(f"dist-workspace: error: {error}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
