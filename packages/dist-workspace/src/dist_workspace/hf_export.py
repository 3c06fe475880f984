"""Every rank writes its own part of a model, at once, as one Hugging Face checkpoint.

Gathering every tensor to rank 0 and writing one file is what makes large exports
slow: rank 0 receives the whole model and writes it alone. :func:`export_sharded`
lets every rank write the tensors it holds into a shard of its own, in parallel, and
the result is one checkpoint in the layout ``save_pretrained`` writes and
``safetensors`` and ``transformers`` load as usual::

    model-00001-of-0000N.safetensors ... model-0000N-of-0000N.safetensors
    model.safetensors.index.json   {"metadata": {"total_size": ...}, "weight_map": {...}}

It is built on ``torch.distributed.checkpoint`` and its ``HuggingFaceStorageWriter``
(in every torch this package supports, 2.11 and later), not on a format of our own:
each file's metadata carries ``"format": "pt"`` and DCP's own entries, the index is
DCP's. DCP gathers its save plans between the ranks with torch's object collectives
(pickle between the live ranks of the job, never from a file); what it writes is
safetensors and JSON.

What is added around DCP:

- **Visible only when complete.** The ranks write into a temporary directory beside
  ``output``; after every rank has finished (a barrier), the first rank of the group
  fsyncs it and renames it into place (or swaps it with an existing output in one
  step, :func:`dist_workspace.fsutil.swap_paths_atomically`, when ``overwrite``).
  A reader sees no checkpoint, or all of it.
- **Files numbered without gaps, in rank order**: a rank that holds tensors writes
  one file, or with ``max_shard_size`` as many as its tensors fill, packed in name
  order as ``save_pretrained`` packs them (:func:`dist_workspace.shard_plan.pack_in_order`,
  a tensor over the limit alone in its file). Each rank's packing depends on its own
  names and sizes only; the writer's global plan, which DCP makes from every rank's
  plan anyway, numbers the files: no extra collective. One file in all is named
  ``model.safetensors``, without an index, as ``save_pretrained`` names it.
- **Integer and bool tensors** are written as they are: nothing is consolidated, so
  torch's consolidation of such tensors (``torch.finfo`` on an integer dtype, pytorch
  #192485) never runs.
- **A name on two ranks is an error** naming the name and both ranks (DCP would keep
  one copy silently: replicated state is what it deduplicates). Names are compared by
  a 64-bit hash, gathered with tensor collectives.
- **An existing output is refused** before anything is written, unless
  ``overwrite``, as ``dist-workspace merge`` refuses one.

Every rank must see ``output``'s directory (a shared file system across hosts: the
rename that publishes the checkpoint is made on the first rank).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dist_workspace.errors import WorkspaceError
from dist_workspace.fsutil import fsync_directory, put_directory_in_place
from dist_workspace.merge import SAFE_WEIGHTS_NAME, check_output
from dist_workspace.shard_plan import numbered, pack_in_order
from dist_workspace.units import parse_size

logger = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
# HuggingFaceStorageWriter numbers files by the largest index in the mapping of a
# plan; this key names no tensor and makes every file say "-of-N" with one N.
_COUNT_KEY = "dist_workspace.shard_count"


def _item_bytes(item: Any) -> int:
    """The bytes of a DCP write item's tensor."""
    data = item.tensor_data
    return int(data.size.numel()) * int(data.properties.dtype.itemsize)


def _files_by_size_writer(path: str, limit: int | None) -> Any:
    """DCP's Hugging Face writer, each rank's tensors in files of their own.

    The coordinator sees every rank's plan: each rank's tensors, sorted by name, are
    packed into files of at most ``limit`` bytes (one file when None); files are
    numbered 1..N in rank order, and every plan carries N. Everything else (file
    names, headers, the index) is DCP's.
    """
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageWriter  # noqa: PLC0415

    class FilesBySize(HuggingFaceStorageWriter):
        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            packed = []
            for plan in plans:
                items = sorted(plan.items, key=lambda item: item.index.fqn)
                shards = pack_in_order([_item_bytes(item) for item in items], limit)
                packed.append([[items[i].index.fqn for i in shard] for shard in shards])
            firsts = numbered([len(files) for files in packed])
            count = max(sum(len(files) for files in packed), 1)
            planned = []
            for plan, files, first in zip(plans, packed, firsts, strict=True):
                mapping: dict[str, int] = {_COUNT_KEY: count}
                mapping.update({fqn: first + k for k, names in enumerate(files) for fqn in names})
                storage_data = {"fqn_to_index_mapping": mapping}
                planned.append(dataclasses.replace(plan, storage_data=storage_data))
            return planned

    return FilesBySize(path)


def _shard_limit(max_shard_size: int | str | None, rank: int) -> tuple[int | None, str | None]:
    """``max_shard_size`` in bytes (None: no limit), or the error naming what was wrong."""
    if max_shard_size is None:
        return None, None
    try:
        if isinstance(max_shard_size, str):
            limit = parse_size(max_shard_size)
        elif isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool):
            limit = max_shard_size
        else:
            raise ValueError(f"{max_shard_size!r} is a {type(max_shard_size).__name__}")
        if limit <= 0:
            raise ValueError(f"{max_shard_size!r} is not a positive size")
    except ValueError as error:
        return None, (
            f"rank {rank}: export_sharded got max_shard_size={max_shard_size!r}: {error}. "
            "Pass bytes (an int) or a size such as '5GB' or '500MiB'"
        )
    return limit, None


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


def _device_for(group: dist.ProcessGroup | None) -> torch.device:
    """Where the group's collectives take tensors: CPU, or this rank's GPU for NCCL alone."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and "cpu" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gathered(values: list[int], group: dist.ProcessGroup | None) -> list[list[int]]:
    """Every rank's list of ints (of any length), with tensor collectives only."""
    world = dist.get_world_size(group)
    device = _device_for(group)
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    mine = torch.tensor([len(values)], dtype=torch.int64, device=device)
    dist.all_gather(counts, mine, group=group)
    longest = max(int(count.item()) for count in counts)
    padded = torch.zeros(max(longest, 1), dtype=torch.int64, device=device)
    padded[: len(values)] = torch.tensor(values, dtype=torch.int64)
    every = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(every, padded, group=group)
    return [every[rank][: int(counts[rank].item())].tolist() for rank in range(world)]


def _fail_together(error: str | None, rank: int, group: Any, ranks: list[int]) -> None:
    """Raises on every rank when any rank found ``error`` (so that none waits for ever)."""
    failed = [
        ranks[index]
        for index, values in enumerate(_gathered([1 if error else 0], group))
        if values[0]
    ]
    if failed:
        raise WorkspaceError(error or f"rank {rank}: export_sharded failed on rank(s) {failed}")


def _name_clashes(names: list[str], rank: int, group: Any, ranks: list[int]) -> str | None:
    """This rank's names that another rank holds too, as an error, or None."""
    own = {_name_hash(name): name for name in names}
    everyone = _gathered(sorted(own), group)
    clashes = sorted(
        f"{own[value]!r} (ranks {rank} and {ranks[other]})"
        for other, values in enumerate(everyone)
        if ranks[other] != rank
        for value in set(values) & set(own)
    )
    if not clashes:
        return None
    return (
        f"rank {rank}: export_sharded needs every tensor name on one rank only; names on "
        f"two ranks: {', '.join(clashes)}. Give replicated tensors to one rank"
    )


def _agreed_directory(output: Path, group: dist.ProcessGroup | None, first: int) -> Path:
    """The temporary directory beside ``output``, named by the first rank for all."""
    token = torch.tensor(
        [secrets.randbits(62) if dist.get_rank() == first else 0],
        dtype=torch.int64,
        device=_device_for(group),
    )
    dist.broadcast(token, src=first, group=group)
    return output.parent / f".{output.name}.{int(token.item()):016x}.tmp"


def export_sharded(
    state_dict: dict[str, torch.Tensor],
    output: str | os.PathLike[str],
    *,
    group: dist.ProcessGroup | None = None,
    overwrite: bool = False,
    max_shard_size: int | str | None = None,
) -> Path:
    """Writes every rank's tensors at once as one Hugging Face sharded checkpoint.

    Every rank of ``group`` calls it with the tensors it holds (distinct names across
    ranks; a rank may hold none). Reads no environment variable.

    Args:
        state_dict: This rank's tensors (CPU or GPU), by their names in the model.
        output: The checkpoint directory to create; every rank must see its parent.
        group: The ranks that take part; None means the world.
        overwrite: Replace an existing checkpoint directory (in one step where the
            file system can); False refuses it.
        max_shard_size: Bytes of tensors per file at most (an int, or a size such
            as ``"5GB"``, decimal, or ``"500MiB"``, binary, as ``save_pretrained``
            reads them); None writes one file per rank that holds tensors.

    Returns:
        ``output`` as a Path, once the checkpoint is complete and visible.

    Raises:
        WorkspaceError: ``output`` exists (and not ``overwrite``) or is not ours to
            replace, a name is on two ranks (naming both), a value is not a tensor,
            or ``max_shard_size`` is not a positive size.
    """
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save  # noqa: PLC0415

    target = Path(output)
    rank = dist.get_rank()
    ranks = (
        dist.get_process_group_ranks(group)
        if group is not None
        else list(range(dist.get_world_size()))
    )
    first = ranks[0]
    limit, problem = _shard_limit(max_shard_size, rank)
    problem = problem or next(
        (
            f"rank {rank}: export_sharded needs tensors; {name!r} is a {type(value).__name__}"
            for name, value in state_dict.items()
            if not isinstance(value, torch.Tensor)
        ),
        None,
    )
    if rank == first and problem is None:
        try:
            check_output(target, directory=True, overwrite=overwrite)
        except WorkspaceError as error:
            problem = f"rank {rank}: {error}"
    _fail_together(problem, rank, group, ranks)
    _fail_together(_name_clashes(list(state_dict), rank, group, ranks), rank, group, ranks)
    building = _agreed_directory(target, group, first)
    if rank == first:
        os.mkdir(building, 0o755)
    dist.barrier(group=group)
    try:
        dcp_save(
            state_dict,
            storage_writer=_files_by_size_writer(str(building), limit),
            process_group=group,
        )
        dist.barrier(group=group)  # every rank's files are written and fsynced
        if rank == first:
            _publish(building, target)
    except BaseException:
        if rank == first:
            shutil.rmtree(building, ignore_errors=True)
        raise
    dist.barrier(group=group)  # the checkpoint is visible before any rank returns
    return target


def _publish(building: Path, target: Path) -> None:
    # DCP may write bookkeeping of its own beside the shards; the checkpoint is the
    # shards and the index.
    for leftover in building.iterdir():
        if leftover.name != INDEX_NAME and not leftover.name.endswith(".safetensors"):
            if leftover.is_dir():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
    files = sorted(building.glob("*.safetensors"))
    if len(files) == 1:  # one file: named as save_pretrained names it, no index
        files[0].rename(building / SAFE_WEIGHTS_NAME)
        (building / INDEX_NAME).unlink(missing_ok=True)
    fsync_directory(building)
    put_directory_in_place(building, target)
    fsync_directory(target.parent)
    logger.info("published the sharded checkpoint %s", target)
