"""A ``torch.distributed.Store`` whose keys live in etcd, for what the rounds share.

torch's dynamic rendezvous hands each round a store (the round's prefix of this one):
rank 0's node publishes the workers' master address in it, and dist-launch keeps the
job-wide restart count, the failure records, the exit barrier and the job board there
(:mod:`dist_launch.rendezvous.c10d`, :mod:`dist_launch.rendezvous.job_board`). With c10d
that store is a TCPStore in one node's launcher; here every key is an etcd key under
``<prefix>``, so it outlives any node.

Waits (``get`` of a missing key, ``wait``) poll etcd, starting at
:data:`FIRST_POLL_SECONDS` and doubling up to :data:`LONGEST_POLL_SECONDS`, and give up
after the store's timeout, as a TCPStore does.
"""

from __future__ import annotations

import time
from datetime import timedelta

from torch._C._distributed_c10d import Store

from dist_launch.rendezvous.etcd_gateway import EtcdGateway

FIRST_POLL_SECONDS = 0.01
LONGEST_POLL_SECONDS = 0.25


def _common_prefix(keys: list[bytes]) -> bytes:
    """The longest byte string every key starts with."""
    first, last = min(keys), max(keys)
    size = 0
    while size < min(len(first), len(last)) and first[size] == last[size]:
        size += 1
    return first[:size]


def _as_bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


class EtcdStore(Store):
    """torch's ``Store`` interface on etcd keys under ``prefix``.

    Args:
        gateway: The etcd client.
        prefix: The namespace of this store's keys (``dist-launch/<rdzv-id>/store/``).
        timeout: How long ``get`` and ``wait`` wait for a key by default.
    """

    def __init__(self, gateway: EtcdGateway, prefix: str, timeout: timedelta) -> None:
        super().__init__()
        self._gateway = gateway
        self._prefix = prefix
        self._timeout = timeout

    def _key(self, key: str) -> bytes:
        return (self._prefix + key).encode()

    def set(self, key: str, value: str | bytes) -> None:
        """Sets ``key``."""
        self._gateway.put(self._key(key), _as_bytes(value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, once set (waits up to the store's timeout)."""
        return self._wait_for([key], self._timeout)[self._key(key)]

    def add(self, key: str, amount: int) -> int:
        """Adds ``amount`` to the counter ``key`` (0 when new), atomically; the new value."""
        current = self._gateway.get(self._key(key))
        while True:
            revision = current.mod_revision if current is not None else 0
            total = (int(current.value) if current is not None else 0) + amount
            if amount == 0 and current is not None:
                return total
            done, current = self._gateway.replace(self._key(key), str(total).encode(), revision)
            if done:
                return total

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Sets ``key`` to ``desired_value`` if it holds ``expected_value``.

        An empty ``expected_value`` means the key is not set. Returns the value it
        holds after.
        """
        expected, desired = _as_bytes(expected_value), _as_bytes(desired_value)
        while True:
            current = self._gateway.get(self._key(key))
            if (current.value if current is not None else b"") != expected:
                return current.value if current is not None else expected
            revision = current.mod_revision if current is not None else 0
            done, _ = self._gateway.replace(self._key(key), desired, revision)
            if done:
                return desired

    def check(self, keys: list[str]) -> bool:
        """True when every key is set."""
        return all(self._gateway.get(self._key(key)) is not None for key in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, once set (waits up to the store's timeout).

        One request per look, whatever the number of keys: a range over the keys'
        common prefix (each node's share of a round is one key, so reading them one by
        one would cost every node as many requests as there are nodes).

        Raises:
            TimeoutError: A key is still missing after the store's timeout.
        """
        found = self._wait_for(keys, self._timeout)
        return [found[self._key(key)] for key in keys]

    def delete_key(self, key: str) -> bool:
        """Removes ``key``; True when it was set."""
        existed = self._gateway.get(self._key(key)) is not None
        self._gateway.delete(self._key(key))
        return existed

    def num_keys(self) -> int:
        """How many keys this store holds."""
        return self._gateway.count_prefix(self._prefix.encode())

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Returns once every key is set.

        Raises:
            TimeoutError: A key is still missing after ``timeout`` (the store's when None).
        """
        self._wait_for(keys, timeout or self._timeout)

    def _wait_for(self, keys: list[str], timeout: timedelta) -> dict[bytes, bytes]:
        """The values of the keys' common prefix once every key is set; polls with backoff.

        One key is read alone; several in one range over their common prefix (within
        this store's prefix), so a look costs one request however many keys there are.
        """
        seconds = timeout.total_seconds()
        deadline = time.monotonic() + seconds
        delay = FIRST_POLL_SECONDS
        wanted = [self._key(key) for key in keys]
        while True:
            found = self._read(wanted)
            missing = [key for key in wanted if key not in found]
            if not missing:
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"etcd store: {', '.join(k.decode(errors='replace') for k in missing)} "
                    f"not set within {seconds:g} s"
                )
            time.sleep(min(delay, left))
            delay = min(delay * 2, LONGEST_POLL_SECONDS)

    def _read(self, keys: list[bytes]) -> dict[bytes, bytes]:
        """The keys that are set, with their values: one request."""
        if len(keys) == 1:
            one = self._gateway.get(keys[0])
            return {} if one is None else {keys[0]: one.value}
        return self._gateway.get_prefix(_common_prefix(keys))
