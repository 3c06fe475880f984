"""dist-launch: start N workers fast, stop them all when one fails, name the root cause.

Library: :func:`launch_subprocesses` and :func:`init_and_run`. Command line:
``dist-launch -n 4 train.py ARGS`` or ``python -m dist_launch ...``; a script it runs
may call :func:`report_progress` for its hang detection.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from dist_launch.errors import LaunchError
from dist_launch.exit_codes import ExitCode
from dist_launch.in_worker.beacon import report_progress

if TYPE_CHECKING:
    from dist_launch.library.spawn import init_and_run, launch_subprocesses

# Imported on first use: the CLI and the worker bootstrap must not pay for torch.
_LAZY = {
    "init_and_run": "dist_launch.library.spawn",
    "launch_subprocesses": "dist_launch.library.spawn",
}


def _version() -> str:
    # importlib.metadata costs tens of milliseconds: only a caller who asks pays it.
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("dist-launch")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value = _version()
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dist_launch' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, "__version__"})


__all__ = [
    "ExitCode",
    "LaunchError",
    "__version__",
    "init_and_run",
    "launch_subprocesses",
    "report_progress",
]
