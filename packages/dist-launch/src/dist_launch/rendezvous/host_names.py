"""Waiting for the rendezvous host's name to resolve, as a pod's must.

A Kubernetes headless service publishes a pod's DNS record only once the pod is
running (and, by default, ready), so the master's name (``PET_MASTER_ADDR``,
``LWS_LEADER_ADDRESS``, a JobSet's ``<job>-0-0.<subdomain>``) may not resolve yet when
the other pods start. :func:`wait_until_resolvable` retries until the rendezvous
timeout instead of failing the job at once; a literal address never waits.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

# The first retry, and the longest wait between two (doubling in between).
FIRST_RETRY_SECONDS = 0.1
LONGEST_RETRY_SECONDS = 2.0

Resolver = Callable[[str], object]


class UnresolvableHostError(OSError):
    """The rendezvous host's name did not resolve before the deadline; names it and why."""


def _resolve(host: str) -> object:
    return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)


def is_literal_address(host: str) -> bool:
    """True for an IPv4 or IPv6 address (``[::1]`` included), which needs no lookup."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def wait_until_resolvable(
    host: str,
    source: str,
    timeout: float,
    *,
    resolve: Resolver = _resolve,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Returns once ``host`` resolves; retries with backoff until ``timeout`` seconds.

    Logs once, at the first failure, which name it waits for and where it came from.

    Args:
        host: The host name (or address) of the rendezvous.
        source: Where the name came from (``PET_MASTER_ADDR``, ``flag``), for the messages.
        timeout: Seconds to keep trying (the rendezvous's join timeout).
        resolve: Looks a name up, raising ``OSError`` while it does not resolve.
        clock: Monotonic time.
        sleep: Waits between tries.

    Raises:
        UnresolvableHostError: It still did not resolve at the deadline.
    """
    if is_literal_address(host):
        return
    deadline = clock() + timeout
    delay = FIRST_RETRY_SECONDS
    logged = False
    while True:
        try:
            resolve(host)
            if logged:
                logger.info("%s resolves now", host)
            return
        except OSError as error:
            now = clock()
            if now >= deadline:
                raise UnresolvableHostError(
                    f"the rendezvous host {host} (from {source}) did not resolve within "
                    f"{timeout:g} s (--rdzv-conf join_timeout): {error}"
                ) from None
            if not logged:
                logger.warning(
                    "waiting up to %g s for %s (from %s) to resolve: a headless service's "
                    "DNS records appear only once its pod runs (%s)",
                    timeout,
                    host,
                    source,
                    error,
                )
                logged = True
            sleep(min(delay, deadline - now))
            delay = min(delay * 2, LONGEST_RETRY_SECONDS)
