"""Several launchers on this host, as the nodes of one job, run to their end.

Each launcher's stdout and stderr are read whole; whatever happens, every launcher is
killed and reaped before the helper returns, so a test that fails leaves no launcher
(and, through it, no rank) behind.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

LAUNCH = [sys.executable, "-m", "dist_launch"]


def run_nodes(
    argvs: list[list[str]],
    cwd: Path,
    timeout: float,
    envs: list[dict[str, str]] | None = None,
) -> tuple[list[subprocess.Popen[str]], list[tuple[str, str]]]:
    """Starts ``dist_launch`` once per argument list; waits for all.

    ``envs``, when given, holds each launcher's environment (by default this process's).

    Returns:
        The launchers (for their return codes) and, in the same order, each one's
        ``(stdout, stderr)``.

    Raises:
        subprocess.TimeoutExpired: a launcher did not end within ``timeout`` seconds.
    """
    nodes = [
        subprocess.Popen(
            [*LAUNCH, *argv],
            cwd=cwd,
            env=None if envs is None else envs[index],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for index, argv in enumerate(argvs)
    ]
    try:
        return nodes, [node.communicate(timeout=timeout) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
            node.wait(30)


def run_launcher(cwd: Path, *argv: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Runs one ``dist_launch`` to its end (at most 120 s); its status and stderr."""
    done = subprocess.run(
        [*LAUNCH, *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    return done.returncode, done.stderr
