"""What kind of failure a round was: deterministic, infrastructure, or another error."""

from __future__ import annotations

from dist_core.rank_files import ErrorRecord
from dist_core.supervisor import GroupOutcome, RankOutcome
from dist_launch.diagnostics.failure_class import (
    FailureClass,
    Fingerprint,
    classify_failure,
    fingerprint_of,
)

TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/job/train.py", line 3, in <module>\n'
    "    import trainer\n"
    '  File "/job/trainer.py", line 14, in <module>\n'
    "    from missing import thing\n"
    "ImportError: cannot import name 'thing'\n"
)


def failed(exception: str, *, in_group: bool | None, returncode: int = 1) -> GroupOutcome:
    record = ErrorRecord(1, 5.0, exception, "x", TRACEBACK, 1, in_process_group=in_group)
    ranks = [
        RankOutcome(0, 0, 0, status="stopped", returncode=-15, stop_signal=15),
        RankOutcome(1, 1, 0, status="failed", returncode=returncode, record=record),
    ]
    return GroupOutcome("failed", ranks)


def killed(signum: int) -> GroupOutcome:
    return GroupOutcome("failed", [RankOutcome(0, 0, 0, status="failed", returncode=-signum)])


def test_the_innermost_frame_is_where_an_error_was_raised() -> None:
    assert fingerprint_of("ImportError", TRACEBACK) == Fingerprint(
        "ImportError", "/job/trainer.py:14"
    )
    assert fingerprint_of("MemoryError", "").describe() == "MemoryError"


def test_a_code_error_before_the_process_group_is_deterministic() -> None:
    found = classify_failure(failed("ImportError", in_group=False), None)
    assert found.kind == "deterministic"
    assert found.why == "ImportError at /job/trainer.py:14 before the process group existed"


def test_the_same_error_inside_the_group_is_deterministic_only_the_second_time() -> None:
    first = classify_failure(failed("ImportError", in_group=True), None)
    assert first.kind == "error"
    again = classify_failure(failed("ImportError", in_group=True), first.fingerprint)
    assert again.kind == "deterministic" and again.why.endswith("again, as the last time")
    elsewhere = Fingerprint("ImportError", "/job/train.py:3")
    assert classify_failure(failed("ImportError", in_group=True), elsewhere).kind == "error"


def test_other_errors_before_the_group_are_not_deterministic() -> None:
    # An OSError (a file system, a port) may well pass the next time.
    assert classify_failure(failed("OSError", in_group=False), None).kind == "error"
    assert classify_failure(failed("ImportError", in_group=None), None).kind == "error"


def test_a_rank_killed_by_a_signal_is_infrastructure() -> None:
    assert classify_failure(killed(9), None) == FailureClass(
        "infrastructure", why="rank 0 was killed by a signal"
    )
    assert classify_failure(killed(11), None).kind == "infrastructure"  # SIGSEGV


def test_an_exit_code_without_an_error_is_another_error() -> None:
    outcome = GroupOutcome("failed", [RankOutcome(0, 0, 0, status="failed", returncode=7)])
    assert classify_failure(outcome, None).kind == "error"
