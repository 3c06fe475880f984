"""A rank's records file, parsed: real torch 2.13 dumps, and every way a file can be bad."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_launch.diagnostics.flight_records import (
    MAX_RECORDS_BYTES,
    RecordsError,
    parse_rank_records,
)

DATA = Path(__file__).parent / "data" / "flight_records_2.13"


def real(rank: int) -> bytes:
    return (DATA / f"rank{rank}.json").read_bytes()


def test_a_real_dump_gives_each_groups_counters_ops_and_members() -> None:
    records = parse_rank_records(real(2), 2)
    assert records.missing is None
    assert records.torch == "2.13.0+cpu"
    default = records.groups[("0", "gloo")]
    assert default.is_default
    assert (default.last_enqueued, default.last_completed) == (3, 3)
    assert default.members == (0, 1, 2)
    assert [default.ops[seq].describe() for seq in (1, 2, 3)] == ["all_reduce [4]"] * 3
    pair = records.groups[("1", "gloo")]
    assert not pair.is_default
    assert (pair.last_enqueued, pair.last_completed) == (2, 1)
    assert pair.members == (1, 2)
    assert pair.ops[1].describe() == "broadcast [4]"
    assert pair.ops[2].created_ns > pair.ops[1].created_ns > 0


def test_a_group_is_named_by_its_entries_not_by_the_ranks_own_number() -> None:
    # Rank 0's second group is its own number 1 in the dump, but torch's group "2".
    records = parse_rank_records(real(0), 0)
    assert set(records.groups) == {("0", "gloo"), ("2", "gloo")}
    assert records.groups[("2", "gloo")].ops[1].describe() == "all_reduce [2, 3]"


def _edited(rank: int, edit: object) -> bytes:
    data = json.loads(real(rank))
    edit(data)  # type: ignore[operator]
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (real(1)[:200], r"rank 1's records f: \(file\): not JSON"),
        (b"[1, 2]", r"rank 1's records f: \(file\): expected dict, found list"),
        (_edited(1, lambda d: d["header"].update(rank=2)), r"header.rank: the file is rank 2's"),
        (
            _edited(1, lambda d: d["fr"]["pg_status"]["0"].update(last_enqueued_collective="x")),
            r"fr.pg_status.0.last_enqueued_collective: expected an integer, found 'x'",
        ),
        (
            _edited(1, lambda d: d["fr"]["entries"][0].update(input_sizes="4")),
            r"fr.entries\[0\].input_sizes: expected list, found str",
        ),
        (
            _edited(1, lambda d: d["fr"]["entries"][1].update(process_group=["0"])),
            r"fr.entries\[1\].process_group: expected \[name, desc\]",
        ),
        (
            _edited(1, lambda d: d["header"]["groups"][0].update(ranks=None)),
            r"header.groups\[0\].ranks: expected list, found NoneType",
        ),
    ],
    ids=["truncated", "not-an-object", "another-ranks", "counter", "sizes", "group", "members"],
)
def test_a_bad_file_names_the_rank_the_file_and_the_key(text: bytes, message: str) -> None:
    with pytest.raises(RecordsError, match=message):
        parse_rank_records(text, 1, "f")


def test_an_oversized_file_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(RecordsError, match=f"more than {MAX_RECORDS_BYTES}"):
        parse_rank_records(b" " * (MAX_RECORDS_BYTES + 1), 3, "big")


def test_a_recorder_turned_off_says_so() -> None:
    header = {"id": 1, "kind": "hang", "rank": 0, "torch": "2.13.0", "buffer_size": "0"}
    # What torch 2.13 dumps with TORCH_FR_BUFFER_SIZE=0: no group status at all.
    text = json.dumps({"header": header, "fr": {"version": "2.10", "pg_status": {}}})
    records = parse_rank_records(text, 0)
    assert records.missing == "TORCH_FR_BUFFER_SIZE=0 turns torch's flight recorder off"
    assert records.groups == {}


def test_a_rank_without_a_process_group_says_why() -> None:
    header = {"id": 1, "kind": "hang", "rank": 0, "missing": "torch.distributed is not initialised"}
    records = parse_rank_records(json.dumps({"header": header}), 0)
    assert records.missing == "torch.distributed is not initialised"
