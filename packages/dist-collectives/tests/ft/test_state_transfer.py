"""Sending a healing replica its peer's state: layout, checksums, and the real transfer.

The layout and checksum tests run without processes; the transfers run on two real
processes over a gloo group, with messages made small so that a few KiB of state
already spans sliced, packed and empty tensors.
"""

from __future__ import annotations

import itertools
import os
import pickle
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_collectives.ft import ProcessGroupGloo, StateTransferError, host_pages, state_transfer
from dist_collectives.ft.state_layout import (
    checksum,
    describe,
    plan_messages,
    rebuild,
    tensor_specs,
)
from dist_core.testing import run_ranks


def _store_addr(prefix: str) -> str:
    return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}/{prefix}"


def _state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1)
    grid = torch.randn(64, 48, generator=generator)
    return {
        "model": {
            "weight": torch.randn(40_000, generator=generator),  # sliced: > chunk
            "strided": grid.t(),  # not contiguous
            "column": grid[:, 3],  # a strided view into a larger storage
            "half": torch.randn(33, generator=generator).to(torch.bfloat16),
            "empty": torch.empty(0, 5),
            "mask": torch.rand(77, generator=generator) > 0.5,
            "complex": torch.randn(9, dtype=torch.complex64, generator=generator),
        },
        "optimizer": {
            "state": {
                0: {"step": torch.tensor(12.0), "count": torch.tensor([3], dtype=torch.int64)}
            },
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "name": None, "nan": float("nan")}],
        },
        "int8": torch.arange(-50, 50, dtype=torch.int8)[::3],
    }


def _flat(state: Any, path: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        return {
            k: v for key, item in state.items() for k, v in _flat(item, f"{path}/{key}").items()
        }
    if isinstance(state, list | tuple):
        return {
            k: v for i, item in enumerate(state) for k, v in _flat(item, f"{path}/{i}").items()
        } | {f"{path}:type": type(state).__name__}
    return {path: state}


def _same(a: Any, b: Any) -> bool:
    fa, fb = _flat(a), _flat(b)
    if fa.keys() != fb.keys():
        return False
    for key, x in fa.items():
        y = fb[key]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif isinstance(x, float) and x != x:
            if not (isinstance(y, float) and y != y):
                return False
        elif x != y or type(x) is not type(y):
            return False
    return True


# -- layout, without processes ------------------------------------------------------


def test_every_byte_travels_in_exactly_one_message() -> None:
    sizes = [0, 10, 5000, 300, 0, 12_000, 7, 4096, 1]
    messages = plan_messages(sizes, chunk_bytes=4096, pack_bytes=1024)
    covered: dict[int, list[tuple[int, int]]] = {}
    for message in messages:
        assert 0 < message.nbytes <= 4096
        assert message.nbytes == sum(p.stop - p.start for p in message.pieces)
        if message.direct:
            assert len(message.pieces) == 1 and sizes[message.pieces[0].tensor] >= 1024
        for piece in message.pieces:
            covered.setdefault(piece.tensor, []).append((piece.start, piece.stop))
    for index, size in enumerate(sizes):
        ranges = sorted(covered.get(index, []))
        assert sum(stop - start for start, stop in ranges) == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_small_tensors_are_packed_and_large_ones_sliced() -> None:
    messages = plan_messages([100] * 50 + [10_000], chunk_bytes=4096, pack_bytes=1024)
    packed = [m for m in messages if not m.direct]
    direct = [m for m in messages if m.direct]
    assert len(packed) == 2 and sum(len(m.pieces) for m in packed) == 50
    assert [m.nbytes for m in direct] == [4096, 4096, 1808]


def test_a_description_is_json_and_comes_back_whole() -> None:
    import json

    state = _state()
    description, tensors, specs = describe(state)
    again = json.loads(json.dumps(description))
    received = tensor_specs(again)
    assert [(s.path, s.shape, s.dtype) for s in received] == [
        (s.path, s.shape, s.dtype) for s in specs
    ]
    assert _same(rebuild(again, tensors), state)


def test_a_state_that_json_cannot_describe_is_refused_by_name() -> None:
    with pytest.raises(StateTransferError, match=r"state\['opt'\]\['fn'\] is a function"):
        describe({"opt": {"fn": lambda: 0}})
    with pytest.raises(StateTransferError, match="only str and int keys"):
        describe({(1, 2): torch.ones(1)})


def test_a_malformed_description_is_an_error_not_a_crash() -> None:
    with pytest.raises(StateTransferError, match="unknown dtype"):
        tensor_specs({"tensor": 0, "shape": [1], "dtype": "torch.nonsense"})
    with pytest.raises(StateTransferError, match="malformed"):
        tensor_specs({"tensor": 0, "shape": [-1], "dtype": "torch.float32"})
    with pytest.raises(StateTransferError, match="tensor numbers"):
        tensor_specs({"list": [{"tensor": 1, "shape": [1], "dtype": "torch.float32"}]})


@pytest.mark.parametrize("nbytes", [1, 7, 8, 9, 4095, 4096, 4097, 70_001])
def test_the_checksum_sees_one_changed_byte_and_moved_words(nbytes: int) -> None:
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator())
    reference = checksum(data)
    assert checksum(data.clone()) == reference
    for position in {0, nbytes // 2, nbytes - 1}:
        changed = data.clone()
        changed[position] ^= 0x10
        assert checksum(changed) != reference, position
    if nbytes >= 16 and not torch.equal(data[:8], data[8:16]):
        swapped = data.clone()
        swapped[:8], swapped[8:16] = data[8:16].clone(), data[:8].clone()
        assert checksum(swapped) != reference


def test_the_checksum_does_not_depend_on_where_the_bytes_sit() -> None:
    data = torch.randint(0, 256, (10_003,), dtype=torch.uint8)
    assert checksum(data[3:9000]) == checksum(data[3:9000].clone())


# -- real transfers ---------------------------------------------------------------


class _CorruptingGroup:
    """Sends through ``pg`` but flips one byte of the message with tag ``tag``."""

    def __init__(self, pg: Any, tag: int, position: int) -> None:
        self._pg, self._tag, self._position = pg, tag, position

    def getBackendName(self) -> str:
        return str(self._pg.getBackendName())

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        if tag == self._tag:
            changed = tensors[0].clone()
            changed[self._position] ^= 0x01
            tensors = [changed]
        return self._pg.send(tensors, dst, tag)


def _no_pickle(*_: Any, **__: Any) -> Any:
    raise AssertionError("the state transfer used pickle")


def _transfer_worker(mode: str) -> Any:
    rank, world = dist.get_rank(), dist.get_world_size()
    pg = ProcessGroupGloo(timeout=timedelta(seconds=60))
    pg.configure(_store_addr(f"state-transfer/{mode}"), rank, world)
    # Small messages: the state below then spans sliced, packed and empty tensors.
    state_transfer.CHUNK_BYTES, state_transfer.PACK_BYTES = 64 << 10, 8 << 10
    for name in ("dumps", "loads", "load", "dump", "Pickler", "Unpickler"):
        setattr(pickle, name, _no_pickle)
    try:
        if rank == 0 and mode == "no tensors":
            state_transfer.send_state(pg, {"empty": torch.empty(0), "n": [1, "a"]}, 3, 1)
            return None
        if rank == 0:
            target: Any = pg
            if mode == "corrupt":  # a byte of the second message (tags 0, 1: header)
                target = _CorruptingGroup(pg, tag=3, position=5)
            state_transfer.send_state(target, _state(), 17, 1)
            return None
        into = None
        if mode == "into":
            into = _state()
            into["model"]["weight"].zero_()
            into["model"]["half"] = torch.zeros(5, dtype=torch.bfloat16)  # other shape
        try:
            received, step = state_transfer.recv_state(pg, 0, into=into)
        except StateTransferError as error:
            return str(error)
        if mode == "no tensors":
            return [step, received["empty"].shape == (0,), received["n"]]
        same = _same(received, _state())
        if mode == "into":
            assert into is not None
            in_place = received["model"]["weight"].data_ptr() == into["model"]["weight"].data_ptr()
            fresh = received["model"]["half"].data_ptr() != into["model"]["half"].data_ptr()
            return [step, same, in_place, fresh]
        return [step, same]
    finally:
        pg.shutdown()


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_nested_state_of_mixed_tensors_arrives_whole_without_pickle() -> None:
    _, received = run_ranks(_transfer_worker, 2, "plain", timeout=240)
    assert received == [17, True]


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_state_is_received_in_place_where_the_tensors_fit() -> None:
    _, received = run_ranks(_transfer_worker, 2, "into", timeout=240)
    assert received == [17, True, True, True]


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_state_without_bytes_to_send_arrives() -> None:
    _, received = run_ranks(_transfer_worker, 2, "no tensors", timeout=240)
    assert received == [3, True, [1, "a"]]


def test_mapping_pages_ahead_keeps_what_the_memory_holds() -> None:
    data = torch.arange(3 << 20, dtype=torch.int32)  # 12 MiB, written already
    fresh = torch.empty(3 << 20, dtype=torch.int32)
    host_pages.prefer_huge_pages(fresh)
    host_pages.populate(fresh)  # may do nothing (not Linux, an older kernel)
    fresh.copy_(data)
    host_pages.prefer_huge_pages(data)
    host_pages.populate(data[5:])
    assert torch.equal(data, fresh)
    assert not host_pages.populate(torch.ones(10))  # too small to bother


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_a_byte_changed_in_transit_is_found_and_named() -> None:
    _, message = run_ranks(_transfer_worker, 2, "corrupt", timeout=240)
    assert isinstance(message, str)
    assert "arrived corrupted" in message and "step 17" in message
    # The second message is the second slice of the 40 000-float weight (160 000 bytes).
    assert "state['model']['weight'] bytes [65536, 131072)" in message
    assert "(1 of " in message
