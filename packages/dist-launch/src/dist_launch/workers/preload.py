"""What the fork server imports before it forks the workers (``DIST_LAUNCH_PRELOAD``).

Preloading torch saves each worker torch's import (about 2 s of CPU) and costs the
server that import once. A script that imports nothing beyond the standard library
(a data-preparation step, a health check, a test's stand-in for a rank) gains nothing
from it, so the server skips it for such a script; for any other target it imports
torch and torch.distributed, as before. What a worker can run is the same either way:
an import the server did not do, the worker does itself.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Mapping
from pathlib import Path

from dist_launch.in_worker.fork_server import DEFAULT_PRELOAD, PRELOAD_VARIABLE
from dist_launch.plan.launch_plan import WorkerTarget


def imports_only_stdlib(source: str) -> bool:
    """Whether every ``import`` in ``source`` names a standard-library module.

    Imports anywhere count (in functions too); a relative import, a syntax error or a
    module outside :data:`sys.stdlib_module_names` answers False.
    """
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level or node.module is None:
                return False
            names = [node.module]
        else:
            continue
        if any(name.split(".", 1)[0] not in sys.stdlib_module_names for name in names):
            return False
    return True


def preload_modules(target: WorkerTarget, environ: Mapping[str, str], cwd: Path) -> str:
    """The fork server's ``DIST_LAUNCH_PRELOAD``: comma-separated modules, or empty.

    Reads ``DIST_LAUNCH_PRELOAD``: when set (empty included), its value is used as
    given. Otherwise torch and torch.distributed, except for a script (not ``-m``) whose
    imports are all of the standard library (:func:`imports_only_stdlib`), which gets
    none. A script that cannot be read gets the default: the worker reports the error.

    Args:
        target: What the workers run.
        environ: The launcher's environment.
        cwd: The directory the workers start in (a relative script is found there).
    """
    if PRELOAD_VARIABLE in environ:
        return environ[PRELOAD_VARIABLE]
    if target.is_module or target.no_python:
        return DEFAULT_PRELOAD
    try:
        source = (cwd / target.name).read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return DEFAULT_PRELOAD
    return "" if imports_only_stdlib(source) else DEFAULT_PRELOAD
