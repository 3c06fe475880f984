"""get_tensors_parallel / get_configs_parallel on real processes, and their failures."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from shm_inspection import backing, own_segments

from dist_core.testing import run_ranks
from dist_workspace import WorkspaceError, get_configs_parallel, get_tensors_parallel

pytestmark = pytest.mark.usefixtures("private_shm_dir")


@pytest.fixture(params=["link", "segments"])
def link_max(request: pytest.FixtureRequest) -> int | None:
    """Small records on the link (the default), then every record in a segment or file.

    The value is the ranks' ``protocol.LINK_MAX_BYTES`` (None: as it is), passed to
    each rank function.
    """
    return None if request.param == "link" else 0


def _set_link_max(link_max: int | None) -> None:
    from dist_workspace import protocol

    if link_max is not None:
        protocol.LINK_MAX_BYTES = link_max


def _exchanges(directory: str, link_max: int | None) -> dict[str, Any]:
    import torch.distributed as dist

    _set_link_max(link_max)
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    tensor = (torch.arange(12, dtype=torch.float32).reshape(3, 4) + 100 * rank).bfloat16()
    with get_tensors_parallel(tensor, [2, 0, 1]) as tensors:
        out["tensors"] = [t.float().tolist() for t in tensors]
        out["dtypes"] = {str(t.dtype) for t in tensors}
        kept = list(tensors)
    if rank == 2:
        kept[1].add_(1)  # writable, private copy-on-write pages: valid after the context
        out["after_exit"] = kept[1].float().sum().item()
    config = {"rank": rank, "pair": (rank, "x"), "scale": torch.full((2,), float(rank))}
    with get_configs_parallel(config, [0, 1, 2], None) as configs:
        out["configs"] = [{**c, "scale": c["scale"].tolist()} for c in configs]
    many = {"layers": [torch.full((3,), float(i + rank)) for i in range(200)]}
    with get_configs_parallel(many, [1, 2, 0], None) as configs:
        out["many"] = [
            [t[0].item() for t in c["layers"]] == [float(i + [1, 2, 0][n]) for i in range(200)]
            for n, c in enumerate(configs)
        ]
    with get_configs_parallel({"rank": rank, "t": (1, 2)}, [0, 2, 1], None, directory) as configs:
        out["dir"] = configs
    pair = dist.new_group([0, 1])
    if rank in (0, 1):
        with get_tensors_parallel(torch.tensor([rank, rank]), [1, 0], pair) as tensors:
            out["subgroup"] = [t.tolist() for t in tensors]
    with get_tensors_parallel(torch.tensor(7.0 + rank), [rank]) as tensors:
        out["single"] = [t.item() for t in tensors]
    dist.barrier()
    out["segments_left"] = own_segments()
    out["dir_left"] = sorted(os.listdir(directory))
    return out


@pytest.mark.processes
def test_values_arrive_in_ranks_order(tmp_path: Path, link_max: int | None) -> None:
    results = run_ranks(_exchanges, 3, str(tmp_path), link_max, timeout=120)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert results[2]["tensors"] == [(base + 200).tolist(), base.tolist(), (base + 100).tolist()]
    assert results[2]["dtypes"] == {"torch.bfloat16"}
    assert results[2]["after_exit"] == float((base + 1).sum())
    assert results[0]["tensors"] == results[1]["tensors"] == []
    assert results[0]["configs"] == [
        {"rank": r, "pair": [r, "x"], "scale": [float(r)] * 2} for r in (0, 1, 2)
    ]
    assert results[1]["configs"] == results[2]["configs"] == []
    assert results[1]["many"] == [True, True, True]
    assert results[0]["dir"] == [{"rank": r, "t": [1, 2]} for r in (0, 2, 1)]
    assert results[1]["subgroup"] == [[1, 1], [0, 0]] and results[0]["subgroup"] == []
    assert [r["single"] for r in results] == [[7.0], [8.0], [9.0]]
    for result in results:
        assert result["segments_left"] == []
        assert result["dir_left"] == []


def _own_entries(directory: str) -> dict[str, Any]:
    """What the receiver gets back of its own value, through each transport."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for transport, path in (("shm", None), ("dir", directory)):
        scale = torch.full((3,), float(rank))
        config = {"scale": scale, "tied": scale, "tail": scale[1:], "pair": (rank, 1)}
        with get_configs_parallel(config, [0, 1], None, path) as configs:
            if not configs:
                continue
            own, peer = configs
            entry: dict[str, Any] = {
                "equal": torch.equal(own["scale"], scale) and own["pair"] == [0, 1],
                "not_the_callers": own["scale"] is not scale
                and own["scale"].untyped_storage().data_ptr() != scale.untyped_storage().data_ptr(),
                "devices": sorted({str(c[k].device) for c in configs for k in ("scale", "tail")}),
            }
            own["scale"].add_(7.0)  # changing the result never changes the caller's config
            entry["caller_unchanged"] = scale.tolist() == [0.0, 0.0, 0.0]
            entry["ties_kept"] = [
                c["tied"].tolist() == c["scale"].tolist()
                and c["tail"].tolist() == c["scale"][1:].tolist()
                for c in configs
            ]
            peer["scale"].add_(1.0)
            entry["peer_ties_kept"] = peer["tied"].tolist() == [2.0] * 3
            out[transport] = entry
    mine = torch.arange(4, dtype=torch.float32) + rank
    with get_tensors_parallel(mine, [0, 1]) as tensors:
        if tensors:
            tensors[0].zero_()
            out["tensor_caller_unchanged"] = mine.tolist() == [0.0, 1.0, 2.0, 3.0]
    return out


@pytest.mark.processes
def test_the_receivers_own_value_is_a_copy_like_its_peers(tmp_path: Path) -> None:
    results = run_ranks(_own_entries, 2, str(tmp_path), timeout=120)
    assert results[1] == {}
    for transport in ("shm", "dir"):
        assert results[0][transport] == {
            "equal": True,
            "not_the_callers": True,
            "devices": ["cpu"],
            "caller_unchanged": True,
            "ties_kept": [True, True],
            "peer_ties_kept": True,
        }, transport
    assert results[0]["tensor_caller_unchanged"] is True


def _catch(fn: Any) -> str:
    try:
        fn()
    except (WorkspaceError, TypeError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _shape_mismatch(link_max: int | None) -> str:
    import torch.distributed as dist

    _set_link_max(link_max)
    rank = dist.get_rank()
    shape = (2, 3) if rank != 2 else (2, 4)

    def call() -> None:
        with get_tensors_parallel(torch.zeros(shape), [0, 1, 2], timeout=60):
            pass

    return _catch(call)


@pytest.mark.processes
def test_tensors_of_different_shapes_fail_everywhere(link_max: int | None) -> None:
    results = run_ranks(_shape_mismatch, 3, link_max, timeout=90)
    for result in results:
        assert "WorkspaceError" in result
        assert "rank 0 has shape (2, 3)" in result and "rank 2 has shape (2, 4)" in result
    assert own_segments() == []


def _failing_writer(link_max: int | None) -> str:
    import torch.distributed as dist

    _set_link_max(link_max)
    rank = dist.get_rank()
    config: Any = {"ok": {1, 2}} if rank == 1 else {"ok": True}

    def call() -> None:
        # A long timeout: peers must fail because rank 1 reported, not by timing out.
        with get_configs_parallel(config, [0, 1, 2], None, timeout=600):
            pass

    return _catch(call)


@pytest.mark.processes
def test_failing_writer_makes_every_peer_fail_naming_it(link_max: int | None) -> None:
    results = run_ranks(_failing_writer, 3, link_max, timeout=90)
    assert results[1].startswith("TypeError: config['ok'] is a builtins.set")
    for result in (results[0], results[2]):
        assert result.startswith("WorkspaceError") and "rank 1 failed to write" in result


def _missing_rank(link_max: int | None) -> str:
    import torch.distributed as dist

    _set_link_max(link_max)
    if dist.get_rank() == 2:
        return "did not call"

    def call() -> None:
        with get_tensors_parallel(torch.ones(2), [0, 1, 2], timeout=3):
            pass

    return _catch(call)


@pytest.mark.processes
def test_a_rank_that_never_writes_is_named(link_max: int | None) -> None:
    results = run_ranks(_missing_rank, 3, link_max, timeout=90)
    assert "rank(s) [2] never wrote" in results[0]
    assert "rank 1" in results[1] and "rank(s) [2] never wrote" in results[1]
    assert own_segments() == []


def _caller_not_in_ranks() -> str:
    import torch.distributed as dist

    rank = dist.get_rank()

    def call() -> None:
        with get_tensors_parallel(torch.full((2,), rank), [0, 1], timeout=60) as tensors:
            if rank == 0:
                assert [t.tolist() for t in tensors] == [[0, 0], [1, 1]]

    return _catch(call)


@pytest.mark.processes
def test_ranks_list_without_the_caller() -> None:
    results = run_ranks(_caller_not_in_ranks, 3, timeout=90)
    assert results[:2] == ["no error", "no error"]
    assert "rank 2" in results[2] and "does not include the caller" in results[2]


def test_single_process_without_a_group() -> None:
    with get_tensors_parallel(torch.ones(2), [0]) as tensors:
        assert [t.tolist() for t in tensors] == [[1.0, 1.0]]
    with get_configs_parallel({"a": (1,)}, [0], None) as configs:
        assert configs == [{"a": [1]}]
    mine = torch.ones(2)
    with get_tensors_parallel(mine, [0]) as tensors:
        tensors[0].add_(1)
    with get_configs_parallel({"t": mine}, [0], None) as configs:
        configs[0]["t"].add_(1)
    assert mine.tolist() == [1.0, 1.0]  # the caller's own value is copied, as on a receiver
    needs_group = pytest.raises(WorkspaceError, match="needs an initialized process group")
    with needs_group, get_tensors_parallel(torch.ones(2), [0, 1]):
        pass
    not_included = pytest.raises(WorkspaceError, match="does not include the caller")
    with not_included, get_tensors_parallel(torch.ones(2), [1]):
        pass


def _where_received_tensors_live(elements: int) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    tensor = torch.full((elements,), float(rank))
    with get_tensors_parallel(tensor, [0, 1, 2]) as tensors:
        if not tensors:
            return {}
        return {
            "peers": [backing(value) for value in tensors[1:]],
            "own": backing(tensors[0]),
            "values": [float(value[-1]) for value in tensors],
        }


@pytest.mark.processes
def test_the_receiver_maps_the_senders_segments_instead_of_copying() -> None:
    # 12 MiB each: above the link's limit (8 MiB), so through segments.
    result = run_ranks(_where_received_tensors_live, 3, 3 << 20, timeout=120)[0]
    assert result["values"] == [0.0, 1.0, 2.0]
    for path, rank in zip(result["peers"], (1, 2), strict=True):
        assert path.startswith(os.environ["DIST_WORKSPACE_SHM_DIR"] + "/"), path
        assert f"/dist-workspace.{os.getuid()}." in path and f".r{rank}." in path, path
    assert "dist-workspace." not in result["own"]  # its own value is a private copy
    assert own_segments() == []


@pytest.mark.processes
def test_small_records_travel_on_the_link_not_in_segments() -> None:
    result = run_ranks(_where_received_tensors_live, 3, 64, timeout=120)[0]
    assert result["values"] == [0.0, 1.0, 2.0]
    for path in result["peers"]:  # private copies: no segment was made for them
        assert "dist-workspace." not in path, path


def _configs_with_shared_views(count: int) -> list[bool]:
    import torch.distributed as dist

    rank = dist.get_rank()
    results = []
    for call in range(count):
        base = torch.arange(64 * 1024, dtype=torch.float32) + rank + call
        config = {"rank": rank, "first": base[:100], "strided": base[1::3], "whole": base}
        with get_configs_parallel(config, [1, 0], None) as configs:
            for sender, got in zip([1, 0], configs or [], strict=bool(configs)):
                want = torch.arange(64 * 1024, dtype=torch.float32) + sender + call
                results.append(
                    got["rank"] == sender
                    and torch.equal(got["whole"], want)
                    and torch.equal(got["strided"], want[1::3])
                    and got["strided"].untyped_storage().data_ptr()
                    == got["whole"].untyped_storage().data_ptr()
                )
    return results


@pytest.mark.processes
def test_configs_with_views_of_one_storage_come_back_shared() -> None:
    results = run_ranks(_configs_with_shared_views, 2, 4, timeout=120)[1]  # rank 1 receives
    assert results and all(results), results


def _a_sender_late_for_a_call_the_receiver_gave_up() -> list[str]:
    import torch.distributed as dist

    rank = dist.get_rank()
    outcomes = []
    if rank == 0:  # gives up on call 0 before rank 1 comes
        outcomes.append(_catch(lambda: _exchange_once(rank, timeout=1)))
        dist.barrier()
    else:  # comes to call 0 only after the receiver gave up on it
        dist.barrier()
        outcomes.append(_catch(lambda: _exchange_once(rank, timeout=60)))
    # Call 1: the receiver finds rank 1's status of call 0 first in its queue.
    outcomes.append(_catch(lambda: _exchange_once(rank, timeout=60)))
    return outcomes


def _exchange_once(rank: int, timeout: float) -> None:
    with get_tensors_parallel(torch.full((3,), float(rank)), [0, 1], timeout=timeout) as tensors:
        if tensors:
            assert [t.tolist() for t in tensors] == [[0.0] * 3, [1.0] * 3]


@pytest.mark.processes
def test_a_late_senders_message_is_dropped_by_the_next_call() -> None:
    receiver, sender = run_ranks(_a_sender_late_for_a_call_the_receiver_gave_up, 2, timeout=120)
    assert "rank(s) [1] never wrote" in receiver[0]
    # The late sender is told at once (the receiver's verdict waits in its queue).
    assert "failed on receiver rank 0" in sender[0] and "never wrote" in sender[0]
    assert receiver[1] == sender[1] == "no error"
    assert own_segments() == []


def _keys_in_the_store_after(calls: list[int]) -> list[int]:
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    counts = []
    for call in range(max(calls) + 1):
        with get_tensors_parallel(torch.full((4,), float(rank)), [0, 1, 2]):
            pass
        with get_configs_parallel({"call": call}, [2, 0, 1], None):
            pass
        if call in calls:
            dist.barrier()  # every rank's deletes of the call before are done
            counts.append(int(store.num_keys()))
            dist.barrier()
    return counts


@pytest.mark.processes
def test_calls_leave_no_growing_trail_of_keys_in_the_store() -> None:
    counts = run_ranks(_keys_in_the_store_after, 3, [3, 40], timeout=120)[0]
    assert counts[0] == counts[1], counts
