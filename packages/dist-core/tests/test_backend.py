"""Backend choice, init with the sanity all-reduce, init/destroy repeated in one process."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dist_core
from dist_core import DistEnvError
from dist_core.backend import choose_backend, env_rendezvous_variables
from dist_core.devices import accelerator_device_count, accelerator_type, cuda_device_count
from dist_core.testing import run_ranks


def test_default_backend_without_an_accelerator_is_gloo() -> None:
    if accelerator_type() is not None:
        pytest.skip(f"this host has a {accelerator_type()} accelerator")
    assert dist_core.default_backend() == "gloo"
    assert dist_core.default_backend(local_world_size=8) == "gloo"


def test_more_local_ranks_than_devices_gets_gloo() -> None:
    # True on every host: one rank more than there are accelerator devices (0 on CPU).
    crowded = accelerator_device_count() + 1
    choice = choose_backend(crowded)
    assert choice.backend == "gloo"
    assert choice.local_world_size == crowded
    assert choice.shares_devices == (choice.accelerator is not None)


@pytest.mark.parametrize(("local_world_size", "expected"), [("1", "nccl"), ("2", "gloo")])
def test_default_backend_reads_local_world_size(
    monkeypatch: pytest.MonkeyPatch, local_world_size: str, expected: str
) -> None:
    # A host with one GPU, on every machine: the answer must come from the variable.
    monkeypatch.setattr(dist_core.backend, "accelerator", lambda: ("cuda", 1))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    assert dist_core.default_backend() == expected


def test_default_backend_with_more_local_ranks_than_devices_is_gloo(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(accelerator_device_count() + 1))
    assert dist_core.default_backend() == "gloo"


@pytest.mark.cuda
def test_one_rank_per_gpu_gets_nccl() -> None:
    assert dist_core.default_backend(local_world_size=1) == "nccl"
    assert dist_core.default_backend(local_world_size=cuda_device_count()) == "nccl"


def test_backend_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DISTRIBUTED_BACKEND", "")  # restored after the test
    assert dist_core.get_distributed_backend() == dist_core.default_backend()
    dist_core.set_distributed_backend("nccl")
    assert os.environ["TORCH_DISTRIBUTED_BACKEND"] == "nccl"
    assert dist_core.get_distributed_backend() == "nccl"
    monkeypatch.setenv("TORCH_DISTRIBUTED_BACKEND", "cpu:gloo,cuda:nccl")
    assert dist_core.get_distributed_backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.setenv("TORCH_DISTRIBUTED_BACKEND", "glooo")
    with pytest.raises(DistEnvError, match="TORCH_DISTRIBUTED_BACKEND=glooo"):
        dist_core.get_distributed_backend()


def test_set_dist_writes_environment_and_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "INIT_METHOD",
        "NODE_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    dist_core.set_dist(3, 1, 4, 2, "10.1.2.3", 1234, "env://")
    assert os.environ["RANK"] == "3" and os.environ["NODE_RANK"] == "1"
    assert os.environ["MASTER_PORT"] == "1234" and dist_core.get_init_method() == "env://"
    with pytest.raises(DistEnvError, match="RANK=5 with WORLD_SIZE=4"):
        dist_core.set_dist(5, 1, 4, 2, "h", 1, "env://")


def _next_port() -> int:
    """A free port chosen by rank 0 and sent to all through the current group.

    Each group gets a port of its own: a rank that connects to the port of the group
    its peer is tearing down may reach the closing store (torch: "Failed to recv, got
    0 bytes"), seen once in CI.
    """
    # A tensor, not broadcast_object_list: that needs numpy, which dist-core does not.
    chosen = torch.tensor([dist_core.get_unused_port() if dist.get_rank() == 0 else 0])
    dist.broadcast(chosen, src=0)
    return int(chosen.item())


def _init_destroy_twice() -> list[int]:
    """Destroys run_ranks' group, then initializes and destroys two more in a row."""
    rank, world = dist.get_rank(), dist.get_world_size()
    port = _next_port()
    dist_core.destroy_dist()
    dist_core.destroy_dist()  # harmless without a group
    sums = []
    for _ in range(2):
        dist_core.init_dist(rank, rank, world, world, "127.0.0.1", port, "env://", backend="gloo")
        value = torch.tensor([rank + 1.0])
        dist.all_reduce(value)
        sums.append(int(value.item()))
        port = _next_port()
        dist_core.destroy_dist()
        assert not dist_core.is_initialized()
    os.environ["MASTER_PORT"] = str(port)
    dist_core.init_process_group_from_backend("gloo")  # leave a group for run_ranks
    return sums


@pytest.mark.processes
def test_init_then_destroy_twice_in_one_process() -> None:
    assert run_ranks(_init_destroy_twice, 2) == [[3, 3], [3, 3]]


def _init_twice_without_destroy() -> None:
    dist_core.init_process_group_from_backend("gloo")


@pytest.mark.processes
def test_second_init_without_destroy_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="already initialized"):
        run_ranks(_init_twice_without_destroy, 1)


def test_single_process_init_and_destroy(monkeypatch: pytest.MonkeyPatch) -> None:
    for round_ in range(2):
        port = dist_core.get_unused_port()
        for name in ("GROUP_RANK", "NODE_RANK"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("RANK", "0")  # let monkeypatch restore what set_dist writes
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        dist_core.init_dist(0, 0, 1, 1, "127.0.0.1", port, "env://")  # the default backend
        try:
            assert dist_core.is_initialized(), round_
            assert dist_core.get_world_size() == 1
        finally:
            dist_core.destroy_dist()
        assert not dist_core.is_initialized()


def test_env_rendezvous_variables_fill_only_what_the_launcher_left_out() -> None:
    env = dist_core.DistEnv(rank=1, world_size=2, master_addr="node-07", master_port=12345)
    assert env_rendezvous_variables(env, {}) == {
        "MASTER_ADDR": "node-07",
        "MASTER_PORT": "12345",
    }
    assert env_rendezvous_variables(env, {"MASTER_ADDR": "other"}) == {"MASTER_PORT": "12345"}
    assert env_rendezvous_variables(env, {"MASTER_ADDR": "a", "MASTER_PORT": "1"}) == {}


def test_srun_task_without_master_addr_forms_its_group(monkeypatch: pytest.MonkeyPatch) -> None:
    # What srun -n1 gives a task: no MASTER_ADDR, which torch's env:// needs (issue 32, bug 1).
    _clear_rank_variables(monkeypatch)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "INIT_METHOD"):
        monkeypatch.delenv(name, raising=False)
    slurm = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NODELIST": "localhost",
        # The derived port could be taken on a shared machine; the address is the point.
        "MASTER_PORT": str(dist_core.get_unused_port()),
    }
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    dist_core.init_process_group_from_backend(backend="gloo")
    try:
        assert dist_core.get_world_size() == 1
        assert os.environ["MASTER_ADDR"] == "localhost"
    finally:
        dist_core.destroy_dist()


def _clear_rank_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "PMI_")) or name in (
            "GROUP_RANK",
            "NODE_RANK",
            "TORCH_DISTRIBUTED_BACKEND",
            "CUDA_VISIBLE_DEVICES",
        ):
            monkeypatch.delenv(name)


def test_explicit_nccl_with_too_few_gpus_fails_before_any_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _clear_rank_variables(monkeypatch)
    crowded = cuda_device_count() + 1
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(crowded))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(crowded))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    # Nobody listens there: a group that got as far as the rendezvous would hang.
    monkeypatch.setenv("MASTER_PORT", str(dist_core.get_unused_port()))
    pattern = f"LOCAL_WORLD_SIZE={crowded} ranks .* has {crowded - 1} device"
    with pytest.raises(DistEnvError, match=pattern):
        dist_core.init_process_group_from_backend("nccl")
    assert not dist.is_initialized()
    monkeypatch.setenv("TORCH_DISTRIBUTED_BACKEND", "cpu:gloo,cuda:nccl")
    with pytest.raises(DistEnvError, match="backend cpu:gloo,cuda:nccl needs one"):
        dist_core.init_process_group_from_backend()
    assert not dist.is_initialized()


def _init_with_default_backend_and_report() -> tuple[str, str | None]:
    """Re-initializes run_ranks' group with no backend named anywhere."""
    dist_core.destroy_dist()
    os.environ.pop("TORCH_DISTRIBUTED_BACKEND", None)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    backend_logger = logging.getLogger("dist_core.backend")
    backend_logger.addHandler(Keep())
    backend_logger.setLevel(logging.INFO)
    dist_core.init_process_group_from_backend()
    fallback = [r.getMessage() for r in records if "ranks per node share" in r.getMessage()]
    return dist.get_backend(), fallback[0] if fallback else None


@pytest.mark.processes
@pytest.mark.cuda
def test_more_ranks_than_gpus_run_on_gloo_and_rank_zero_says_why() -> None:
    crowded = cuda_device_count() + 1
    results = run_ranks(_init_with_default_backend_and_report, crowded)
    assert [backend for backend, _ in results] == ["gloo"] * crowded
    line = results[0][1]
    assert line is not None and f"{crowded} ranks per node share" in line
    assert "TORCH_DISTRIBUTED_BACKEND=nccl" in line
    assert all(message is None for _, message in results[1:])


def _nccl_group_of_one() -> tuple[str, str, list[str]]:
    import warnings

    dist_core.destroy_dist()
    os.environ.pop("TORCH_DISTRIBUTED_BACKEND", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist_core.init_process_group_from_backend()
        value = torch.ones(2, device="cuda")
        dist.all_reduce(value)
        dist.barrier()
    return dist.get_backend(), str(value.device), [str(w.message) for w in caught]


@pytest.mark.processes
@pytest.mark.cuda
def test_one_rank_on_a_gpu_gets_nccl_bound_to_its_device_without_warnings() -> None:
    [(backend, device, warned)] = run_ranks(_nccl_group_of_one, 1)
    assert backend == "nccl" and device == "cuda:0"
    assert not [w for w in warned if "device_id" in w], warned


_FORK_AFTER_IS_AVAILABLE = """\
import os
import sys

import torch
import torch.distributed as dist

import dist_core
from dist_core.ports import get_unused_port

assert torch.cuda.is_available()  # starts the driver; torch.cuda.is_initialized() stays False
assert not torch.cuda.is_initialized()
for backend in ("gloo", "nccl"):
    port = get_unused_port()
    pid = os.fork()
    if pid == 0:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        try:
            dist_core.init_process_group_from_backend(backend)
        except RuntimeError as error:
            print(f"{backend} refused: {error}", flush=True)
            os._exit(3)
        value = torch.ones(1)
        dist.all_reduce(value)
        print(f"{backend} ok {value.item()}", flush=True)
        dist_core.destroy_dist()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print(f"{backend} exit {os.waitstatus_to_exitcode(status)}", flush=True)
"""


@pytest.mark.processes
@pytest.mark.cuda
def test_a_child_forked_after_the_parent_asked_for_cuda_runs_gloo_and_names_why_not_nccl(
    tmp_path: Path,
) -> None:
    script = tmp_path / "fork_after_is_available.py"
    script.write_text(_FORK_AFTER_IS_AVAILABLE)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_BACKEND"}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gloo ok 1.0" in done.stdout and "gloo exit 0" in done.stdout, done.stdout
    assert "nccl exit 3" in done.stdout, done.stdout + done.stderr
    assert "forked from one that had already initialised CUDA" in done.stdout
    assert "spawn" in done.stdout and "forkserver" in done.stdout
