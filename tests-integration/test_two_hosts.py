"""Two hosts (network namespaces), one dist-launch each: the workspace across hosts.

A collective across two hosts and the loss of one host's launcher are tested under a
real two-node SLURM (tests-cluster/test_multi_node_slurm.py) and across namespace hosts
(test_multinode.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.processes

Host = Any  # conftest.Host; conftest modules are not importable by name

SCRIPT = Path(__file__).parent / "scripts" / "allreduce_job.py"
PORT = 29731


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
