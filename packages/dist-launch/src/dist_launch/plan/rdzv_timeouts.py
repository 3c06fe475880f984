"""torch elastic's rendezvous timeouts, read from ``--rdzv-conf`` with torch's defaults.

torch's c10d rendezvous reads them itself (``join_timeout``, ``last_call_timeout``,
``close_timeout``, ``read_timeout``, ``keep_alive_interval``,
``keep_alive_max_attempt``); the launcher needs them too, to bound its own calls to the
rendezvous and its store and to tell the user which wait ends first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class RendezvousTimeouts:
    """Seconds torch's c10d rendezvous waits for each thing (its defaults).

    Attributes:
        join: For a round to form (``join_timeout``).
        last_call: For late nodes once ``MIN`` nodes joined (``last_call_timeout``).
        close: For the rendezvous to close (``close_timeout``).
        read: For one store operation (``read_timeout``): also each of the launcher's
            own store calls' deadline.
        keep_alive_interval: Between two heartbeats of a node.
        keep_alive_max_attempt: Heartbeats a node may miss before it counts as dead.
    """

    join: float = 600.0
    last_call: float = 30.0
    close: float = 30.0
    read: float = 60.0
    keep_alive_interval: float = 5.0
    keep_alive_max_attempt: int = 3

    @property
    def node_dead_after(self) -> float:
        """Seconds of missed heartbeats after which torch drops a node."""
        return self.keep_alive_interval * self.keep_alive_max_attempt

    @property
    def reform_after_loss(self) -> float:
        """Seconds from a node's death until its peers' next round forms without it.

        torch's rendezvous keeps a dead node among the round's participants until its
        heartbeats are ``node_dead_after`` old; the survivors, rejoining, then wait
        ``last_call`` for more nodes (the round has fewer than ``MAX``) before the round
        closes. So re-forming after a lost node takes at most the keep-alive plus the
        last call (and a second of torch's polling); the keep-alive alone bounds how
        soon the loss is noticed.
        """
        return self.node_dead_after + self.last_call

    @property
    def round_forms_within(self) -> float:
        """The longest a round may take to form: join, then the last call."""
        return self.join + self.last_call


_FIELDS = {
    "join_timeout": "join",
    "last_call_timeout": "last_call",
    "close_timeout": "close",
    "read_timeout": "read",
    "keep_alive_interval": "keep_alive_interval",
}


def parse_rendezvous_timeouts(conf: Mapping[str, str]) -> RendezvousTimeouts:
    """The timeouts ``--rdzv-conf`` sets, torch's defaults for the others.

    Raises:
        ValueError: A value is not a positive number (``keep_alive_max_attempt``: a
            positive whole number); the message names the key.
    """
    seconds: dict[str, float] = {}
    for key, name in _FIELDS.items():
        raw = conf.get(key)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not value > 0:
            raise ValueError(f"--rdzv-conf {key}={raw}: not a positive number of seconds")
        seconds[name] = value
    raw_attempts = conf.get("keep_alive_max_attempt", "3")
    if not raw_attempts.strip().isdigit() or int(raw_attempts) < 1:
        raise ValueError(
            f"--rdzv-conf keep_alive_max_attempt={raw_attempts}: not a positive whole number"
        )
    return RendezvousTimeouts(**seconds, keep_alive_max_attempt=int(raw_attempts))
