"""Placeholder: replaced by the output helper's module (timestamped launcher lines)."""

from __future__ import annotations

import logging
import sys


def configure_launcher_logging(prog: str) -> None:
    """Sends the ``dist_launch`` logger's INFO lines to stderr as ``prog: time message``."""
    package_logger = logging.getLogger("dist_launch")
    if any(getattr(h, "_dist_launch", False) for h in package_logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prog}: %(asctime)s %(message)s"))
    handler._dist_launch = True  # type: ignore[attr-defined]
    package_logger.addHandler(handler)
    package_logger.setLevel(logging.INFO)
