"""The hang verdict from every rank's records, row by row (no process)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from dist_launch.diagnostics.flight_records import GroupRecords, Op, RankRecords, parse_rank_records
from dist_launch.diagnostics.verdict import decide_verdict

DATA = Path(__file__).parent / "data" / "flight_records_2.13"

# Waiting in torch: a frame in the installed packages.
TORCH_FILE = f"{sysconfig.get_paths()['purelib']}/torch/distributed/distributed_c10d.py"
WAITING = (
    "Thread 0x1 (most recent call first):\n"
    f'  File "{TORCH_FILE}", line 9 in all_reduce\n'
    '  File "/job/train.py", line 14 in <module>\n'
)
SLEEPING = (
    "Thread 0x2 (most recent call first):\n"
    '  File "/job/train.py", line 6 in load_next_batch\n'
    '  File "/job/train.py", line 13 in <module>\n'
)


def op(name: str = "all_reduce", size: int = 4, at: int = 0) -> Op:
    return Op(name, ((size,),), ("Float",), at)


def group(
    enq: int,
    comp: int,
    *,
    name: str = "0",
    members: tuple[int, ...] | None = None,
    ops: dict[int, Op] | None = None,
) -> GroupRecords:
    desc = "default_pg" if name == "0" else "undefined"
    if ops is None:
        ops = {seq: op() for seq in range(max(1, enq - 2), enq + 1)}
    return GroupRecords(name, desc, "gloo", enq, comp, ops, members)


def rank(r: int, *groups: GroupRecords) -> RankRecords:
    return RankRecords(r, "2.13.0", {g.key: g for g in groups})


def test_a_rank_passing_another_group_is_behind_on_the_default_group() -> None:
    # Every rank at one line of the script; rank 2 passes group=pair (ranks 1-2).
    records = {r: rank(r, group(6, 5)) for r in (0, 3)}
    records[1] = rank(1, group(6, 5), group(0, 0, name="1", members=(1, 2), ops={}))
    records[2] = rank(2, group(5, 5), group(1, 0, name="1", members=(1, 2), ops={1: op()}))
    verdict = decide_verdict(records, job_ranks=range(4), stacks={r: WAITING for r in range(4)})
    assert verdict.collective is not None
    assert (verdict.collective.label, verdict.collective.seq) == ("default", 6)
    assert (verdict.waiting, verdict.behind, verdict.unknown) == ((0, 1, 3), (2,), ())
    assert verdict.headline() == (
        "rank 2 never entered all_reduce #6 on the default group; ranks 0-1, 3 wait in it; "
        "rank 2 waits in all_reduce #1 on group 1"
    )
    (pair,) = [g for g in verdict.groups if g.name == "1"]
    assert (pair.waiting, pair.behind) == ((2,), (1,))


def test_a_rank_asleep_is_behind_and_told_by_its_stack() -> None:
    records = {r: rank(r, group(2, 1)) for r in (0, 2)}
    records[1] = rank(1, group(1, 1))
    stacks = {0: WAITING, 1: SLEEPING, 2: WAITING}
    verdict = decide_verdict(records, job_ranks=range(3), stacks=stacks)
    assert (verdict.waiting, verdict.behind) == ((0, 2), (1,))
    assert verdict.headline() == (
        "rank 1 never entered all_reduce #2 on the default group; ranks 0, 2 wait in it; "
        "rank 1 is at train.py:6 in load_next_batch"
    )


def test_different_ops_at_one_sequence_number_are_a_desync() -> None:
    records = {r: rank(r, group(2, 1, ops={1: op(), 2: op()})) for r in (0, 1)}
    records[2] = rank(2, group(2, 1, ops={1: op(), 2: op("broadcast")}))
    verdict = decide_verdict(records, job_ranks=range(3), stacks={})
    (desync,) = verdict.desyncs
    assert desync.seq == 2
    assert desync.describe() == (
        "desync on the default group at #2: ranks 0-1 run all_reduce [4], rank 2 runs broadcast [4]"
    )


def test_different_sizes_at_one_sequence_number_are_a_desync() -> None:
    records = {r: rank(r, group(2, 1, ops={1: op(), 2: op()})) for r in (0, 2)}
    records[1] = rank(1, group(1, 1, ops={1: op()}))
    records[3] = rank(3, group(2, 1, ops={1: op(), 2: op(size=8)}))
    verdict = decide_verdict(records, job_ranks=range(4), stacks={})
    assert verdict.behind == (1,)
    assert [d.describe() for d in verdict.desyncs] == [
        "desync on the default group at #2: "
        "ranks 0, 2 run all_reduce [4], rank 3 runs all_reduce [8]"
    ]
    assert verdict.lines()[1] == verdict.desyncs[0].describe()


def test_all_entered_and_none_completed() -> None:
    records = {r: rank(r, group(3, 2)) for r in range(2)}
    verdict = decide_verdict(records, job_ranks=range(2), stacks={})
    assert (verdict.waiting, verdict.behind) == ((0, 1), ())
    assert verdict.headline() == (
        "ranks 0-1 entered all_reduce #3 on the default group and none completed it"
    )


def test_a_member_without_records_is_unknown_not_behind() -> None:
    records = {r: rank(r, group(2, 1)) for r in (0, 1)}
    records[2] = RankRecords(2, "2.13.0", {}, missing="torch.distributed is not initialised")
    verdict = decide_verdict(records, job_ranks=range(4), stacks={})
    assert (verdict.waiting, verdict.behind, verdict.unknown) == ((0, 1), (), (2, 3))
    assert verdict.headline().endswith("; ranks 2-3 sent no records")
    assert verdict.missing == {2: "torch.distributed is not initialised"}


def test_without_records_the_stacks_name_the_odd_rank_and_say_why() -> None:
    off = "TORCH_FR_BUFFER_SIZE=0 turns torch's flight recorder off"
    records = {r: RankRecords(r, "2.13.0", {}, missing=off) for r in range(3)}
    stacks = {0: WAITING, 1: SLEEPING, 2: WAITING}
    verdict = decide_verdict(records, job_ranks=range(3), stacks=stacks)
    assert verdict.collective is None
    assert verdict.source == f"stacks only: {off} on ranks 0-2"
    assert (verdict.waiting, verdict.behind) == ((0, 2), (1,))
    assert verdict.headline() == (
        f"no flight records ({off} on ranks 0-2); "
        "from the stacks: rank 1 is at train.py:6 in load_next_batch"
    )


def test_a_group_nobody_declared_has_the_ranks_that_recorded_it() -> None:
    records = {
        0: rank(0, group(1, 1), group(3, 2, name="5")),
        1: rank(1, group(1, 1), group(2, 2, name="5")),
        2: rank(2, group(1, 1)),
    }
    verdict = decide_verdict(records, job_ranks=range(3), stacks={})
    assert verdict.collective is not None and verdict.collective.members == (0, 1)
    assert (verdict.waiting, verdict.behind) == ((0,), (1,))


def test_the_most_waiting_ranks_win_then_a_group_with_ranks_behind() -> None:
    # Group 1 (ranks 0-1) and group 2 (ranks 2-4) both have two ranks waiting: the tie
    # goes to the group with a rank behind.
    records = {
        0: rank(0, group(1, 1), group(2, 1, name="1", members=(0, 1))),
        1: rank(1, group(1, 1), group(2, 1, name="1", members=(0, 1))),
        2: rank(2, group(1, 1), group(2, 1, name="2", members=(2, 3, 4))),
        3: rank(3, group(1, 1), group(2, 1, name="2", members=(2, 3, 4))),
        4: rank(4, group(1, 1), group(1, 1, name="2", members=(2, 3, 4))),
    }
    verdict = decide_verdict(records, job_ranks=range(5), stacks={})
    assert verdict.collective is not None and verdict.collective.name == "2"
    assert verdict.behind == (4,)


def test_the_real_deadlock_of_three_ranks() -> None:
    records = {r: parse_rank_records((DATA / f"rank{r}.json").read_bytes(), r) for r in range(3)}
    verdict = decide_verdict(records, job_ranks=range(3), stacks={})
    assert verdict.headline() == (
        "rank 2 never entered all_reduce #4 on the default group; ranks 0-1 wait in it; "
        "rank 2 waits in all_reduce #2 on group 1"
    )
    assert verdict.desyncs == ()


def test_with_no_collective_pending_the_headline_says_so_and_where_each_rank_is() -> None:
    # Every rank completed all_reduce #3 and then went to sleep outside any collective.
    records = {r: rank(r, group(3, 3)) for r in (0, 1, 2)}
    stacks = {0: SLEEPING, 1: SLEEPING, 2: WAITING}
    verdict = decide_verdict(records, job_ranks=range(3), stacks=stacks)
    assert verdict.collective is None
    assert verdict.headline() == (
        "no collective is pending; ranks 0-1 are at train.py:6 in load_next_batch; "
        "rank 2 waits in all_reduce at train.py:14; "
        "the last collective completed was all_reduce #3 on the default group"
    )
