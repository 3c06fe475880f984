"""A rank's records file, parsed: per process group, its last collectives (pure).

The file is what :mod:`dist_launch.in_worker.records` wrote: a header (the rank, torch's
version, the groups the rank belongs to, why records are missing) and torch's flight
recorder dumps (``_dump_fr_trace_json``; ``_dump_nccl_trace_json`` in CUDA builds).
A dump's ``pg_status`` gives each group's last enqueued and last completed collective
sequence number (torch's own, 1-based per group); its ``entries`` give, per
collective, the op (``gloo:all_reduce``), the input sizes and dtypes and when the rank
enqueued it (wall clock, ns). On gloo, ``last_started_collective`` is -1 and point to
point operations report no completion; neither is used.

The file is JSON: nothing is unpickled. A malformed field raises :class:`RecordsError`
naming the rank, the file and the key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# A dump of 2000 entries is about 1 MB; a user's larger TORCH_FR_BUFFER_SIZE grows it.
MAX_RECORDS_BYTES = 64 * 1024 * 1024
DEFAULT_GROUP_DESC = "default_pg"


class RecordsError(ValueError):
    """A rank's records file is not what the worker writes: names the rank, file and key."""


@dataclass(frozen=True)
class Op:
    """One collective a rank enqueued."""

    op: str  # all_reduce
    sizes: tuple[tuple[int, ...], ...]  # the input tensors' shapes
    dtypes: tuple[str, ...]
    created_ns: int  # when the rank enqueued it (wall clock)

    def describe(self) -> str:
        """``all_reduce [4]`` (the shapes of its inputs, ``[4], [8]`` for two)."""
        if not self.sizes:
            return self.op
        return f"{self.op} " + ", ".join(f"[{', '.join(map(str, s))}]" for s in self.sizes)


# A process group as the records name it: its torch name and its backend (one group
# with gloo and nccl has two counters).
GroupKey = tuple[str, str]


@dataclass(frozen=True)
class GroupRecords:
    """One process group as one rank recorded it.

    Attributes:
        name: torch's name of the group (``0`` for the default group on torch 2.13).
        desc: torch's description (``default_pg`` for the default group).
        backend: ``gloo``, ``nccl``, ...
        last_enqueued: The last collective's sequence number the rank enqueued (0: none).
        last_completed: The last one it completed.
        ops: The collectives still in the recorder's ring, by sequence number.
        members: The group's global ranks, as the rank declared them; None if unknown.
    """

    name: str
    desc: str
    backend: str
    last_enqueued: int
    last_completed: int
    ops: Mapping[int, Op] = field(default_factory=dict)
    members: tuple[int, ...] | None = None

    @property
    def is_default(self) -> bool:
        """True for the default (world) group."""
        return self.desc == DEFAULT_GROUP_DESC

    @property
    def key(self) -> GroupKey:
        """(name, backend)."""
        return (self.name, self.backend)


@dataclass(frozen=True)
class RankRecords:
    """What one rank recorded: each group's records, or why there are none.

    Attributes:
        rank: The global rank.
        torch: torch's version in the rank.
        groups: Each group's records, by (name, backend).
        missing: Why the rank has no records (no process group, a torch without the
            dump, ``TORCH_FR_BUFFER_SIZE=0``); None when it has them.
        dump_s: Seconds the rank spent taking the dump, when it said.
    """

    rank: int
    torch: str | None
    groups: Mapping[GroupKey, GroupRecords]
    missing: str | None = None
    dump_s: float | None = None


def _fail(rank: int, source: str, key: str, what: str) -> RecordsError:
    return RecordsError(f"rank {rank}'s records {source}: {key}: {what}")


def _as_int(value: Any, rank: int, source: str, key: str) -> int:
    if isinstance(value, bool):
        raise _fail(rank, source, key, f"expected an integer, found {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise _fail(rank, source, key, f"expected an integer, found {value!r}")


def _as(kind: type, value: Any, rank: int, source: str, key: str) -> Any:
    if not isinstance(value, kind):
        raise _fail(rank, source, key, f"expected {kind.__name__}, found {type(value).__name__}")
    return value


def _sizes(value: Any, rank: int, source: str, key: str) -> tuple[tuple[int, ...], ...]:
    shapes = _as(list, value, rank, source, key)
    result = []
    for shape in shapes:
        dims = _as(list, shape, rank, source, key)
        result.append(tuple(_as_int(dim, rank, source, key) for dim in dims))
    return tuple(result)


def _parse_dump(
    dump: Any,
    dump_name: str,
    rank: int,
    source: str,
    declared: Mapping[str, tuple[str, str | None, tuple[int, ...] | None]],
) -> dict[GroupKey, GroupRecords]:
    """One torch dump's groups. ``declared``: name -> (desc, backend, members)."""
    dump = _as(dict, dump, rank, source, dump_name)
    status = _as(dict, dump.get("pg_status", {}), rank, source, f"{dump_name}.pg_status")
    entries = _as(list, dump.get("entries", []), rank, source, f"{dump_name}.entries")
    names: dict[str, tuple[str, str]] = {}  # pg_id -> (name, desc)
    backends: dict[str, str] = {}  # pg_id -> backend
    ops: dict[str, dict[int, Op]] = {}
    for index, entry in enumerate(entries):
        where = f"{dump_name}.entries[{index}]"
        entry = _as(dict, entry, rank, source, where)
        pg_id = str(_as_int(entry.get("pg_id"), rank, source, f"{where}.pg_id"))
        group = _as(list, entry.get("process_group"), rank, source, f"{where}.process_group")
        if len(group) != 2 or not all(isinstance(part, str) for part in group):
            raise _fail(rank, source, f"{where}.process_group", f"expected [name, desc]: {group!r}")
        names[pg_id] = (group[0], group[1])
        profiling = str(
            _as(str, entry.get("profiling_name"), rank, source, f"{where}.profiling_name")
        )
        backend, _, op = profiling.rpartition(":")
        if backend:
            backends[pg_id] = backend
        if entry.get("is_p2p"):
            continue  # gloo reports no completion of point to point operations
        seq = _as_int(entry.get("collective_seq_id"), rank, source, f"{where}.collective_seq_id")
        ops.setdefault(pg_id, {})[seq] = Op(
            op=op or profiling,
            sizes=_sizes(entry.get("input_sizes", []), rank, source, f"{where}.input_sizes"),
            dtypes=tuple(
                str(d)
                for d in _as(
                    list, entry.get("input_dtypes", []), rank, source, f"{where}.input_dtypes"
                )
            ),
            created_ns=_as_int(
                entry.get("time_created_ns", 0), rank, source, f"{where}.time_created_ns"
            ),
        )
    groups: dict[GroupKey, GroupRecords] = {}
    for pg_id, counters in status.items():
        where = f"{dump_name}.pg_status.{pg_id}"
        counters = _as(dict, counters, rank, source, where)
        if str(pg_id) not in names:
            # pg_id is the rank's own number for the group; only its entries name it.
            # A group none of whose collectives is left in the ring is long past.
            continue
        name, desc = names[str(pg_id)]
        declared_desc, declared_backend, members = declared.get(name) or ("", None, None)
        backend = (
            backends.get(str(pg_id))
            or declared_backend
            or ("nccl" if dump_name == "nccl" else "gloo")
        )
        records = GroupRecords(
            name=name,
            desc=desc or declared_desc,
            backend=backend,
            last_enqueued=max(
                0,
                _as_int(
                    counters.get("last_enqueued_collective"),
                    rank,
                    source,
                    f"{where}.last_enqueued_collective",
                ),
            ),
            last_completed=max(
                0,
                _as_int(
                    counters.get("last_completed_collective"),
                    rank,
                    source,
                    f"{where}.last_completed_collective",
                ),
            ),
            ops=ops.get(str(pg_id), {}),
            members=members,
        )
        groups[records.key] = records
    return groups


def parse_rank_records(text: bytes | str, rank: int, source: str = "file") -> RankRecords:
    """Parses one rank's records file (see the module docstring).

    Args:
        text: The file's contents.
        rank: The global rank that wrote it (the header must say the same).
        source: How errors name the file (its path).

    Raises:
        RecordsError: The file is too large, not JSON, or a field is malformed.
    """
    if len(text) > MAX_RECORDS_BYTES:
        raise _fail(rank, source, "(file)", f"{len(text)} bytes, more than {MAX_RECORDS_BYTES}")
    try:
        data = json.loads(text)
    except ValueError as error:
        raise _fail(rank, source, "(file)", f"not JSON ({error})") from None
    data = _as(dict, data, rank, source, "(file)")
    header = _as(dict, data.get("header"), rank, source, "header")
    said = _as_int(header.get("rank"), rank, source, "header.rank")
    if said != rank:
        raise _fail(rank, source, "header.rank", f"the file is rank {said}'s")
    version = header.get("torch")
    missing = header.get("missing")
    declared: dict[str, tuple[str, str | None, tuple[int, ...] | None]] = {}
    for index, group in enumerate(
        _as(list, header.get("groups") or [], rank, source, "header.groups")
    ):
        where = f"header.groups[{index}]"
        group = _as(dict, group, rank, source, where)
        members = tuple(
            _as_int(member, rank, source, f"{where}.ranks")
            for member in _as(list, group.get("ranks"), rank, source, f"{where}.ranks")
        )
        backend = group.get("backend")
        declared[str(group.get("name"))] = (
            str(group.get("desc") or ""),
            None if backend is None else str(backend),
            members,
        )
    groups: dict[GroupKey, GroupRecords] = {}
    for dump_name in ("fr", "nccl"):
        if dump_name in data:
            groups.update(_parse_dump(data[dump_name], dump_name, rank, source, declared))
    if missing is None and not groups:
        if header.get("buffer_size") == "0":
            missing = "TORCH_FR_BUFFER_SIZE=0 turns torch's flight recorder off"
        else:
            missing = "torch's flight recorder holds no process group"
    dump_s = header.get("dump_s")
    return RankRecords(
        rank=rank,
        torch=None if version is None else str(version),
        groups=groups if missing is None else {},
        missing=None if missing is None else str(missing),
        dump_s=float(dump_s) if isinstance(dump_s, int | float) else None,
    )


def records_to_json(records: RankRecords, last: int | None = None) -> dict[str, Any]:
    """``records`` as a JSON value another node reads back (:func:`records_from_json`).

    Args:
        records: One rank's records.
        last: Keep only each group's ``last`` highest sequence numbers (a hang's verdict
            needs a few; a slow-rank window needs them all).
    """
    groups = []
    for group in records.groups.values():
        seqs = sorted(group.ops)
        if last is not None:
            seqs = seqs[-last:]
        groups.append(
            {
                "name": group.name,
                "desc": group.desc,
                "backend": group.backend,
                "last_enqueued": group.last_enqueued,
                "last_completed": group.last_completed,
                "members": None if group.members is None else list(group.members),
                "ops": [
                    [seq, op.op, [list(s) for s in op.sizes], list(op.dtypes), op.created_ns]
                    for seq in seqs
                    for op in (group.ops[seq],)
                ],
            }
        )
    return {"torch": records.torch, "missing": records.missing, "groups": groups}


def records_from_json(value: Any, rank: int, source: str = "another node") -> RankRecords:
    """Reads back what :func:`records_to_json` wrote.

    Raises:
        RecordsError: A field is malformed; names the rank, the source and the key.
    """
    value = _as(dict, value, rank, source, "(records)")
    groups: dict[GroupKey, GroupRecords] = {}
    for index, group in enumerate(_as(list, value.get("groups") or [], rank, source, "groups")):
        where = f"groups[{index}]"
        group = _as(dict, group, rank, source, where)
        ops: dict[int, Op] = {}
        for op in _as(list, group.get("ops") or [], rank, source, f"{where}.ops"):
            seq, name, sizes, dtypes, created = _as(list, op, rank, source, f"{where}.ops")
            ops[_as_int(seq, rank, source, f"{where}.ops")] = Op(
                str(name),
                _sizes(sizes, rank, source, f"{where}.ops"),
                tuple(str(d) for d in _as(list, dtypes, rank, source, f"{where}.ops")),
                _as_int(created, rank, source, f"{where}.ops"),
            )
        members = group.get("members")
        records = GroupRecords(
            name=str(group.get("name")),
            desc=str(group.get("desc") or ""),
            backend=str(group.get("backend")),
            last_enqueued=_as_int(
                group.get("last_enqueued"), rank, source, f"{where}.last_enqueued"
            ),
            last_completed=_as_int(
                group.get("last_completed"), rank, source, f"{where}.last_completed"
            ),
            ops=ops,
            members=None
            if members is None
            else tuple(
                _as_int(m, rank, source, f"{where}.members")
                for m in _as(list, members, rank, source, f"{where}.members")
            ),
        )
        groups[records.key] = records
    missing = value.get("missing")
    torch = value.get("torch")
    return RankRecords(
        rank,
        None if torch is None else str(torch),
        groups,
        None if missing is None else str(missing),
    )
