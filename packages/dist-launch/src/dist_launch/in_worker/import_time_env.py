"""The thread variables torch reads when it is imported, honoured in preloaded workers.

torch sizes its CPU thread pool from ``MKL_NUM_THREADS`` (builds with MKL) and
``OMP_NUM_THREADS`` once, when it is imported. A worker forked from the fork server
(:mod:`dist_launch.in_worker.fork_server`) inherits a torch imported with the server's environment,
so a script that sets one of them before ``import torch`` (as under torchrun, where
every worker imports torch itself) would otherwise keep the server's thread count.
:func:`apply_at_first_torch_import` notices the script's first ``import torch`` (an
``import`` statement anywhere, the script's or a library's) and, when the variables
then differ from the ones the server imported torch with, sets the thread count torch
would have chosen from them.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Mapping
from typing import Any

THREAD_VARIABLES = ("MKL_NUM_THREADS", "OMP_NUM_THREADS")


def snapshot(environ: Mapping[str, str]) -> dict[str, str | None]:
    """The thread variables of ``environ`` (read before the server imports torch).

    Reads ``MKL_NUM_THREADS`` and ``OMP_NUM_THREADS`` from ``environ``.
    """
    return {name: environ.get(name) for name in THREAD_VARIABLES}


def threads_at_import(variables: Mapping[str, str | None], has_mkl: bool, cpus: int) -> int | None:
    """The intra-op thread count torch's import derives from ``variables``; None: its default.

    With MKL, torch takes MKL's count: ``MKL_NUM_THREADS``, else ``OMP_NUM_THREADS``,
    at most one per CPU. Without MKL, the OpenMP runtime's: ``OMP_NUM_THREADS``. A
    value that is not a positive integer counts as unset, as the runtimes ignore it.
    """
    names = THREAD_VARIABLES if has_mkl else ("OMP_NUM_THREADS",)
    for name in names:
        value = (variables.get(name) or "").strip()
        if value.isdigit() and int(value) > 0:
            return min(int(value), cpus) if has_mkl else int(value)
    return None


def apply_at_first_torch_import(imported_with: Mapping[str, str | None]) -> None:
    """Sets torch's thread count from ``os.environ`` at the first ``import torch``.

    Only where the thread variables of ``os.environ`` at that moment differ from
    ``imported_with`` (what the server's torch was imported with) and name a count;
    a variable the script removed leaves the server's count. Reads
    ``MKL_NUM_THREADS`` and ``OMP_NUM_THREADS``.
    """
    original = builtins.__import__

    def first_torch_import(
        name: str,
        globals: Mapping[str, object] | None = None,
        locals: Mapping[str, object] | None = None,
        fromlist: Any = (),
        level: int = 0,
    ) -> Any:
        if (
            level == 0
            and name.split(".", 1)[0] == "torch"
            and builtins.__import__ is first_torch_import
        ):
            builtins.__import__ = original
            _apply(imported_with)
        return original(name, globals, locals, fromlist, level)

    builtins.__import__ = first_torch_import


def _apply(imported_with: Mapping[str, str | None]) -> None:
    import torch  # noqa: PLC0415 - preloaded by the server

    now = snapshot(os.environ)
    if now == dict(imported_with):
        return
    has_mkl = torch.backends.mkl.is_available()  # type: ignore[no-untyped-call, unused-ignore]
    cpus = len(os.sched_getaffinity(0))
    wanted = threads_at_import(now, has_mkl, cpus)
    if wanted is not None and wanted != threads_at_import(imported_with, has_mkl, cpus):
        torch.set_num_threads(wanted)
