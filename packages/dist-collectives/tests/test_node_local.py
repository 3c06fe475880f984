"""Node-local helpers (local rank 0 first, file waits, signal files) on real ranks.

run_ranks puts every rank on one node (LOCAL_RANK = RANK, NODE_RANK = 0) and has no
per-rank environment option, so the two-node layouts set LOCAL_RANK, LOCAL_WORLD_SIZE,
NODE_RANK and GROUP_RANK in os.environ inside the rank function, before the first
helper call: the helpers read them through dist_core at call time, exactly as on a
real node of a multi-node job. The ranks share one directory (tmp_path) for their
marker files, as nodes would share an NFS directory.

Waits in these tests are bounded polls for a file some rank writes, never sleeps
standing in for an ordering. Where a test checks that something does NOT happen
while local rank 0 is in the block (a follower entering early), it watches for a
bounded window (OBSERVE_S): an implementation that let followers in early fails it.
"""

from __future__ import annotations

import logging
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import dist_collectives as dc
from dist_core import get_local_rank, get_node_rank
from dist_core.testing import RankFailedError, run_ranks

OBSERVE_S = 1.0  # how long local rank 0 watches for a follower entering too early
EVENT_S = 30.0  # bound on waiting for a file another rank writes
NAME = re.compile(r"^\._signal_file_node(\d+)_([A-Za-z0-9]{6})$")


def _poll(paths: list[Path], seconds: float) -> list[Path]:
    """The paths that exist, polled until one does or ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while True:
        found = [path for path in paths if path.exists()]
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.01)


def _as_nodes_of_two() -> None:
    """Places this rank on node RANK // 2 as local rank RANK % 2 (see the module doc)."""
    rank = dist.get_rank()
    os.environ.update(
        {
            "LOCAL_RANK": str(rank % 2),
            "LOCAL_WORLD_SIZE": "2",
            "NODE_RANK": str(rank // 2),
            "GROUP_RANK": str(rank // 2),
        }
    )


def _node_followers(local_world_size: int) -> list[int]:
    """Global ranks of this node's other local ranks (nodes of consecutive ranks)."""
    first = dist.get_rank() - get_local_rank()
    return list(range(first + 1, first + local_world_size))


# --- run_local_rank_zero_first ---------------------------------------------------


def zero_first_worker(shared: str, two_nodes: bool, leader_waits_for: dict[int, int]) -> Any:
    """Local rank 0 watches that no follower of its node enters while it is inside.

    ``leader_waits_for[node]``: a global rank of another node whose entry into the block
    this node's local rank 0 waits for while inside it; it comes only if nodes do not
    wait for each other.
    """
    if two_nodes:
        _as_nodes_of_two()
    rank, node = dist.get_rank(), get_node_rank()
    followers = _node_followers(2 if two_nodes else dist.get_world_size())
    root = Path(shared)
    out: dict[str, Any] = {"runs": 0}
    with dc.run_local_rank_zero_first(timeout=EVENT_S * 2):
        out["runs"] += 1
        if get_local_rank() == 0:
            entered = [root / f"entered-{r}" for r in followers]
            out["early"] = [p.name for p in _poll(entered, OBSERVE_S)]
            other = leader_waits_for.get(node)
            if other is not None:
                out["other_node_entered"] = bool(_poll([root / f"entered-{other}"], EVENT_S))
            (root / f"done-node{node}").touch()
        else:
            (root / f"entered-{rank}").touch()
            out["leader_done"] = (root / f"done-node{node}").exists()
    # Called again: the node groups are reused, and the order holds again.
    with dc.run_local_rank_zero_first(timeout=EVENT_S):
        if get_local_rank() == 0:
            (root / f"again-done-node{node}").touch()
        else:
            out["leader_done_again"] = (root / f"again-done-node{node}").exists()
    return out


@pytest.mark.processes
def test_run_local_rank_zero_first_one_node(tmp_path: Path) -> None:
    results = run_ranks(zero_first_worker, 3, str(tmp_path), False, {}, timeout=120)
    assert results[0] == {"runs": 1, "early": []}
    for out in results[1:]:
        assert out == {"runs": 1, "leader_done": True, "leader_done_again": True}


@pytest.mark.processes
def test_run_local_rank_zero_first_is_per_node(tmp_path: Path) -> None:
    # Node 1's local rank 0 (global 2) stays in its block until node 0's follower
    # (global 1) has entered its own: with one barrier for the whole job, global 1
    # would wait for global 2 and this would time out.
    results = run_ranks(zero_first_worker, 4, str(tmp_path), True, {1: 1}, timeout=120)
    assert results[0] == {"runs": 1, "early": []}
    assert results[2] == {"runs": 1, "early": [], "other_node_entered": True}
    for rank in (1, 3):
        assert results[rank] == {"runs": 1, "leader_done": True, "leader_done_again": True}


def failing_leader_worker(two_nodes: bool, failing_nodes: list[int]) -> Any:
    """Local rank 0 of each node in ``failing_nodes`` raises inside the block."""
    if two_nodes:
        _as_nodes_of_two()
    rank, node = dist.get_rank(), get_node_rank()
    ran = False
    try:
        # A timeout far beyond run_ranks' own: the followers must learn of the failure
        # from local rank 0's signal, not from running out of time.
        with dc.run_local_rank_zero_first(timeout=3600):
            ran = True
            if get_local_rank() == 0 and node in failing_nodes:
                raise ValueError(f"download failed on rank {rank}")
    except Exception as error:
        return {"ran": ran, "error": type(error).__name__, "message": str(error)}
    return {"ran": ran, "error": None}


@pytest.mark.processes
def test_leader_error_reaches_followers_one_node() -> None:
    results = run_ranks(failing_leader_worker, 3, False, [0], timeout=60)
    assert results[0] == {
        "ran": True,
        "error": "ValueError",
        "message": "download failed on rank 0",
    }
    for rank in (1, 2):
        assert results[rank]["ran"] is False
        assert results[rank]["error"] == "CollectivesError"
        assert results[rank]["message"] == (
            "run_local_rank_zero_first: local rank 0 of node 0 (global rank 0) raised "
            f"inside the block: ValueError: download failed on rank 0; global rank {rank} "
            "did not run it"
        )


@pytest.mark.processes
def test_leader_error_stays_on_its_node() -> None:
    results = run_ranks(failing_leader_worker, 4, True, [1], timeout=60)
    assert results[0] == {"ran": True, "error": None}
    assert results[1] == {"ran": True, "error": None}
    assert results[2]["error"] == "ValueError"
    assert results[3]["ran"] is False
    assert results[3]["error"] == "CollectivesError"
    assert (
        "local rank 0 of node 1 (global rank 2) raised inside the block" in (results[3]["message"])
    )
    assert "ValueError: download failed on rank 2" in results[3]["message"]


def stuck_leader_worker(shared: str) -> Any:
    """Local rank 0 stays in the block until both followers have given up waiting."""
    rank = dist.get_rank()
    root = Path(shared)
    try:
        with dc.run_local_rank_zero_first(timeout=2):
            if rank == 0:
                gave_up = [root / "gave-up-1", root / "gave-up-2"]
                deadline = time.monotonic() + EVENT_S
                while not all(p.exists() for p in gave_up) and time.monotonic() < deadline:
                    _poll(gave_up, 0.1)
                raise ValueError("leader gives up too")
            return {"ran": True}
    except dc.CollectivesError as error:
        (root / f"gave-up-{rank}").touch()
        return {"ran": False, "message": str(error)}
    except ValueError as error:
        return {"ran": True, "message": str(error), "leader": True}


@pytest.mark.processes
def test_followers_time_out_naming_local_rank_zero(tmp_path: Path) -> None:
    results = run_ranks(stuck_leader_worker, 3, str(tmp_path), timeout=60)
    assert results[0] == {"ran": True, "message": "leader gives up too", "leader": True}
    for rank in (1, 2):
        assert results[rank]["ran"] is False
        assert (
            f"global rank {rank} (local rank {rank} of node 0) waited 2 s for local rank 0 "
            "of its node (global rank 0) to finish the block, and it did not signal"
        ) in results[rank]["message"]


def dying_leader_worker(shared: str) -> None:
    """Local rank 0 dies inside the block; the others write down what they got."""
    rank = dist.get_rank()
    try:
        with dc.run_local_rank_zero_first(timeout=3600):
            if rank == 0:
                os._exit(3)
            Path(shared, f"rank{rank}").write_text("ran")
    except dc.CollectivesError as error:
        Path(shared, f"rank{rank}").write_text(str(error))


@pytest.mark.processes
def test_followers_notice_a_dead_local_rank_zero(tmp_path: Path) -> None:
    # run_ranks stops the others FAILURE_GRACE_SECONDS (2 s) after rank 0 dies: they
    # have written their error before that only if they noticed the death, not the
    # 3600 s timeout.
    with pytest.raises(RankFailedError) as caught:
        run_ranks(dying_leader_worker, 3, str(tmp_path), timeout=60)
    assert caught.value.rank == 0
    for rank in (1, 2):
        message = (tmp_path / f"rank{rank}").read_text()
        assert message.startswith(
            f"run_local_rank_zero_first: global rank {rank} (local rank {rank} of node 0) "
            "lost contact with local rank 0 of its node (global rank 0) after "
        ), message
        assert "It probably died (see its log)" in message


def duplicate_place_worker() -> Any:
    os.environ.update({"LOCAL_RANK": "0", "NODE_RANK": "0", "GROUP_RANK": "0"})
    try:
        with dc.run_local_rank_zero_first(timeout=EVENT_S):
            return "ran"
    except dc.CollectivesError as error:
        return str(error)


@pytest.mark.processes
def test_inconsistent_node_places_fail_on_every_rank() -> None:
    results = run_ranks(duplicate_place_worker, 2, timeout=60)
    expected = (
        "run_local_rank_zero_first: global ranks 0 and 1 both say they are local rank 0 of node 0"
    )
    assert all(result.startswith(expected) for result in results), results


# --- signal files and local_rank_zero_download_and_wait ---------------------------


def signal_file_worker(shared: str, two_nodes: bool) -> Any:
    if two_nodes:
        _as_nodes_of_two()
    name = dc.get_node_signal_file_name()
    path = dc.write_signal_file(name, Path(shared) / "signals")
    with dc.local_rank_zero_download_and_wait(path, timeout=EVENT_S):
        content = Path(path).read_text()
    return {"name": name, "path": path, "content": content, "node": get_node_rank()}


@pytest.mark.processes
@pytest.mark.parametrize("two_nodes", [False, True], ids=["one-node", "two-nodes"])
def test_signal_file_names_and_files(tmp_path: Path, two_nodes: bool) -> None:
    results = run_ranks(signal_file_worker, 4, str(tmp_path), two_nodes, timeout=120)
    tokens = set()
    for rank, out in enumerate(results):
        match = NAME.match(out["name"])
        assert match is not None, out["name"]
        assert int(match.group(1)) == out["node"] == (rank // 2 if two_nodes else 0)
        tokens.add(match.group(2))
        assert out["path"] == str(tmp_path / "signals" / out["name"])
        leader = rank - rank % 2 if two_nodes else 0
        assert out["content"] == f"local rank 0 done (global rank {leader})\n"
    assert len(tokens) == 1  # rank 0 drew it for everyone
    (token,) = tokens
    expected = [f"._signal_file_node{n}_{token}" for n in ([0, 1] if two_nodes else [0])]
    assert sorted({out["name"] for out in results}) == expected
    # Exactly one file per node, written by its local rank 0; no temporary file left.
    assert sorted(os.listdir(tmp_path / "signals")) == expected


def download_worker(shared: str) -> Any:
    """Two nodes of two, without a process group: only LOCAL_RANK and NODE_RANK count."""
    _as_nodes_of_two()
    rank, node = dist.get_rank(), get_node_rank()
    dist.destroy_process_group()
    root = Path(shared)
    target = root / f"dataset-node{node}.txt"
    with dc.local_rank_zero_download_and_wait(target, timeout=EVENT_S):
        if get_local_rank() == 0:
            early = [p.name for p in _poll([root / f"entered-{rank + 1}"], OBSERVE_S)]
            temporary = root / f".dataset-node{node}.partial"
            temporary.write_text(f"data of node {node}")
            os.replace(temporary, target)
            return {"early": early}
        (root / f"entered-{rank}").touch()
        return {"read": target.read_text()}


@pytest.mark.processes
def test_download_and_wait_without_process_group(tmp_path: Path) -> None:
    results = run_ranks(download_worker, 4, str(tmp_path), timeout=120)
    assert results == [
        {"early": []},
        {"read": "data of node 0"},
        {"early": []},
        {"read": "data of node 1"},
    ]


# --- single process -------------------------------------------------------------


def test_single_process_runs_the_block_at_once(tmp_path: Path) -> None:
    assert not dist.is_initialized()
    runs = []
    with dc.run_local_rank_zero_first():
        runs.append(1)
    assert runs == [1]
    # The file never appears: local rank 0 does not wait for it.
    with dc.local_rank_zero_download_and_wait(tmp_path / "missing", timeout=0.01):
        runs.append(2)
    assert runs == [1, 2]


def test_single_process_error_in_block_propagates() -> None:
    with pytest.raises(KeyError, match="inner"), dc.run_local_rank_zero_first():
        raise KeyError("inner")


def test_local_rank_zero_warns_when_the_file_was_not_created(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    level = caplog.at_level(logging.WARNING, logger="dist_collectives.node_local")
    with level, dc.local_rank_zero_download_and_wait(tmp_path / "never"):
        pass
    assert f"{tmp_path / 'never'} does not exist" in caplog.text


def test_single_process_signal_file_name() -> None:
    name = dc.get_node_signal_file_name()
    assert NAME.match(name) is not None
    assert name.startswith("._signal_file_node0_")
    assert dc.get_node_signal_file_name(random.Random(7)) == dc.get_node_signal_file_name(
        random.Random(7)
    )


def test_write_signal_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "a" / "b"
    path = dc.write_signal_file("._signal", str(directory))
    assert path == str(directory / "._signal")
    assert os.listdir(directory) == ["._signal"]
    assert Path(path).read_text() == "local rank 0 done (global rank 0)\n"
    monkeypatch.chdir(tmp_path)
    assert dc.write_signal_file("here") == str(tmp_path / "here")
    assert (tmp_path / "here").exists()


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "/abs"])
def test_write_signal_file_refuses_paths(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="must be a plain file name"):
        dc.write_signal_file(name, tmp_path)


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_timeouts_must_be_positive(tmp_path: Path, timeout: float) -> None:
    refused = pytest.raises(ValueError, match="must be a positive duration")
    with refused, dc.run_local_rank_zero_first(timeout=timeout):
        pytest.fail("the block ran")
    refused = pytest.raises(ValueError, match="must be a positive duration")
    with refused, dc.local_rank_zero_download_and_wait(tmp_path, timeout=timeout):
        pytest.fail("the block ran")


# --- several ranks in the environment, no process group --------------------------


@pytest.fixture
def local_rank_one_of_four(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4",
        "NODE_RANK": "0",
    }.items():
        monkeypatch.setenv(name, value)


@pytest.mark.usefixtures("local_rank_one_of_four")
def test_collective_ones_need_a_process_group() -> None:
    refused = pytest.raises(dc.CollectivesError, match="WORLD_SIZE=4 but no process group")
    with refused, dc.run_local_rank_zero_first():
        pytest.fail("the block ran")
    with pytest.raises(dc.CollectivesError, match="WORLD_SIZE=4 but no process group"):
        dc.get_node_signal_file_name()


@pytest.mark.usefixtures("local_rank_one_of_four")
def test_file_ones_work_from_local_rank_alone(tmp_path: Path) -> None:
    path = dc.write_signal_file("sig", tmp_path)
    assert path == str(tmp_path / "sig")
    assert os.listdir(tmp_path) == []  # local rank 1 does not write
    with (
        pytest.raises(dc.CollectivesError) as caught,
        dc.local_rank_zero_download_and_wait(path, timeout=0.2),
    ):
        pytest.fail("the block ran")
    assert str(caught.value).startswith(
        f"local_rank_zero_download_and_wait: {path} did not appear within 0.2 s; local "
        "rank 0 of node 0 should create it (this is local rank 1, global rank 1)"
    )
    Path(path).touch()
    with dc.local_rank_zero_download_and_wait(path, timeout=0.2):
        pass
