"""all_to_all and all_to_all_v with CUDA tensors, bit-exact against the same on CPU.

Every test needs a GPU (``@pytest.mark.cuda``) and is skipped elsewhere. NCCL refuses
two ranks on one device, so the multi-rank tests exchange CUDA tensors over gloo
(``run_ranks(..., backend="gloo")``), which one GPU can run; the single-process test
runs without any process group, where both functions are the identity.

Each case runs twice on every rank, once with CPU tensors and once with CUDA tensors
(split sizes given as CPU or CUDA tensors to match), and the values, the gradients
and the analytic reference must agree bit for bit; the results must stay on the GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from dist_collectives import all_to_all, all_to_all_v
from dist_core.testing import run_ranks

pytestmark = pytest.mark.cuda

DTYPES = (torch.float32, torch.bfloat16)
COLUMNS = 3


@dataclasses.dataclass(frozen=True)
class Case:
    """One exchange: which call, how the split sizes are given, which input."""

    call: str  # all_to_all | v_given | v_exchanged | v_device_sizes | v_device_in | v_equal
    noncontiguous: bool = False
    grad: bool = True

    @property
    def name(self) -> str:
        flags = ("noncontiguous " if self.noncontiguous else "") + ("" if self.grad else "nograd")
        return f"{self.call} {flags}".strip()


CASES = [
    Case("all_to_all"),
    Case("all_to_all", noncontiguous=True),
    Case("all_to_all", grad=False),
    Case("v_given"),  # uneven splits with zero-row chunks, sizes as ints
    Case("v_given", noncontiguous=True),
    Case("v_given", grad=False),
    Case("v_exchanged"),  # output sizes None: exchanged on the data's device
    Case("v_device_sizes"),  # both split sizes as tensors on the data's device
    Case("v_device_in"),  # input sizes as a device tensor, output sizes exchanged
    Case("v_equal"),  # no split sizes: equal splits of inputs of different lengths
]


def _coordinates() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _tensor(seed: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, COLUMNS, generator=generator).to(dtype)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor on CPU, for a bit-exact comparison."""
    return tensor.detach().cpu().contiguous().view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))


def _splits(case: Case, world: int) -> list[list[int]]:
    """splits[src][dst]: rows rank src sends to rank dst."""
    if case.call == "all_to_all":
        return [[2] * world for _ in range(world)]
    if case.call == "v_equal":
        return [[src + 1] * world for src in range(world)]
    # Uneven, with zero-row chunks (every world size >= 2 has some).
    return [[(src + 2 * dst + 1) % 3 for dst in range(world)] for src in range(world)]


def _reference(case: Case, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What this rank must receive, and its input's gradient, computed by slicing."""
    rank, world = _coordinates()
    splits = _splits(case, world)
    inputs = [_tensor(100 + src, sum(splits[src]), dtype) for src in range(world)]
    received = [[splits[src][dst] for src in range(world)] for dst in range(world)]
    weights = [_tensor(200 + dst, sum(received[dst]), dtype) for dst in range(world)]
    output = torch.cat([inputs[src].split(splits[src])[rank] for src in range(world)])
    grad = torch.cat([weights[dst].split(received[dst])[rank] for dst in range(world)])
    return output, grad


def _exchange(
    case: Case, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Runs ``case`` on ``device``; returns the output and the input's gradient."""
    rank, world = _coordinates()
    splits = _splits(case, world)
    sending = splits[rank]
    receiving = [splits[src][rank] for src in range(world)]
    data = _tensor(100 + rank, sum(sending), dtype).to(device)
    if case.noncontiguous:
        data = data.t().contiguous().t()  # same values, column-major
        assert not data.is_contiguous() or data.shape[0] <= 1
    if case.grad:
        data.requires_grad_()
    if case.call == "all_to_all":
        output = all_to_all(data)
    elif case.call == "v_given":
        output = all_to_all_v(data, receiving, sending)
    elif case.call == "v_exchanged":
        output = all_to_all_v(data, None, sending)
    elif case.call == "v_device_sizes":
        output = all_to_all_v(
            data, torch.tensor(receiving, device=device), torch.tensor(sending, device=device)
        )
    elif case.call == "v_device_in":
        output = all_to_all_v(data, None, torch.tensor(sending, device=device))
    elif case.call == "v_equal":
        output = all_to_all_v(data)
    else:
        raise AssertionError(case.call)
    if not case.grad:
        return output, None
    output.backward(_tensor(200 + rank, sum(receiving), dtype).to(device))
    return output.detach(), data.grad


def cuda_worker() -> list[str]:
    """Every case in both dtypes on this rank; returns the failed checks (none: [])."""
    device = torch.device("cuda", torch.cuda.current_device())
    failures = []
    for dtype in DTYPES:
        for case in CASES:
            label = f"{case.name} {dtype}"
            expected, expected_grad = _reference(case, dtype)
            on_cpu, cpu_grad = _exchange(case, dtype, torch.device("cpu"))
            on_gpu, gpu_grad = _exchange(case, dtype, device)
            if on_gpu.device != device:
                failures.append(f"{label}: output on {on_gpu.device}, not {device}")
            if not _same(on_gpu, on_cpu):
                failures.append(f"{label}: CUDA output differs from the CPU one")
            if not _same(on_gpu, expected):
                failures.append(f"{label}: CUDA output differs from the reference")
            if not case.grad:
                continue
            if gpu_grad is None or cpu_grad is None:
                failures.append(f"{label}: no gradient")
                continue
            if gpu_grad.device != device:
                failures.append(f"{label}: gradient on {gpu_grad.device}, not {device}")
            if not _same(gpu_grad, cpu_grad):
                failures.append(f"{label}: CUDA gradient differs from the CPU one")
            if not _same(gpu_grad, expected_grad):
                failures.append(f"{label}: CUDA gradient differs from the reference")
    return failures


@pytest.mark.processes
@pytest.mark.parametrize("world", [2, 3])
def test_cuda_exchanges_over_gloo_match_cpu_bit_exactly(world: int) -> None:
    results = run_ranks(cuda_worker, world, backend="gloo", timeout=180)
    assert results == [[] for _ in range(world)]


def test_cuda_exchanges_without_a_group_match_cpu_bit_exactly() -> None:
    assert not dist.is_initialized()
    assert cuda_worker() == []
    data = torch.ones(4, 2, device="cuda")
    assert all_to_all(data) is data  # the identity, on the GPU
    assert all_to_all_v(data, torch.tensor([4], device="cuda"), [4]) is data
