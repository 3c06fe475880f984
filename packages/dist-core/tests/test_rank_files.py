"""A worker's error record says whether its process group existed when it failed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist

import dist_core
from dist_core.rank_files import read_error_record, write_error_record


def _raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as caught:
        return caught


def test_an_error_before_any_process_group_says_so(tmp_path: Path) -> None:
    assert not dist.is_initialized()
    path = tmp_path / "rank0.error.json"
    written = write_error_record(path, 0, _raised(ImportError("no module named trainer")))
    assert written.in_process_group is False
    assert read_error_record(path) == written


def test_an_error_inside_a_process_group_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = dist_core.get_unused_port()
    monkeypatch.setenv("MASTER_PORT", str(port))  # monkeypatch restores what init writes
    dist_core.init_dist(0, 0, 1, 1, "127.0.0.1", port, "env://", backend="gloo")
    try:
        path = tmp_path / "rank0.error.json"
        write_error_record(path, 0, _raised(ValueError("bad lr")))
    finally:
        dist_core.destroy_dist()
    record = read_error_record(path)
    assert record is not None and record.in_process_group is True


def test_a_record_without_the_field_reads_as_unknown(tmp_path: Path) -> None:
    path = tmp_path / "rank0.error.json"
    write_error_record(path, 0, _raised(ValueError("x")))
    data = json.loads(path.read_text())
    del data["in_process_group"]
    path.write_text(json.dumps(data))
    record = read_error_record(path)
    assert record is not None and record.in_process_group is None
    data["in_process_group"] = "yes"
    path.write_text(json.dumps(data))
    assert read_error_record(path) is None  # malformed: ignored, with a warning
