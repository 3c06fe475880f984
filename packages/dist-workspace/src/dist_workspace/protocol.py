"""The decisions of a ``*_parallel`` call and the words of its errors, as pure functions.

Nothing here does I/O or touches ``torch.distributed``: :mod:`dist_workspace.exchange`
carries out what these functions decide, and the tests call them in one process.
Every text a user may read in a failed call is made here, so that each wording has
one owner (launchers look for ``Connection closed by peer`` in them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class Call:
    """What names one call in the errors: its kind, the caller, the ranks, the wait."""

    kind: str  # "get_tensors_parallel" or "get_configs_parallel"
    rank: int  # the caller's global rank
    ranks: tuple[int, ...]  # as the caller passed them; the first one receives
    timeout: float  # seconds the receiver waits for a sender

    @property
    def receiver(self) -> int:
        """The rank that gets every value."""
        return self.ranks[0]

    @property
    def senders(self) -> tuple[int, ...]:
        """The ranks that send theirs, in ``ranks`` order."""
        return self.ranks[1:]


# ---------------------------------------------------------------- receiver


def sender_failed(call: Call, sender: int, error: object) -> str:
    """A sender could not write its value and said why."""
    return f"{call.kind}: rank {sender} failed to write its value: {error}"


def never_wrote(call: Call, missing: Sequence[int], came: Sequence[int]) -> str:
    """The receiver waited ``call.timeout`` and some senders never came."""
    return (
        f"{call.kind}: receiver rank {call.rank} timed out after {call.timeout:g} s: "
        f"rank(s) {list(missing)} never wrote their value (ranks {sorted(came)} did). Did "
        f"they call {call.kind} with ranks={list(call.ranks)}? Set DIST_WORKSPACE_TIMEOUT "
        "for slower ranks"
    )


def decide_receipt(
    call: Call,
    heads: Mapping[int, Mapping[str, Any]],
    *,
    host: str,
    one_host: bool,
    own_shape: tuple[list[int], str] | None,
) -> str | None:
    """Whether the receiver may read the values its senders announced; else the error.

    ``heads`` holds every sender that came, by rank; the checks run in this order:
    a sender's own error, senders missing, the ranks list, the host (when the
    records need one), then shape and dtype (``own_shape``: the receiver's tensor,
    None for configs).
    """
    for sender, head in heads.items():
        if not head.get("ok"):
            return sender_failed(call, sender, head.get("error"))
    missing = [r for r in call.senders if r not in heads]
    if missing:
        return never_wrote(call, missing, list(heads))
    for sender, head in heads.items():
        if head.get("ranks") != list(call.ranks):
            return (
                f"{call.kind}: rank {sender} passed ranks={head.get('ranks')}, receiver rank "
                f"{call.rank} passed ranks={list(call.ranks)}; every rank must pass the same list"
            )
        if one_host and head.get("host") != host:
            return (
                f"{call.kind}: rank {sender} runs on {head.get('host')}, receiver rank "
                f"{call.rank} on {host}: shared memory needs one host. Pass workspace_path (a "
                "directory every rank sees) instead"
            )
    if own_shape is None:
        return None
    shapes: dict[int, tuple[Any, Any]] = {call.rank: own_shape}
    shapes.update({r: (h.get("shape"), h.get("dtype")) for r, h in heads.items()})
    if all(shape == own_shape for shape in shapes.values()):
        return None
    described = ", ".join(
        f"rank {r} has shape {tuple(shapes[r][0] or ())} {shapes[r][1]}" for r in call.ranks
    )
    return f"get_tensors_parallel needs tensors of one shape and dtype: {described}"


# ---------------------------------------------------------------- sender


def receiver_failed(call: Call, error: object) -> str:
    """The receiver's verdict said the call failed."""
    return f"rank {call.rank}: {call.kind} failed on receiver rank {call.receiver}: {error}"


def receiver_timed_out(call: Call, patience: float) -> str:
    """No verdict came in ``patience`` seconds."""
    receiver = call.receiver
    return (
        f"rank {call.rank}: {call.kind} timed out after {patience:g} s waiting for receiver "
        f"rank {receiver} to read the values (did rank {receiver} call {call.kind} with "
        f"ranks={list(call.ranks)}?)"
    )


def verdict_error(call: Call, verdict: Mapping[str, Any] | None, patience: float) -> str | None:
    """What a sender raises for the verdict it got (None: it timed out), or None on success."""
    if verdict is None:
        return receiver_timed_out(call, patience)
    if not verdict.get("ok"):
        return receiver_failed(call, verdict.get("error"))
    return None
