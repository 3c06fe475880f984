"""Which accelerator this node has and how many, found without initialising it.

A launcher decides how many workers to start before it starts them, and with the
``fork`` start method a parent that initialised CUDA (even through
``torch.cuda.is_available()``, which calls ``cuInit``) can never fork a worker that
uses CUDA again: torch refuses with "Cannot re-initialize CUDA in forked subprocess".
So nothing here calls ``torch.cuda.is_available()``. The accelerator's kind comes from
how torch was built (:func:`torch.accelerator.current_accelerator`, which does not
touch the driver), and the CUDA device count from NVML through
:func:`torch.cuda.device_count` (torch >= 2.0 asks NVML first and only falls back to
the CUDA runtime when NVML itself fails, e.g. without the NVML library).
"""

from __future__ import annotations

import torch


def cuda_built() -> bool:
    """Whether torch was built with CUDA (or ROCm, which torch also calls ``cuda``)."""
    return torch.version.cuda is not None or getattr(torch.version, "hip", None) is not None


def _compiled_accelerator() -> str | None:
    """The accelerator torch was built for (``cuda``, ``xpu``, ...), or None; no driver call."""
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator is not None:
        current = accelerator.current_accelerator()
        if current is None or current.type == "cpu":
            return None
        return str(current.type)
    return "cuda" if cuda_built() else None


def cuda_device_count() -> int:
    """The number of CUDA devices this process may use, without initialising CUDA.

    Reads ``CUDA_VISIBLE_DEVICES`` (through torch and NVML). 0 on a torch built without
    CUDA, and on a host whose driver reports no device.
    """
    if not cuda_built():
        return 0
    try:
        return max(0, int(torch.cuda.device_count()))
    except RuntimeError:  # a broken driver: the same answer torch.cuda.is_available() gives
        return 0


def accelerator_device_count() -> int:
    """The number of devices of :func:`accelerator_type`'s kind; 0 when there is none."""
    kind = _compiled_accelerator()
    if kind is None:
        return 0
    if kind == "cuda":
        return cuda_device_count()
    try:
        return max(0, int(torch.get_device_module(kind).device_count()))
    except (RuntimeError, AttributeError):
        return 0


def accelerator() -> tuple[str | None, int]:
    """The accelerator's device type and how many devices of it this process sees.

    ``(None, 0)`` on a CPU-only build or host. Asks the driver once, without
    initialising the accelerator.
    """
    count = accelerator_device_count()
    return (_compiled_accelerator() if count else None), count


def accelerator_type() -> str | None:
    """The device type of the accelerator this process can use (``cuda``, ``xpu``, ...).

    None on a CPU-only build or host. Does not initialise the accelerator, so a parent
    that calls it can still fork workers that use it.
    """
    return accelerator()[0]


def device_count() -> int:
    """Number of accelerator devices on this node; 1 on a CPU-only node (the CPU).

    Does not initialise the accelerator (see the module doc).
    """
    return accelerator_device_count() or 1
