"""What the fork server imports before forking: torch, unless the script needs only the stdlib."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dist_launch.in_worker.fork_server import DEFAULT_PRELOAD
from dist_launch.plan.launch_plan import WorkerTarget
from dist_launch.workers.preload import imports_only_stdlib, preload_modules


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import os, sys\nfrom pathlib import Path\n", True),
        ("def f():\n    import json.decoder\n", True),
        ("", True),
        ("import torch\n", False),
        ("import os\ndef f():\n    import torch.distributed as dist\n", False),
        ("from dist_core import init_dist\n", False),
        ("from . import helpers\n", False),
        ("import helpers  # a module beside the script\n", False),
        ("import os\nprint(\n", False),  # a syntax error
    ],
)
def test_imports_only_stdlib(source: str, expected: bool) -> None:
    assert imports_only_stdlib(source) is expected


def test_preload_follows_the_script_unless_the_variable_is_set(tmp_path: Path) -> None:
    (tmp_path / "plain.py").write_text("import os\nprint(os.getpid())\n")
    (tmp_path / "train.py").write_text("import torch\n")
    plain, train = WorkerTarget("plain.py", ()), WorkerTarget("train.py", ())
    assert preload_modules(plain, {}, tmp_path) == ""
    assert preload_modules(train, {}, tmp_path) == DEFAULT_PRELOAD
    # A module, or a script that cannot be read: the default (the worker reports errors).
    assert preload_modules(WorkerTarget("pkg.train", (), is_module=True), {}, tmp_path) == (
        DEFAULT_PRELOAD
    )
    assert preload_modules(WorkerTarget("missing.py", ()), {}, tmp_path) == DEFAULT_PRELOAD
    # DIST_LAUNCH_PRELOAD, when set, is used as given, empty included.
    assert preload_modules(plain, {"DIST_LAUNCH_PRELOAD": "json"}, tmp_path) == "json"
    assert preload_modules(train, {"DIST_LAUNCH_PRELOAD": ""}, tmp_path) == ""


# Each rank says whether torch was imported before its script's first line ran.
SEEN = "import sys\nprint('preloaded', 'torch' in sys.modules, flush=True)\n"


@pytest.mark.processes
def test_the_server_preloads_torch_for_a_torch_script_only(tmp_path: Path) -> None:
    (tmp_path / "plain.py").write_text(SEEN)
    torch_lines = "import torch\nprint('torch', torch.ones(1).item())\n"
    (tmp_path / "train.py").write_text(SEEN + torch_lines)
    launch = [sys.executable, "-m", "dist_launch", "-n", "2", "--start-method", "forkserver"]
    outputs = {}
    for script in ("plain.py", "train.py"):
        done = subprocess.run(
            [*launch, script], cwd=tmp_path, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        outputs[script] = done.stdout
    assert outputs["plain.py"].count("preloaded False") == 2, outputs
    assert outputs["train.py"].count("preloaded True") == 2, outputs
    assert outputs["train.py"].count("torch 1.0") == 2, outputs
