"""An export tool installs dist-workspace alone and inspects the demo's export."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.processes

ROOT = Path(__file__).resolve().parent.parent


def _run(argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)


def test_dist_workspace_alone_inspects_the_demo_export(demo_run: Any, tmp_path: Path) -> None:
    venv = tmp_path / "export-tool"
    assert _run([sys.executable, "-m", "venv", str(venv)]).returncode == 0
    python = str(venv / "bin" / "python")
    # torch first, pinned to the build on this machine's disk (see noxfile.py). Where the
    # nox run has that build installed already (DIST_TEST_TORCH_SITE, its template's
    # site-packages), a .pth file makes it this venv's too: pip finds it installed, as
    # it would after installing it, without unpacking it a second time.
    shared = os.environ.get("DIST_TEST_TORCH_SITE")
    if shared:
        [site] = venv.glob("lib/python*/site-packages")
        (site / "shared_torch.pth").write_text(shared + "\n")
    installed = _run([python, "-m", "pip", "install", "-q", "torch==2.13.0"])
    assert installed.returncode == 0, installed.stderr
    # The run's wheels where nox built them (DIST_TEST_WHEELS), else the source folders.
    wheels = os.environ.get("DIST_TEST_WHEELS")
    packages = [str(ROOT / "packages" / name) for name in ("dist-core", "dist-workspace")]
    if wheels:
        names = ("dist_core", "dist_workspace")
        packages = [str(next(Path(wheels).glob(f"{name}-*.whl"))) for name in names]
    installed = _run([python, "-m", "pip", "install", "-q", *packages])
    assert installed.returncode == 0, installed.stderr
    listed = _run([python, "-m", "pip", "list", "--format=freeze"]).stdout.lower()
    ours = sorted(line.split("==")[0] for line in listed.splitlines() if line.startswith("dist-"))
    assert ours == ["dist-core", "dist-workspace"]

    inspected = _run(
        [str(venv / "bin" / "dist-workspace"), "inspect", str(demo_run.export_dir / "workspace")]
    )
    assert inspected.returncode == 0, inspected.stderr
    assert "gate.weight" in inspected.stdout and "experts.3.up.weight" in inspected.stdout

    for module in ("dist_launch", "dist_collectives"):
        imported = _run([python, "-c", f"import {module}"])
        assert imported.returncode != 0
        assert "ModuleNotFoundError" in imported.stderr
