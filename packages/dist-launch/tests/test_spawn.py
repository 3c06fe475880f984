"""launch_subprocesses / init_and_run with real processes."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dist_core.config import MultiprocessConfig
from dist_launch import LaunchError, init_and_run, launch_subprocesses

pytestmark = pytest.mark.timeout(180)


@dataclasses.dataclass
class _Greeting:
    text: str


def _write_greeting(out_dir: str, greeting: _Greeting) -> None:
    """Defined in this test file: workers load it (and _Greeting) from the file."""
    import torch.distributed as dist

    Path(out_dir, f"rank{dist.get_rank()}").write_text(f"{greeting.text} {__name__ != ''}")


def _cfg(world_size: int, method: str = "forkserver") -> MultiprocessConfig:
    return MultiprocessConfig(
        world_size=world_size, local_world_size=world_size, launch_method=method
    )


@pytest.mark.processes
@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_every_rank_runs_in_one_group(tmp_path: Path, method: str) -> None:
    from dist_launch_test_workers import write_rank_and_sum

    world = 2 if method == "spawn" else 3  # spawn pays torch's import once per rank
    launch_subprocesses(write_rank_and_sum, _cfg(world, method), None, 0, str(tmp_path), scale=2)
    lines = sorted(path.read_text() for path in tmp_path.iterdir())
    total = 2 * sum(range(world))
    assert lines == [f"{rank} {world} {total} {rank}" for rank in range(world)]


@pytest.mark.processes
@pytest.mark.parametrize("method", ["forkserver", "fork"])
def test_function_and_argument_classes_from_a_test_file(tmp_path: Path, method: str) -> None:
    launch_subprocesses(_write_greeting, _cfg(2, method), None, 0, str(tmp_path), _Greeting("hi"))
    assert sorted(path.read_text() for path in tmp_path.iterdir()) == ["hi True", "hi True"]


@pytest.mark.processes
def test_failing_rank_is_named_with_its_traceback() -> None:
    from dist_launch_test_workers import fail_on_rank

    with pytest.raises(LaunchError) as caught:
        launch_subprocesses(fail_on_rank, _cfg(3), None, 0, 2)
    message = str(caught.value)
    assert caught.value.rank == 2
    assert isinstance(caught.value, RuntimeError)
    assert message.splitlines()[0].startswith("launch_subprocesses: rank 2 ")
    assert "ValueError: deliberate failure on rank 2" in message
    assert "in fail_on_rank" in message  # the real traceback, captured in the worker
    assert "rank 0 (local rank 0, node 0)" in message and "rank 1 (local rank 1" in message


@pytest.mark.processes
def test_root_cause_is_right_ten_times_in_a_row() -> None:
    from dist_launch_test_workers import fail_on_rank

    named = []
    for _ in range(10):
        with pytest.raises(LaunchError) as caught:
            launch_subprocesses(fail_on_rank, _cfg(4), None, 0, 1)
        named.append(caught.value.rank)
    assert named == [1] * 10


@pytest.mark.processes
def test_two_calls_with_rank_offsets_form_one_world(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """As two nodes would: each call starts 2 local ranks of a 4-rank world."""
    import logging
    import threading

    from dist_launch_test_workers import write_rank_and_sum

    from dist_core.ports import get_unused_port

    port = get_unused_port()
    errors: list[BaseException] = []

    def node(offset: int) -> None:
        cfg = MultiprocessConfig(world_size=4, local_world_size=2, master_port=port)
        try:
            launch_subprocesses(write_rank_and_sum, cfg, None, offset, str(tmp_path))
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=node, args=(offset,)) for offset in (0, 2)]
    with caplog.at_level(logging.INFO, logger="dist_launch.library.spawn"):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(150)
    assert not errors, errors
    lines = sorted(path.read_text() for path in tmp_path.iterdir())
    assert lines == ["0 4 6 0", "1 4 6 1", "2 4 6 0", "3 4 6 1"]
    # Only rank 0's node says whom it waits for, once.
    waiting = [r.getMessage() for r in caplog.records if "from other nodes" in r.getMessage()]
    assert len(waiting) == 1, waiting
    assert "ranks 0-1 of 4 on this node" in waiting[0]
    assert f"ranks 2-3 from other nodes at 127.0.0.1:{port}" in waiting[0]
    assert "DIST_LAUNCH_TIMEOUT" in waiting[0]


def test_rank_offset_outside_the_world_is_refused(tmp_path: Path) -> None:
    from dist_launch_test_workers import write_rank_and_sum

    cfg = MultiprocessConfig(world_size=2, local_world_size=2)
    with pytest.raises(LaunchError, match="rank_offset=1"):
        launch_subprocesses(write_rank_and_sum, cfg, None, 1, str(tmp_path))


def test_single_rank_runs_in_this_process(tmp_path: Path) -> None:
    import torch.distributed as dist
    from dist_launch_test_workers import fail_on_rank, write_rank_and_sum

    calls = []
    environ_before = dict(os.environ)
    launch_subprocesses(write_rank_and_sum, _cfg(1), lambda: calls.append(1), 0, str(tmp_path))
    assert calls == [1]
    assert (tmp_path / "rank0").read_text() == "0 1 0 0"
    assert not dist.is_initialized()
    # RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, ... left behind would make the caller a job
    # of one rank (they voided a later test's LOCAL_RANK in one pytest worker).
    assert dict(os.environ) == environ_before
    with pytest.raises(LaunchError, match="deliberate failure on rank 0") as caught:
        launch_subprocesses(fail_on_rank, _cfg(1), None, 0, 0)
    assert isinstance(caught.value.__cause__, ValueError)
    assert not dist.is_initialized()
    assert dict(os.environ) == environ_before


@pytest.mark.skipif(
    importlib.util.find_spec("dist_collectives") is not None,
    reason="dist-collectives is installed here",
)
def test_parallelism_without_dist_collectives_names_the_package() -> None:
    cfg = MultiprocessConfig(world_size=1, local_world_size=1, model_parallelism=2)
    MultiprocessConfig.resolve(cfg)
    cfg.rank, cfg.local_rank = 0, 0
    with pytest.raises(LaunchError, match="dist-collectives"):
        init_and_run(print, cfg)


def test_unknown_start_method_is_named() -> None:
    with pytest.raises(LaunchError, match="'threads'"):
        launch_subprocesses(print, _cfg(2, "threads"))


_KILLED_CALLER = """\
import sys
sys.path.insert(0, {tests!r})
from dist_core.config import MultiprocessConfig
from dist_launch import launch_subprocesses
from dist_launch_test_workers import print_pid_and_wait

if __name__ == "__main__":
    cfg = MultiprocessConfig(world_size=2, local_world_size=2, launch_method={method!r})
    launch_subprocesses(print_pid_and_wait, cfg)
"""


@pytest.mark.processes
@pytest.mark.parametrize("method", ["forkserver", "fork"])
def test_no_worker_outlives_a_sigkilled_caller(tmp_path: Path, method: str) -> None:
    import os
    import re
    import select
    import subprocess
    import sys
    import time

    script = tmp_path / "caller.py"
    script.write_text(_KILLED_CALLER.format(tests=str(Path(__file__).parent), method=method))
    caller = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE)
    try:
        assert caller.stdout is not None
        seen = b""
        deadline = time.monotonic() + 90
        while len(re.findall(rb"ready (\d+)", seen)) < 2:
            assert time.monotonic() < deadline, seen
            if select.select([caller.stdout], [], [], 1.0)[0]:
                chunk = os.read(caller.stdout.fileno(), 4096)
                assert chunk, seen
                seen += chunk
        pids = [int(pid) for pid in re.findall(rb"ready (\d+)", seen)]
        caller.kill()
        caller.wait(30)
        deadline = time.monotonic() + 20
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [pid for pid in pids if _alive(pid)]
            time.sleep(0.05)
        assert alive == [], "workers survived their caller's SIGKILL"
    finally:
        caller.kill()
        caller.wait(30)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


_FORK_ON_A_GPU_HOST = """\
import sys
sys.path.insert(0, {tests!r})
import dist_core
from dist_core.config import MultiprocessConfig
from dist_launch import launch_subprocesses
from dist_launch_test_workers import write_cuda_sum

if __name__ == "__main__":
    # Everything a parent does before it forks: each once poisoned fork on a GPU host.
    dist_core.default_backend()
    dist_core.device_count()
    cfg = MultiprocessConfig(world_size={world}, launch_method="fork")
    MultiprocessConfig.resolve(cfg)
    launch_subprocesses(write_cuda_sum, cfg, None, 0, {out!r})
    import torch
    assert not torch.cuda.is_initialized(), "the launcher initialised CUDA in the parent"
"""


@pytest.mark.processes
@pytest.mark.cuda
@pytest.mark.parametrize("ranks_per_gpu", [1, 2])
def test_fork_workers_use_cuda_after_the_parent_resolved_the_config(
    tmp_path: Path, ranks_per_gpu: int
) -> None:
    import subprocess
    import sys

    from dist_core.devices import cuda_device_count

    world = max(2, cuda_device_count() * ranks_per_gpu)
    out = tmp_path / "out"
    out.mkdir()
    script = tmp_path / "fork_on_gpu.py"
    script.write_text(
        _FORK_ON_A_GPU_HOST.format(tests=str(Path(__file__).parent), world=world, out=str(out))
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_BACKEND"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=150
    )
    assert done.returncode == 0, done.stdout + done.stderr
    expected_backend = "nccl" if world <= cuda_device_count() else "gloo"
    total = sum(range(1, world + 1))
    lines = sorted(path.read_text() for path in out.iterdir())
    assert lines == [f"{expected_backend} cuda {total}"] * world


_FORK_AFTER_CUDA_INIT = """\
import sys
sys.path.insert(0, {tests!r})
import torch
from dist_core.config import MultiprocessConfig
from dist_launch import LaunchError, launch_subprocesses
from dist_launch_test_workers import write_rank_and_sum

if __name__ == "__main__":
    torch.cuda.init()
    cfg = MultiprocessConfig(world_size=2, launch_method="fork", backend="gloo")
    try:
        launch_subprocesses(write_rank_and_sum, cfg, None, 0, {out!r})
    except LaunchError as error:
        print(error)
        sys.exit(3)
"""


def _run_as_parent(tmp_path: Path, template: str) -> subprocess.CompletedProcess[str]:
    """Runs ``template`` as a fresh parent process whose workers write into ``tmp_path``."""
    script = tmp_path / "parent.py"
    script.write_text(template.format(tests=str(Path(__file__).parent), out=str(tmp_path)))
    return subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=150
    )


@pytest.mark.processes
@pytest.mark.cuda
def test_fork_after_the_caller_initialised_cuda_is_refused_by_name(tmp_path: Path) -> None:
    done = _run_as_parent(tmp_path, _FORK_AFTER_CUDA_INIT)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "initialised CUDA" in done.stdout and "forkserver" in done.stdout
    assert not list(tmp_path.glob("rank*"))


_FORK_AFTER_IS_AVAILABLE = """\
import sys
sys.path.insert(0, {tests!r})
import torch
from dist_core.config import MultiprocessConfig
from dist_launch import launch_subprocesses
from dist_launch_test_workers import write_rank_and_sum

if __name__ == "__main__":
    # What pytest, a notebook or a training script often does before launching: it
    # starts the driver without torch.cuda.is_initialized() turning true.
    assert torch.cuda.is_available() and not torch.cuda.is_initialized()
    cfg = MultiprocessConfig(world_size=2, launch_method="fork", backend="gloo")
    launch_subprocesses(write_rank_and_sum, cfg, None, 0, {out!r})
"""


@pytest.mark.processes
@pytest.mark.cuda
def test_fork_of_a_cpu_job_after_the_caller_asked_for_cuda_runs(tmp_path: Path) -> None:
    done = _run_as_parent(tmp_path, _FORK_AFTER_IS_AVAILABLE)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(path.read_text() for path in tmp_path.glob("rank*"))
    assert lines == ["0 2 1 0", "1 2 1 1"]


@pytest.mark.processes
def test_world_size_alone_starts_every_rank_on_this_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The README's call: once it started 1 rank that waited 30 min for 2 "other nodes".
    from dist_launch_test_workers import write_rank_and_sum

    monkeypatch.setenv("DIST_LAUNCH_TIMEOUT", "90")  # a regression fails, not hangs
    launch_subprocesses(
        write_rank_and_sum, MultiprocessConfig(world_size=3), None, 0, str(tmp_path)
    )
    lines = sorted(path.read_text() for path in tmp_path.iterdir())
    assert lines == ["0 3 3 0", "1 3 3 1", "2 3 3 2"]
