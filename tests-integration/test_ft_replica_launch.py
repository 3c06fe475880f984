"""dist-collectives' replica groups, each started by its own dist-launch.

The scenario of ``packages/dist-collectives/tests/ft/test_replica_groups.py`` (one rank
of one group SIGKILLed mid-step, the group left out, restarted whole and rejoined),
with each group started by ``dist-launch --max-restarts 1`` instead of by the test: it
needs both packages, so it lives here and runs on every torch CI tests. It shares the
scenario's helpers (``group_scenario.py``) with those tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from dist_core.ports import get_unused_port

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "packages" / "dist-collectives" / "tests" / "ft"))

from group_scenario import (  # noqa: E402 - after the sys.path set-up above
    GROUP_SIZE,
    GROUPS,
    PROCESS_TIMEOUT,
    WORKER,
    ScenarioResult,
    check_scenario,
    stop_after_the_rejoin,
    wait_for_the_survivors,
)

pytestmark = pytest.mark.processes

SERVER_ARGS = ("--host", "127.0.0.1", "--port")


@pytest.mark.timeout(500)
def test_one_dist_launch_per_replica_group_restarts_only_its_group(tmp_path: Path) -> None:
    port = get_unused_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "dist_collectives.ft.store_server", *SERVER_ARGS, str(port)],
        stdout=subprocess.PIPE,
    )
    launchers: dict[str, subprocess.Popen[bytes]] = {}
    groups = [f"group{g}" for g in range(GROUPS)]
    try:
        assert server.stdout is not None
        assert b"listening" in server.stdout.readline()  # ready: it printed after binding
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)
        for index, group in enumerate(groups):
            command = [sys.executable, "-m", "dist_launch", "-n", str(GROUP_SIZE)]
            command += ["--max-restarts", "1", "--master-port", str(get_unused_port())]
            command += [str(WORKER), "--out", str(tmp_path / "{group}-{rank}.json")]
            command += ["--min-replicas", str(GROUPS - 1)]
            if group == groups[-1]:
                command += ["--kill-at-step", "3", "--kill-rank", "1"]
            env = {**os.environ, "FT_STORE": f"127.0.0.1:{port}", "GROUP_ID": str(index)}
            launchers[group] = subprocess.Popen(command, env=env)
        store.wait(["test/killed"], timedelta(seconds=PROCESS_TIMEOUT))
        # The victim's launcher restarts it meanwhile; it waits for test/restart_ok.
        killed = wait_for_the_survivors(store, groups, groups[-1])
        stop_after_the_rejoin(store, groups, groups[-1])
        for group, launcher in launchers.items():
            assert launcher.wait(timeout=PROCESS_TIMEOUT) == 0, f"{group}'s launcher failed"
    finally:
        for launcher in launchers.values():
            if launcher.poll() is None:
                launcher.terminate()
                launcher.wait(timeout=30)
        server.terminate()
        assert server.wait(timeout=30) == 0, "the store server did not stop on SIGTERM"
    reports = {
        (g, r): json.loads((tmp_path / f"{g}-{r}.json").read_text())
        for g in groups
        for r in range(GROUP_SIZE)
    }
    check_scenario(ScenarioResult(reports, killed, groups, groups[-1]))
