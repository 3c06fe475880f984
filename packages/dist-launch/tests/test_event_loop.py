"""The launcher's event loop: posted calls, threads, timers, deadlines, signals, closing.

No process is started: threads, pipes and a signal the test sends itself.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from dist_launch.agent.event_loop import EventLoop
from dist_launch.agent.signal_inbox import SignalInbox

# Bounds every wait of these tests; none comes near it when the loop works.
LONG = 30.0


@pytest.fixture
def loop() -> Iterator[EventLoop]:
    event_loop = EventLoop()
    yield event_loop
    event_loop.close()


def test_a_call_posted_from_a_thread_runs_on_the_loops_thread(loop: EventLoop) -> None:
    ran_on: list[int] = []

    def from_thread() -> None:
        loop.post(lambda: ran_on.append(threading.get_ident()))

    thread = threading.Thread(target=from_thread)
    thread.start()
    assert loop.run_until(lambda: bool(ran_on), time.monotonic() + LONG)
    thread.join(LONG)
    assert ran_on == [threading.get_ident()]


def test_run_until_gives_up_at_its_deadline(loop: EventLoop) -> None:
    start = time.monotonic()
    assert not loop.run_until(lambda: False, start + 0.05)
    assert 0.05 <= time.monotonic() - start < LONG


def test_a_timers_returned_time_bounds_the_wait(loop: EventLoop) -> None:
    calls: list[float] = []
    start = time.monotonic()

    def due(now: float) -> float | None:
        calls.append(now)
        return now + 0.01  # no descriptor is ever ready: only this wakes the loop

    handle = loop.add_timer(due)
    assert loop.run_until(lambda: len(calls) >= 5, start + LONG)
    assert time.monotonic() - start < LONG
    loop.remove_timer(handle)
    assert not loop.run_until(lambda: len(calls) > 5, time.monotonic() + 0.02)


def test_a_threads_result_and_error_reach_the_loop(loop: EventLoop) -> None:
    def fail() -> int:
        raise ValueError("the store is gone")

    good = loop.call_in_thread(lambda: 42)
    bad = loop.call_in_thread(fail)
    assert loop.run_until(lambda: good.done and bad.done, time.monotonic() + LONG)
    assert (good.result, good.error) == (42, None)
    assert isinstance(bad.error, ValueError)
    with pytest.raises(RuntimeError, match="raised ValueError"):
        _ = bad.result


def test_a_callback_that_unwatches_another_ready_descriptor_stops_it(loop: EventLoop) -> None:
    (first_read, first_write), (second_read, second_write) = os.pipe(), os.pipe()
    ran: list[str] = []

    def first() -> None:
        os.read(first_read, 1)
        ran.append("first")
        loop.unwatch(second_read)

    def second() -> None:
        os.read(second_read, 1)
        ran.append("second")
        loop.unwatch(first_read)

    loop.watch(first_read, first)
    loop.watch(second_read, second)
    os.write(first_write, b"x")
    os.write(second_write, b"x")
    assert loop.run_until(lambda: bool(ran), time.monotonic() + LONG)
    loop.run_until(lambda: False, time.monotonic() + 0.02)
    assert ran in (["first"], ["second"])  # whichever ran first stopped the other
    for fd in (first_read, first_write, second_read, second_write):
        os.close(fd)


def test_closing_unregisters_everything_and_drops_late_posts(loop: EventLoop) -> None:
    read_fd, write_fd = os.pipe()
    loop.watch(read_fd, lambda: None)
    loop.add_timer(lambda now: None)
    loop.close()
    loop.close()  # idempotent
    ran: list[int] = []
    loop.post(lambda: ran.append(1))  # a thread that ends after the launcher: dropped
    assert ran == []
    os.close(read_fd)
    os.close(write_fd)


def test_a_real_signal_is_taken_through_the_inbox(loop: EventLoop) -> None:
    inbox = SignalInbox([signal.SIGUSR1])
    taken: list[int] = []
    try:
        loop.watch(inbox.read_fd, lambda: taken.extend(inbox.take()))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert loop.run_until(lambda: bool(taken), time.monotonic() + LONG)
    finally:
        loop.unwatch(inbox.read_fd)
        inbox.close()
    assert taken == [signal.SIGUSR1]
