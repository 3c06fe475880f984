"""Two hosts (network namespaces), one dist-launch each, one collective across both."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.processes

Host = Any  # conftest.Host; conftest modules are not importable by name

SCRIPT = Path(__file__).parent / "scripts" / "allreduce_job.py"
PORT = 29731
BOUND_SECONDS = 60.0


def _launcher(
    host: Host,
    master: Host,
    node_rank: int,
    extra_env: dict[str, str],
    script: Path = SCRIPT,
    *args: str,
) -> subprocess.Popen[str]:
    launcher = shutil.which("dist-launch") or str(Path(sys.executable).with_name("dist-launch"))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": host.interface, **extra_env}
    argv = [
        launcher,
        "--nnodes",
        "2",
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        "2",
        "--master-addr",
        master.address,
        "--master-port",
        str(PORT),
        "--grace-period",
        "2",
        str(script),
        *args,
    ]
    return subprocess.Popen(
        host.command(argv),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _succeeded(launchers: list[subprocess.Popen[str]]) -> str:
    """Every launcher's output, joined, once each has exited 0."""
    outputs = []
    for launcher in launchers:
        out, _ = launcher.communicate(timeout=180)
        outputs.append(out)
        assert launcher.returncode == 0, out
    return "\n".join(outputs)


def test_collective_across_two_hosts(two_hosts: tuple[Host, Host]) -> None:
    first, second = two_hosts
    launchers = [_launcher(first, first, 0, {}), _launcher(second, first, 1, {})]
    joined = _succeeded(launchers)
    for rank in range(4):
        assert f"rank={rank} world=4 sum=10" in joined, joined


def test_killing_one_hosts_launcher_ends_the_other_non_zero(two_hosts: tuple[Host, Host]) -> None:
    first, second = two_hosts
    block = {"BLOCK_AFTER_ALLREDUCE": "1"}
    launchers = [_launcher(first, first, 0, block), _launcher(second, first, 1, block)]
    try:
        # Wait until every rank has done the collective (the line is printed after it).
        seen: list[str] = []
        deadline = time.monotonic() + 180
        assert launchers[1].stdout is not None
        while sum("sum=10" in line for line in seen) < 2 and time.monotonic() < deadline:
            line = launchers[1].stdout.readline()
            if not line:
                break
            seen.append(line)
        assert sum("sum=10" in line for line in seen) == 2, "".join(seen)
        os.kill(launchers[1].pid, signal.SIGKILL)  # the launcher alone
        started = time.monotonic()
        launchers[0].wait(timeout=BOUND_SECONDS)
        assert launchers[0].returncode != 0
        assert time.monotonic() - started < BOUND_SECONDS
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait(timeout=30)


def test_the_parallel_helpers_across_two_hosts(
    two_hosts: tuple[Host, Host], tmp_path: Path
) -> None:
    """Configs through a directory span hosts (small ones on the link, a large one in a
    file); shared memory across hosts is refused on every rank, naming both hosts."""
    first, second = two_hosts
    script = SCRIPT.with_name("workspace_two_hosts.py")
    launchers = [
        _launcher(host, first, index, {}, script, str(tmp_path))
        for index, host in enumerate((first, second))
    ]
    joined = _succeeded(launchers)
    assert "small: ranks=[0, 1, 2, 3] hosts=2" in joined, joined
    assert "large: ranks=[0, 1, 2, 3] values=[0, 1, 2, 3]" in joined, joined
    assert "shared memory needs one host. Pass workspace_path" in joined, joined
    assert first.name in joined and second.name in joined, joined
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)  # the call directory is gone
