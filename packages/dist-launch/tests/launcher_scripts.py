"""Scripts the launcher tests run as workers, and readers of the launcher's output.

Shared by this directory's test modules: a module of its own, because pytest imports
the test modules of every package into one name space, where ``test_cli`` is not
unique (dist-workspace has one too).
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import time
from pathlib import Path
from typing import IO

TORCHRUN_SCRIPT = """\
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env://, as under torchrun
value = torch.tensor([float(dist.get_rank())])
dist.all_reduce(value)
names = ["RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
         "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
         "OMP_NUM_THREADS"]
print("env", " ".join(f"{name}={os.environ.get(name, '<unset>')}" for name in names))
print("sum", int(value.item()), "world", dist.get_world_size(), "argv", os.sys.argv[1:])
dist.destroy_process_group()
"""


# Each rank prints its pid, then waits (bounded) for the file named by argv[1].
WAITING_SCRIPT = """\
import os, sys, time

print("ready", os.getpid(), flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
print("done", flush=True)
"""


def write_script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def read_ready_pids(process: subprocess.Popen[bytes], count: int, timeout: float = 90) -> list[int]:
    """Reads the launcher's stdout until ``count`` ranks said ``ready PID``."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + timeout
    while True:
        pids = [int(pid) for pid in re.findall(rb"\[rank\d+\]: ready (\d+)\n", seen)]
        if len(pids) >= count:
            return pids
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"ranks did not start in time; output so far:\n{seen!r}"
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            chunk = os.read(fd, 65536)
            assert chunk, f"launcher ended early (status {process.wait()}): {seen!r}"
            seen += chunk


def read_until(stream: IO[bytes] | None, text: bytes, count: int = 1) -> bytes:
    """Reads ``stream`` until ``text`` appeared ``count`` times (bounded); what was read."""
    assert stream is not None
    seen = b""
    deadline = time.monotonic() + 60
    while seen.count(text) < count:
        assert time.monotonic() < deadline, seen
        if select.select([stream], [], [], 1.0)[0]:
            chunk = os.read(stream.fileno(), 65536)
            assert chunk, seen
            seen += chunk
    return seen
