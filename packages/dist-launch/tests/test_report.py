"""The launcher's report: identical live stacks are shown once, under the ranks sharing them."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest

from dist_core.supervisor import GroupOutcome, RankOutcome
from dist_launch.diagnostics.failure_report import format_report
from dist_launch.diagnostics.stacks import (
    format_rank_ranges,
    format_stack_dump,
    format_stacks,
    group_stacks,
)

pytestmark = pytest.mark.timeout(120)

# A "rank": a helper thread blocked for good at a known line, and the main thread
# dumping every thread's stack with faulthandler from one of two lines of `place`.
# The helper writes to the pipe on the line where it then blocks, so once the main
# thread has read the byte the helper's stack can no longer change.
RANK_SCRIPT = """\
import faulthandler, os, sys, threading

ready_read, ready_write = os.pipe()
never = threading.Lock()
never.acquire()


def helper():
    os.write(ready_write, b"x"); never.acquire()


def place(which):
    if which == "a":
        faulthandler.dump_traceback(all_threads=True)
    else:
        faulthandler.dump_traceback(all_threads=True)


threading.Thread(target=helper, daemon=True).start()
os.read(ready_read, 1)
place(sys.argv[1])
"""

# Which line of `place` each rank dumps from: ranks 0, 2, 3 and 5 share one place.
PLACES = {0: "a", 1: "b", 2: "a", 3: "a", 4: "b", 5: "a"}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """Each rank's real faulthandler dump, from its own process."""
    script = tmp_path_factory.mktemp("stacks") / "rank.py"
    script.write_text(RANK_SCRIPT)
    stacks: dict[int, str] = {}
    for rank, which in PLACES.items():
        result = subprocess.run(
            [sys.executable, str(script), which],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        stacks[rank] = result.stderr
    return stacks


def _line_of(stack: str, function: str) -> int:
    found = re.search(rf"line (\d+) in {function}\n", stack)
    assert found is not None, stack
    return int(found.group(1))


@pytest.mark.processes
def test_identical_stacks_are_grouped_despite_different_thread_ids(
    dumps: dict[int, str],
) -> None:
    # The grouping has work to do: each process's thread ids make every dump differ.
    assert len(set(dumps.values())) == len(dumps)
    groups = group_stacks(dumps)
    assert [ranks for ranks, _ in groups] == [[0, 2, 3, 5], [1, 4]]
    first, second = (stack for _, stack in groups)
    # Same function, different lines: line numbers are kept, so they are two places.
    assert _line_of(first, "place") + 2 == _line_of(second, "place")
    assert "0x" not in first  # the thread ids are gone
    assert first.count("Thread (most recent call first):") == 2
    assert 'rank.py", line 9 in helper' in first


@pytest.mark.processes
def test_which_thread_is_current_does_not_split_a_group(dumps: dict[int, str]) -> None:
    # The kernel may hand the dump signal to another thread in another rank.
    swapped = dumps[0].replace("Current thread", "Thread", 1)
    swapped = swapped.replace("Thread", "Current thread", 1)
    assert swapped != dumps[0]
    assert [ranks for ranks, _ in group_stacks({0: dumps[0], 7: swapped})] == [[0, 7]]


@pytest.mark.processes
def test_launcher_frames_do_not_split_a_group(dumps: dict[int, str]) -> None:
    frame = '  File "/site-packages/dist_launch/in_worker/bootstrap.py", line 70 in run_target\n'
    assert [ranks for ranks, _ in group_stacks({3: dumps[0] + frame, 1: dumps[2]})] == [[1, 3]]


@pytest.mark.processes
def test_groups_are_ordered_by_their_lowest_rank(dumps: dict[int, str]) -> None:
    stacks = {9: dumps[1], 4: dumps[0], 2: dumps[4]}
    assert [ranks for ranks, _ in group_stacks(stacks)] == [[2, 9], [4]]


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([5, 0, 2, 1], "0-2, 5"),
        ([3], "3"),
        ([], ""),
        ([1, 3, 4, 5, 7], "1, 3-5, 7"),
        ([2, 1, 1], "1-2"),
    ],
)
def test_rank_ranges(ranks: list[int], text: str) -> None:
    assert format_rank_ranges(ranks) == text


@pytest.mark.processes
def test_format_stacks_shows_each_stack_once(dumps: dict[int, str]) -> None:
    text = format_stacks(dumps)
    lines = text.splitlines()
    assert lines[0] == "ranks 0, 2-3, 5: same stack"
    assert "ranks 1, 4: same stack" in lines
    assert text.count("in helper") == 2  # once per distinct stack, not once per rank
    assert all(line.startswith("    ") for line in lines if "File" in line)


def _outcome(rank: int, status: str, stack: str = "", returncode: int | None = None) -> RankOutcome:
    outcome = RankOutcome(rank=rank, local_rank=rank, node_rank=0, live_stack=stack)
    outcome.status = status  # type: ignore[assignment]
    outcome.returncode = returncode
    if status == "stopped":
        outcome.stop_signal = signal.SIGTERM
    return outcome


@pytest.mark.processes
def test_failure_report_has_the_root_cause_first_then_grouped_stacks(
    dumps: dict[int, str],
) -> None:
    ranks = [_outcome(rank, "stopped", dumps[rank], -signal.SIGTERM) for rank in PLACES]
    ranks[1] = _outcome(1, "failed", returncode=3)
    ranks[1].ended_at = 1.0
    report = format_report(GroupOutcome("failed", ranks))
    assert report.startswith("dist-launch: rank 1 (local rank 1, node 0) failed first"), report
    head, _, stacks = report.partition("where they were:\n")
    assert "in place" not in head  # one line per rank above, the stacks below
    assert head.count("stopped by the launcher (SIGTERM after rank 1 failed)") == 5
    assert stacks.splitlines()[0] == "  ranks 0, 2-3, 5: same stack"
    assert "  rank 4:" in stacks.splitlines()
    assert stacks.count("in helper") == 2


@pytest.mark.processes
def test_timeout_report_groups_stacks(dumps: dict[int, str]) -> None:
    ranks = [_outcome(rank, "stopped", dumps[rank], -signal.SIGTERM) for rank in PLACES]
    report = format_report(GroupOutcome("timed_out", ranks, timeout=4.0))
    assert report.startswith("dist-launch: timed out after 4 s\n"), report
    assert "  ranks 0, 2-3, 5: same stack" in report.splitlines()
    assert "  ranks 1, 4: same stack" in report.splitlines()


@pytest.mark.processes
def test_interrupt_report_shows_stacks_when_it_has_them(dumps: dict[int, str]) -> None:
    ranks = [_outcome(rank, "stopped", dumps[rank], -signal.SIGINT) for rank in PLACES]
    report = format_report(GroupOutcome("interrupted", ranks, signum=signal.SIGINT))
    assert report.splitlines()[:2] == [
        "dist-launch: interrupted by SIGINT; stopped 6 rank(s)",
        "where they were:",
    ]
    assert report.count("in helper") == 2
    quiet = [_outcome(rank, "stopped", "", -signal.SIGINT) for rank in PLACES]
    report = format_report(GroupOutcome("interrupted", quiet, signum=signal.SIGINT))
    assert report == "dist-launch: interrupted by SIGINT; stopped 6 rank(s)"


@pytest.mark.processes
def test_stack_dump_on_request_shows_the_running_ranks(dumps: dict[int, str]) -> None:
    ranks = [_outcome(rank, "running", dumps[rank]) for rank in PLACES]
    ranks[5] = _outcome(5, "succeeded", dumps[5], 0)  # ended earlier: not shown
    text = format_stack_dump(ranks, "SIGQUIT; nothing stopped")
    lines = text.splitlines()
    assert lines[0] == "dist-launch: stacks of 5 ranks (SIGQUIT; nothing stopped):"
    assert lines[1] == "  ranks 0, 2-3: same stack"
    assert "  ranks 1, 4: same stack" in lines
    assert text.count("in helper") == 2


def test_stack_dump_without_running_ranks_says_so() -> None:
    text = format_stack_dump([_outcome(0, "succeeded", "", 0)], "SIGQUIT; nothing stopped")
    assert text == "dist-launch: no running rank to show the stack of (SIGQUIT; nothing stopped)"
