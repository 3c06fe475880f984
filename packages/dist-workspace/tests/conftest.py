"""Every test starts from, and leaves, the environment it found."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


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
