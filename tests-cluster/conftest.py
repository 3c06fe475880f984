"""Fixtures of the real-launcher tests: one SLURM cluster per pytest process, a tag per test.

Needs root and the programs of :data:`one_host_slurm.TOOLS` (Debian: ``slurm-wlm``,
``munge``, ``openmpi-bin``; ``nox -s cluster`` installs them). Outside CI a test that
lacks them is skipped with the reason; in CI (``CI`` set) it fails instead, so the real
launchers are always exercised there.

Each pytest-xdist worker brings up a cluster of its own (its own ports, directory,
munge socket and cluster name), so workers share nothing. Every test gets a ``tag``
that its jobs carry in their environment (``DIST_TEST_TAG``); after the test, no
process with that tag may be alive (the test fails, and they are killed).
"""

from __future__ import annotations

import os
import sys
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from one_host_slurm import SlurmCluster, missing_tools, one_host_slurm
from processes import TAG_VARIABLE, kill_pids, leftovers

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def require_cluster_tools() -> None:
    """Skips (outside CI) or fails (in CI) when root or a program is missing."""
    problems = []
    if os.geteuid() != 0:
        problems.append("root (slurmd runs jobs as any user)")
    missing = missing_tools()
    if missing:
        problems.append(
            f"{', '.join(missing)} (apt-get install -y --no-install-recommends "
            "slurm-wlm munge openmpi-bin)"
        )
    if not problems:
        return
    reason = "a one-host SLURM cluster needs " + "; ".join(problems)
    if os.environ.get("CI"):
        pytest.fail(f"{reason}: CI must run the real launchers", pytrace=False)
    pytest.skip(reason)


def first_job_id() -> int:
    """Job ids for this pytest process's cluster, apart from its sibling workers'.

    A job's master port is derived from its id modulo 20000: each xdist worker of a
    run gets its own thousand ids, the run itself a random place among twenty such.
    """
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", uuid.uuid4().hex)
    return 1 + 1000 * ((zlib.crc32(run.encode()) + worker) % 20)


@pytest.fixture(scope="session")
def slurm() -> Iterator[SlurmCluster]:
    """The cluster of this pytest process (one per xdist worker)."""
    require_cluster_tools()
    with one_host_slurm(first_job_id=first_job_id()) as cluster:
        yield cluster


@pytest.fixture
def tag() -> Iterator[str]:
    """A unique tag for the test's jobs; none of its processes may outlive the test."""
    value = f"t{uuid.uuid4().hex[:12]}"
    yield value
    left = leftovers(value)
    if left:
        kill_pids(left)
        pytest.fail(f"processes of the test still alive after it: {left}", pytrace=False)


@pytest.fixture
def job_env(tag: str) -> dict[str, str]:
    """Variables for a job's environment: the tag, unbuffered Python, gloo."""
    return {
        TAG_VARIABLE: tag,
        "PYTHONUNBUFFERED": "1",
        "TORCH_DISTRIBUTED_BACKEND": "gloo",
        "OMP_NUM_THREADS": "1",
    }
