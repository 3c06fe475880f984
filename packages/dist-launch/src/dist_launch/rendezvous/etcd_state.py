"""The rendezvous state of torch's dynamic rendezvous, held in one etcd key.

torch elastic's ``DynamicRendezvousHandler`` keeps the whole state of a job's
rendezvous (round, participants, wait list, heartbeats, closed) in one value that its
backend reads and writes with compare-and-set on a token. :class:`EtcdStateBackend` is
that backend on etcd's v3 API: the token is the key's ``mod_revision``, and a write is
a transaction that compares it. torch's own etcd backend does the same on the v2 API,
which etcd 3.4 turns off by default and 3.6 removed.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from dist_launch.rendezvous.etcd_gateway import EtcdError, EtcdGateway


class EtcdStateBackend(RendezvousBackend):
    """torch's ``RendezvousBackend`` on the etcd key ``key``.

    Args:
        gateway: The etcd client.
        key: The key of the job's state (``dist-launch/<rdzv-id>/state``).
    """

    def __init__(self, gateway: EtcdGateway, key: str) -> None:
        self._gateway = gateway
        self._key = key.encode()

    @property
    def name(self) -> str:
        """``etcd-v3``."""
        return "etcd-v3"

    def get_state(self) -> tuple[bytes, Token] | None:
        """The state and its revision, or None before the first node wrote it.

        Raises:
            RendezvousConnectionError: No etcd member answered.
        """
        try:
            found = self._gateway.get(self._key)
        except EtcdError as error:
            raise RendezvousConnectionError(str(error)) from error
        return None if found is None else (found.value, found.mod_revision)

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Writes ``state`` if the key is still at ``token`` (None: not yet written).

        Returns:
            The state now held, its revision, and whether this write made it; None if
            the key vanished meanwhile (deleted by hand).

        Raises:
            RendezvousConnectionError: No etcd member answered.
        """
        revision = token if isinstance(token, int) else 0
        try:
            done, now = self._gateway.replace(self._key, state, revision)
        except EtcdError as error:
            raise RendezvousConnectionError(str(error)) from error
        if now is None:
            return None
        return now.value, now.mod_revision, done
