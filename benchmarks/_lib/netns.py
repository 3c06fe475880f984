"""Hosts on one machine for a benchmark: tests-integration/netns.py's network.

A bridge in a "switch" namespace, one veth per host, a hostname per host and a hosts
file every host reads; :func:`network` gives its hosts as a tuple.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2] / "tests-integration"))

from netns import Host, why_not
from netns import network as _network


@contextlib.contextmanager
def network(count: int) -> Iterator[tuple[Host, ...]]:
    """``count`` hosts on one switch, removed (with whatever still runs there) afterwards."""
    with _network(count) as net:
        yield net.hosts


__all__ = ["Host", "network", "why_not"]
