"""hang.json's keys and types, from a verdict on real records (no process)."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

from dist_launch.diagnostics.flight_records import parse_rank_records
from dist_launch.diagnostics.hang_json import RankPlace, hang_document, stack_frames
from dist_launch.diagnostics.verdict import decide_verdict

DATA = Path(__file__).parent / "data" / "flight_records_2.13"
LIB = sysconfig.get_paths()["purelib"]
STACK = f"""\
Thread 0x00007f01 (most recent call first):
  File "{LIB}/threading.py", line 331 in wait
  File "/x/dist_launch/in_worker/beacon.py", line 109 in _run_beacon

Current thread 0x00007f00 (most recent call first):
  File "{LIB}/torch/distributed/distributed_c10d.py", line 2806 in all_reduce
  File "/job/train.py", line 9 in <module>
  File "/x/dist_launch/in_worker/bootstrap.py", line 120 in run_script
"""


def test_frames_are_file_line_function_most_recent_first_without_the_launchers() -> None:
    assert stack_frames(STACK) == [
        f"{LIB}/torch/distributed/distributed_c10d.py:2806 in all_reduce",
        "/job/train.py:9 in <module>",
    ]


def test_the_document_has_the_documented_keys_and_types() -> None:
    records = {r: parse_rank_records((DATA / f"rank{r}.json").read_bytes(), r) for r in range(3)}
    stacks = {r: STACK for r in range(3)}
    verdict = decide_verdict(records, job_ranks=range(3), stacks=stacks)
    document = hang_document(
        reason="no rank on this node made progress for 8 s (--hang-timeout 8)",
        node="h (node 0)",
        attempt=0,
        time="2026-01-01T00:00:00+00:00",
        verdict=verdict,
        records=records,
        stacks=stacks,
        places={r: RankPlace(0, "h", r) for r in range(3)},
        collect_s=0.25,
    )
    document = json.loads(json.dumps(document))  # what a tool reads
    assert document["version"] == 1
    assert document["source"] == "flight recorder"
    assert document["collective"] == {
        "group": "default", "backend": "gloo", "seq": 4, "op": "all_reduce",
        "sizes": [[4]], "members": [0, 1, 2],
    }  # fmt: skip
    assert (document["waiting"], document["behind"], document["unknown"]) == ([0, 1], [2], [])
    assert document["desync"] == []
    assert [group["group"] for group in document["groups"]] == ["default", "1"]
    assert sorted(document["ranks"]) == ["0", "1", "2"]
    rank2 = document["ranks"]["2"]
    assert (rank2["node"], rank2["host"], rank2["local_rank"], rank2["records"]) == (
        0,
        "h",
        2,
        None,
    )
    assert rank2["stack"] == stack_frames(STACK)
    assert rank2["groups"] == {
        "default": {"backend": "gloo", "last_enqueued": 3, "last_completed": 3},
        "1": {
            "backend": "gloo", "last_enqueued": 2, "last_completed": 1,
            "pending": {"seq": 2, "op": "all_reduce", "sizes": [[4]]},
        },
    }  # fmt: skip
    assert document["collect_s"] == 0.25
