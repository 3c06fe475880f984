"""Bounded reads on torch's real stores, and an exchange over a FileStore."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dist_core.testing import run_ranks
from dist_workspace import get_configs_parallel, get_tensors_parallel
from dist_workspace.store_reader import frees_deleted_values, reader_for


@pytest.fixture(params=["tcp", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A TCPStore served by this process, or a FileStore (``init_method="file://"``)."""
    if request.param == "tcp":
        yield dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    else:
        yield dist.FileStore(str(tmp_path / "store"), 1)


def test_a_read_waits_for_its_key_no_longer_than_asked(store: Any) -> None:
    reader = reader_for(store)
    assert reader_for(store) is reader  # one per store
    store.set("here", "1")
    assert reader.get("here", 5.0) == b"1"
    began = time.monotonic()
    assert reader.get("never", 0.3) is None
    # A FileStore polls its file: its waits end on its own clock, within seconds.
    assert 0.25 <= time.monotonic() - began < 10.0
    assert store.timeout == timedelta(seconds=60) or isinstance(store, dist.FileStore)
    store.set("late", "2")
    assert reader.get("late", 5.0) == b"2"


def _over_a_file_store(path: str) -> list[Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    got: list[Any] = []
    for step in range(3):
        with get_tensors_parallel(torch.full((2,), float(rank + step)), [0, 1, 2]) as tensors:
            got.append([t.tolist() for t in tensors])
    with get_configs_parallel({"rank": rank}, [2, 1, 0], None) as configs:
        got.append(configs)
    # A FileStore keeps every value it was given: even a small record goes through a
    # segment, which the receiver maps (visible in its maps while the context lasts).
    with get_tensors_parallel(torch.ones(2), [0, 1, 2]) as tensors:
        maps = Path("/proc/self/maps").read_text().splitlines()
        got.append(len([line for line in maps if "/dist-workspace." in line]) if tensors else 0)
    return got


@pytest.mark.processes
@pytest.mark.usefixtures("private_shm_dir")
def test_an_exchange_over_a_file_store(tmp_path: Path) -> None:
    results = run_ranks(_over_a_file_store, 3, str(tmp_path / "init"), timeout=120)
    assert results[0][:3] == [[[float(r + step)] * 2 for r in range(3)] for step in range(3)]
    assert results[1][:3] == [[], [], []]
    assert results[2][3] == [{"rank": 2}, {"rank": 1}, {"rank": 0}]
    assert results[0][4] >= 2  # both senders' segments mapped


def test_small_records_ride_in_the_store_only_where_deleting_frees_them(store: Any) -> None:
    # A FileStore's file keeps every value ever set: records posted on every call
    # would grow it for the whole job, so its exchanges use segments only.
    expected = isinstance(store, dist.TCPStore)
    assert frees_deleted_values(store) is expected
    assert frees_deleted_values(dist.PrefixStore("job", store)) is expected
