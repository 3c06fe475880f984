"""ManagedProcessGroup and extend_device_mesh on real processes; Manager argument checks."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dist_collectives.ft import (
    ManagedProcessGroup,
    Manager,
    ManagerConfigError,
    ProcessGroupGloo,
    extend_device_mesh,
)
from dist_core.testing import run_ranks


def _managed_worker() -> list[float]:
    rank = dist.get_rank()
    weight = torch.nn.Parameter(torch.zeros(2))
    manager = Manager(
        ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=lambda state: weight.data.copy_(state["w"]),
        state_dict=lambda: {"w": weight.data},
        min_replica_size=2,
        replica_id=f"managed{rank}",
        timeout=timedelta(seconds=30),
        namespace="test-managed",
    )  # the store comes from MASTER_ADDR / MASTER_PORT
    managed = ManagedProcessGroup(manager)
    manager.start_quorum()
    t = torch.tensor([float(rank + 1)])
    managed.allreduce([t], dist.AllreduceOptions()).wait()
    size = managed.size()
    committed = manager.should_commit()
    manager.shutdown()
    return [float(t), float(size), float(committed), float(manager.current_step())]


@pytest.mark.processes
def test_managed_group_averages_over_live_participants() -> None:
    assert run_ranks(_managed_worker, 2, timeout=120) == [[1.5, 2.0, 1.0, 1.0]] * 2


def _differently_initialised_worker(init_sync: bool) -> list[float]:
    rank = dist.get_rank()
    weight = torch.full((3,), float(rank))  # an unseeded init: every replica differs
    manager = Manager(
        ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=lambda state: weight.copy_(state["w"]),
        state_dict=lambda: {"w": weight},
        min_replica_size=3,
        replica_id=f"init{rank}",
        timeout=timedelta(seconds=30),
        namespace=f"test-init-sync-{init_sync}",
        init_sync=init_sync,
    )
    participants = []
    for _ in range(3):
        manager.start_quorum()
        grad = weight + 1.0  # computed from this replica's weights, after start_quorum
        manager.allreduce(grad).wait()
        participants.append(manager.num_participants())
        if manager.should_commit():
            weight.sub_(0.5 * grad)
    manager.shutdown()
    return [*weight.tolist(), *map(float, participants), float(manager.current_step())]


@pytest.mark.processes
@pytest.mark.parametrize("init_sync", [True, False])
def test_replicas_initialised_differently_train_identically_under_init_sync(
    init_sync: bool,
) -> None:
    # w <- w - 0.5 (w + 1) from replica init0's 0.0: -0.5, -0.75, -0.875, and every
    # replica takes part in every step. Without init_sync each goes its own way.
    results = run_ranks(_differently_initialised_worker, 3, init_sync, timeout=150)
    if init_sync:
        assert results == [[-0.875, -0.875, -0.875, 3.0, 3.0, 3.0, 3.0]] * 3
    else:
        assert len({tuple(r[:3]) for r in results}) == 3


def _tensor_kinds_worker() -> list[list[float]]:
    rank = dist.get_rank()
    manager = Manager(
        ProcessGroupGloo(timeout=timedelta(seconds=30)),
        load_state_dict=lambda state: None,
        state_dict=lambda: {},
        min_replica_size=2,
        replica_id=f"kinds{rank}",
        timeout=timedelta(seconds=30),
        namespace="test-manager-kinds",
    )
    results = []
    for _ in range(2):  # the second step reuses the first step's buffers
        manager.start_quorum()
        contiguous = torch.full((4,), float(4 * rank), dtype=torch.bfloat16)
        integers = torch.full((3,), 3 * rank + 1, dtype=torch.int64)  # sums 5: floor 2
        matrix = torch.full((3, 2), float(rank))
        column = matrix[:, 1]  # not contiguous: goes through a buffer
        futures = [manager.allreduce(t) for t in (contiguous, integers, column)]
        for future in futures:
            future.wait()
        assert manager.should_commit()
        results += [
            contiguous.float().tolist(),
            integers.float().tolist(),
            matrix.flatten().tolist(),
        ]
    manager.shutdown()
    return results


@pytest.mark.processes
def test_manager_averages_every_kind_of_tensor_in_place() -> None:
    # bfloat16 is divided before the sum, integers floor-divided after it, and a view
    # is written back into the storage it views (the other column stays as it was).
    first = [[2.0] * 4, [2.0] * 3, [0.0, 0.5, 0.0, 0.5, 0.0, 0.5]]
    second = [[2.0] * 4, [2.0] * 3, [1.0, 0.5, 1.0, 0.5, 1.0, 0.5]]
    assert run_ranks(_tensor_kinds_worker, 2, timeout=120) == [first * 2, second * 2]


def _overdue_worker() -> list[object]:
    import time

    rank = dist.get_rank()
    manager = Manager(
        ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=lambda state: None,
        state_dict=lambda: {},
        min_replica_size=2,
        replica_id=f"overdue{rank}",
        # Rank 1's own commit wait must outlast rank 0's: else it may give up first and
        # its error, not rank 0's timeout, fails the step.
        timeout=timedelta(seconds=3 if rank == 0 else 60),
        namespace="test-manager-overdue",
    )
    manager.start_quorum()
    started = time.monotonic()
    if rank == 0:  # rank 1 is alive but never joins this allreduce
        future = manager.allreduce(torch.ones(2))
    committed = manager.should_commit()
    elapsed = time.monotonic() - started
    error = manager.errored()
    result: list[object] = [committed, type(error).__name__ if error else None, elapsed < 10]
    if rank == 0:
        future.wait()  # completed by the failure, not by gloo's own 5 s timeout
        result.append(str(error))
    dist.barrier()  # nobody closes its connections while the other still decides
    manager.shutdown()
    return result


@pytest.mark.processes
def test_an_overdue_allreduce_fails_the_step_on_every_replica() -> None:
    first, second = run_ranks(_overdue_worker, 2, timeout=120)
    assert first[:3] == [False, "TimeoutError", True], first
    assert "allreduce did not finish within 0:00:03" in str(first[3])
    assert second[0] is False, "the replica that did vote must not commit either"


def _mesh_worker() -> list[object]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    pg = ProcessGroupGloo()
    with pytest.raises(ValueError, match="not registered"):
        extend_device_mesh(mesh, pg)
    pg.register("mesh-test")
    extended = extend_device_mesh(mesh, pg, name="dp", dim=0)
    with pytest.raises(ValueError, match="already has a dimension named 'tp'"):
        extend_device_mesh(mesh, pg, name="tp")
    pg.unregister()
    return [list(extended.mesh_dim_names or ()), list(extended.mesh.shape)]


@pytest.mark.processes
def test_extend_device_mesh_inserts_the_replica_dimension() -> None:
    assert run_ranks(_mesh_worker, 2, timeout=120) == [[["dp", "tp"], [1, 2]]] * 2


def test_manager_without_a_store_names_the_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ManagerConfigError, match="MASTER_ADDR"):
        Manager(ProcessGroupGloo(), load_state_dict=print, state_dict=dict)
