"""Records copied straight out of a sender's memory (process_vm_readv), on real processes."""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from shm_inspection import backing, own_segments

from dist_core.testing import run_ranks
from dist_workspace import WorkspaceError, cross_memory, get_configs_parallel, get_tensors_parallel

pytestmark = [
    pytest.mark.usefixtures("private_shm_dir"),
    pytest.mark.skipif(not cross_memory.enabled(), reason="no process_vm_readv on this system"),
]

MIB = 1 << 20


def _calls(count: int, elements: int) -> list[dict[str, Any]]:
    """``count`` calls of a tensor per rank; per call, where the receiver's values live."""
    import torch.distributed as dist

    rank = dist.get_rank()
    seen = []
    for call in range(count):
        tensor = torch.arange(elements, dtype=torch.int32) + 1000 * rank + call
        with get_tensors_parallel(tensor, [0, 1, 2]) as tensors:
            if tensors:
                expected = [
                    torch.arange(elements, dtype=torch.int32) + 1000 * r + call for r in range(3)
                ]
                seen.append(
                    {
                        "peers": [backing(value) for value in tensors[1:]],
                        "equal": all(
                            torch.equal(value, want)
                            for value, want in zip(tensors, expected, strict=True)
                        ),
                        "writable": bool(tensors[1].add_(0).is_contiguous()),
                    }
                )
    return seen


@pytest.mark.processes
def test_after_two_calls_the_receiver_copies_from_the_senders_memory() -> None:
    calls = run_ranks(_calls, 3, 4, MIB // 4, timeout=120)[0]
    assert all(call["equal"] for call in calls)
    segment = f"/dist-workspace.{os.getuid()}."
    # Call 0 learns the receiver's pid; call 1 offers memory beside a segment.
    assert all(segment in path for path in calls[0]["peers"]), calls[0]
    for call in calls[1:]:  # this process's own memory (heap or anonymous), no file
        assert all(path in ("anonymous", "[heap]") for path in call["peers"]), call
    assert own_segments() == []


@pytest.mark.processes
def test_cross_memory_can_be_turned_off() -> None:
    os.environ["DIST_WORKSPACE_CROSS_MEMORY"] = "0"  # the ranks inherit it
    calls = run_ranks(_calls, 3, 4, MIB // 4, timeout=120)[0]
    assert all(call["equal"] for call in calls)
    segment = f"/dist-workspace.{os.getuid()}."
    assert all(segment in path for call in calls for path in call["peers"]), calls


@pytest.mark.processes
def test_records_above_the_limit_keep_their_segment() -> None:
    from dist_workspace.shm_transport import CROSS_MEMORY_MAX_BYTES

    calls = run_ranks(_calls, 3, 3, CROSS_MEMORY_MAX_BYTES // 4 + 1, timeout=180)[0]
    assert all(call["equal"] for call in calls)
    segment = f"/dist-workspace.{os.getuid()}."
    assert all(segment in path for call in calls for path in call["peers"]), calls


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


def _with_a_bad_offer(break_call: int, how: str, calls: int) -> list[str]:
    """Rank 1's offers from call ``break_call`` on name memory the receiver cannot read.

    Returns each call's outcome: its error, or "ok" and where the receiver's value lives.
    """
    import torch.distributed as dist

    from dist_workspace import shm_transport

    rank = dist.get_rank()
    original = shm_transport._MemoryParcel.status
    outcomes = []
    for call in range(calls):
        if rank == 1 and call == break_call:

            def bad(self: Any) -> dict[str, Any]:
                status = original(self)
                if how == "address":
                    status["memory"]["token_at"] = 8  # page 0 is never mapped: EFAULT
                else:
                    status["memory"]["token"] = "00" * 16
                return status

            shm_transport._MemoryParcel.status = bad  # type: ignore[method-assign]
        tensor = torch.full((MIB // 4,), float(rank + call))
        try:
            with get_tensors_parallel(tensor, [0, 1], timeout=30) as tensors:
                outcome = "ok"
                if tensors:
                    outcome = "ok" if float(tensors[1][-1]) == 1 + call else "wrong data"
                    outcome += " " + backing(tensors[1])
        except WorkspaceError as error:
            outcome = str(error)
        outcomes.append(outcome)
    return outcomes


@pytest.mark.processes
def test_a_refused_trial_falls_back_to_the_segment() -> None:
    # Call 1 is the trial: the kernel refuses (EFAULT), the receiver reads the segment,
    # and call 2 goes through a segment alone.
    results = run_ranks(_with_a_bad_offer, 2, 1, "address", 3, timeout=120)
    for outcome in results[0][1:]:
        assert outcome.startswith("ok ") and "/dist-workspace." in outcome, results
    assert results[1] == ["ok"] * 3
    assert own_segments() == []


@pytest.mark.processes
def test_a_refused_copy_after_the_trial_names_the_rank_and_pid() -> None:
    # Call 2 sends memory alone and the kernel refuses: the call fails on both ranks,
    # naming rank 1 and its pid, and rank 1 sends segments from call 3 on.
    receiver, sender = run_ranks(_with_a_bad_offer, 2, 2, "address", 4, timeout=120)
    assert receiver[0].startswith("ok ") and receiver[1].startswith("ok "), receiver
    assert "rank 1's memory (pid " in receiver[2], receiver
    assert "refused" in receiver[2] and "DIST_WORKSPACE_CROSS_MEMORY=0" in receiver[2]
    assert "failed on receiver rank 0" in sender[2] and "rank 1's memory" in sender[2]
    assert receiver[3].startswith("ok ") and "/dist-workspace." in receiver[3], receiver
    assert sender[3] == "ok"
    assert own_segments() == []


@pytest.mark.processes
def test_bytes_from_another_process_than_the_sender_are_refused() -> None:
    results = run_ranks(_with_a_bad_offer, 2, 2, "token", 3, timeout=120)
    assert "is not the sender any more" in results[0][2], results


_HOLDER = """
import ctypes, os, sys
data = ctypes.create_string_buffer(bytes(range(256)) * 32, 8192)
print(os.getpid(), ctypes.addressof(data), flush=True)
sys.stdin.readline()  # until the reader is done
"""


@pytest.mark.processes
def test_read_spans_copies_from_a_live_process_and_names_a_dead_one() -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        pid, address = (int(part) for part in holder.stdout.readline().split())
        target = ctypes.create_string_buffer(8192)
        base = ctypes.addressof(target)
        # Two spans, the first ending at an odd byte: copied whole, in place.
        cross_memory.read_spans(pid, [(base, address, 3), (base + 3, address + 3, 8189)])
        assert target.raw == bytes(range(256)) * 32
        with pytest.raises(cross_memory.CrossMemoryError) as refused:
            cross_memory.read_spans(pid, [(base, 8, 8)])  # page 0 is never mapped
        assert refused.value.errno == errno.EFAULT
        holder.stdin.write("done\n")
        holder.stdin.flush()
        assert holder.wait(60) == 0
        with pytest.raises(cross_memory.CrossMemoryError) as gone:
            cross_memory.read_spans(pid, [(base, address, 8)])
        assert gone.value.errno == errno.ESRCH
    finally:
        holder.kill()
        holder.wait(60)


def test_a_partial_copy_resumes_where_it_stopped() -> None:
    from dist_workspace.cross_memory import _after

    spans = [(100, 1000, 10), (200, 2000, 5)]
    assert _after(spans, 0) == spans
    assert _after(spans, 4) == [(104, 1004, 6), (200, 2000, 5)]
    assert _after(spans, 10) == [(200, 2000, 5)]
    assert _after(spans, 12) == [(202, 2002, 3)]
    assert _after(spans, 15) == []
