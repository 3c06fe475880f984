"""The hang decision on sequences of samples, with no processes (dist_launch.watch.quiet_watch)."""

from __future__ import annotations

import pytest

from dist_launch.in_worker.completed_collectives import count_completed
from dist_launch.plan.hang_policy import (
    AUTO_FACTOR,
    AUTO_FLOOR_SECONDS,
    HangPolicy,
    parse_hang_timeout,
)
from dist_launch.watch.quiet_watch import QuietWatch


@pytest.mark.parametrize(
    ("text", "policy"),
    [
        ("3", HangPolicy("fixed", 3.0)),
        ("0.5", HangPolicy("fixed", 0.5)),
        ("auto", HangPolicy("auto")),
        ("AUTO", HangPolicy("auto")),
        ("off", HangPolicy("off")),
        ("0", HangPolicy("off")),
    ],
)
def test_hang_timeout_values(text: str, policy: HangPolicy) -> None:
    assert parse_hang_timeout(text) == policy


@pytest.mark.parametrize("text", ["soon", "-1", "inf", "nan", ""])
def test_bad_hang_timeout_is_named(text: str) -> None:
    with pytest.raises(ValueError, match="--hang-timeout"):
        parse_hang_timeout(text)


def test_a_constant_stack_is_hung_after_the_timeout() -> None:
    watch = QuietWatch(HangPolicy("fixed", 3.0), now=0.0)
    for t in range(1, 5):
        watch.saw(0, (7, 0), float(t))  # the same counters every look
        watch.saw(1, (4, 0), float(t))
    assert not watch.hung(3.9)
    assert watch.hung(4.0)  # progress last at t=1 (the first non-zero look)


def test_any_rank_moving_keeps_the_group_alive() -> None:
    """Rank 0 evaluates while the others wait in a barrier: not a hang."""
    watch = QuietWatch(HangPolicy("fixed", 3.0), now=0.0)
    for t in range(1, 60):
        watch.saw(0, (t, 0), float(t))  # rank 0's stack changes
        watch.saw(1, (1, 0), float(t))  # rank 1 waits
    assert not watch.hung(60.0)


def test_explicit_progress_and_output_count() -> None:
    watch = QuietWatch(HangPolicy("fixed", 3.0), now=0.0)
    watch.saw(0, (1, 0), 1.0)
    watch.saw(0, (1, 1), 3.5)  # report_progress() moved the second counter
    assert not watch.hung(6.0)
    watch.progress(6.0)  # output relayed
    assert not watch.hung(8.9)
    assert watch.hung(9.0)


def test_the_first_look_at_a_worker_that_has_not_started_is_not_progress() -> None:
    watch = QuietWatch(HangPolicy("fixed", 3.0), now=0.0)
    watch.saw(0, (0, 0), 2.0)
    assert watch.hung(3.0)


def test_the_time_spent_starting_ranks_is_neither_silence_nor_learned() -> None:
    # A loaded host: the launcher took 400 s to start the ranks.
    watch = QuietWatch(HangPolicy("auto"), now=0.0)
    watch.begin(400.0)
    assert not watch.hung(400.0 + AUTO_FLOOR_SECONDS - 1)
    watch.progress(401.0)
    assert watch.timeout() == AUTO_FLOOR_SECONDS
    assert watch.longest_quiet == 1.0


def test_off_is_never_hung() -> None:
    watch = QuietWatch(HangPolicy("off"), now=0.0)
    assert watch.timeout() is None
    assert not watch.hung(1e9)


def test_auto_starts_at_the_floor_and_grows_with_the_longest_quiet_interval() -> None:
    watch = QuietWatch(HangPolicy("auto"), now=0.0)
    assert watch.timeout() == AUTO_FLOOR_SECONDS
    watch.progress(10.0)
    assert watch.timeout() == AUTO_FLOOR_SECONDS  # 5 x 10 s is under the floor
    watch.progress(10.0 + 100.0)  # a checkpoint write kept the job quiet for 100 s
    assert watch.timeout() == AUTO_FACTOR * 100.0
    assert not watch.hung(110.0 + AUTO_FACTOR * 100.0 - 1)
    assert watch.hung(110.0 + AUTO_FACTOR * 100.0)


def test_auto_keeps_what_earlier_rounds_learned() -> None:
    watch = QuietWatch(HangPolicy("auto"), now=0.0, longest_quiet=200.0)
    assert watch.timeout() == AUTO_FACTOR * 200.0


def test_an_evaluation_pass_is_not_a_hang_though_steps_slow_down_tenfold() -> None:
    """Steps of 1 s, every 20th 10 s long, the stack changing within each: never hung."""
    watch = QuietWatch(HangPolicy("fixed", 3.0), now=0.0)
    t, counter = 0.0, 0
    for step in range(100):
        length = 10.0 if step % 20 == 19 else 1.0
        end = t + length
        while t < end:
            t += 0.1
            counter += 1
            watch.saw(0, (counter, 0), t)
            assert not watch.hung(t)


def test_completed_collectives_are_progress_though_the_stack_stands_still() -> None:
    """A rank that sleeps between collectives: only the third counter moves."""
    watch = QuietWatch(HangPolicy("fixed", 3.0), now=0.0)
    for t in range(1, 30):
        watch.saw(0, (1, 0, t // 2), float(t))  # one collective every 2 s
        assert not watch.hung(float(t))
    for t in range(30, 33):
        watch.saw(0, (1, 0, 14), float(t))  # then a collective that never completes
    assert not watch.hung(30.9)
    assert watch.hung(31.0)  # quiet since t=28, the last completion


def test_torchs_counters_are_read_from_a_dump_without_entries() -> None:
    dump = (
        b'{"pg_config":{},"pg_status":{"0":{"last_completed_collective":"12",'
        b'"last_enqueued_collective":"13","last_started_collective":"-1"},'
        b'"1":{"last_completed_collective":"-1","last_enqueued_collective":"-1"},'
        b'"2":{"last_completed_collective":3}},"version":"2.10"}'
    )
    assert count_completed(dump) == 15
    assert count_completed(b"") == 0
