"""The decisions of a call and the words of its errors, in one process, without a link."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dist_workspace import WorkspaceError, protocol

CALL = protocol.Call("get_tensors_parallel", 0, (0, 1, 2), 30.0)
HOST = "node-a/boot-1"


def _head(**fields: Any) -> dict[str, Any]:
    head: dict[str, Any] = {"ok": True, "ranks": [0, 1, 2], "host": HOST}
    head.update(shape=[2, 3], dtype="torch.float32")
    head.update(fields)
    return head


def _decide(heads: dict[int, dict[str, Any]], *, one_host: bool = True) -> str | None:
    return protocol.decide_receipt(
        CALL, heads, host=HOST, one_host=one_host, own_shape=([2, 3], "torch.float32")
    )


def test_heads_that_agree_let_the_receiver_read() -> None:
    assert _decide({1: _head(), 2: _head()}) is None


def test_a_senders_error_comes_before_missing_ranks() -> None:
    error = _decide({1: {"ok": False, "error": "TypeError: config['ok'] is a builtins.set"}})
    assert error == (
        "get_tensors_parallel: rank 1 failed to write its value: TypeError: config['ok'] is "
        "a builtins.set"
    )


def test_missing_senders_are_named_beside_those_that_came() -> None:
    error = _decide({1: _head()})
    assert error is not None
    assert "receiver rank 0 timed out after 30 s" in error
    assert "rank(s) [2] never wrote their value (ranks [1] did)" in error
    assert "ranks=[0, 1, 2]" in error and "DIST_WORKSPACE_TIMEOUT" in error


def test_heads_that_disagree_on_ranks_are_named() -> None:
    error = _decide({1: _head(), 2: _head(ranks=[0, 2, 1])})
    assert error == (
        "get_tensors_parallel: rank 2 passed ranks=[0, 2, 1], receiver rank 0 passed "
        "ranks=[0, 1, 2]; every rank must pass the same list"
    )


def test_a_sender_on_another_host_is_refused_without_a_directory() -> None:
    elsewhere = {1: _head(), 2: _head(host="node-b/boot-9")}
    error = _decide(elsewhere)
    assert error is not None
    assert "rank 2 runs on node-b/boot-9, receiver rank 0 on node-a/boot-1" in error
    assert "Pass workspace_path" in error
    assert _decide(elsewhere, one_host=False) is None


def test_shapes_and_dtypes_that_differ_name_every_rank() -> None:
    error = _decide({1: _head(), 2: _head(shape=[2, 4])})
    assert error == (
        "get_tensors_parallel needs tensors of one shape and dtype: rank 0 has shape (2, 3) "
        "torch.float32, rank 1 has shape (2, 3) torch.float32, rank 2 has shape (2, 4) "
        "torch.float32"
    )
    configs = protocol.Call("get_configs_parallel", 0, (0, 1), 30.0)
    heads = {1: {"ok": True, "ranks": [0, 1], "host": HOST}}  # configs have no shape
    assert protocol.decide_receipt(configs, heads, host=HOST, one_host=True, own_shape=None) is None


def test_a_sender_raises_the_receivers_error_naming_it() -> None:
    sender = protocol.Call("get_configs_parallel", 2, (0, 1, 2), 30.0)
    assert protocol.verdict_error(sender, {"ok": True}) is None
    assert protocol.verdict_error(sender, {"ok": False, "error": "WorkspaceError: x"}) == (
        "rank 2: get_configs_parallel failed on receiver rank 0: WorkspaceError: x"
    )


def test_a_silent_receiver_is_named_with_the_wait() -> None:
    sender = protocol.Call("get_configs_parallel", 2, (0, 1, 2), 30.0)
    assert protocol.verdict_error(sender, None) == (
        "rank 2: get_configs_parallel timed out after 40 s waiting for receiver rank 0 to "
        "read the values (did rank 0 call get_configs_parallel with ranks=[0, 1, 2]?)"
    )


def test_route_is_by_size_alone(tmp_path: Path) -> None:
    limit = protocol.LINK_MAX_BYTES
    assert limit == 8 << 20
    assert [protocol.route(size, None) for size in (0, 4096, limit)] == ["link"] * 3
    assert protocol.route(limit + 1, None) == "segment"
    assert protocol.route(limit, tmp_path) == "link"  # small records skip the directory
    assert protocol.route(limit + 1, tmp_path) == "file"


def test_a_frame_that_is_not_ours_or_too_large_names_the_rank() -> None:
    frame = protocol.encode_frame(protocol.HEAD, 7, {"ok": True}, 100)
    fixed, head = frame[: protocol.FIXED_BYTES], frame[protocol.FIXED_BYTES :]
    assert protocol.decode_fixed(fixed, 3) == (protocol.HEAD, 7, len(head), 100)
    assert protocol.decode_head(head, 3) == {"ok": True}
    with pytest.raises(WorkspaceError, match="rank 3 sent bytes that are not a dist-workspace"):
        protocol.decode_fixed(b"GET / HTTP/1.1\r\n".ljust(protocol.FIXED_BYTES), 3)
    huge = protocol.encode_frame(protocol.HEAD, 7, {}, protocol.LINK_MAX_BYTES + 1)
    with pytest.raises(WorkspaceError, match="rank 3 sent a malformed frame"):
        protocol.decode_fixed(huge[: protocol.FIXED_BYTES], 3)
    for raw in (b"[1, 2]", b"not json", b'{"a": {"b": {"c": 1}}}', b"\xff"):
        with pytest.raises(WorkspaceError, match="rank 3 sent a head that is not"):
            protocol.decode_head(raw, 3)


def test_opening_is_decided_by_the_receiver_naming_who_never_came() -> None:
    version = protocol.WIRE_VERSION
    came = {0: {"version": version}, 1: {"version": version}}
    assert "rank(s) [2] never wrote their value (ranks [1] did)" in str(
        protocol.decide_open(CALL, came)
    )
    assert protocol.decide_open(CALL, {**came, 2: {"version": version}}) is None
    assert "rank 2 speaks dist-workspace wire version 4" in str(
        protocol.decide_open(CALL, {**came, 2: {"version": 4}})
    )
    refused = {**came, 2: {"version": version, "error": "cannot listen on 10.0.0.9: ..."}}
    assert "rank 2 cannot take part in the link: cannot listen on 10.0.0.9" in str(
        protocol.decide_open(CALL, refused)
    )
