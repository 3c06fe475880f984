"""A worker's answer to the launcher's request for its collective records.

torch keeps, per process group, the collectives each rank enqueued and completed (its
*flight recorder*: sequence numbers, ops, sizes, when each was enqueued). When the
launcher finds a hang, and once per slow-rank window, it asks every rank for them
through a FIFO (``DIST_LAUNCH_REQUESTS``): one JSON line per request,
``{"id": 7, "kind": "hang"}``. The worker's beacon thread
(:mod:`dist_launch.in_worker.beacon`) reads it and calls :func:`answer`, which writes
``rank<r>.records.<id>.json`` beside the FIFO, atomically (a temporary file, then a
rename), so the launcher never reads half a file. A rank blocked in a collective sits
in C++ with the GIL released: the beacon's thread can still take it and answer, which
a Python signal handler (run only by the main thread) could not.

The file is one JSON object: ``header`` (the request's id and kind, the rank, torch's
version, ``TORCH_FR_BUFFER_SIZE`` as the rank saw it, the process groups the rank
belongs to with their global ranks, and why records are missing, if they are) and
``fr`` / ``nccl``: torch's own JSON dumps, spliced in unparsed (the rank pays for the
dump only; the launcher parses, :mod:`dist_launch.diagnostics.flight_records`).
Nothing is pickled.

Standard library only at import; torch is touched only when the script imported
``torch.distributed`` and initialised it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REQUESTS_VARIABLE = "DIST_LAUNCH_REQUESTS"
# torch's flight recorder's size (entries per recorder); 0 turns it off.
BUFFER_SIZE_VARIABLE = "TORCH_FR_BUFFER_SIZE"
# The NCCL recorder's older name, which torch still reads.
NCCL_BUFFER_SIZE_VARIABLE = "TORCH_NCCL_TRACE_BUFFER_SIZE"
REQUEST_KINDS = ("hang", "window")
MAX_REQUEST_BYTES = 4096


def records_path(requests: str | os.PathLike[str], rank: int, request_id: int) -> Path:
    """Where rank ``rank`` answers request ``request_id`` (beside the FIFO)."""
    return Path(requests).parent / f"rank{rank}.records.{request_id}.json"


def parse_requests(data: bytes) -> list[dict[str, Any]]:
    """The well-formed requests in what was read from the FIFO; others are dropped."""
    requests = []
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            request = json.loads(line)
            if (
                isinstance(request, dict)
                and isinstance(request.get("id"), int)
                and request.get("kind") in REQUEST_KINDS
            ):
                requests.append(request)
    return requests


def _groups(distributed: Any) -> list[dict[str, Any]]:
    """The process groups this rank belongs to: name, description, backend, global ranks.

    torch's flight recorder names each group but does not say which ranks belong to
    it (on gloo its group table is empty): the rank itself knows, from torch's private
    registry of groups.
    """
    world = distributed.distributed_c10d._world
    groups = []
    for group, ranks in list(world.pg_group_ranks.items()):
        name = str(world.pg_names.get(group, ""))
        if not name:
            continue  # a group this rank is not a member of
        backend = world.pg_map.get(group, (None,))[0]
        groups.append(
            {
                "name": name,
                "desc": str(getattr(group, "group_desc", "") or ""),
                "backend": None if backend is None else str(backend),
                "ranks": sorted(int(rank) for rank in ranks),
            }
        )
    return groups


def collect(rank: int, request: dict[str, Any]) -> bytes:
    """This rank's records file, as bytes (see the module docstring)."""
    header: dict[str, Any] = {
        "id": request["id"],
        "kind": request["kind"],
        "rank": rank,
        "torch": None,
        "buffer_size": os.environ.get(BUFFER_SIZE_VARIABLE),
        "groups": None,
        "missing": None,
    }
    dumps: dict[str, bytes] = {}
    started = time.perf_counter()
    distributed = sys.modules.get("torch.distributed")
    torch = sys.modules.get("torch")
    if torch is not None:
        header["torch"] = str(getattr(torch, "__version__", "unknown"))
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        header["missing"] = "torch.distributed is not initialised"
    else:
        try:
            header["groups"] = _groups(distributed)
        except Exception as error:  # private API: it may move
            header["groups_error"] = f"{type(error).__name__}: {error}"
        c10d = torch._C._distributed_c10d  # type: ignore[union-attr]
        dump = getattr(c10d, "_dump_fr_trace_json", None)
        if dump is None:
            header["missing"] = f"torch {header['torch']} has no _dump_fr_trace_json"
        else:
            try:
                dumps["fr"] = bytes(dump(includeCollectives=True, onlyActive=False))
            except Exception as error:
                header["missing"] = f"_dump_fr_trace_json failed: {type(error).__name__}: {error}"
        nccl_dump = getattr(c10d, "_dump_nccl_trace_json", None)
        cuda = getattr(torch, "cuda", None)
        if nccl_dump is not None and cuda is not None and cuda.is_initialized():
            with contextlib.suppress(Exception):
                dumps["nccl"] = bytes(nccl_dump(includeCollectives=True, onlyActive=False))
    # What the dump cost the rank (it holds the GIL): the slow-rank report keeps it small.
    header["dump_s"] = round(time.perf_counter() - started, 6)
    parts = [b'{"header": ', json.dumps(header).encode()]
    for name, text in dumps.items():
        # torch's dump is JSON already: spliced in, not parsed and written again.
        parts += [b', "', name.encode(), b'": ', text]
    parts.append(b"}")
    return b"".join(parts)


def answer(requests: str | os.PathLike[str], rank: int, request: dict[str, Any]) -> Path:
    """Writes this rank's answer to ``request`` atomically; returns its path."""
    path = records_path(requests, rank, int(request["id"]))
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_bytes(collect(rank, request))
    os.replace(temporary, path)
    return path
