"""How an exchange moves a sender's record to the receiver: the interface.

The implementations live beside it (:mod:`dist_workspace.shm_transport`,
:mod:`dist_workspace.dir_transport`) and this module imports neither:
:func:`dist_workspace.transports.open_transport` picks one per call, and
:mod:`dist_workspace.exchange` then only talks to the :class:`Transport` it got and
never asks which one it is. Both send a record of at most
:data:`dist_workspace.protocol.LINK_MAX_BYTES` in the sender's frame.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import torch


@dataclasses.dataclass(frozen=True)
class CallId:
    """What names one call of a ``*_parallel`` helper, for the transport's files."""

    kind: str  # "get_tensors_parallel" or "get_configs_parallel", for messages
    rank: int  # this process's global rank
    job: str  # tag of the job id
    group: str  # tag of the ranks list
    seq: int  # this call's number among the calls with these ranks
    timeout: float  # seconds the receiver waits for a peer
    receiver: int  # the receiving rank (global)


class Parcel(Protocol):
    """What a sender has written, held until the receiver's verdict."""

    def status(self) -> dict[str, Any]:
        """JSON fields the receiver needs to find and check the record."""
        ...

    def body(self) -> Sequence[Any]:
        """Buffers sent after the head in the frame (a small record itself), or none."""
        ...

    def release(self) -> None:
        """Frees what the sender still holds; called once, on every path."""
        ...


class Transport(Protocol):
    """Writes records on the senders and reads them on the receiver."""

    one_host: bool
    """Every rank of the call must run on the receiver's host."""

    def send(self, weights: dict[str, torch.Tensor], config: Any) -> Parcel:
        """Writes this rank's record; raises (TypeError, WorkspaceError) before posting."""
        ...

    def receive(
        self, sender: int, status: dict[str, Any], body: torch.Tensor | None
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """The sender's ``(config, weights)``, from its head and the frame's body."""
        ...

    def close(self) -> None:
        """Receiver: every value is read or the call failed; drops what the call left."""
        ...
