"""torchrun command lines run unchanged: real launches with the flags users copy."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
from launcher_nodes import LAUNCH, run_nodes

from dist_core.ports import get_unused_port

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

BOUND = 120

ALLREDUCE = """\
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
value = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(value)
print(f"rank={dist.get_rank()} world={dist.get_world_size()} sum={int(value.item())} "
      f"restart={os.environ['TORCHELASTIC_RESTART_COUNT']}", flush=True)
print(f"err-of-{dist.get_rank()}", file=sys.stderr, flush=True)
dist.destroy_process_group()
"""


def run(
    argv: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LAUNCH, *argv],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=BOUND,
    )


@pytest.fixture
def allreduce(tmp_path: Path) -> Path:
    path = tmp_path / "allreduce.py"
    path.write_text(ALLREDUCE)
    return path


def test_standalone_as_in_torchruns_docs(tmp_path: Path, allreduce: Path) -> None:
    result = run(["--standalone", "--nproc-per-node", "2", str(allreduce)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[rank0]: rank=0 world=2 sum=3" in result.stdout
    assert "[rank1]: rank=1 world=2 sum=3" in result.stdout


def test_pet_variables_alone(tmp_path: Path, allreduce: Path) -> None:
    result = run([str(allreduce)], tmp_path, {"PET_NPROC_PER_NODE": "3", "PET_STANDALONE": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("world=3 sum=6") == 3
    assert "PET_NPROC_PER_NODE" in result.stderr.splitlines()[0]  # where the value came from


def test_an_unsupported_flag_is_refused_by_name(tmp_path: Path, allreduce: Path) -> None:
    result = run(["--logs-specs", "custom", str(allreduce)], tmp_path)
    assert result.returncode == 2
    assert "--logs-specs is not supported" in result.stderr


def test_log_dir_layout_and_torch_error_file(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    printed = tmp_path / "rank0-printed"
    # Rank 1 fails only once rank 0 printed: the launcher stops the other ranks at a
    # failure, and a rank stopped before its print has nothing in its log.
    script.write_text(
        "import os, sys, time\nprint('out', os.environ['RANK'], flush=True)\n"
        "print('err', os.environ['RANK'], file=sys.stderr, flush=True)\n"
        f"printed = {str(printed)!r}\n"
        "if os.environ['RANK'] == '0':\n    open(printed, 'w').close()\n"
        "if os.environ['RANK'] == '1':\n"
        "    deadline = time.monotonic() + 60\n"
        "    while not os.path.exists(printed) and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    raise ValueError('bad lr 0.3')\n"
    )
    logs = tmp_path / "logs"
    argv = ["-n", "2", "--log-dir", str(logs), "--rdzv-id", "exp1", str(script)]
    first = run(argv, tmp_path)
    assert first.returncode == 1, first.stderr
    rank_dir = logs / "exp1" / "attempt_0" / "1"
    assert (rank_dir / "stdout.log").read_text() == "out 1\n"
    assert "err 1" in (rank_dir / "stderr.log").read_text()
    assert (logs / "exp1" / "attempt_0" / "0" / "stdout.log").read_text() == "out 0\n"
    assert not (logs / "exp1" / "attempt_0" / "0" / "error.json").exists()
    assert not list(logs.rglob("hang.*"))  # a crash is not a hang
    assert not (logs / "exp1" / "slow_ranks.jsonl").exists()

    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(1, 0, 1, str(rank_dir / "error.json"))
    assert isinstance(failure.message, dict)
    assert failure.message["message"] == "ValueError: bad lr 0.3"
    assert failure.timestamp > 0
    assert (
        "fails.py"
        in json.loads((rank_dir / "error.json").read_text())["message"]["extraInfo"]["py_callstack"]
    )

    second = run(argv, tmp_path)  # the same run id again never overwrites the first
    assert second.returncode == 1
    assert (logs / "exp1_1" / "attempt_0" / "1" / "stdout.log").exists()
    assert (rank_dir / "stdout.log").read_text() == "out 1\n"


def test_restarts_log_to_their_own_attempt(tmp_path: Path) -> None:
    script = tmp_path / "flaky.py"
    script.write_text(
        "import os\nn = os.environ['TORCHELASTIC_RESTART_COUNT']\nprint('attempt', n)\n"
        "raise SystemExit(0 if n == '1' else 5)\n"
    )
    logs = tmp_path / "logs"
    result = run(
        ["--max-restarts", "2", "--log-dir", str(logs), "--rdzv-id", "r", str(script)], tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert (logs / "r" / "attempt_0" / "0" / "stdout.log").read_text() == "attempt 0\n"
    assert (logs / "r" / "attempt_1" / "0" / "stdout.log").read_text() == "attempt 1\n"


def test_local_ranks_filter_shows_only_rank_zero(tmp_path: Path, allreduce: Path) -> None:
    logs = tmp_path / "logs"
    result = run(
        [
            "-n",
            "2",
            "--local-ranks-filter",
            "0",
            "--log-dir",
            str(logs),
            "--rdzv-id",
            "f",
            str(allreduce),
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "[rank0]: rank=0" in result.stdout and "[rank1]" not in result.stdout
    assert "[rank1]" not in result.stderr
    assert "rank=1 world=2" in (logs / "f" / "attempt_0" / "1" / "stdout.log").read_text()


def test_redirects_keep_streams_off_the_console(tmp_path: Path, allreduce: Path) -> None:
    logs = tmp_path / "logs"
    result = run(
        ["-n", "2", "-r", "1", "--log-dir", str(logs), "--rdzv-id", "x", str(allreduce)], tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert "rank=" not in result.stdout  # stdout redirected
    assert "[rank1]: err-of-1" in result.stderr  # stderr still shown
    assert "sum=3" in (logs / "x" / "attempt_0" / "0" / "stdout.log").read_text()


@pytest.mark.parametrize("source", ["flag", "PET_LOG_LINE_PREFIX_TEMPLATE", "TORCHELASTIC"])
def test_log_line_prefix_template_as_torch_2_14_renders_it(
    tmp_path: Path, allreduce: Path, source: str
) -> None:
    template = "${hostname}:${role_name}${local_rank}/${rank}|${unknown}:"
    argv = ["--nproc-per-node", "2", "--role", "trainer", str(allreduce)]
    env: dict[str, str] = {}
    if source == "flag":
        argv = ["--log-line-prefix-template", template, *argv]
    elif source == "TORCHELASTIC":
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = template
    else:
        env[source] = template
    result = run(argv, tmp_path, env)
    assert result.returncode == 0, result.stderr
    host = socket.gethostname()
    # Nothing added after the template, an unknown macro left as written (torch's
    # safe_substitute); every console line of both streams carries it.
    assert f"{host}:trainer1/1|${{unknown}}:rank=1 world=2 sum=3" in result.stdout
    assert f"{host}:trainer0/0|${{unknown}}:err-of-0" in result.stderr
    assert "[rank" not in result.stdout + result.stderr


def test_print_completion_prints_a_script_or_names_shtab(tmp_path: Path) -> None:
    import importlib.util

    # No script: the flag acts while the line is parsed, as --help does.
    result = run(["--print-completion", "bash"], tmp_path)
    if importlib.util.find_spec("shtab") is None:
        assert result.returncode == 2
        assert "--print-completion bash: needs the optional 'shtab' package" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert "dist-launch" in result.stdout and "--log-line-prefix-template" in result.stdout


def test_no_python_runs_a_program(tmp_path: Path) -> None:
    result = run(["--no-python", "-n", "2", "sh", "-c", "echo rank $RANK of $WORLD_SIZE"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[rank0]: rank 0 of 2" in result.stdout and "[rank1]: rank 1 of 2" in result.stdout


def test_run_path_and_module(tmp_path: Path, allreduce: Path) -> None:
    assert run(["--run-path", "-n", "2", str(allreduce)], tmp_path).returncode == 0
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "job.py").write_text(ALLREDUCE)
    result = run(["-m", "-n", "2", "mypkg.job"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "world=2 sum=3" in result.stdout


def test_progress_bars_update_in_place_with_their_prefix(tmp_path: Path) -> None:
    script = tmp_path / "bar.py"
    script.write_text(
        "import sys\nfor i in range(3):\n    sys.stdout.write(f'\\rstep {i}')\n"
        "    sys.stdout.flush()\nprint()\n"
    )
    # Bytes: text mode would turn each \r into a line end of its own.
    result = subprocess.run(
        [*LAUNCH, "-n", "1", str(script)], cwd=tmp_path, capture_output=True, timeout=BOUND
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == b"[rank0]: step 0\r[rank0]: step 1\r[rank0]: step 2\n"


def test_one_prefix_per_line(tmp_path: Path) -> None:
    script = tmp_path / "logs.py"
    script.write_text(
        "import logging\nfrom dist_core.log import configure_logging, INFOALL\n"
        "configure_logging()\nlogging.getLogger('x').log(INFOALL, 'hello from every rank')\n"
    )
    result = run(["-n", "2", str(script)], tmp_path)
    assert result.returncode == 0, result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if "hello" in line]
    assert len(lines) == 2, result.stdout + result.stderr
    for line in lines:
        assert line.startswith("[rank") and "[rank " not in line, line


def test_virtual_local_rank(tmp_path: Path) -> None:
    script = tmp_path / "v.py"
    script.write_text(
        "import os\nprint(os.environ['LOCAL_RANK'], os.environ['CUDA_VISIBLE_DEVICES'])\n"
    )
    result = run(
        ["--virtual-local-rank", "-n", "2", str(script)], tmp_path, {"CUDA_VISIBLE_DEVICES": "5,7"}
    )
    assert result.returncode == 0, result.stderr
    assert "[rank0]: 0 5" in result.stdout and "[rank1]: 0 7" in result.stdout


def two_loopback_nodes(
    argv: list[str], cwd: Path
) -> tuple[list[subprocess.Popen[str]], list[tuple[str, str]]]:
    """Two launchers on this host, as two nodes of one c10d job; waits for both."""
    return run_nodes([argv, argv], cwd, timeout=BOUND)


def test_c10d_on_loopback_two_nodes(tmp_path: Path, allreduce: Path) -> None:
    port = get_unused_port()
    argv = [
        "--nnodes", "2", "-n", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "rev", str(allreduce),
    ]  # fmt: skip
    nodes, outputs = two_loopback_nodes(argv, tmp_path)
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err
    joined = "".join(out for out, _ in outputs)
    for rank in range(4):
        assert f"rank={rank} world=4 sum=10" in joined, joined


def test_c10d_endpoint_without_port_is_torchruns_29400(tmp_path: Path) -> None:
    """``--rdzv-endpoint HOST`` means HOST:29400, as torchrun documents (not 29500)."""
    from dist_launch.rendezvous.c10d import c10d_host_and_port

    assert c10d_host_and_port("node0") == ("node0", 29400)
    assert c10d_host_and_port("[::1]:1234") == ("::1", 1234)
    probe = socket.socket()
    try:
        probe.bind(("127.0.0.1", 29400))
    except OSError:
        pytest.skip("127.0.0.1:29400 is taken on this machine")
    finally:
        probe.close()
    script = tmp_path / "peek.py"
    script.write_text(
        "import socket\n"
        "socket.create_connection(('127.0.0.1', 29400), timeout=10).close()\n"
        "print('rendezvous store on 29400', flush=True)\n"
    )
    argv = ["--nnodes", "1", "-n", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1"]
    result = run([*argv, "--rdzv-id", "portless", str(script)], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "rendezvous store on 29400" in result.stdout


def test_c10d_restart_budget_is_job_wide(tmp_path: Path) -> None:
    """Node 1's rank fails in every round: 1 restart for the whole job, not per node."""
    script = tmp_path / "bad.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "print('round', os.environ['TORCHELASTIC_RESTART_COUNT'], flush=True)\n"
        "if dist.get_rank() == 3:\n    raise RuntimeError('rank 3 always fails')\n"
        "dist.barrier()\n"
    )
    port = get_unused_port()
    argv = [
        "--nnodes", "2", "-n", "2", "--rdzv-backend", "c10d", "--max-restarts", "1",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "budget", "--grace-period", "2",
        str(script),
    ]  # fmt: skip
    nodes, outputs = two_loopback_nodes(argv, tmp_path)
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode != 0, err
    out = "".join(out for out, _ in outputs)
    assert out.count("round 0") == 4 and out.count("round 1") == 4, out
    assert "round 2" not in out
    err = "".join(err for _, err in outputs)
    assert "rank 3" in err and "rank 3 always fails" in err, err
    assert "restart 1 of 1, job-wide" in err, err


@pytest.mark.parametrize("spelling", ["--rdzv-endpoint", "--rdzv_endpoint"])
def test_a_static_endpoint_is_the_workers_master_address_as_under_torchrun(
    tmp_path: Path, spelling: str
) -> None:
    """torchrun's static rendezvous serves its store at the endpoint, whatever --nnodes."""
    port = get_unused_port()
    script = tmp_path / "where.py"
    script.write_text(
        "import os\n"
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "print('master', os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'], flush=True)\n"
        # gloo's init returns on one rank before the other's connections are made: a
        # rank that left at once could close them under it.
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    )
    argv = ["-n", "2", "--rdzv-backend", "static", spelling, f"127.0.0.1:{port}", str(script)]
    result = run(argv, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(f"master 127.0.0.1 {port}") == 2, result.stdout
