"""The link in one process: socket pairs stand for two ranks, an in-process store for the
opening."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
import torch

from dist_workspace import WorkspaceError, protocol
from dist_workspace.link import Closed, Frame, LinkState, SocketLink, open_link

HEAD, VERDICT = protocol.HEAD, protocol.VERDICT


@pytest.fixture
def pair() -> Iterator[tuple[SocketLink, SocketLink]]:
    """Rank 0's link (its peer: rank 1) and rank 1's (its peer: rank 0)."""
    zero_end, one_end = socket.socketpair()
    zero, one = SocketLink({1: zero_end}), SocketLink({0: one_end})
    yield zero, one
    zero.close()
    one.close()


def _soon() -> float:
    return time.monotonic() + 30


def test_a_frame_and_its_body_arrive_whole_in_memory_of_their_own(
    pair: tuple[SocketLink, SocketLink],
) -> None:
    zero, one = pair
    data = torch.arange(1000, dtype=torch.int32)
    assert one.send(0, Frame(HEAD, 0, {"ok": True}), [b"abc", data.numpy()], _soon()) is None
    got = zero.receive([1], HEAD, 0, _soon())[1]
    assert isinstance(got, Frame) and got.head == {"ok": True} and got.body is not None
    assert bytes(got.body.numpy()) == b"abc" + data.numpy().tobytes()
    got.body.add_(1)  # writable: its own memory


def test_a_wait_that_times_out_ends_at_its_deadline_and_leaves_the_link_working(
    pair: tuple[SocketLink, SocketLink],
) -> None:
    zero, one = pair
    began = time.monotonic()
    assert zero.receive([1], HEAD, 0, began + 0.2) == {}
    assert 0.15 <= time.monotonic() - began < 5
    one.send(0, Frame(HEAD, 0, {"late": True}), (), _soon())
    got = zero.receive([1], HEAD, 0, _soon())[1]
    assert isinstance(got, Frame) and got.head == {"late": True}


def test_a_frame_of_an_earlier_call_is_dropped_and_never_counts_for_a_later_one(
    pair: tuple[SocketLink, SocketLink],
) -> None:
    zero, one = pair
    one.send(0, Frame(HEAD, 3, {"call": 3}), [b"x" * 100], _soon())
    one.send(0, Frame(VERDICT, 2, {"call": 2}), (), _soon())
    one.send(0, Frame(HEAD, 4, {"call": 4}), (), _soon())
    got = zero.receive([1], HEAD, 4, _soon())[1]
    assert isinstance(got, Frame) and got.head == {"call": 4}


def test_a_closed_peer_is_named_at_once_in_the_peer_words_and_stays_closed(
    pair: tuple[SocketLink, SocketLink],
) -> None:
    zero, one = pair
    one.close()
    began = time.monotonic()
    closed = Closed("Connection closed by peer")
    assert zero.receive([1], HEAD, 0, began + 60) == {1: closed}
    assert zero.receive([1], VERDICT, 1, began + 60) == {1: closed}
    assert zero.send(1, Frame(VERDICT, 1, {"ok": True}), (), began + 60) == closed
    assert time.monotonic() - began < 5


def test_a_frame_of_a_later_call_is_named_out_of_order(
    pair: tuple[SocketLink, SocketLink],
) -> None:
    zero, one = pair
    one.send(0, Frame(HEAD, 7, {}), (), _soon())
    got = zero.receive([1], HEAD, 5, _soon())[1]
    assert got == Closed(
        "rank 1 sent its value for call 7 while this rank waited for call 5: did the ranks "
        "call in different orders?"
    )


def test_bytes_that_are_not_a_frame_name_the_rank(pair: tuple[SocketLink, SocketLink]) -> None:
    zero, _ = pair
    stranger_end, zero_end = socket.socketpair()
    zero = SocketLink({1: zero_end})
    stranger_end.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".ljust(protocol.FIXED_BYTES))
    got = zero.receive([1], HEAD, 0, _soon())[1]
    assert got == Closed("rank 1 sent bytes that are not a dist-workspace frame")
    stranger_end.close()


def test_a_rank_of_another_wire_version_is_named(pair: tuple[SocketLink, SocketLink]) -> None:
    zero, one = pair
    raw = bytearray(protocol.encode_frame(HEAD, 0, {}, 0))
    raw[4:6] = (4).to_bytes(2, "little")  # dist-workspace 0.4 had no wire; say it did
    one._peers[0].sendall(raw)
    got = zero.receive([1], HEAD, 0, _soon())[1]
    assert isinstance(got, Closed) and "rank 1 speaks dist-workspace wire version 4" in got.why


def test_a_failed_opening_names_who_never_came_to_every_rank_and_the_next_tries_anew() -> None:
    """The opening's agreement in one process, over an in-process store (no sockets meet)."""
    store = torch.distributed.HashStore()
    ranks = (0, 1, 2)
    receiver_state = LinkState()
    with pytest.raises(WorkspaceError) as receiver_error:
        open_link(
            store, "job/ranks", protocol.Call("get_tensors_parallel", 0, ranks, 0.2), receiver_state
        )
    assert "rank(s) [1, 2] never wrote their value (ranks [] did)" in str(receiver_error.value)
    # Rank 1 comes late to the same opening: it reads the receiver's verdict at once.
    late_state = LinkState()
    began = time.monotonic()
    with pytest.raises(WorkspaceError) as late_error:
        open_link(
            store, "job/ranks", protocol.Call("get_tensors_parallel", 1, ranks, 60.0), late_state
        )
    assert time.monotonic() - began < 30
    assert str(late_error.value).startswith(
        "rank 1: get_tensors_parallel failed on receiver rank 0: get_tensors_parallel: receiver "
        "rank 0 timed out after 0.2 s: rank(s) [1, 2] never wrote"
    )
    # Both try the next opening under keys of their own.
    assert receiver_state.attempt == late_state.attempt == 1
    assert receiver_state.link is late_state.link is None
