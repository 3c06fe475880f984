"""The numbers of ``--rdzv-conf`` (torch's rendezvous settings, ``key=value,...``)."""

from __future__ import annotations

from collections.abc import Mapping

from dist_launch.rendezvous.protocol import RendezvousUsageError


def conf_seconds(conf: Mapping[str, str], key: str, default: float) -> float:
    """``--rdzv-conf key`` as a positive number of seconds, ``default`` when not given.

    Raises:
        RendezvousUsageError: It is not a positive number.
    """
    raw = conf.get(key)
    if raw is None:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise RendezvousUsageError(f"--rdzv-conf {key}={raw}: not a positive number")
    return seconds
