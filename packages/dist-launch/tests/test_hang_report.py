"""Grouping stacks and naming the odd ranks of a hang, from faulthandler text."""

from __future__ import annotations

import sysconfig

from dist_launch.diagnostics.flight_records import GroupRecords, Op, RankRecords
from dist_launch.diagnostics.hang_report import HangReport, describe_place, summarize_stacks
from dist_launch.diagnostics.stacks import main_thread_frames
from dist_launch.diagnostics.verdict import decide_verdict

LIB = sysconfig.get_paths()["purelib"]
ALL_REDUCE = f"""\
Current thread 0x00007f{{tid}} (most recent call first):
  File "{LIB}/torch/distributed/distributed_c10d.py", line 2806 in all_reduce
  File "{LIB}/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/home/me/train.py", line 88 in main
  File "/home/me/train.py", line 95 in <module>
"""
LOADER = """\
Current thread 0x00007f{tid} (most recent call first):
  File "/home/me/loader.py", line 41 in next_batch
  File "/home/me/train.py", line 86 in main
  File "/home/me/train.py", line 95 in <module>
"""
BEACON_THREAD = f"""\
Thread 0x00007f99 (most recent call first):
  File "{LIB}/threading.py", line 331 in wait
  File "/x/dist_launch/in_worker/beacon.py", line 109 in _sample_main_thread

"""


def test_the_odd_rank_is_named_beside_where_the_others_wait() -> None:
    stacks = {rank: ALL_REDUCE.format(tid=rank) for rank in (0, 1, 2, 4, 5, 6, 7)}
    stacks[3] = LOADER.format(tid=3)
    summary = summarize_stacks(stacks)
    assert summary == (
        "ranks 0-2, 4-7 wait in all_reduce at train.py:88; "
        "rank 3 is elsewhere: loader.py:41 in next_batch"
    )
    assert HangReport("why", "n1 (node 0)", stacks).odd_rank == 3


def test_a_tie_prefers_the_ranks_waiting_in_a_library_as_the_main_group() -> None:
    stacks = {0: ALL_REDUCE.format(tid=0), 1: LOADER.format(tid=1)}
    assert summarize_stacks(stacks).startswith("rank 0 waits in all_reduce at train.py:88; rank 1")
    assert HangReport("why", "n", stacks).odd_rank == 1


def test_all_ranks_in_one_place_name_no_odd_rank() -> None:
    stacks = {rank: ALL_REDUCE.format(tid=rank) for rank in range(4)}
    assert summarize_stacks(stacks) == "ranks 0-3 wait in all_reduce at train.py:88"
    assert HangReport("why", "n", stacks).odd_rank is None


def test_the_main_thread_is_the_last_block_and_the_beacon_thread_is_ignored() -> None:
    stack = BEACON_THREAD + LOADER.format(tid=1)
    frames = main_thread_frames(stack)
    assert frames[0].function == "next_batch"
    assert describe_place(stack) == "loader.py:41 in next_batch"
    grouped = summarize_stacks({0: stack, 1: LOADER.format(tid=2)})
    assert grouped == "ranks 0-1 are at loader.py:41 in next_batch"


def test_the_report_shows_reason_summary_and_stacks() -> None:
    stacks = {0: ALL_REDUCE.format(tid=0), 1: ALL_REDUCE.format(tid=1), 2: LOADER.format(tid=2)}
    text = HangReport("no rank made progress for 3 s", "n1 (node 0)", stacks).format()
    assert text.splitlines()[0] == (
        "dist-launch: hang on node n1 (node 0): no rank made progress for 3 s"
    )
    assert "ranks 0-1: same stack" in text
    assert "progress.py" not in text


def _records(enq: int, comp: int) -> RankRecords:
    ops = {enq: Op("all_reduce", ((4,),), ("Float",), 1)}
    group = GroupRecords("0", "default_pg", "gloo", enq, comp, ops)
    return RankRecords(0, "2.13.0", {group.key: group})


def test_the_verdict_comes_first_and_the_rest_is_as_before() -> None:
    stacks = {rank: ALL_REDUCE.format(tid=rank) for rank in range(3)}
    records = {
        rank: RankRecords(rank, "2.13.0", _records(enq, 1).groups)
        for rank, enq in ((0, 2), (1, 1), (2, 2))
    }
    verdict = decide_verdict(records, job_ranks=range(3), stacks=stacks)
    without = HangReport("no rank made progress for 3 s", "n1 (node 0)", stacks).format()
    text = HangReport("no rank made progress for 3 s", "n1 (node 0)", stacks, verdict).format()
    assert text.splitlines()[0] == (
        "dist-launch: hang: rank 1 never entered all_reduce #2 on the default group; "
        "ranks 0, 2 wait in it; rank 1 waits in all_reduce at train.py:88"
    )
    assert text.splitlines()[1:] == without.splitlines()  # the stacks' report, unchanged


def test_the_fallback_says_why_there_are_no_records() -> None:
    stacks = {0: ALL_REDUCE.format(tid=0), 1: LOADER.format(tid=1), 2: ALL_REDUCE.format(tid=2)}
    missing = {
        r: RankRecords(r, None, {}, missing="torch.distributed is not initialised")
        for r in range(3)
    }
    verdict = decide_verdict(missing, job_ranks=range(3), stacks=stacks)
    text = HangReport("why", "n1 (node 0)", stacks, verdict).format()
    assert text.splitlines()[0] == (
        "dist-launch: hang: no flight records (torch.distributed is not initialised on "
        "ranks 0-2); from the stacks: rank 1 is at loader.py:41 in next_batch"
    )
