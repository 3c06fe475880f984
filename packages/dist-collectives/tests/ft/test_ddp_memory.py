"""The DDP path through a Manager: plain DDP's gradients, one extra copy of them held.

Two real replicas train the same model twice, once with torch's own DDP on a plain gloo
group and once through the Manager's comm hook, and compare the gradients bit for bit.
After each managed step the test walks every object the Manager and the hook's state
reach, and adds up the bytes of the tensors found there that are none of the model's
own (parameters, gradients, DDP's bucket buffers): the copies of the gradients held
between steps. The pooled exchange buffer is one; a second (a concatenation kept
alive by the step) fails the test.
"""

# No `from __future__ import annotations`: DDP compares the hook's annotations with
# the real dist.GradBucket and Future[torch.Tensor] types.

import gc
import types
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import GradBucket  # type: ignore[attr-defined]  # public, not re-exported in the stubs
from torch.futures import Future

from dist_collectives.ft import Manager, ProcessGroupDummy, ProcessGroupGloo
from dist_collectives.ft.ddp import ReplicaAveraging, ft_allreduce_hook
from dist_core.testing import run_ranks

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)  # the same weights on every replica and in both runs
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)  # different data per rank
    x = torch.randn(32, 16, generator=generator)
    return x, x.sum(dim=1, keepdim=True)


def _reachable_tensors(roots: list[Any]) -> Iterator[torch.Tensor]:
    """The tensors that ``roots`` reach through the package's own objects and containers.

    Follows the attributes of objects defined in ``dist_collectives``, containers,
    closures and bound methods; never modules, classes or a function's globals (those
    reach everything in the process).
    """
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type | types.ModuleType):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield obj
            continue
        if isinstance(obj, types.FunctionType):
            todo.extend(cell.cell_contents for cell in obj.__closure__ or () if _filled(cell))
        elif isinstance(obj, types.MethodType):
            todo.append(obj.__self__)
        elif isinstance(obj, dict | list | tuple | set | frozenset):
            todo.extend(gc.get_referents(obj))
        elif type(obj).__module__.startswith("dist_collectives"):
            todo.extend(gc.get_referents(obj))
            todo.extend(getattr(obj, name, None) for name in getattr(type(obj), "__slots__", ()))


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


def _storages(tensors: Any) -> dict[int, int]:
    """Each distinct storage under ``tensors``: its address and size in bytes."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _plain_ddp_grads() -> list[list[torch.Tensor]]:
    rank = dist.get_rank()
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    grads = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        model.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    return grads


def _managed_ddp_worker() -> dict[str, Any]:
    rank = dist.get_rank()
    plain = _plain_ddp_grads()
    model = _model()
    manager = Manager(
        ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=lambda state: None,
        state_dict=lambda: {},
        min_replica_size=2,
        replica_id=f"ddp-memory-{rank}",
        timeout=timedelta(seconds=30),
        namespace="test-ddp-memory",
    )
    # ft's DistributedDataParallel, with the hook wrapped to note DDP's bucket buffers.
    ddp = nn.parallel.DistributedDataParallel(
        model, process_group=ProcessGroupDummy(0, 1), bucket_cap_mb=0.01
    )
    state = ReplicaAveraging(manager, model)
    buckets: dict[int, int] = {}

    def noting_hook(state: ReplicaAveraging, bucket: GradBucket) -> Future[torch.Tensor]:
        buckets.update(_storages([bucket.buffer()]))
        return ft_allreduce_hook(state, bucket)

    ddp.register_comm_hook(state, noting_hook)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    held, identical, committed = [], [], 0
    for step in range(STEPS):
        manager.start_quorum()
        x, y = _batch(rank, step)
        model.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        committed += manager.should_commit()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        identical.append(all(map(torch.equal, grads, plain[step])))
        own = _storages(model.parameters()) | _storages(grads) | buckets
        found = _storages(_reachable_tensors([manager, state]))
        held.append(sum(size for address, size in found.items() if address not in own))
    manager.shutdown()
    return {"held": held, "grad_bytes": grad_bytes, "identical": identical, "committed": committed}


@pytest.mark.processes
@pytest.mark.timeout(180)
def test_managed_ddp_matches_plain_ddp_and_holds_one_extra_copy_of_the_gradients() -> None:
    reports = run_ranks(_managed_ddp_worker, 2, timeout=150)
    for rank, report in enumerate(reports):
        print(
            f"rank {rank}: held between steps {report['held']} bytes; "
            f"the gradients are {report['grad_bytes']} bytes"
        )
        assert report["committed"] == STEPS, report
        assert report["identical"] == [True] * STEPS, f"rank {rank}: not plain DDP's gradients"
        assert report["held"][-1] > 0, "the walk found no exchange buffer: it sees nothing"
        assert max(report["held"]) <= report["grad_bytes"], (
            f"rank {rank} held {max(report['held'])} bytes between steps: more than one "
            f"copy of its {report['grad_bytes']} bytes of gradients"
        )
