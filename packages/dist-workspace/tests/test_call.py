"""Whole calls in one process: each rank's side runs against a scripted link."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from shm_inspection import own_segments

from dist_workspace import WorkspaceError, exchange, protocol
from dist_workspace.link import Closed, Frame, LinkState

HEAD, VERDICT = protocol.HEAD, protocol.VERDICT


class FakeLink:
    """Frames that arrive from each peer, in order; what this rank sent, in order.

    A peer in ``closed`` reports that on every use. A wait for a frame that is not
    there ends at once, as one at its deadline would.
    """

    def __init__(
        self,
        arrivals: dict[int, list[Frame]] | None = None,
        closed: dict[int, Closed] | None = None,
    ) -> None:
        self.arrivals = {peer: list(frames) for peer, frames in (arrivals or {}).items()}
        self.closed = dict(closed or {})
        self.sent: list[tuple[int, Frame]] = []

    def send(self, peer: int, frame: Frame, body: Sequence[Any], deadline: float) -> Closed | None:
        if peer in self.closed:
            return self.closed[peer]
        data = b"".join(bytes(memoryview(part).cast("B")) for part in body)
        as_received = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
        self.sent.append((peer, Frame(frame.kind, frame.seq, frame.head, as_received)))
        return None

    def receive(
        self, peers: Sequence[int], kind: int, seq: int, deadline: float
    ) -> dict[int, Frame | Closed]:
        got: dict[int, Frame | Closed] = {}
        for peer in peers:
            if peer in self.closed:
                got[peer] = self.closed[peer]
                return got
            queue = self.arrivals.get(peer, [])
            while queue:
                frame = queue.pop(0)
                if frame.seq < seq:  # an earlier call's: dropped
                    continue
                assert (frame.kind, frame.seq) == (kind, seq), frame
                got[peer] = frame
                break
        return got


def _call(
    rank: int, ranks: list[int], state: LinkState, kind: str = "get_tensors_parallel"
) -> exchange.Exchange:
    call = protocol.Call(kind, rank, tuple(ranks), 5.0)
    return exchange.Exchange(call, state.next_seq(), state, "one-process-job", None)


def _send(rank: int, ranks: list[int], value: torch.Tensor, verdict: dict[str, Any]) -> Frame:
    """Rank ``rank`` sends ``value``, given ``verdict``; the frame it sent."""
    state = LinkState()
    fake = FakeLink({ranks[0]: [Frame(VERDICT, 0, verdict)]})
    state.link = fake
    exchange.send(_call(rank, ranks, state), {"tensor": value}, None)
    [(peer, frame)] = fake.sent
    assert peer == ranks[0] and frame.kind == HEAD
    return frame


def _receive(
    ranks: list[int], state: LinkState, arrivals: dict[int, list[Frame]], value: torch.Tensor
) -> list[torch.Tensor]:
    state.link = FakeLink(arrivals)
    rank = ranks[0]
    got = exchange.receive(_call(rank, ranks, state), {"tensor": value}, None)
    return [weights["tensor"] for _, weights in got]


def _sent_verdicts(state: LinkState) -> list[tuple[int, int, dict[str, Any]]]:
    assert isinstance(state.link, FakeLink)
    return [(peer, f.seq, f.head) for peer, f in state.link.sent if f.kind == VERDICT]


def test_a_call_gives_values_in_ranks_order() -> None:
    ranks = [2, 0, 1]
    values = {rank: torch.full((3, 4), float(rank)).bfloat16() for rank in ranks}
    arrivals = {r: [_send(r, ranks, values[r], {"ok": True})] for r in (0, 1)}
    assert {frame.head["route"] for [frame] in arrivals.values()} == {"link"}
    state = LinkState()
    got = _receive(ranks, state, arrivals, values[2])
    assert [t.float()[0, 0].item() for t in got] == [2.0, 0.0, 1.0]
    assert {str(t.dtype) for t in got} == {"torch.bfloat16"}
    assert _sent_verdicts(state) == [(0, 0, {"ok": True}), (1, 0, {"ok": True})]


@pytest.mark.usefixtures("private_shm_dir")
def test_a_sender_holds_its_segment_until_the_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol, "LINK_MAX_BYTES", 0)
    seen: list[Any] = []

    class Receiver(FakeLink):
        """Reads the segment the head names while the sender waits for its verdict."""

        def receive(self, *args: Any, **kwargs: Any) -> dict[int, Frame | Closed]:
            [(_, head)] = self.sent
            seen.append(own_segments())
            got = _receive([0, 1], LinkState(), {1: [head]}, torch.zeros(4))
            seen.append([t.tolist() for t in got])
            return super().receive(*args, **kwargs)

    state = LinkState()
    state.link = Receiver({0: [Frame(VERDICT, 0, {"ok": True})]})
    exchange.send(_call(1, [0, 1], state), {"tensor": torch.ones(4)}, None)
    segments, values = seen
    assert len(segments) == 1 and ".r1." in segments[0]
    assert values == [[0.0] * 4, [1.0] * 4]
    assert own_segments() == []  # unlinked once the verdict came


def test_a_late_sender_finds_its_calls_error_and_its_head_never_counts_for_a_later_one() -> None:
    ranks = [0, 1]
    state = LinkState()
    with pytest.raises(WorkspaceError, match=r"rank\(s\) \[1\] never wrote their value") as failed:
        _receive(ranks, state, {}, torch.zeros(2))
    # The missing sender gets the verdict too: it finds it when it comes.
    error = f"WorkspaceError: {failed.value}"
    assert _sent_verdicts(state) == [(1, 0, {"ok": False, "error": error})]
    late = _send(1, ranks, torch.full((2,), 5.0), {"ok": True})  # its call 0
    on_time = Frame(HEAD, 1, late.head, late.body)  # the same value, for call 1
    got = _receive(ranks, state, {1: [late, on_time]}, torch.zeros(2))
    assert [t.tolist() for t in got] == [[0.0, 0.0], [5.0, 5.0]]
    assert _sent_verdicts(state) == [(1, 1, {"ok": True})]  # the late head: dropped


def test_a_failed_call_leaves_the_link_ready() -> None:
    ranks = [0, 1, 2]
    state = LinkState()
    wrong = {r: [_send(r, ranks, torch.zeros(2, 2 + r), {"ok": True})] for r in (1, 2)}
    with pytest.raises(WorkspaceError, match=r"rank 2 has shape \(2, 4\) torch.float32"):
        _receive(ranks, state, wrong, torch.zeros(2, 2))
    assert [head["ok"] for _, _, head in _sent_verdicts(state)] == [False, False]
    right = {r: [_send(r, ranks, torch.ones(2, 2) * r, {"ok": True})] for r in (1, 2)}
    for frames in right.values():
        frames[0] = Frame(HEAD, 1, frames[0].head, frames[0].body)
    got = _receive(ranks, state, right, torch.zeros(2, 2))
    assert [t[0, 0].item() for t in got] == [0.0, 1.0, 2.0]
    assert [head["ok"] for _, _, head in _sent_verdicts(state)] == [True, True]


def test_a_closed_sender_is_named_in_the_peer_words_and_the_others_get_the_verdict() -> None:
    ranks = [0, 1, 2]
    state = LinkState()
    arrivals = {1: [_send(1, ranks, torch.ones(2), {"ok": True})]}
    state.link = FakeLink(arrivals, closed={2: Closed("Connection closed by peer")})
    with pytest.raises(WorkspaceError) as failed:
        exchange.receive(_call(0, ranks, state), {"tensor": torch.ones(2)}, None)
    assert "rank(s) [2] never wrote their value: its connection to this receiver was lost " in (
        str(failed.value)
    )
    assert "(Connection closed by peer)" in str(failed.value)
    [(peer, seq, verdict)] = _sent_verdicts(state)
    assert (peer, seq, verdict["ok"]) == (1, 0, False)


@pytest.mark.usefixtures("private_shm_dir")
def test_a_sender_raises_the_receivers_error_and_unlinks_its_segment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(protocol, "LINK_MAX_BYTES", 0)
    with pytest.raises(WorkspaceError) as failed:
        _send(1, [0, 1], torch.ones(8), {"ok": False, "error": "WorkspaceError: boom"})
    assert str(failed.value) == (
        "rank 1: get_tensors_parallel failed on receiver rank 0: WorkspaceError: boom"
    )
    assert own_segments() == []


def test_a_sender_whose_value_fails_sends_its_error_and_raises_its_own() -> None:
    state = LinkState()
    state.link = fake = FakeLink()
    call = _call(1, [0, 1], state, "get_configs_parallel")
    with pytest.raises(TypeError, match=r"config\['ok'\] is a builtins.set"):
        exchange.send(call, {}, {"ok": {1, 2}})
    [(peer, frame)] = fake.sent
    assert peer == 0 and frame.kind == HEAD and frame.head["ok"] is False
    assert frame.head["error"].startswith("TypeError: config['ok'] is a builtins.set")


def test_a_silent_or_closed_receiver_is_named() -> None:
    state = LinkState()
    state.link = FakeLink()  # no verdict ever comes (a wait that reached its deadline)
    with pytest.raises(WorkspaceError, match="timed out after 15 s waiting for receiver rank 0"):
        exchange.send(_call(1, [0, 1], state), {"tensor": torch.ones(2)}, None)
    state.link = FakeLink(closed={0: Closed("Connection closed by peer")})
    with pytest.raises(WorkspaceError) as failed:
        exchange.send(_call(1, [0, 1], state), {"tensor": torch.ones(2)}, None)
    assert str(failed.value) == (
        "rank 1: get_tensors_parallel: receiver rank 0 closed its connection before its "
        "verdict (Connection closed by peer): did it exit or fail?"
    )


def test_records_above_the_limit_go_to_the_calls_directory(tmp_path: Path) -> None:
    """A large record of a workspace_path call is a file there; small ones ride the link."""
    state = LinkState()
    state.link = fake = FakeLink({0: [Frame(VERDICT, 0, {"ok": True})]})
    call = protocol.Call("get_configs_parallel", 1, (0, 1), 5.0)
    sender = exchange.Exchange(call, state.next_seq(), state, "one-process-job", tmp_path)
    big = torch.zeros(protocol.LINK_MAX_BYTES // 4 + 1)
    exchange.send(sender, {}, {"big": big})
    [(_, frame)] = fake.sent
    assert frame.head["route"] == "file" and frame.body is None
    assert sender.directory is not None
    assert [p.name for p in sender.directory.path.glob("*.safetensors")] == ["rank-1.safetensors"]
    receiver_state = LinkState()
    receiver_state.link = FakeLink({1: [frame]})
    receiver = exchange.Exchange(
        protocol.Call("get_configs_parallel", 0, (0, 1), 5.0),
        0,
        receiver_state,
        "one-process-job",
        tmp_path,
    )
    configs = exchange.receive(receiver, {}, {"big": torch.ones(1)})
    assert torch.equal(configs[1][0]["big"], big)
    assert list(tmp_path.iterdir()) == []  # the receiver removed the call's directory
