"""Two real launchers as the two pods of a job, with only what each operator sets.

Each pod's variables as its operator writes them (and ``KUBERNETES_SERVICE_HOST``, which
every container has), ``dist-launch`` with no node flags; each worker must see its own
process rank, never the pod's. The DNS wait runs a launcher whose ``/etc/hosts`` is a
file the test writes (a mount namespace of its own, root only): the master's name
starts resolving while the launcher waits, as a headless service's record does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from launcher_nodes import LAUNCH, run_nodes
from launcher_scripts import TORCHRUN_SCRIPT, read_until, write_script

from dist_core.ports import get_unused_port

pytestmark = [pytest.mark.processes, pytest.mark.timeout(240)]

POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
# What a worker sees, printed without Python (the --no-python runs pay no torch import).
SHOW = 'echo "worker RANK=$RANK WORLD_SIZE=$WORLD_SIZE NODE_RANK=$NODE_RANK MASTER=$MASTER_ADDR"'


def pods(per_pod: list[dict[str, str]]) -> list[dict[str, str]]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "SLURM_"))}
    return [{**base, **POD, **variables} for variables in per_pod]


def workers_seen(outputs: list[tuple[str, str]]) -> list[str]:
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for out, _ in outputs for line in out.splitlines()]
    return sorted(line for line in lines if line.startswith("worker "))


def platform(name: str, port: int, index: int) -> dict[str, str]:
    """Pod ``index`` of 2 as the operator ``name`` starts it (1 process per pod)."""
    master = {"PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port)}
    return {
        "trainer-v2": {
            **master, "PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(index),
        },
        "pytorchjob-v1-nproc": {
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(index),
            "WORLD_SIZE": "2", "PET_NPROC_PER_NODE": "1", "PET_NNODES": "2",
            "PET_NODE_RANK": str(index),
        },
        "indexed-job": {**master, "JOB_COMPLETION_INDEX": str(index), "PET_NNODES": "2"},
        "leaderworkerset": {
            # A pod spec may name the port; LWS itself gives none (29500, maybe taken here).
            "LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2",
            "LWS_WORKER_INDEX": str(index), "PET_MASTER_PORT": str(port),
        },
    }[name]  # fmt: skip


@pytest.mark.parametrize(
    "name", ["trainer-v2", "pytorchjob-v1-nproc", "indexed-job", "leaderworkerset"]
)
def test_each_operators_pods_run_with_no_flags(tmp_path: Path, name: str) -> None:
    port = get_unused_port()
    argv = ["--no-python", "sh", "-c", SHOW]
    launchers, outputs = run_nodes(
        [argv, argv], tmp_path, 60, pods([platform(name, port, i) for i in range(2)])
    )
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs
    assert workers_seen(outputs) == [
        f"worker RANK={i} WORLD_SIZE=2 NODE_RANK={i} MASTER=127.0.0.1" for i in range(2)
    ]


def test_pytorchjob_v1_pods_form_one_group_of_process_ranks(tmp_path: Path) -> None:
    # The operator's RANK is the pod's index and WORLD_SIZE the pod count: 2 pods of 2
    # processes are 4 ranks, not "rank 1 of 2".
    script = write_script(tmp_path, "train.py", TORCHRUN_SCRIPT)
    port = get_unused_port()
    per_pod = [
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(i), "WORLD_SIZE": "2"}
        for i in range(2)
    ]
    launchers, outputs = run_nodes([["-n", "2", script]] * 2, tmp_path, 150, pods(per_pod))
    assert [launcher.returncode for launcher in launchers] == [0, 0], outputs
    sums = re.findall(r"\]: sum (\d+) world (\d+)", "".join(out for out, _ in outputs))
    assert sums == [("6", "4")] * 4


def _in_own_hosts_file(hosts: Path, argv: list[str]) -> list[str]:
    """``argv`` in a mount namespace whose /etc/hosts is ``hosts`` (appends show at once)."""
    bind = 'mount --bind "$0" /etc/hosts && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", bind, str(hosts), *argv]


def _require_mount_namespaces() -> None:
    if os.geteuid() == 0 and shutil.which("unshare"):
        return
    reason = "a mount namespace of its own needs root and unshare (util-linux)"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI runs as root", pytrace=False)
    pytest.skip(reason)


def _hosts_file(tmp_path: Path) -> Path:
    hosts = tmp_path / "hosts"
    hosts.write_text(Path("/etc/hosts").read_text())
    return hosts


def test_the_master_name_is_waited_for_until_it_resolves(tmp_path: Path) -> None:
    _require_mount_namespaces()
    hosts = _hosts_file(tmp_path)
    name = f"master-{os.getpid()}-{tmp_path.name}.late.test".lower()
    pod = {"PET_NNODES": "1", "PET_MASTER_ADDR": name, "PET_MASTER_PORT": str(get_unused_port())}
    launcher = subprocess.Popen(
        _in_own_hosts_file(hosts, [*LAUNCH, "--no-python", "sh", "-c", SHOW]),
        cwd=tmp_path,
        env=pods([pod])[0],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        waited = read_until(launcher.stderr, b"to resolve")
        assert f"{name} (from PET_MASTER_ADDR)".encode() in waited, waited
        with hosts.open("a") as entry:  # the headless service's record appears
            entry.write(f"127.0.0.1 {name}\n")
        out, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 0, err
        assert f"MASTER={name}".encode() in out, out
    finally:
        launcher.kill()
        launcher.wait(30)


def test_a_master_name_that_never_resolves_is_named(tmp_path: Path) -> None:
    _require_mount_namespaces()
    hosts = _hosts_file(tmp_path)
    name = f"never-{os.getpid()}-{tmp_path.name}.late.test".lower()
    pod = {"LWS_LEADER_ADDRESS": name, "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    argv = [*LAUNCH, "--rdzv-conf", "join_timeout=2", "--no-python", "true"]
    done = subprocess.run(
        _in_own_hosts_file(hosts, argv),
        cwd=tmp_path,
        env=pods([pod])[0],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert f"{name} (from LWS_LEADER_ADDRESS) did not resolve within 2 s" in done.stderr
