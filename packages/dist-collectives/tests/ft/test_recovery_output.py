"""What a user reads: replicas started together begin together, and a replica's death
is told in one line per event, without torch's C++ store warnings.

Real processes, a real SIGKILL, the survivors' stderr as the user would see it.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from dist_core.ports import get_unused_port

pytestmark = pytest.mark.processes

HERE = Path(__file__).parent
PROCESS_TIMEOUT = 120


@pytest.mark.timeout(400)
def test_replicas_started_together_form_the_first_quorum_together(tmp_path: Path) -> None:
    # min_replica_size=1: without waiting for the others, the first replica to ask
    # would form quorum 0 alone and the rest would join (and heal) a step later.
    replicas, repeats = 4, 3
    port = get_unused_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    outs = [tmp_path / f"replica{i}.json" for i in range(replicas)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "quorum_worker.py"),
                *("--port", str(port), "--index", str(i), "--replicas", str(replicas)),
                *("--repeats", str(repeats), "--stagger", "0.25", "--out", str(outs[i])),
            ]
        )
        for i in range(replicas)
    ]
    try:
        codes = [proc.wait(timeout=PROCESS_TIMEOUT * repeats) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert codes == [0] * replicas, f"exit codes {codes}"
    del store
    for index, out in enumerate(outs):
        firsts = json.loads(out.read_text())
        expected = {"quorum_id": 0, "members": replicas, "participants": replicas}
        for repeat, first in enumerate(firsts):
            assert first["committed"], f"replica{index}, repeat {repeat}: {first}"
            assert {k: first[k] for k in expected} == expected, (
                f"replica{index}, repeat {repeat}: first quorum {first}, expected {expected}"
            )


def _lines(text: str, pattern: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(pattern, line)]


@pytest.mark.timeout(400)
def test_a_replica_death_is_told_in_one_line_per_event_without_store_warnings(
    tmp_path: Path,
) -> None:
    replicas = 3
    port = get_unused_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    victim = f"replica{replicas - 1}"
    survivors = [f"replica{i}" for i in range(replicas - 1)]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    errs = {r: tmp_path / f"{r}.stderr" for r in [*survivors, victim]}
    try:
        for replica, err in errs.items():
            extra = ["--min-replicas", str(replicas - 1)]
            if replica == victim:
                extra += ["--kill-at-step", "3", "--kill-when-count", str(replicas)]
            with err.open("wb") as handle:
                procs[replica] = subprocess.Popen(
                    [
                        sys.executable,
                        str(HERE / "replica_worker.py"),
                        *("--port", str(port), "--replica-id", replica),
                        *("--out", str(tmp_path / f"{replica}.json"), *extra),
                    ],
                    stderr=handle,
                )
        assert procs[victim].wait(timeout=PROCESS_TIMEOUT) == -signal.SIGKILL
        killed = json.loads(store.get("test/killed"))
        deadline = time.monotonic() + PROCESS_TIMEOUT
        while time.monotonic() < deadline and not all(
            store.check([f"test/progress/{r}"])
            and int(store.get(f"test/progress/{r}")) > killed["step"] + 1
            for r in survivors
        ):
            time.sleep(0.05)  # polling the store for progress other processes write
        progress = [int(store.get(f"test/progress/{r}")) for r in survivors]
        store.set("test/stop_at", str(max(progress) + 2))
        for replica in survivors:
            assert procs[replica].wait(timeout=PROCESS_TIMEOUT) == 0, f"{replica} failed"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    del store
    step = killed["step"]
    for replica in survivors:
        text = errs[replica].read_text(errors="replace")
        context = f"{replica}'s stderr:\n{text}"
        store_warnings = [
            line
            for line in _lines(text, r"waitForInput|socket\.cpp")
            # The resolver's, not the store's: torch names the local end of each new
            # connection, and a DNS server that stalls (seen in this sandbox) says so.
            if "hostname of the client socket cannot be retrieved" not in line
        ]
        assert not store_warnings, context
        # One quorum of every replica before the death; on a loaded machine a replica
        # may start after the first quorum closed and join in the next one.
        assert len(_lines(text, rf"quorum \d+ with {replicas} replicas")) == 1, context
        assert len(_lines(text, rf"replica {replica}: step {step} failed: \w+")) == 1, context
        assert len(_lines(text, r" failed: ")) == 1, context
        assert len(_lines(text, rf"replica {replica}: step {step} discarded on every replica")) == 1
        assert len(_lines(text, r"discarded on every replica")) == 1, context
        new_quorum = _lines(text, rf"quorum \d+ with {replicas - 1} replicas, .*without {victim}")
        assert len(new_quorum) == 1, context
        recovered = _lines(
            text,
            rf"replica {replica}: recovered in \d+\.\d\d s: {victim} failed, step {step} "
            rf"discarded, step {step} committed by quorum \d+ with {replicas - 1} replicas",
        )
        assert len(recovered) == 1, context
        seconds = float(re.search(r"recovered in (\S+) s", recovered[0]).group(1))  # type: ignore[union-attr]
        assert 0 < seconds < 30, recovered
