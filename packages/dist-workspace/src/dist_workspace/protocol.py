"""The decisions of a ``*_parallel`` call and the words of its errors, as pure functions.

No I/O and no ``torch.distributed``: :mod:`dist_workspace.exchange` carries out what
these decide, and tests call them in one process. Every text a user may read in a
failed call is made here, so each wording has one owner.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from dist_workspace.errors import WorkspaceError
from dist_workspace.safejson import JsonRefused, loads


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


# Records up to this size travel in the sender's frame on the link, larger ones in a
# segment or file: where the link stopped being faster (benchmarks/workspace.py --link-sweep).
LINK_MAX_BYTES = 8 << 20


def route(size: int, workspace_path: object) -> str:
    """Where a record of ``size`` bytes goes: ``link``, ``segment`` or ``file``.

    The size decides, and ``workspace_path`` (None: shared memory) where a large record
    lies; nothing else (not the call's history, the store or the environment).
    """
    if size <= LINK_MAX_BYTES:
        return "link"
    return "segment" if workspace_path is None else "file"


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
    """Whether the receiver may read what its senders announced (None); else the error.

    ``heads``: every sender that came, by rank. Checked in order: a sender's own error,
    senders missing, the ranks list, the host (if ``one_host``), then shape and dtype
    against ``own_shape`` (the receiver's tensor; None for configs).
    """
    for sender, head in heads.items():
        if not head.get("ok"):
            return f"{call.kind}: rank {sender} failed to write its value: {head.get('error')}"
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


def verdict_error(call: Call, verdict: Mapping[str, Any] | None) -> str | None:
    """What a sender raises for ``verdict`` (None: none came in its wait), or None."""
    receiver = call.receiver
    if verdict is None:
        return (
            f"rank {call.rank}: {call.kind} timed out after "
            f"{call.timeout + VERDICT_MARGIN_SECONDS:g} s waiting for receiver rank {receiver} "
            f"to read the values (did rank {receiver} call {call.kind} with "
            f"ranks={list(call.ranks)}?)"
        )
    if not verdict.get("ok"):
        error = verdict.get("error")
        return f"rank {call.rank}: {call.kind} failed on receiver rank {receiver}: {error}"
    return None


WIRE_VERSION = 5  # dist-workspace 0.5's frames; a rank with another is named at opening
HEAD, VERDICT = 1, 2  # a sender's head (and record), the receiver's verdict
VERDICT_MARGIN_SECONDS = 10.0  # beyond the timeout, for the receiver to read and answer
_FIXED = struct.Struct("<4sHBxQIQ")  # magic, version, kind, call number, head, body bytes
_MAGIC = b"dwsl"
FIXED_BYTES = _FIXED.size
_HEAD_MAX = 1 << 20  # a head is a few hundred bytes of JSON
_HEAD_DEPTH = 2  # {"ranks": [0, 1], "shape": [2, 3], ...}


def encode_frame(kind: int, seq: int, head: Mapping[str, Any], body_size: int) -> bytes:
    """A frame's first bytes: its fixed part and its head; ``body_size`` bytes follow."""
    text = json.dumps(head).encode()
    return _FIXED.pack(_MAGIC, WIRE_VERSION, kind, seq, len(text), body_size) + text


def decode_fixed(raw: bytes, peer: int) -> tuple[int, int, int, int]:
    """A frame's kind, call number, head size and body size.

    Raises:
        WorkspaceError: Not a frame of this protocol and version (naming ``peer``).
    """
    magic, version, kind, seq, head_size, body_size = _FIXED.unpack(raw)
    if magic != _MAGIC:
        raise WorkspaceError(f"rank {peer} sent bytes that are not a dist-workspace frame")
    if version != WIRE_VERSION:
        raise WorkspaceError(other_version(f"rank {peer}", version, "this rank"))
    if kind not in (HEAD, VERDICT) or head_size > _HEAD_MAX or body_size > LINK_MAX_BYTES:
        raise WorkspaceError(
            f"rank {peer} sent a malformed frame (kind {kind}, head {head_size} B, body "
            f"{body_size} B; a record on the link has at most {LINK_MAX_BYTES} B)"
        )
    return kind, seq, head_size, body_size


def decode_head(raw: bytes, peer: int) -> dict[str, Any]:
    """A head's JSON object, parsed without trusting it (bounded depth, no NaN).

    Raises:
        WorkspaceError: Not a JSON object (naming ``peer``).
    """
    try:
        head = loads(raw.decode(), max_depth=_HEAD_DEPTH)
    except (JsonRefused, UnicodeDecodeError) as error:
        raise WorkspaceError(f"rank {peer} sent a head that is not JSON: {error}") from None
    if not isinstance(head, dict):
        raise WorkspaceError(f"rank {peer} sent a head that is not a JSON object")
    return head


def out_of_order(peer: int, kind: int, seq: int, awaited_seq: int) -> str:
    """A frame of a later call, or of the wrong kind: the ranks made different calls."""
    what = {HEAD: "its value", VERDICT: "a verdict"}.get(kind, f"kind {kind}")
    return (
        f"rank {peer} sent {what} for call {seq} while this rank waited for call "
        f"{awaited_seq}: did the ranks call in different orders?"
    )


def decide_open(call: Call, infos: Mapping[int, Mapping[str, Any]]) -> str | None:
    """The receiver's verdict on opening: None when every rank came with this version."""
    missing = [r for r in call.senders if r not in infos]
    if missing:
        return never_wrote(call, missing, [r for r in infos if r != call.rank])
    for rank, info in infos.items():
        if info.get("error"):
            return f"{call.kind}: rank {rank} cannot take part in the link: {info['error']}"
        if info.get("version") != WIRE_VERSION:
            return other_version(
                f"{call.kind}: rank {rank}", info.get("version"), f"receiver rank {call.rank}"
            )
    return None


def other_version(who: str, version: object, me: str) -> str:
    """``who`` runs another wire version than this rank (``me``)."""
    return (
        f"{who} speaks dist-workspace wire version {version}, {me} {WIRE_VERSION}: install "
        "one dist-workspace version on every rank"
    )


def could_not_connect(call: Call, missing: Sequence[int], error: object) -> str:
    """The link's connections could not all be made: ``missing`` are the peers left out."""
    return (
        f"rank {call.rank}: {call.kind}: could not connect the link between ranks "
        f"{sorted(call.ranks)}: no connection with rank(s) {list(missing)} ({error}). Every "
        "rank listens on the address its host reaches the store's server from: can the "
        "others reach it?"
    )


def connection_lost(call: Call, sender: int, why: str) -> str:
    """The receiver's connection to a sender ended during the call."""
    return (
        f"{call.kind}: receiver rank {call.rank}: rank(s) [{sender}] never wrote their "
        f"value: its connection to this receiver was lost ({why}) during the "
        f"call (did rank {sender} exit or fail?)"
    )


def receiver_closed(call: Call, why: str) -> str:
    """A sender's connection to the receiver ended before the verdict came."""
    return (
        f"rank {call.rank}: {call.kind}: receiver rank {call.receiver} closed its connection "
        f"before its verdict ({why}): did it exit or fail?"
    )
