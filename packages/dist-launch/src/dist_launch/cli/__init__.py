"""The ``dist-launch`` command: torchrun's flags parsed into a plan, and its entry point."""

from __future__ import annotations

from dist_launch.cli.entry_point import main, run
from dist_launch.cli.parser import build_parser

__all__ = ["build_parser", "main", "run"]
