"""Every test starts from, and leaves, the environment it found."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

# The tests share helpers (shm_inspection) that rank processes import by name too;
# multiprocessing passes sys.path on to them.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(autouse=True)
def _restore_environ() -> Iterator[None]:
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(params=["disk", "shm"])
def any_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Path]:
    """A fresh directory on local disk, then one on /dev/shm (tmpfs)."""
    if request.param == "disk":
        yield tmp_path
        return
    import tempfile

    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("this machine has no /dev/shm")
    with tempfile.TemporaryDirectory(dir=shm, prefix="dist-workspace-test-") as name:
        yield Path(name)


@pytest.fixture
def private_shm_dir() -> Iterator[None]:
    """Segments of these tests in a directory of their own on /dev/shm.

    Other jobs of this user (another test run on the machine) may hold segments in
    /dev/shm at any moment; counting ours there would count theirs.
    """
    if not Path("/dev/shm").is_dir():
        pytest.skip("this machine has no /dev/shm")
    directory = tempfile.mkdtemp(dir="/dev/shm", prefix="dist-workspace-test-")
    os.environ["DIST_WORKSPACE_SHM_DIR"] = directory  # the ranks inherit it
    try:
        yield
    finally:
        shutil.rmtree(directory, ignore_errors=True)
