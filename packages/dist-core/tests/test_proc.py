"""dist_core.proc: the parent-death signal, checked in a real child process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.processes

# A child that asks for SIGTERM on its parent's death while every way of starting a
# subprocess fails, then reads back what the kernel holds for it.
_CHILD = textwrap.dedent(
    """
    import ctypes, signal, subprocess, sys

    def refuse(*args, **kwargs):
        raise AssertionError("started a subprocess: " + repr(args[:1]))

    subprocess.Popen = refuse
    from dist_core.proc import set_parent_death_signal

    assert set_parent_death_signal(signal.SIGTERM)
    held = ctypes.c_int(0)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(2, ctypes.byref(held), 0, 0, 0) == 0  # PR_GET_PDEATHSIG
    print(held.value)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_parent_death_signal_is_set_without_starting_a_subprocess() -> None:
    # ctypes.util.find_library runs ldconfig in a subprocess: seconds of every worker's
    # start on a loaded machine.
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "15", done.stdout
