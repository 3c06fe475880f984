"""The Supervisor owns its workers: failures stop the group, and leaving the block cleans up.

Workers are real interpreters (no torch) that install the same guards as dist-launch's
and run_ranks' workers; each says ``ready`` on its stdout once its stack handler is
armed.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from dist_core.rank_files import ErrorRecord, RankFiles
from dist_core.supervisor import (
    SIGNAL_RACE_SECONDS,
    PopenWorker,
    RankOutcome,
    Supervisor,
    catches_signal,
    pick_root_cause,
)

WORKER = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from pathlib import Path
    from dist_core.rank_files import RankFiles
    from dist_core.worker_guards import install_worker_guards, record_and_print

    run_dir, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    files = RankFiles.for_rank(run_dir, rank)
    install_worker_guards(files, os.getppid())

    def parked_in_python():
        print("ready", flush=True)
        time.sleep(600)

    if mode == "park":
        parked_in_python()
    elif mode == "grandchild":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(child.pid, flush=True)
        parked_in_python()
    elif mode == "note-sigint":
        def note(signum, frame):
            Path(run_dir, f"rank{rank}.got").write_text(signal.Signals(signum).name)
            os._exit(130)
        signal.signal(signal.SIGINT, note)
        parked_in_python()
    elif mode in ("checkpoint", "checkpoint-grandchild"):
        # Notes each SIGTERM and SIGUSR1; after the first SIGTERM, a 1 s "checkpoint".
        got = Path(run_dir, f"rank{rank}.got")
        def note(signum, frame):
            with got.open("a") as file:
                file.write(signal.Signals(signum).name + "\\n")
        signal.signal(signal.SIGTERM, note)
        signal.signal(signal.SIGUSR1, note)
        if mode == "checkpoint-grandchild":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            print(child.pid, flush=True)
        print("ready", flush=True)
        while "SIGTERM" not in (got.read_text() if got.exists() else ""):
            time.sleep(0.01)
        time.sleep(1.0)
        sys.exit(0)
    elif mode == "fail":
        try:
            raise ValueError(f"rank {rank} failed on purpose")
        except ValueError as error:
            sys.exit(record_and_print(files, rank, error))
    """
)

READY_SECONDS = 60.0


class Workers:
    """Starts the test's workers; :meth:`kill_leftovers` ends any a test left alive."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.started: list[PopenWorker] = []

    def start(self, rank: int, mode: str, supervisor: Supervisor | None = None) -> PopenWorker:
        """Starts rank ``rank`` in ``mode`` (see WORKER); hands it to ``supervisor``."""
        script = self.run_dir.parent / "worker.py"
        popen = subprocess.Popen(
            [sys.executable, str(script), str(self.run_dir), str(rank), mode],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: a line read leaves the next one in the pipe for select()
            process_group=0,
        )
        worker = PopenWorker(popen, rank, rank, 0)
        self.started.append(worker)
        if supervisor is not None:
            supervisor.add(worker, RankFiles.for_rank(self.run_dir, rank))
        return worker

    def park(self, supervisor: Supervisor, ranks: Sequence[int]) -> None:
        """Starts ``ranks`` parked in Python and waits until each one's handler is armed."""
        for rank in ranks:
            assert read_line(self.start(rank, "park", supervisor)) == "ready"

    def kill_leftovers(self) -> None:
        for worker in self.started:
            if worker.popen.poll() is None:
                worker.popen.kill()
                worker.popen.wait(30)
            if worker.popen.stdout is not None:
                worker.popen.stdout.close()


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (tmp_path / "worker.py").write_text(WORKER)
    starter = Workers(run_dir)
    yield starter
    starter.kill_leftovers()


def read_line(worker: PopenWorker) -> str:
    """The worker's next stdout line, waiting at most READY_SECONDS."""
    stdout = worker.popen.stdout
    assert stdout is not None
    ready, _, _ = select.select([stdout], [], [], READY_SECONDS)
    assert ready, f"rank {worker.rank} said nothing within {READY_SECONDS:g} s"
    return stdout.readline().decode().strip()


def reaped(pid: int) -> bool:
    """Whether ``pid``, a child of this process, was already waited for."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


@pytest.mark.processes
def test_leaving_the_block_by_an_exception_kills_and_reaps_every_worker(
    workers: Workers, alive: Callable[[int], bool]
) -> None:
    """As when the start of a later rank fails: the ranks already started do not leak."""
    with (
        pytest.raises(OSError, match="rank 1 could not start"),
        Supervisor(grace_period=5.0) as supervisor,
    ):
        worker = workers.start(0, "grandchild", supervisor)
        grandchild = int(read_line(worker))
        assert read_line(worker) == "ready"
        raise OSError("rank 1 could not start")
    assert worker.popen.returncode == -signal.SIGKILL
    assert reaped(worker.popen.pid)
    assert not alive(worker.popen.pid)
    # The worker led its process group: what it started went with it. That one is not
    # our child (nothing to wait on): poll /proc, bounded.
    deadline = time.monotonic() + 30
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)
    assert supervisor.outcomes[0].status == "stopped"


@pytest.mark.processes
def test_keyboard_interrupt_forwards_sigint_before_killing(workers: Workers) -> None:
    with pytest.raises(KeyboardInterrupt), Supervisor(grace_period=30.0) as supervisor:
        worker = workers.start(0, "note-sigint", supervisor)
        assert read_line(worker) == "ready"
        raise KeyboardInterrupt
    assert (workers.run_dir / "rank0.got").read_text() == "SIGINT"
    assert worker.popen.returncode == 130
    assert reaped(worker.popen.pid)
    # Where it was when interrupted, asked for before the signal was forwarded.
    assert "in parked_in_python" in supervisor.outcomes[0].live_stack


@pytest.mark.processes
def test_a_failure_stops_the_others_and_says_where_they_were(workers: Workers) -> None:
    with Supervisor(grace_period=5.0) as supervisor:
        workers.park(supervisor, [0, 1])
        workers.start(2, "fail", supervisor)
        outcome = supervisor.run()
    assert outcome.status == "failed"
    root = outcome.root_cause
    assert root is not None and root.rank == 2 and root.returncode == 1
    assert root.record is not None
    assert root.record.summary == "ValueError: rank 2 failed on purpose"
    for other in outcome.ranks[:2]:
        assert other.status == "stopped"
        assert other.stop_signal == signal.SIGTERM
        assert other.returncode == -signal.SIGTERM
        assert "in parked_in_python" in other.live_stack


@pytest.mark.processes
def test_request_stacks_stops_nothing(workers: Workers) -> None:
    with Supervisor(grace_period=5.0) as supervisor:
        workers.park(supervisor, [0, 1])
        first = supervisor.request_stacks()
        second = supervisor.request_stacks()
        assert sorted(first) == sorted(second) == [0, 1]
        for stacks in (first, second):
            assert all("in parked_in_python" in stack for stack in stacks.values())
        assert [w.popen.poll() for w in workers.started] == [None, None]
        assert [o.status for o in supervisor.outcomes] == ["running", "running"]
        assert [o.stop_signal for o in supervisor.outcomes] == [None, None]
        supervisor.dump_stacks()
        assert [o.status for o in supervisor.outcomes] == ["running", "running"]
        assert all("in parked_in_python" in o.live_stack for o in supervisor.outcomes)
    assert [w.popen.returncode for w in workers.started] == [-signal.SIGKILL] * 2


@pytest.mark.processes
def test_an_interrupt_dumps_every_stack_then_forwards_the_signal(workers: Workers) -> None:
    with Supervisor(grace_period=30.0) as supervisor:
        workers.park(supervisor, [0, 1])
        supervisor.interrupt(signal.SIGTERM)
        outcome = supervisor.run()
    assert outcome.status == "interrupted"
    assert outcome.signum == signal.SIGTERM
    for rank in outcome.ranks:
        assert rank.status == "stopped"
        assert rank.returncode == -signal.SIGTERM
        assert "in parked_in_python" in rank.live_stack


@pytest.mark.processes
def test_a_closed_supervisor_takes_no_worker(workers: Workers) -> None:
    with Supervisor(grace_period=1.0) as supervisor:
        pass
    worker = workers.start(0, "park")
    with pytest.raises(RuntimeError, match="cannot add rank 0: the supervisor is closed"):
        supervisor.add(worker, RankFiles.for_rank(workers.run_dir, 0))
    with Supervisor(grace_period=1.0) as other, pytest.raises(KeyError, match="rank 0"):
        other.add(worker)


def _got(workers: Workers, rank: int) -> list[str]:
    path = workers.run_dir / f"rank{rank}.got"
    return path.read_text().split() if path.exists() else []


@pytest.mark.processes
def test_a_stop_signal_that_reached_every_rank_is_not_sent_again(workers: Workers) -> None:
    # As scancel does: every process of the job gets SIGTERM, the caller too.
    with Supervisor(grace_period=30.0) as supervisor:
        started = [workers.start(rank, "checkpoint", supervisor) for rank in range(2)]
        assert [read_line(worker) for worker in started] == ["ready", "ready"]
        assert supervisor.notify(signal.SIGUSR1) == [0, 1]  # a notification: nothing stops
        # Each rank notes it before the SIGTERM comes: a SIGTERM arriving while the
        # SIGUSR1 handler runs would be noted first (CPython runs it nested).
        deadline = time.monotonic() + READY_SECONDS
        while any(_got(workers, rank) != ["SIGUSR1"] for rank in range(2)):
            assert time.monotonic() < deadline, [_got(workers, rank) for rank in range(2)]
            time.sleep(0.01)
        for worker in started:
            os.kill(worker.popen.pid, signal.SIGTERM)
        supervisor.interrupt(signal.SIGTERM, take_stacks=False, delivered=True)
        supervisor.interrupt(signal.SIGTERM)  # SLURM's second copy at a time limit
        outcome = supervisor.run()
    assert (outcome.status, outcome.signum) == ("interrupted", signal.SIGTERM)
    # Each finished its checkpoint and exited 0 within the grace period.
    assert [(rank.status, rank.returncode) for rank in outcome.ranks] == [("succeeded", 0)] * 2
    assert [_got(workers, rank) for rank in range(2)] == [["SIGUSR1", "SIGTERM"]] * 2


@pytest.mark.processes
def test_a_stop_reaches_the_rank_alone_and_what_it_left_dies_with_the_block(
    workers: Workers, alive: Callable[[int], bool]
) -> None:
    with Supervisor(grace_period=30.0) as supervisor:
        worker = workers.start(0, "checkpoint-grandchild", supervisor)
        grandchild = int(read_line(worker))
        assert read_line(worker) == "ready"
        supervisor.interrupt(signal.SIGTERM, take_stacks=False)
        outcome = supervisor.run()
        # The rank ended on its own after its checkpoint; its child got no SIGTERM.
        assert outcome.ranks[0].returncode == 0
        assert alive(grandchild)
    deadline = time.monotonic() + 30
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild), "the rank's process group was not swept"


def fake_group(tmp_path: Path, ranks: int) -> tuple[list[FakeWorker], Supervisor]:
    """``ranks`` fake workers in a supervisor with a long grace period."""
    fakes = [FakeWorker(rank) for rank in range(ranks)]
    files = {rank: RankFiles.for_rank(tmp_path, rank) for rank in range(ranks)}
    return fakes, Supervisor(fakes, files, grace_period=60.0)


def test_a_rank_the_schedulers_signal_reached_first_was_stopped_not_failed(
    tmp_path: Path,
) -> None:
    fakes, group = fake_group(tmp_path, 2)
    with group as supervisor:
        fakes[0].code = -signal.SIGTERM  # no handler: dead before our copy arrived
        supervisor.advance()
        assert not supervisor.finished and supervisor.outcomes[1].stop_signal is None
        supervisor.interrupt(signal.SIGTERM, take_stacks=False, delivered=True)
        supervisor.advance()
        fakes[1].code = -signal.SIGTERM
        supervisor.advance()
        outcome = supervisor.outcome()
    assert (outcome.status, outcome.root_cause) == ("interrupted", None)
    assert [rank.status for rank in outcome.ranks] == ["stopped", "stopped"]


def test_a_rank_killed_by_sigterm_alone_is_still_a_failure_after_a_moment(
    tmp_path: Path,
) -> None:
    fakes, group = fake_group(tmp_path, 2)
    with group as supervisor:
        fakes[0].code = -signal.SIGTERM
        supervisor.advance(time.monotonic())
        assert supervisor.outcomes[1].stop_signal is None  # waits for the caller's copy
        supervisor.advance(time.monotonic() + SIGNAL_RACE_SECONDS)
        assert supervisor.outcomes[1].stop_signal == signal.SIGTERM  # none came: failed
        fakes[1].code = -signal.SIGTERM
        supervisor.advance()
        outcome = supervisor.outcome()
    assert outcome.status == "failed" and outcome.root_cause is outcome.ranks[0]


def test_ranks_all_dead_of_the_schedulers_signal_wait_for_the_callers_copy(
    tmp_path: Path,
) -> None:
    # Ranks without a handler can all be gone before the caller's copy is read: the
    # group does not end as failed while that copy may still come.
    fakes, group = fake_group(tmp_path, 2)
    with group as supervisor:
        fakes[0].code = fakes[1].code = -signal.SIGTERM
        start = time.monotonic()
        assert supervisor.advance(start) == pytest.approx(start + SIGNAL_RACE_SECONDS)
        assert not supervisor.finished
        supervisor.interrupt(signal.SIGTERM, take_stacks=False)
        supervisor.advance(start + SIGNAL_RACE_SECONDS / 2)
        outcome = supervisor.outcome()
    assert (outcome.status, outcome.signum) == ("interrupted", signal.SIGTERM)
    assert [rank.status for rank in outcome.ranks] == ["stopped", "stopped"]


def test_ranks_all_dead_of_sigterm_with_no_copy_coming_failed(tmp_path: Path) -> None:
    fakes, group = fake_group(tmp_path, 2)
    with group as supervisor:
        fakes[0].code = fakes[1].code = -signal.SIGTERM
        start = time.monotonic()
        supervisor.advance(start)
        assert supervisor.advance(start + SIGNAL_RACE_SECONDS) is None
        outcome = supervisor.outcome()
    assert outcome.status == "failed" and outcome.root_cause is outcome.ranks[0]


def test_only_a_second_sigint_cuts_the_grace_period(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fakes, group = fake_group(tmp_path, 1)
    with group as supervisor:
        supervisor.interrupt(signal.SIGTERM, take_stacks=False)
        supervisor.advance()
        with caplog.at_level(logging.INFO, logger="dist_core.supervisor"):
            supervisor.interrupt(signal.SIGTERM)
            supervisor.interrupt(signal.SIGHUP)
            supervisor.advance()
            assert "grace period over" not in caplog.text
            assert "SIGTERM again: still within the grace period" in caplog.text
            supervisor.interrupt(signal.SIGINT)
            supervisor.advance()
            assert "grace period over: SIGKILL" in caplog.text
        fakes[0].code = -signal.SIGKILL
        supervisor.advance()


def test_catches_signal_reads_sigcgt() -> None:
    status = "Name:\tpython3\nSigBlk:\t0000000000000000\nSigCgt:\t0000000180004202\n"
    # 0x4202: bits 1, 9, 14 -> SIGINT (2), SIGUSR1 (10), SIGTERM (15).
    assert catches_signal(status, signal.SIGTERM) and catches_signal(status, signal.SIGINT)
    assert catches_signal(status, signal.SIGUSR1)
    assert not catches_signal(status, signal.SIGHUP)
    assert not catches_signal("Name:\tx\n", signal.SIGTERM)


def _failed(rank: int, when: float, text: str) -> RankOutcome:
    record = ErrorRecord(rank, when, "RuntimeError", text, text, 1)
    return RankOutcome(rank, rank, 0, status="failed", returncode=1, record=record)


def test_root_cause_prefers_the_first_failure_that_is_not_a_peer_vanishing() -> None:
    peer = _failed(0, 1.0, "Connection closed by peer")
    real = _failed(1, 2.0, "out of memory")
    later = _failed(2, 3.0, "out of memory")
    assert pick_root_cause([peer, real, later]) is real
    assert pick_root_cause([peer]) is peer
    assert pick_root_cause([RankOutcome(0, 0, 0, status="succeeded", returncode=0)]) is None


class FakeWorker:
    """A worker whose exit the test decides: no process (the fast lane)."""

    own_process_group = False

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.local_rank = rank
        self.node_rank = 0
        self.code: int | None = None
        self.signals: list[int] = []

    @property
    def pid(self) -> int | None:
        return None  # nothing to signal: the supervisor skips it

    def returncode(self) -> int | None:
        return self.code

    def exit_fd(self) -> int | None:
        return None

    def close(self) -> None:
        pass


def test_advance_steps_the_group_without_waiting(tmp_path: Path) -> None:
    fakes = [FakeWorker(0), FakeWorker(1)]
    files = {rank: RankFiles.for_rank(tmp_path, rank) for rank in range(2)}
    with Supervisor(fakes, files, grace_period=1.0) as supervisor:
        timer_calls: list[float] = []
        supervisor.add_timer(lambda now: timer_calls.append(now) or now + 7.0)
        started = time.monotonic()
        wake_at = supervisor.advance()
        assert not supervisor.finished
        # Workers without an exit descriptor are polled, sooner than the timer asks.
        assert wake_at is not None and started < wake_at < started + 1.0
        assert len(timer_calls) == 1
        with pytest.raises(RuntimeError, match="has not finished"):
            supervisor.outcome()
        fakes[0].code = 0
        supervisor.advance()
        assert not supervisor.finished
        fakes[1].code = 0
        assert supervisor.advance() is None
        assert supervisor.finished
        outcome = supervisor.outcome()
        assert time.monotonic() - started < 1.0  # nothing waited
    assert outcome.status == "succeeded"
    assert [rank.status for rank in outcome.ranks] == ["succeeded", "succeeded"]
    assert supervisor.run() is outcome  # run() after the end returns the same outcome


def test_advance_reports_a_failure_and_an_interrupt_without_stacks(tmp_path: Path) -> None:
    fakes = [FakeWorker(0), FakeWorker(1)]
    files = {rank: RankFiles.for_rank(tmp_path, rank) for rank in range(2)}
    with Supervisor(fakes, files, grace_period=60.0) as supervisor:
        supervisor.interrupt(signal.SIGTERM, take_stacks=False)
        supervisor.advance()
        assert [rank.stop_signal for rank in supervisor.outcomes] == [signal.SIGTERM] * 2
        fakes[0].code = -signal.SIGTERM
        fakes[1].code = 3
        supervisor.advance()
        outcome = supervisor.outcome()
    assert (outcome.status, outcome.signum) == ("interrupted", signal.SIGTERM)
    assert [rank.status for rank in outcome.ranks] == ["stopped", "stopped"]
    assert all(rank.live_stack == "" for rank in outcome.ranks)
