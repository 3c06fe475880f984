"""What the installed torch offers that changes between the versions dist-* supports.

Found by looking, not by comparing version numbers, so that a nightly build or a
backport answers for what it really has. Nothing here starts a process group or
initialises CUDA.

- Reconfigurable process groups (torch 2.14): ``ProcessGroup.reconfigure`` and
  ``supports_reconfigure``, which torchft 0.3 uses instead of rebuilding groups.
- What the ``nccl`` backend name means: torch 2.14 added the ``nccl2`` backend (and
  ``nccl-legacy`` for the old one), with ``nccl`` meaning the legacy one unless
  ``TORCH_DIST_USE_NCCL2=1``; torch 2.15 makes ``nccl`` mean ``nccl2`` by default.
"""

from __future__ import annotations

from typing import Literal

import torch.distributed as dist

NcclName = Literal["nccl2", "nccl-legacy"]

# The torch releases CI runs every package's tests on: the lowest the packages declare,
# the project's local build, and the newest release.
TESTED_RELEASES = ("2.11.0", "2.13.0", "2.15.0")


def is_tested_release(version: str) -> bool:
    """Whether ``version`` (``torch.__version__``, a local suffix allowed) is one CI tests.

    Args:
        version: A torch version string such as ``"2.15.0+cu132"``.

    Returns:
        True when its release part is in :data:`TESTED_RELEASES`.
    """
    return version.split("+", 1)[0] in TESTED_RELEASES


def has_reconfigurable_groups() -> bool:
    """Whether torch's process groups can be reconfigured in place (torch >= 2.14)."""
    group = getattr(dist, "ProcessGroup", None)
    # supports_reconfigure is a property of each group: its presence on the class is
    # the question; whether one group supports it depends on its backend.
    return (
        group is not None
        and callable(getattr(group, "reconfigure", None))
        and (hasattr(group, "supports_reconfigure"))
    )


def nccl_backend_implementation() -> NcclName | None:
    """Which NCCL implementation the backend name ``nccl`` creates here.

    ``"nccl-legacy"`` on a torch that has no ``nccl2`` backend (before 2.14), and where
    ``nccl`` is registered to create the legacy group; ``"nccl2"`` where it creates
    ``ProcessGroupNCCL2``. None when torch has no NCCL, or when the answer cannot be
    read (the registry is torch's private ``Backend._plugins``). Reads, through torch,
    ``TORCH_DIST_USE_NCCL2``.
    """
    if not dist.is_available() or not dist.is_nccl_available():
        return None
    if not hasattr(dist, "ProcessGroupNCCL2"):
        return "nccl-legacy"
    backend = dist.Backend
    register = getattr(backend, "_ensure_backend_registered", None)
    plugins = getattr(backend, "_plugins", None)
    if not callable(register) or not isinstance(plugins, dict):
        return None
    try:
        register("nccl")  # what init_process_group("nccl") does first
    except Exception:  # a broken backend entry point: no answer rather than a crash
        return None
    creator = getattr(plugins.get("NCCL"), "creator_fn", None)
    name = getattr(creator, "__name__", "")
    if "nccl2" in name:
        return "nccl2"
    return "nccl-legacy" if name else None
