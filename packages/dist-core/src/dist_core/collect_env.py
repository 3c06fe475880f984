"""A report of the detected distributed environment (``python -m dist_core``).

Like ``python -m torch.utils.collect_env`` for torch: what a bug report needs.
"""

from __future__ import annotations

import json
import os
import platform
import socket
from importlib.metadata import distributions
from typing import Any

import torch
import torch.distributed as dist

from dist_core.backend import BACKEND_VARIABLE, default_backend
from dist_core.devices import device_count
from dist_core.env import DistEnv
from dist_core.errors import DistEnvError

_LAUNCHER_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "INIT_METHOD",
    BACKEND_VARIABLE,
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_ID",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "CUDA_VISIBLE_DEVICES",
)


def _dist_packages() -> dict[str, str]:
    found: dict[str, str] = {}
    for distribution in distributions():
        name = distribution.metadata["Name"] or ""
        if name.lower().replace("_", "-") in {
            "dist-core",
            "dist-launch",
            "dist-collectives",
            "dist-workspace",
        }:
            found[name] = distribution.version
    return dict(sorted(found.items()))


def collect() -> dict[str, Any]:
    """Gathers the report as a JSON-ready dict.

    Reads every variable :meth:`DistEnv.from_environ` reads, ``TORCH_DISTRIBUTED_BACKEND``
    and ``CUDA_VISIBLE_DEVICES``.
    """
    report: dict[str, Any] = {}
    try:
        env = DistEnv.from_environ()
        report["environment"] = {
            "source": env.source,
            "rank": env.rank,
            "local_rank": env.local_rank,
            "node_rank": env.node_rank,
            "world_size": env.world_size,
            "local_world_size": env.local_world_size,
            "master_addr": env.master_addr,
            "master_port": env.master_port,
        }
    except DistEnvError as error:
        report["environment"] = {"error": str(error)}
    report["variables"] = {
        name: os.environ[name] for name in _LAUNCHER_VARIABLES if name in os.environ
    }
    report["backend"] = {
        "default": default_backend(),
        BACKEND_VARIABLE: os.environ.get(BACKEND_VARIABLE),
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    devices: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "count": device_count()}
    if torch.cuda.is_available():
        devices["names"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        devices["cuda"] = torch.version.cuda
    report["devices"] = devices
    report["versions"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        **_dist_packages(),
    }
    report["host"] = {"hostname": socket.gethostname(), "platform": platform.platform()}
    return report


def format_report(report: dict[str, Any]) -> str:
    """Renders :func:`collect`'s dict as indented text."""
    lines: list[str] = []
    for section, values in report.items():
        lines.append(f"{section}:")
        if not values:
            lines.append("  (none)")
        for key, value in values.items():
            lines.append(f"  {key}: {value}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Prints the report; ``--json`` prints it as JSON."""
    import argparse  # noqa: PLC0415

    parser = argparse.ArgumentParser(
        prog="python -m dist_core", description="Print the detected distributed environment."
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    options = parser.parse_args(argv)
    report = collect()
    print(json.dumps(report, indent=2) if options.json else format_report(report))
    return 1 if "error" in report["environment"] else 0
