"""The Supervisor owns its workers: failures stop the group, and leaving the block cleans up.

Workers are real interpreters (no torch) that install the same guards as dist-launch's
and run_ranks' workers; each says ``ready`` on its stdout once its stack handler is
armed.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dist_core.rank_files import ErrorRecord, RankFiles
from dist_core.supervisor import PopenWorker, RankOutcome, Supervisor, pick_root_cause

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
    elif mode == "fail":
        try:
            raise ValueError(f"rank {rank} failed on purpose")
        except ValueError as error:
            sys.exit(record_and_print(files, rank, error))
    """
)

READY_SECONDS = 60.0


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    (tmp_path / "worker.py").write_text(WORKER)
    return path


def _start(run_dir: Path, rank: int, mode: str) -> PopenWorker:
    popen = subprocess.Popen(
        [sys.executable, str(run_dir.parent / "worker.py"), str(run_dir), str(rank), mode],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        bufsize=0,  # unbuffered: a line read leaves the next one in the pipe for select()
        process_group=0,
    )
    return PopenWorker(popen, rank, rank, 0)


def _read_line(worker: PopenWorker) -> str:
    """The worker's next stdout line, waiting at most READY_SECONDS."""
    stdout = worker.popen.stdout
    assert stdout is not None
    ready, _, _ = select.select([stdout], [], [], READY_SECONDS)
    assert ready, f"rank {worker.rank} said nothing within {READY_SECONDS:g} s"
    return stdout.readline().decode().strip()


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _reaped(pid: int) -> bool:
    """Whether ``pid``, a child of this process, was already waited for."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


def _gone_within(pid: int, seconds: float) -> bool:
    """Whether ``pid`` (not our child: nothing to wait on) is gone within ``seconds``."""
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)  # polling /proc: it is not our child
    return not _alive(pid)


@pytest.fixture
def started() -> Iterator[list[PopenWorker]]:
    """Workers a test started; any the test leaves alive are killed after it."""
    workers: list[PopenWorker] = []
    yield workers
    for worker in workers:
        if worker.popen.poll() is None:
            worker.popen.kill()
            worker.popen.wait(30)
        if worker.popen.stdout is not None:
            worker.popen.stdout.close()


def test_leaving_the_block_by_an_exception_kills_and_reaps_every_worker(
    run_dir: Path, started: list[PopenWorker]
) -> None:
    """As when the start of a later rank fails: the ranks already started do not leak."""
    worker = _start(run_dir, 0, "grandchild")
    started.append(worker)
    grandchild = int(_read_line(worker))
    assert _read_line(worker) == "ready"
    with (
        pytest.raises(OSError, match="rank 1 could not start"),
        Supervisor(grace_period=5.0) as supervisor,
    ):
        supervisor.add(worker, RankFiles.for_rank(run_dir, 0))
        raise OSError("rank 1 could not start")
    assert worker.popen.returncode == -signal.SIGKILL
    assert _reaped(worker.popen.pid)
    assert not _alive(worker.popen.pid)
    # The worker led its process group: what it started went with it.
    assert _gone_within(grandchild, 30.0)
    assert supervisor.outcomes[0].status == "stopped"


def test_keyboard_interrupt_forwards_sigint_before_killing(
    run_dir: Path, started: list[PopenWorker]
) -> None:
    worker = _start(run_dir, 0, "note-sigint")
    started.append(worker)
    assert _read_line(worker) == "ready"
    with pytest.raises(KeyboardInterrupt), Supervisor(grace_period=30.0) as supervisor:
        supervisor.add(worker, RankFiles.for_rank(run_dir, 0))
        raise KeyboardInterrupt
    assert (run_dir / "rank0.got").read_text() == "SIGINT"
    assert worker.popen.returncode == 130
    assert _reaped(worker.popen.pid)
    # Where it was when interrupted, asked for before the signal was forwarded.
    assert "in parked_in_python" in supervisor.outcomes[0].live_stack


def test_a_failure_stops_the_others_and_says_where_they_were(
    run_dir: Path, started: list[PopenWorker]
) -> None:
    with Supervisor(grace_period=5.0) as supervisor:
        for rank in (0, 1):
            worker = _start(run_dir, rank, "park")
            started.append(worker)
            supervisor.add(worker, RankFiles.for_rank(run_dir, rank))
            assert _read_line(worker) == "ready"
        failing = _start(run_dir, 2, "fail")
        started.append(failing)
        supervisor.add(failing, RankFiles.for_rank(run_dir, 2))
        outcome = supervisor.run()
    assert outcome.status == "failed"
    root = outcome.root_cause
    assert root is not None and root.rank == 2 and root.returncode == 1
    assert root.record is not None
    assert root.record.summary == "ValueError: rank 2 failed on purpose"
    for rank in (0, 1):
        other = outcome.ranks[rank]
        assert other.status == "stopped"
        assert other.stop_signal == signal.SIGTERM
        assert other.returncode == -signal.SIGTERM
        assert "in parked_in_python" in other.live_stack


def test_request_stacks_stops_nothing(run_dir: Path, started: list[PopenWorker]) -> None:
    with Supervisor(grace_period=5.0) as supervisor:
        for rank in (0, 1):
            worker = _start(run_dir, rank, "park")
            started.append(worker)
            supervisor.add(worker, RankFiles.for_rank(run_dir, rank))
            assert _read_line(worker) == "ready"
        first = supervisor.request_stacks()
        second = supervisor.request_stacks()
        assert sorted(first) == sorted(second) == [0, 1]
        for stacks in (first, second):
            assert all("in parked_in_python" in stack for stack in stacks.values())
        assert [w.popen.poll() for w in started] == [None, None]
        assert [o.status for o in supervisor.outcomes] == ["running", "running"]
        assert [o.stop_signal for o in supervisor.outcomes] == [None, None]
        supervisor.dump_stacks()
        assert [o.status for o in supervisor.outcomes] == ["running", "running"]
        assert all("in parked_in_python" in o.live_stack for o in supervisor.outcomes)
    assert [w.popen.returncode for w in started] == [-signal.SIGKILL] * 2


def test_an_interrupt_dumps_every_stack_then_forwards_the_signal(
    run_dir: Path, started: list[PopenWorker]
) -> None:
    with Supervisor(grace_period=30.0) as supervisor:
        for rank in (0, 1):
            worker = _start(run_dir, rank, "park")
            started.append(worker)
            supervisor.add(worker, RankFiles.for_rank(run_dir, rank))
            assert _read_line(worker) == "ready"
        supervisor.interrupt(signal.SIGTERM)
        outcome = supervisor.run()
    assert outcome.status == "interrupted"
    assert outcome.signum == signal.SIGTERM
    for rank in outcome.ranks:
        assert rank.status == "stopped"
        assert rank.returncode == -signal.SIGTERM
        assert "in parked_in_python" in rank.live_stack


def test_a_closed_supervisor_takes_no_worker(run_dir: Path, started: list[PopenWorker]) -> None:
    with Supervisor(grace_period=1.0) as supervisor:
        pass
    worker = _start(run_dir, 0, "park")
    started.append(worker)
    with pytest.raises(RuntimeError, match="cannot add rank 0: the supervisor is closed"):
        supervisor.add(worker, RankFiles.for_rank(run_dir, 0))
    with Supervisor(grace_period=1.0) as other, pytest.raises(KeyError, match="rank 0"):
        other.add(worker)


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
