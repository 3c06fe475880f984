"""dist-collectives: autograd all_to_all, collective helpers and parallel groups.

Fault-tolerant process groups live in :mod:`dist_collectives.ft`, imported explicitly
(``import dist_collectives.ft``) so that this package's import stays light.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("dist-collectives")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
