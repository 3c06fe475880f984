"""Autograd-aware all-to-all exchanges along dim 0.

:func:`all_to_all` splits its input into equal chunks along dim 0 and sends chunk
``j`` to rank ``j`` of the group; chunk ``j`` of the output came from rank ``j``.
:func:`all_to_all_v` does the same with uneven chunks (as mixture-of-experts token
dispatch needs). Both are differentiable: the gradient of an exchange is the reverse
exchange, which for equal chunks is the same exchange again and for uneven chunks
swaps the input and output split sizes.

Both are the identity in a single process (no process group initialized, a group of
one rank).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dist_collectives._group import GroupView, ProcessGroup, resolve_group

logger = logging.getLogger(__name__)

__all__ = ["all_to_all", "all_to_all_v"]


def _exchange(
    data: torch.Tensor,
    group: ProcessGroup,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
) -> torch.Tensor:
    data = data.contiguous()
    if output_split_sizes is None:
        output = torch.empty_like(data)
    else:
        output = data.new_empty((sum(output_split_sizes), *data.shape[1:]))
    dist.all_to_all_single(
        output,
        data,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=group,
    )
    return output


class _AllToAll(torch.autograd.Function):
    """Equal-split exchange; its own adjoint."""

    @staticmethod
    def forward(ctx: Any, data: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _exchange(data, group)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        # Through apply, not _exchange, so that double backward works too.
        return _apply_equal(grad_output, ctx.group), None


class _AllToAllV(torch.autograd.Function):
    """Uneven exchange; its adjoint is the exchange with the split sizes swapped."""

    @staticmethod
    def forward(
        ctx: Any,
        data: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        group: ProcessGroup,
    ) -> torch.Tensor:
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        return _exchange(data, group, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = _apply_uneven(grad_output, ctx.input_split_sizes, ctx.output_split_sizes, ctx.group)
        return grad, None, None, None


def _needs_graph(data: torch.Tensor) -> bool:
    # Without a graph to record, the autograd Function is pure overhead (tens of
    # microseconds per call, which is measurable at small sizes).
    return data.requires_grad and torch.is_grad_enabled()


def _apply_equal(data: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    if not _needs_graph(data):
        return _exchange(data, group)
    output: torch.Tensor = _AllToAll.apply(data, group)  # type: ignore[no-untyped-call]
    return output


def _apply_uneven(
    data: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
    group: ProcessGroup,
) -> torch.Tensor:
    if not _needs_graph(data):
        return _exchange(data, group, output_split_sizes, input_split_sizes)
    output: torch.Tensor = _AllToAllV.apply(  # type: ignore[no-untyped-call]
        data, output_split_sizes, input_split_sizes, group
    )
    return output


def _check_rank_dims(data: torch.Tensor, operation: str) -> None:
    if data.dim() == 0:
        raise ValueError(
            f"{operation}: input must have at least one dimension to split along dim 0, "
            "got a 0-d tensor"
        )


def all_to_all(input: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Exchanges equal chunks of dim 0 between the ranks of ``group``, differentiably.

    The input is split into ``group size`` equal chunks along dim 0; chunk ``j`` goes
    to the rank at position ``j`` of the group, and chunk ``j`` of the output is the
    chunk this rank received from position ``j``. The output has the input's shape.
    The backward pass runs the same exchange on the gradient. A non-contiguous input
    is made contiguous first.

    Reads ``WORLD_SIZE`` (and the other launcher variables dist-core knows) only when
    no process group is initialized.

    Args:
        input: Tensor whose dim 0 is divisible by the group size.
        group: The process group; None means the default (world) group.

    Returns:
        The exchanged tensor; ``input`` itself when this process is a single rank.

    Raises:
        ValueError: Dim 0 is not divisible by the group size, the input is 0-d, or
            this rank is not in ``group``.
        dist_collectives.CollectivesError: The environment describes several ranks
            but no process group is initialized.
    """
    view = resolve_group(group, "all_to_all")
    _check_rank_dims(input, "all_to_all")
    if input.shape[0] % view.size != 0:
        raise ValueError(
            f"all_to_all: dim 0 of the input (size {input.shape[0]}, shape "
            f"{tuple(input.shape)}) is not divisible by the group size {view.size}; use "
            "all_to_all_v for uneven splits"
        )
    if view.is_single or view.size == 1:
        return input
    assert view.group is not None
    return _apply_equal(input, view.group)


def _as_split_sizes(sizes: Sequence[int] | torch.Tensor, name: str, view: GroupView) -> list[int]:
    values = [int(size) for size in (sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes)]
    if len(values) != view.size:
        raise ValueError(
            f"all_to_all_v: {name} has {len(values)} entries {values} but the group has "
            f"{view.size} ranks; give one size per rank"
        )
    negative = [size for size in values if size < 0]
    if negative:
        raise ValueError(f"all_to_all_v: {name}={values} holds negative sizes {negative}")
    return values


def _exchange_split_sizes(
    input_split_sizes: list[int], group: ProcessGroup, device: torch.device
) -> list[int]:
    """What every rank will send to this one: entry ``j`` comes from position ``j``."""
    # On the data's device: a backend that exchanges the data can exchange the sizes.
    sending = torch.tensor(input_split_sizes, dtype=torch.int64, device=device)
    receiving = torch.empty_like(sending)
    dist.all_to_all_single(receiving, sending, group=group)
    return [int(size) for size in receiving.tolist()]


def all_to_all_v(
    input: torch.Tensor,
    output_split_sizes: Sequence[int] | torch.Tensor | None = None,
    input_split_sizes: Sequence[int] | torch.Tensor | None = None,
    group: ProcessGroup | None = None,
) -> torch.Tensor:
    """Exchanges uneven chunks of dim 0 between the ranks of ``group``, differentiably.

    ``input_split_sizes[j]`` rows of the input (in order along dim 0) go to the rank
    at position ``j`` of the group; ``output_split_sizes[j]`` rows of the output came
    from position ``j``. The backward pass sends the gradient back along the same
    routes (the split sizes swapped).

    When ``output_split_sizes`` is None the ranks exchange their input split sizes
    first (one small extra all-to-all), so a caller that knows them already should
    pass them. When ``input_split_sizes`` is None the input is split equally. The
    output sizes a caller passes are trusted: if they disagree with what the peers
    send, the backend reports (or hangs until its timeout); pass None to have them
    computed.

    Reads ``WORLD_SIZE`` (and the other launcher variables dist-core knows) only when
    no process group is initialized.

    Args:
        input: Tensor to split along dim 0.
        output_split_sizes: Rows to receive from each rank of the group, or None to
            exchange them.
        input_split_sizes: Rows to send to each rank of the group (summing to dim 0),
            or None for equal splits.
        group: The process group; None means the default (world) group.

    Returns:
        A tensor of ``sum(output_split_sizes)`` rows; ``input`` itself when this
        process is a single rank.

    Raises:
        ValueError: Split sizes of the wrong length, negative, or not summing to dim 0;
            dim 0 not divisible by the group size when ``input_split_sizes`` is None;
            a 0-d input; or this rank is not in ``group``.
        dist_collectives.CollectivesError: The environment describes several ranks
            but no process group is initialized.
    """
    view = resolve_group(group, "all_to_all_v")
    _check_rank_dims(input, "all_to_all_v")
    rows = input.shape[0]
    if input_split_sizes is None:
        if rows % view.size != 0:
            raise ValueError(
                f"all_to_all_v: input_split_sizes is None, so dim 0 of the input (size "
                f"{rows}, shape {tuple(input.shape)}) must be divisible by the group size "
                f"{view.size}; pass input_split_sizes for uneven splits"
            )
        sending = [rows // view.size] * view.size
    else:
        sending = _as_split_sizes(input_split_sizes, "input_split_sizes", view)
        if sum(sending) != rows:
            raise ValueError(
                f"all_to_all_v: input_split_sizes={sending} sum to {sum(sending)} but dim 0 "
                f"of the input has size {rows} (shape {tuple(input.shape)})"
            )
    receiving = (
        None
        if output_split_sizes is None
        else _as_split_sizes(output_split_sizes, "output_split_sizes", view)
    )
    if view.is_single or view.size == 1:
        if receiving is not None and receiving != sending:
            raise ValueError(
                f"all_to_all_v: in a group of one rank output_split_sizes={receiving} must "
                f"equal the input split sizes {sending}"
            )
        return input
    assert view.group is not None
    if receiving is None:
        receiving = _exchange_split_sizes(sending, view.group, input.device)
    return _apply_uneven(input, receiving, sending, view.group)
