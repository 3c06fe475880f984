"""What the jobs on etcd across hosts share: the worker's round markers, the timeouts.

The worker (scripts/etcd_rounds.py) marks each round it runs in; :func:`rounds` reads
the marks. Used by tests-integration/test_etcd_nodes.py (hosts of network namespaces)
and tests-cluster/test_etcd_slurm.py (the same under SLURM).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dist_launch.rendezvous.etcd_http import STALL_SECONDS

WORKER = Path(__file__).resolve().parent / "scripts" / "etcd_rounds.py"
BOUND = 120.0  # seconds for any one wait of these tests
# The timeouts that bound the re-forming (seconds): torch drops a lost node after
# keep_alive_interval x keep_alive_max_attempt without a heartbeat (its etcd lease, as
# long, ends as soon); a survivor whose rank only lost its peers waits up to 5 s for the
# lost node's record of the cause; then a round of MIN < MAX nodes waits
# last_call_timeout for more. A cut-off node is fenced once etcd has not answered it for
# max(5 s, keep-alive bound) + STALL_SECONDS (what an election may cost a healthy node).
KEEP_ALIVE_INTERVAL, KEEP_ALIVE_MAX_ATTEMPT, LAST_CALL = 1, 3, 2
RDZV_CONF = (
    f"keep_alive_interval={KEEP_ALIVE_INTERVAL},keep_alive_max_attempt={KEEP_ALIVE_MAX_ATTEMPT},"
    f"last_call_timeout={LAST_CALL},join_timeout=120"
)
TIMEOUTS = (
    f"--rdzv-conf {RDZV_CONF}: keep-alive {KEEP_ALIVE_INTERVAL} s x {KEEP_ALIVE_MAX_ATTEMPT}"
    f" = {KEEP_ALIVE_INTERVAL * KEEP_ALIVE_MAX_ATTEMPT} s, the wait for the cause 5 s,"
    f" last call {LAST_CALL} s; fencing after 5 s + {STALL_SECONDS:g} s of etcd silence"
)


@dataclass(frozen=True)
class Marker:
    """One worker's mark of a round: its rank, node, world size, restarts, start time, PID."""

    rank: int
    node: str
    world: int
    restarts: int
    started: float
    pid: int


def rounds(out: Path) -> dict[str, list[Marker]]:
    """Each round's markers (scripts/etcd_rounds.py), by the round's master port."""
    found: dict[str, list[Marker]] = {}
    for path in out.iterdir():
        if path.suffix == ".tmp":
            continue
        port, _, rank = path.name.partition("-")
        node, world, restarts, started, pid = path.read_text().split()
        marker = Marker(int(rank), node, int(world), int(restarts), float(started), int(pid))
        found.setdefault(port, []).append(marker)
    return found


def full_round(out: Path, world: int, after: float = 0.0) -> list[Marker] | None:
    """The markers of a round of ``world`` ranks where every rank marked, by rank.

    Args:
        out: The workers' folder.
        world: The round's world size.
        after: A wall time the round's workers all started after (a round of the same
            size may have run before, ``--nnodes 2:3`` forming at two first).
    """
    for markers in rounds(out).values():
        if len(markers) == world and all(m.world == world and m.started > after for m in markers):
            return sorted(markers, key=lambda m: m.rank)
    return None


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_for(predicate: Callable[[], bool], what: str, logs: Callable[[], str]) -> None:
    """Polls ``predicate`` (files written by other processes) for :data:`BOUND` s."""
    deadline = time.monotonic() + BOUND
    while not predicate():
        assert time.monotonic() < deadline, f"not within {BOUND:g} s: {what}\n{logs()}"
        threading.Event().wait(0.1)
