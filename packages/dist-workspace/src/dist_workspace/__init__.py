"""dist-workspace: safe, atomic exchange of configs and weights between ranks.

Through a shared directory (:class:`NFSWorkspace`, files in safetensors with the
config JSON in their metadata) or, on one host, through shared memory
(:func:`get_tensors_parallel`, :func:`get_configs_parallel`). Nothing is ever
unpickled.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from dist_workspace.errors import WorkspaceError
from dist_workspace.exchange import get_configs_parallel, get_tensors_parallel
from dist_workspace.hf_export import export_sharded
from dist_workspace.workspace import NFSWorkspace

try:
    __version__ = version("dist-workspace")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "NFSWorkspace",
    "WorkspaceError",
    "export_sharded",
    "get_configs_parallel",
    "get_tensors_parallel",
    "__version__",
]
