"""Peer hosts of a static job, from the kernel's TCP table, and whether they answer."""

from __future__ import annotations

import socket

from dist_launch.watch.peer_probe import answers, name_peer, parse_tcp_table

# Two sockets of /proc/net/tcp: one established to 10.0.0.2:0x6E08 (inode 4242), one
# listening on 0.0.0.0:0x72B8 (inode 77).
TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100000A:8CD2 0200000A:6E08 01 00000000:00000000 00:00000000 00000000     0        0 4242 1 0
   1: 00000000:72B8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 77 1 0
"""


def test_the_tcp_table_gives_established_remote_ends_by_inode() -> None:
    assert parse_tcp_table(TABLE) == {4242: ("10.0.0.2", 0x6E08)}


def test_a_refusal_is_an_answer() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    assert answers("127.0.0.1", port, seconds=5.0)  # nobody listens there: refused


def test_a_listener_answers() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        assert answers("127.0.0.1", server.getsockname()[1], seconds=5.0)


def test_the_master_is_node_0_and_in_two_nodes_the_other_is_the_other() -> None:
    ranks = {0: (0, 1), 1: (2, 3)}
    assert name_peer("10.0.0.1", "10.0.0.1", 2, 1, ranks).ranks == (0, 1)
    assert name_peer("10.0.0.2", "10.0.0.1", 2, 0, ranks).node == 1
    unknown = name_peer("10.0.0.3", "10.0.0.1", 3, 0, {**ranks, 2: (4, 5)})
    assert (unknown.node, unknown.ranks) == (-1, ())
