"""One attempt at a step: the group it exchanges on and every operation issued in it.

A :class:`Generation` is what a Manager's step (one ``start_quorum`` to its
``should_commit``) owns. Every allreduce of the step goes through it, and it hands the
group only buffers of its own, never the caller's tensor: the caller's tensor is
written once, by the copy of the result, and only after the exchange succeeded while
the generation was still open.

That is what makes a failed step safe. A group whose peer died keeps its exchange
running until its own timeout, long after the step failed (gloo: up to its timeout,
seconds), and may complete it then; FSDP2 and DDP keep their gradient tensors between
steps, so a late write into one would land in a later, committed step, and replicas
would differ without anyone being told. :meth:`Generation.fail` marks every operation
still in flight as abandoned, waits for a copy already under way (a memcpy), and only
then completes the caller's futures with their tensors as they were. After it returns,
nothing of this generation writes into a tensor the caller sees: a late exchange only
fills a buffer that is then dropped (never given back to the pool).

One buffer per operation is the only copy a step makes: several tensors (the
buckets of a DDP backward, in one order every replica shares) are gathered straight
into one buffer and the result is scattered straight back into each of them, so no
concatenation of the caller's tensors is ever kept besides it.

Threads: the training thread issues operations; a group's callback threads finish
them; any thread may fail the generation. One condition guards the status, the
operations' states and the count of copies under way; no I/O happens under it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.futures import Future

from dist_collectives.ft.groups.work import WorkFuture, future_for
from dist_collectives.ft.replica.manager_futures import BufferPool

logger = logging.getLogger(__name__)

GenerationStatus = Literal["open", "failed"]
OperationState = Literal["pending", "copying", "done", "abandoned"]


# What an allreduce takes and its future holds: one tensor, or a list of tensors of one
# dtype and device that are exchanged together in one buffer.
Operand = torch.Tensor | list[torch.Tensor]


@dataclasses.dataclass(eq=False)
class OwnedAllreduce:
    """One allreduce of a generation: the caller's tensors, the buffer the group got.

    ``pieces`` pairs each caller tensor with the view of ``buffer`` that holds it.
    """

    caller: Operand
    buffer: torch.Tensor
    pieces: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    result: WorkFuture
    divide_after: int  # integers are floor-divided after the sum; 1 for the others
    state: OperationState = "pending"
    copied: Any = None  # a CUDA event recorded after the copy into ``caller``


class Generation:
    """The operations of one step, exchanged through buffers the generation owns.

    Args:
        number: The step's generation (``StepState.generation``).
        pg: The group the step's allreduces go to.
        buffers: Where buffers come from and go back to after a success.
        on_error: Called with an operation's error (from the thread that saw it);
            the Manager then fails the step, and with it this generation.
        swallowed_error: The error an error-swallowing group recorded instead of
            raising, checked when an exchange completes.
        copy_wait: How long :meth:`fail` waits at most for a copy under way.
    """

    def __init__(
        self,
        number: int,
        pg: dist.ProcessGroup,
        buffers: BufferPool,
        *,
        on_error: Callable[[Exception], None],
        swallowed_error: Callable[[], Exception | None],
        copy_wait: float,
    ) -> None:
        self.number = number
        self._pg = pg
        self._buffers = buffers
        self._on_error = on_error
        self._swallowed_error = swallowed_error
        self._copy_wait = copy_wait
        self._sum = dist.AllreduceOptions()
        self._sum.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        # Guarded by _changed: the status, each operation's state, the copies under way.
        self._changed = threading.Condition(threading.Lock())
        self._status: GenerationStatus = "open"
        self._ops: list[OwnedAllreduce] = []
        self._copying = 0

    @property
    def status(self) -> GenerationStatus:
        """``open`` until :meth:`fail`, then ``failed``."""
        with self._changed:
            return self._status

    def futures(self) -> tuple[WorkFuture, ...]:
        """The futures of the operations issued so far, in order."""
        with self._changed:
            return tuple(op.result for op in self._ops)

    def unfinished(self) -> bool:
        """Whether an operation still waits for its exchange."""
        with self._changed:
            return any(op.state in ("pending", "copying") for op in self._ops)

    def allreduce(self, tensor: Operand, *, participants: int, behind: bool) -> WorkFuture:
        """Sums ``tensor`` over the group into a buffer, then writes ``sum / participants``.

        Floating-point values are divided on the way into the buffer (one pass, and the
        sum is the average); integers are floor-divided on the way back. A replica that
        is ``behind`` sends zeros: its gradients come from stale weights. A list of
        tensors (one dtype, one device) is gathered into one flat buffer, in its order,
        and exchanged at once; the result goes back into each of them.

        Returns:
            A future of ``tensor`` that never raises: the average once the exchange
            succeeded, or ``tensor`` unchanged when the generation failed first.

        Raises:
            ValueError: A list of tensors that is empty or mixes dtypes or devices.
        """
        result = future_for(tensor, WorkFuture)
        callers = [tensor] if isinstance(tensor, torch.Tensor) else list(tensor)
        first = _check_same_kind(callers)
        floating = first.is_floating_point() or first.is_complex()
        if isinstance(tensor, torch.Tensor):
            buffer = self._buffers.take(tensor.shape, tensor.dtype, tensor.device)
            pieces: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ((tensor, buffer),)
        else:
            total = sum(caller.numel() for caller in callers)
            buffer = self._buffers.take(torch.Size([total]), first.dtype, first.device)
            pieces = tuple(_views(callers, buffer))
        for caller, view in pieces:
            if behind:
                view.zero_()
            elif floating and participants != 1:
                torch.div(caller.detach(), participants, out=view)
            else:
                view.copy_(caller.detach())
        op = OwnedAllreduce(tensor, buffer, pieces, result, 1 if floating else participants)
        with self._changed:
            if self._status != "open":
                op.state = "abandoned"
            else:
                self._ops.append(op)
        if op.state == "abandoned":
            result.set_result(tensor)
            return result
        try:
            work = self._pg.allreduce([buffer], self._sum)
        except Exception as error:
            self._on_error(error)
            return result
        work.get_future().then(lambda future: self._finish(op, future))
        return result

    def _finish(self, op: OwnedAllreduce, future: Future[Any]) -> None:
        """The group's callback: copies the result into the caller's tensor if still open."""
        try:
            future.value()
            swallowed = self._swallowed_error()
            if swallowed is not None:
                raise swallowed
        except Exception as error:
            self._on_error(error)
            return
        with self._changed:
            if self._status != "open" or op.state != "pending":
                return  # failed meanwhile: the buffer is dropped, the caller's tensor kept
            op.state = "copying"
            self._copying += 1
        failure: Exception | None = None
        try:
            for caller, view in op.pieces:
                if op.divide_after != 1:
                    torch.floor_divide(view, op.divide_after, out=caller)
                else:
                    caller.copy_(view)
            if op.buffer.is_cuda:
                op.copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
                op.copied.record()
        except Exception as error:
            failure = error
        finally:
            with self._changed:
                op.state = "done"
                self._copying -= 1
                self._changed.notify_all()
        if failure is not None:
            self._on_error(failure)
            return
        self._buffers.give_back(op.buffer)
        with contextlib.suppress(RuntimeError):  # completed by a failure meanwhile
            op.result.set_result(op.caller)

    def fail(self) -> bool:
        """Ends the generation: no operation of it writes into a caller's tensor afterwards.

        Abandons the operations in flight, waits for the copies under way, and then
        completes every abandoned operation's future with its caller's tensor as it
        was. The first call does it; later ones return at once.

        Returns:
            Whether this call failed the generation.
        """
        with self._changed:
            if self._status != "open":
                return False
            self._status = "failed"
            abandoned = [op for op in self._ops if op.state == "pending"]
            for op in abandoned:
                op.state = "abandoned"
            if not self._changed.wait_for(lambda: self._copying == 0, self._copy_wait):
                logger.warning(
                    "a copy into a caller's tensor took over %.1f s; failing the step anyway",
                    self._copy_wait,
                )
            copied = [op.copied for op in self._ops if op.copied is not None]
        for event in copied:
            event.synchronize()
        for op in abandoned:
            with contextlib.suppress(RuntimeError):  # completed by its exchange meanwhile
                op.result.set_result(op.caller)
        return True


def _check_same_kind(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The first of ``tensors``, once every one has its dtype and device."""
    if not tensors:
        raise ValueError("allreduce: the list of tensors is empty")
    first = tensors[0]
    for index, other in enumerate(tensors):
        if other.dtype != first.dtype or other.device != first.device:
            raise ValueError(
                f"allreduce: tensor {index} of the list is {other.dtype} on {other.device}, "
                f"tensor 0 is {first.dtype} on {first.device}; one list is one buffer, of "
                "one dtype on one device"
            )
    return first


def _views(
    tensors: Sequence[torch.Tensor], buffer: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each of ``tensors`` with its place in the flat ``buffer``, one after the other."""
    pieces, offset = [], 0
    for tensor in tensors:
        size = tensor.numel()
        pieces.append((tensor, buffer[offset : offset + size].view(tensor.shape)))
        offset += size
    return pieces
