"""How an exchange moves a sender's record to the receiver: one interface, chosen once.

:func:`open_transport` picks the implementation for a call (shared memory when there
is no ``workspace_path``, a directory otherwise); :mod:`dist_workspace.exchange` then
only talks to the :class:`Transport` it got and never asks which one it is.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Protocol

import torch

from dist_workspace.dir_transport import DirectoryTransport
from dist_workspace.shm_transport import SharedMemoryTransport


@dataclasses.dataclass(frozen=True)
class CallId:
    """What names one call of a ``*_parallel`` helper, for the transport's files."""

    kind: str  # "get_tensors_parallel" or "get_configs_parallel", for messages
    rank: int  # this process's global rank
    job: str  # tag of the job id
    group: str  # tag of the process group and the ranks list
    seq: int  # this call's number among the calls with this group and ranks
    timeout: float  # seconds the receiver waits for a peer


class Parcel(Protocol):
    """What a sender has written, held until the receiver's verdict."""

    def status(self) -> dict[str, Any]:
        """JSON fields the receiver needs to find and check the record."""
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

    def receive(self, sender: int, status: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor]]:
        """The sender's ``(config, weights)``, from the status it posted."""
        ...

    def close(self) -> None:
        """Receiver: every value is read or the call failed; drops what the call left."""
        ...


def open_transport(workspace_path: str | os.PathLike[str] | None, call: CallId) -> Transport:
    """Shared memory when ``workspace_path`` is None, else files under that directory."""
    if workspace_path is None:
        return SharedMemoryTransport(call)
    return DirectoryTransport(Path(workspace_path), call)
