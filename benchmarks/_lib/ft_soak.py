"""The soak: the replica groups' lose-a-rank-and-rejoin scenario, many times in a row.

Each run is ``packages/dist-collectives/tests/ft/group_scenario.py``'s scenario, the
one ``test_replica_groups.py`` checks once: 3 replica groups of 2 ranks train an FSDP2
MLP, one rank is SIGKILLed at step 3, its group restarts whole and heals. A run
*diverged* when a shard differs between the groups at the end (replicas that disagree
and were never told); it *failed* when it ended otherwise than the scenario expects (a
rank that crashed, a wait past its timeout), with the first line of why. Each run has
a fresh directory and store port. A count, not a timing: it needs no quiet machine.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCENARIO_DIR = ROOT / "packages" / "dist-collectives" / "tests" / "ft"
SCENARIO = "3 groups x 2 ranks, FSDP2, one rank SIGKILLed at step 3, the group rejoins"


def _commit() -> str | None:
    """The repository's commit, when this runs from a git checkout."""
    try:
        found = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None


def measure(runs: int) -> dict[str, Any]:
    """Runs the scenario ``runs`` times in a row; the counts and what went wrong."""
    import torch

    from dist_core.ports import get_unused_port

    if str(SCENARIO_DIR) not in sys.path:
        sys.path.insert(0, str(SCENARIO_DIR))
    import group_scenario

    diverged: list[str] = []
    failed: list[str] = []
    started = time.monotonic()
    for run in range(1, runs + 1):
        with tempfile.TemporaryDirectory(prefix="ft-soak-") as workdir:
            try:
                # Not the well-known 29500 (get_unused_port's default): a process of
                # another job on this host that defaults to it would reach this store.
                port = get_unused_port(0)
                result = group_scenario.run_lose_a_rank_and_rejoin(Path(workdir), port)
            except Exception as error:  # a run that ended otherwise: counted, not fatal
                lines = str(error).strip().splitlines()
                failed.append(f"run {run}: {type(error).__name__}: {lines[0] if lines else ''}")
                verdict = f"failed: {failed[-1]}"
            else:
                divergent = group_scenario.divergent_shards(result)
                if divergent:
                    diverged.append(f"run {run}: {divergent}"[:2000])
                verdict = f"diverged: {diverged[-1]}" if divergent else "identical"
        print(
            f"soak run {run}/{runs}: {verdict} ({len(diverged)} diverged, {len(failed)} "
            f"failed so far, {time.monotonic() - started:.0f} s)",
            flush=True,
        )
    return {
        "scenario": SCENARIO,
        "torch": torch.__version__,
        "commit": _commit(),
        "runs": runs,
        "diverged": len(diverged),
        "failed": len(failed),
        "divergences": diverged,
        "failures": failed,
        "seconds": round(time.monotonic() - started, 1),
    }
