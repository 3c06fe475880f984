"""Test settings every package's tests share: the ``cuda`` and ``processes`` markers.

``@pytest.mark.cuda`` marks a test of GPU behaviour; ``@pytest.mark.cuda(devices=2)``
one that needs two GPUs. Such a test runs where torch sees enough CUDA devices and is
skipped, with the count it found, everywhere else. The count comes from NVML
(:func:`dist_core.devices.cuda_device_count`), not ``torch.cuda.is_available()``, so
the pytest process does not initialise CUDA and tests of the ``fork`` start method
still run on a GPU host.

``@pytest.mark.processes`` marks a test that starts a process of its own (a
subprocess, a fork, a multiprocessing worker, ``run_ranks``, a launcher). Every other
test is in the fast lane (``pytest -m "not processes"``, ``nox -s fast``), which must
stay fast: so the convention is enforced here, in every run, not only the fast lane's.
A test without the marker that starts a process fails, naming the call.
"""

from __future__ import annotations

import _posixsubprocess
import multiprocessing.process
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

PROCESSES_MARKER = "processes"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cuda(devices=1): needs that many CUDA devices; skipped with the count where fewer",
    )
    config.addinivalue_line(
        "markers",
        f"{PROCESSES_MARKER}: starts a process; not in the fast lane (-m 'not processes')",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = [(item, item.get_closest_marker("cuda")) for item in items]
    marked = [(item, marker) for item, marker in marked if marker is not None]
    if not marked:
        return
    from dist_core.devices import cuda_device_count

    found = cuda_device_count()
    for item, marker in marked:
        needed = int(marker.kwargs.get("devices", 1))
        if found < needed:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs {needed} CUDA device(s); torch sees {found} "
                    "(a GPU check: run it on a GPU machine)"
                )
            )


class _ProcessGuard:
    """Fails a test that starts a process without the ``processes`` marker.

    The calls every way of starting a process goes through in CPython are wrapped
    once per pytest process: ``os.fork`` (``fork`` start method, ``pty``,
    ``os.spawn*``), ``_posixsubprocess.fork_exec`` (``spawn`` and ``forkserver``
    servers), ``subprocess.Popen._execute_child`` (``subprocess.run`` and friends),
    ``os.posix_spawn``/``posix_spawnp`` and ``multiprocessing``'s
    ``BaseProcess.start`` (a forkserver already running starts workers without a local
    fork). ``os.system`` is left alone: a test may pickle it by reference (a planted
    pickle payload), which a wrapper would break, and no test of ours starts a process
    with it. The current test is the one pytest is running
    (setup, call and teardown, so module fixtures count for the first test that
    needs them).
    """

    def __init__(self) -> None:
        self.current: pytest.Item | None = None
        self.violations: list[str] = []

    def check(self, what: str) -> None:
        item = self.current
        if item is None or item.get_closest_marker(PROCESSES_MARKER) is not None:
            return
        message = (
            f"{item.nodeid} starts a process ({what}) but is not marked "
            f"@pytest.mark.{PROCESSES_MARKER}: mark it, or keep it in one process "
            "(the fast lane runs only unmarked tests)"
        )
        self.violations.append(message)
        raise RuntimeError(message)

    def wrap(self, owner: Any, name: str, what: str) -> None:
        original: Callable[..., Any] = getattr(owner, name)

        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.check(what)
            return original(*args, **kwargs)

        guarded.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(owner, name, guarded)

    def install(self) -> None:
        self.wrap(os, "fork", "os.fork")
        for name in ("posix_spawn", "posix_spawnp", "forkpty"):
            if hasattr(os, name):
                self.wrap(os, name, f"os.{name}")
        self.wrap(_posixsubprocess, "fork_exec", "fork_exec")
        self.wrap(subprocess.Popen, "_execute_child", "subprocess")
        self.wrap(multiprocessing.process.BaseProcess, "start", "multiprocessing")


_GUARD = _ProcessGuard()
_GUARD.install()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _GUARD.current = item
    try:
        return (yield)
    finally:
        _GUARD.current = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    # A violation that the code under test caught and swallowed still fails the test.
    before = len(_GUARD.violations)
    result = yield
    if len(_GUARD.violations) > before:
        pytest.fail(_GUARD.violations[before], pytrace=False)
    return result
