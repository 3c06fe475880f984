"""all_to_all and all_to_all_v against a single-process reference, values and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_collectives import CollectivesError, all_to_all, all_to_all_v
from dist_core.testing import run_ranks

DTYPES = (torch.float32, torch.bfloat16)
COLUMNS = 3


def _tensor(seed: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, COLUMNS, generator=generator).to(dtype)


def _reference(inputs: list[torch.Tensor], splits: list[list[int]]) -> list[torch.Tensor]:
    """What each rank receives: splits[src][dst] rows go from src to dst, in src order."""
    world = len(inputs)
    chunks = [torch.split(x, s) for x, s in zip(inputs, splits, strict=True)]
    return [torch.cat([chunks[src][dst] for src in range(world)]) for dst in range(world)]


def _reference_with_grads(
    inputs: list[torch.Tensor], splits: list[list[int]], weights: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    leaves = [x.clone().requires_grad_() for x in inputs]
    outputs = _reference(leaves, splits)
    loss = sum((out * w).sum() for out, w in zip(outputs, weights, strict=True))
    assert isinstance(loss, torch.Tensor)
    loss.backward()
    grads = [leaf.grad for leaf in leaves]
    assert all(g is not None for g in grads)
    return [out.detach() for out in outputs], grads  # type: ignore[misc]


def _check_case(
    name: str,
    dtype: torch.dtype,
    rows: list[int],
    splits: list[list[int]],
    call: str,
    make_noncontiguous: bool = False,
) -> str:
    """Runs one exchange on this rank and compares with the reference; returns the name."""
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = [_tensor(100 + r, rows[r], dtype) for r in range(world)]
    expected_rows = [sum(splits[src][dst] for src in range(world)) for dst in range(world)]
    weights = [_tensor(200 + r, expected_rows[r], dtype) for r in range(world)]
    expected, expected_grads = _reference_with_grads(inputs, splits, weights)

    mine = inputs[rank]
    if make_noncontiguous:
        mine = mine.t().contiguous().t()
        assert not mine.is_contiguous()
    mine = mine.clone() if not make_noncontiguous else mine
    mine.requires_grad_()
    if call == "all_to_all":
        out = all_to_all(mine)
    elif call == "v_given":
        receive = [splits[src][rank] for src in range(world)]
        out = all_to_all_v(mine, receive, splits[rank])
    elif call == "v_exchanged":
        out = all_to_all_v(mine, None, splits[rank])
    elif call == "v_equal":
        out = all_to_all_v(mine)
    else:
        raise AssertionError(call)
    out.backward(weights[rank])
    assert out.dtype == dtype
    assert torch.equal(out, expected[rank]), f"{name}: values differ on rank {rank}"
    assert mine.grad is not None
    assert torch.equal(mine.grad, expected_grads[rank]), f"{name}: gradients differ on {rank}"
    return name


def _uneven_splits(world: int) -> list[list[int]]:
    # Zero-row chunks included on purpose.
    return [[(src + 2 * dst) % 3 for dst in range(world)] for src in range(world)]


def exchange_worker() -> list[str]:
    world = dist.get_world_size()
    done: list[str] = []
    for dtype in DTYPES:
        per_rank = 2
        equal = [[per_rank] * world for _ in range(world)]
        rows = [per_rank * world] * world
        done.append(_check_case(f"all_to_all {dtype}", dtype, rows, equal, "all_to_all"))
        done.append(_check_case(f"all_to_all nc {dtype}", dtype, rows, equal, "all_to_all", True))
        uneven = _uneven_splits(world)
        uneven_rows = [sum(s) for s in uneven]
        done.append(_check_case(f"v given {dtype}", dtype, uneven_rows, uneven, "v_given"))
        done.append(_check_case(f"v exchanged {dtype}", dtype, uneven_rows, uneven, "v_exchanged"))
        # Equal splits of each rank's own input, but ranks hold different row counts,
        # so what a rank receives still has to be exchanged.
        varied = [[r + 1] * world for r in range(world)]
        varied_rows = [sum(s) for s in varied]
        done.append(_check_case(f"v equal {dtype}", dtype, varied_rows, varied, "v_equal"))
    return done


def double_backward_worker() -> bool:
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((world,), float(rank + 1), requires_grad=True)
    out = all_to_all(x)
    (grad,) = torch.autograd.grad((out**2).sum(), x, create_graph=True)
    # d/dx sum(out^2) routed back is 2x; its own gradient is 2 everywhere.
    assert torch.equal(grad.detach(), 2 * x.detach())
    (second,) = torch.autograd.grad(grad.sum(), x)
    assert torch.equal(second, torch.full((world,), 2.0))
    return True


def errors_worker() -> list[str]:
    world = dist.get_world_size()
    messages = []
    with pytest.raises(ValueError, match=rf"size {world + 1}.*group size {world}"):
        all_to_all(torch.zeros(world + 1, 2))
    messages.append("a2a-divisible")
    with pytest.raises(ValueError, match=rf"size {world + 1}.*group size {world}"):
        all_to_all_v(torch.zeros(world + 1, 2))
    messages.append("v-divisible")
    bad = [1] * world
    with pytest.raises(ValueError, match=rf"sum to {world}.*size {world + 2}"):
        all_to_all_v(torch.zeros(world + 2), input_split_sizes=bad)
    messages.append("v-sum")
    with pytest.raises(ValueError, match=rf"has {world - 1} entries.*{world} ranks"):
        all_to_all_v(torch.zeros(world), input_split_sizes=[1] * (world - 1))
    messages.append("v-length")
    with pytest.raises(ValueError, match="negative"):
        all_to_all_v(torch.zeros(world), output_split_sizes=[-1] + [1] * (world - 1))
    messages.append("v-negative")
    # A group that holds only rank 0: the others are not members.
    only_zero = dist.new_group([0])
    if dist.get_rank() != 0:
        with pytest.raises(ValueError, match=rf"global rank {dist.get_rank()} is not a member"):
            all_to_all(torch.zeros(world), group=only_zero)
        with pytest.raises(ValueError, match="not a member"):
            all_to_all_v(torch.zeros(world), group=only_zero)
        messages.append("not-member")
    return messages


def subgroup_worker() -> list[float]:
    """An exchange inside ranks [1, 2] of 3 is sized by the group, not the world."""
    group = dist.new_group([1, 2])
    rank = dist.get_rank()
    if rank == 0:
        return []
    x = torch.tensor([10.0 * rank, 10.0 * rank + 1], requires_grad=True)
    out = all_to_all(x, group=group)
    out.backward(torch.tensor([1.0, 2.0]))
    assert x.grad is not None
    v = all_to_all_v(torch.tensor([float(rank)] * rank), None, [rank - 1, 1], group=group)
    return [*out.tolist(), *x.grad.tolist(), *v.tolist()]


@pytest.mark.processes
@pytest.mark.parametrize("world", [2, 3, 4])
def test_exchanges_match_reference(world: int) -> None:
    results = run_ranks(exchange_worker, world, timeout=120)
    assert all(len(done) == 10 for done in results)


@pytest.mark.processes
def test_errors_name_the_sizes() -> None:
    results = run_ranks(errors_worker, 3, timeout=120)
    assert results[0] == ["a2a-divisible", "v-divisible", "v-sum", "v-length", "v-negative"]
    assert results[1][-1] == "not-member"


@pytest.mark.processes
def test_subgroup_and_double_backward() -> None:
    results = run_ranks(subgroup_worker, 3, timeout=120)
    # Rank 1 sends [10] to itself and [11] to rank 2; rank 2 sends [20] and keeps [21].
    assert results[1][:2] == [10.0, 20.0]
    assert results[2][:2] == [11.0, 21.0]
    # Gradients come back along the same routes.
    assert results[1][2:4] == [1.0, 1.0]
    assert results[2][2:4] == [2.0, 2.0]
    # all_to_all_v: rank 1 sends 0 rows to 1 and 1 row to 2; rank 2 sends 1 row to each.
    assert results[1][4:] == [2.0]
    assert results[2][4:] == [1.0, 2.0]
    assert run_ranks(double_backward_worker, 2, timeout=120) == [True, True]


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_process_identity(dtype: torch.dtype) -> None:
    assert not dist.is_initialized()
    x = torch.randn(5, 2).to(dtype).requires_grad_()
    assert all_to_all(x) is x
    y = all_to_all_v(x, input_split_sizes=[5])
    assert y is x
    assert all_to_all_v(x, [5], [5]) is x
    (y * 3).sum().backward()
    assert x.grad is not None
    assert torch.equal(x.grad, torch.full((5, 2), 3.0, dtype=dtype))


def test_single_process_errors() -> None:
    with pytest.raises(ValueError, match=r"sum to 4 but dim 0 of the input has size 5"):
        all_to_all_v(torch.zeros(5), input_split_sizes=[4])
    with pytest.raises(ValueError, match="0-d"):
        all_to_all(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"output_split_sizes=\[4\] must equal"):
        all_to_all_v(torch.zeros(5), output_split_sizes=[4])


def test_environment_with_several_ranks_but_no_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    # Whole: a LOCAL_WORLD_SIZE=1 left in the environment (torch(2.11)'s fast lane, once)
    # made the environment invalid before the missing group could be told.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(CollectivesError, match="WORLD_SIZE=2 but no process group"):
        all_to_all(torch.zeros(4))
    with pytest.raises(CollectivesError, match="WORLD_SIZE=2"):
        all_to_all_v(torch.zeros(4))
