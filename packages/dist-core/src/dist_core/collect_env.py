"""A report of the detected distributed environment (``python -m dist_core``).

Like ``python -m torch.utils.collect_env`` for torch: what a bug report about a
distributed job needs. The text form starts with a line saying so, for copying whole.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
from collections.abc import Mapping
from importlib.metadata import distributions
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dist_core.backend import BACKEND_VARIABLE, choose_backend
from dist_core.devices import accelerator_type, cuda_device_count
from dist_core.env import DistEnv
from dist_core.errors import DistEnvError
from dist_core.interfaces import gloo_choice, ipv4_interfaces, nccl_choice
from dist_core.torch_features import (
    TESTED_RELEASES,
    has_reconfigurable_groups,
    is_tested_release,
    nccl_backend_implementation,
)

HEADER = "Copy and paste everything below into your bug report (python -m dist_core):"
_VARIABLE_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "TORCH_DISTRIBUTED_", "TORCHELASTIC_")
_SINGLE_VARIABLES = (
    "TORCH_CPP_LOG_LEVEL",
    "OMP_NUM_THREADS",
    "CUDA_LAUNCH_BLOCKING",
    "PYTORCH_NVML_BASED_CUDA_CHECK",
    "TORCH_DIST_USE_NCCL2",
)
_DRIVER_FILE = Path("/proc/driver/nvidia/version")
_SHM = Path("/dev/shm")
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


def _variables(environ: Mapping[str, str]) -> dict[str, str]:
    names = set(_LAUNCHER_VARIABLES) | set(_SINGLE_VARIABLES)
    names |= {name for name in environ if name.startswith(_VARIABLE_PREFIXES)}
    return {name: environ[name] for name in sorted(names) if name in environ}


def _nccl_version() -> str | None:
    if not dist.is_nccl_available():
        return None
    try:
        version: object = getattr(torch.cuda.nccl, "version")()  # noqa: B009 (untyped in torch)
    except (RuntimeError, AttributeError):
        return None
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def _nvidia_driver() -> str | None:
    """The NVIDIA kernel driver's version, from /proc (no CUDA call)."""
    try:
        text = _DRIVER_FILE.read_text()
    except OSError:
        return None
    found = re.search(r"Kernel Module(?: for \S+)?\s+([0-9][0-9.]+)", text)
    return found.group(1) if found else text.splitlines()[0].strip()


def _shared_memory() -> dict[str, Any]:
    try:
        stats = os.statvfs(_SHM)
    except OSError as error:
        return {"path": str(_SHM), "error": str(error)}
    return {
        "path": str(_SHM),
        "size_gib": round(stats.f_blocks * stats.f_frsize / 2**30, 2),
        "free_gib": round(stats.f_bavail * stats.f_frsize / 2**30, 2),
    }


def _devices() -> dict[str, Any]:
    kind = accelerator_type()
    cuda_devices = cuda_device_count()
    devices: dict[str, Any] = {
        "accelerator": kind or "none (CPU only)",
        "cuda_devices": cuda_devices,
        "cuda_build": torch.version.cuda,
        "nvidia_driver": _nvidia_driver(),
    }
    if cuda_devices:
        # The report runs in its own process: initialising CUDA here costs nothing later.
        devices["gpus"] = [torch.cuda.get_device_name(i) for i in range(cuda_devices)]
    return devices


def _platform() -> str:
    """``platform.platform()``'s words, without the ``uname -p`` it runs in a subprocess.

    The report may be collected inside a training process, where starting a process
    costs more than the processor's name (which Linux reports as ``unknown``) is worth.
    """
    uname = os.uname()
    libc, version = platform.libc_ver()
    with_libc = f"-with-{libc}{version}" if libc else ""
    return f"{uname.sysname}-{uname.release}-{uname.machine}{with_libc}"


def _torch_features() -> dict[str, Any]:
    """The torch version and what changes between the versions (see :mod:`torch_features`)."""
    if not dist.is_nccl_available():
        nccl = "no NCCL in this torch"
    else:
        nccl = nccl_backend_implementation() or "cannot tell"
    return {
        "version": torch.__version__,
        "tested_releases": ", ".join(TESTED_RELEASES),
        "tested": is_tested_release(torch.__version__),
        "reconfigurable_groups": has_reconfigurable_groups(),
        "nccl_means": nccl,
    }


def collect() -> dict[str, Any]:
    """Gathers the report as a JSON-ready dict.

    Reads every variable :meth:`DistEnv.from_environ` reads, ``TORCH_DISTRIBUTED_BACKEND``,
    ``CUDA_VISIBLE_DEVICES``, every ``NCCL_*``, ``TORCH_NCCL_*``, ``GLOO_*``,
    ``TORCH_DISTRIBUTED_*`` and ``TORCHELASTIC_*`` variable, ``OMP_NUM_THREADS``,
    ``TORCH_CPP_LOG_LEVEL``, and (through torch) ``TORCH_DIST_USE_NCCL2``.
    """
    report: dict[str, Any] = {}
    local_world_size: int | None = None
    try:
        env = DistEnv.from_environ()
        local_world_size = env.local_world_size
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
    report["variables"] = _variables(os.environ)
    choice = choose_backend(local_world_size or 1)
    default = choice.backend
    if choice.shares_devices:
        default += f" ({choice.local_world_size} ranks per node share {choice.devices} GPU(s))"
    report["backend"] = {
        "default": default,
        BACKEND_VARIABLE: os.environ.get(BACKEND_VARIABLE),
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "nccl_version": _nccl_version(),
        "mpi": dist.is_mpi_available(),
    }
    report["torch"] = _torch_features()
    report["devices"] = _devices()
    interfaces = ipv4_interfaces()
    report["network"] = {
        "interfaces": ", ".join(f"{i.name} {i.address}" for i in interfaces) or "none",
        "gloo_would_use": gloo_choice(os.environ, interfaces),
        "nccl_would_use": nccl_choice(os.environ, interfaces),
    }
    report["shared_memory"] = _shared_memory()
    report["versions"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        **_dist_packages(),
    }
    report["host"] = {
        "hostname": socket.gethostname(),
        "platform": _platform(),
        "cpus": os.cpu_count(),
    }
    return report


def format_report(report: dict[str, Any]) -> str:
    """Renders :func:`collect`'s dict as indented text, after :data:`HEADER`."""
    lines: list[str] = [HEADER, ""]
    for section, values in report.items():
        lines.append(f"{section}:")
        if not values:
            lines.append("  (none)")
        for key, value in values.items():
            lines.append(f"  {key}: {value}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m dist_core``."""
    parser = argparse.ArgumentParser(
        prog="python -m dist_core",
        description="Print the detected distributed environment, for a bug report.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Prints the report; ``--json`` prints it as JSON."""
    options = build_parser().parse_args(argv)
    report = collect()
    print(json.dumps(report, indent=2) if options.json else format_report(report))
    return 1 if "error" in report["environment"] else 0
