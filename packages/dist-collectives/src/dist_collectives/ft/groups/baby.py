"""Groups whose backend runs in a child process ("baby" process groups).

A collective that waits for a dead or hung peer cannot be interrupted inside gloo or
NCCL; it can only be killed with the process that runs it. So the backend lives in a
child, started with ``spawn``, and the parent sends each operation over a pipe. When
the child dies, or an operation outlives the timeout (the child is then killed), every
pending operation fails in the parent, :meth:`ProcessGroupBaby.error` says why until
the next :meth:`~ProcessGroupBaby.configure`, and that call starts a fresh child.

How tensors get to the child:

- :class:`ProcessGroupBabyGloo`: a copy in shared memory. The copy to it is made on
  the caller's thread and current stream (``.to("cpu")`` waits for that stream), the
  copy back into the caller's tensors on the reader thread (a blocking copy); the
  Work's future carries the tensors' CUDA devices, so a caller's stream that waits on
  it is ordered after the copy back.
- :class:`ProcessGroupBabyNCCL`: no copy. The caller's CUDA tensors are shared with
  the child through CUDA IPC (torch.multiprocessing's reductions), and the order of
  the GPU work is kept by two interprocess CUDA events: the parent funnels the
  caller's current stream into one "submit" stream and records an event there that
  the child's stream waits for before the collective; the child records an event
  after it, which the parent's reader stream waits for before the Work's future is
  completed on it. Nothing waits on the CPU for the GPU: ``Work.wait()`` returns once
  the child enqueued the collective, with the caller's stream waiting for it.

  A CUDA tensor shared through IPC is kept alive in the parent until the child
  releases it (torch counts the child's references in shared memory). A child that
  dies never releases what it held, and torch would keep those blocks for the life of
  the parent: so the parent counts, per operation, what the child has not yet
  released, and releases it on the child's behalf once the child is gone.

The pipe carries this process's own messages to its own child (operation names,
shared tensors, IPC handles, error strings); nothing from another host is unpickled.

Why the child is not supervised by :class:`dist_core.supervisor.Supervisor`: that
supervisor owns a *group* of ranks for a launcher. Its ``run()`` blocks the caller
until the group ends, stops every rank when one fails, and writes each rank's output
to its ``RankFiles``. A baby group has one child per configuration, whose end is
learnt on the pipe by the reader thread (EOF), which also fails the pending
operations. The child is killed from there, or by the per-operation timeout. A new
``configure`` replaces the child while the caller goes on. None of the supervisor's
loop, grace period or root-cause choice applies. What both share, killing and
reaping on every exit path, is done here in a few lines (``_retire``).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing  # registers the reductions of CUDA tensors and events
from torch.distributed import Store  # type: ignore[attr-defined]  # public, not re-exported in the stubs
from torch.distributed.distributed_c10d import AllreduceCoalescedOptions
from torch.futures import Future
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from dist_collectives.ft.coordination.store import create_store_client, wait_for_arrivals
from dist_collectives.ft.errors import FTError, timed_out_after_seconds
from dist_collectives.ft.groups.gloo import create_gloo_backend
from dist_collectives.ft.groups.nccl import create_nccl_backend, nccl_unavailable_reason
from dist_collectives.ft.groups.process_group import DEFAULT_TIMEOUT, ProcessGroup, reduce_op_name
from dist_collectives.ft.groups.work import FutureWork, future_for

logger = logging.getLogger(__name__)

_WATCH_INTERVAL = 0.05
_STOP_SECONDS = 2.0
_PARENT_POLL_SECONDS = 0.5
# Starting the child imports torch, which takes seconds on a loaded machine; that is
# not the group's fault, so it does not count against the group's timeout.
CHILD_START_SECONDS = 60.0
CHILD_CONNECT_FLOOR = timedelta(seconds=5)

# Where rebuild_cuda_tensor's arguments name the reference counter of a shared block.
_REBUILD_PARAMETERS = list(inspect.signature(rebuild_cuda_tensor).parameters)
_COUNTER_HANDLE = _REBUILD_PARAMETERS.index("ref_counter_handle")
_COUNTER_OFFSET = _REBUILD_PARAMETERS.index("ref_counter_offset")

# An IPC reference counter the child owes the parent: (handle, offset, device index).
_Slot = tuple[bytes, int, int]


class BabyProcessError(FTError, RuntimeError):
    """The child process that runs the backend died, hung or failed to start."""


class BabyTimeoutError(BabyProcessError, TimeoutError):
    """A :class:`BabyProcessError` whose cause is a timeout (also a ``TimeoutError``).

    An operation outlived the group's timeout (the child was then killed), or the
    child did not join its group in time (a peer never arrived). The message starts
    as torchft's does (``... timed out after 0.01 seconds``), then says what was waited
    for.
    """


class BabyClosedError(BabyProcessError, OSError):
    """An operation on a baby group after :meth:`ProcessGroupBaby.shutdown`.

    Also an ``OSError`` whose message says the handle is closed, as torchft's baby
    groups raise from their closed pipe.
    """


def _exit_with_parent(parent_pid: int) -> None:
    """Ends this child when its parent process is gone.

    Not PR_SET_PDEATHSIG: that fires when the parent *thread* that started the child
    exits, and configure often runs on a short-lived thread (the Manager's quorum).
    """

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_SECONDS)
        os._exit(1)

    threading.Thread(target=watch, name="ft-baby-parent-watch", daemon=True).start()


def _describe(error: Exception) -> tuple[str, bool]:
    """What the child reports of ``error``: its text, and whether it is a timeout.

    gloo reports its own timeouts as a RuntimeError ("Timed out waiting 3000ms for
    recv"), so the text counts too.
    """
    timed_out = isinstance(error, TimeoutError) or "timed out" in str(error).lower()
    return f"{type(error).__name__}: {error}", timed_out


def _run_operation(backend: Any, operation: str, tensors: list[torch.Tensor], argument: Any) -> Any:
    if operation == "allreduce":
        return backend.allreduce(tensors, getattr(dist.ReduceOp, argument))
    if operation == "broadcast":
        options = dist.BroadcastOptions()
        options.rootRank = argument
        return backend.broadcast(tensors, options)
    if operation == "send":
        peer, tag = argument
        return backend.send(tensors, peer, tag)
    if operation == "recv":
        peer, tag = argument
        return backend.recv(tensors, peer, tag)
    if operation == "barrier":
        return backend.barrier()
    if operation == "allreduce_coalesced":
        coalesced = AllreduceCoalescedOptions()
        coalesced.reduceOp = getattr(dist.ReduceOp, argument)
        return backend.allreduce_coalesced(tensors, coalesced)
    if operation == "allgather":
        inputs, layout = argument
        outputs, start = [], inputs
        for length in layout:
            outputs.append(tensors[start : start + length])
            start += length
        # One collective per input: a backend that drives one device per process
        # (gloo, NCCL) reads several inputs as several devices' and refuses them.
        return _AllOf(
            [
                backend.allgather([output_list], [input_])
                for output_list, input_ in zip(outputs, tensors[:inputs], strict=True)
            ]
        )
    raise ValueError(f"unknown operation {operation!r}")


class _AllOf:
    """Several backend Works waited for as one, in the order they were issued."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _serve_cpu(backend: Any, conn: mp_connection.Connection) -> None:
    """The child's loop for shared-memory tensors: one blocking operation at a time."""
    while True:
        try:
            op_id, operation, tensors, argument = conn.recv()
        except EOFError:
            return
        try:
            _run_operation(backend, operation, tensors, argument).wait()
            conn.send(("done", op_id, None))
        except Exception as error:
            conn.send(("error", op_id, _describe(error)))


def _serve_cuda(
    backend: Any,
    conn: mp_connection.Connection,
    stream: torch.cuda.Stream,
    to_child: torch.cuda.Event,
    from_child: torch.cuda.Event,
) -> None:
    """The child's loop for CUDA IPC tensors (see the module doc for the events)."""
    while True:
        try:
            op_id, operation, payload, argument = conn.recv()
        except EOFError:
            return
        tensors: list[torch.Tensor] = []
        work: Any = None
        try:
            tensors = [rebuild(*args) for rebuild, args in payload]
            with torch.cuda.stream(stream):
                to_child.wait(stream)  # the parent's caller stream produced the inputs
                work = _run_operation(backend, operation, tensors, argument)
                work.wait()  # NCCL: this stream waits for the collective, the CPU does not
                from_child.record(stream)
            conn.send(("done", op_id, None))
        except Exception as error:
            conn.send(("error", op_id, _describe(error)))
        finally:
            # Release the parent's memory only once the GPU is done with it: the IPC
            # storage's deleter synchronises the current stream, and this one.
            with torch.cuda.stream(stream):
                stream.synchronize()
                work = None
                tensors.clear()
                payload = None
            conn.send(("released", op_id, None))


def _child_main(
    factory: type[ProcessGroupBaby],
    conn: mp_connection.Connection,
    store_addr: str,
    rank: int,
    world_size: int,
    timeout_seconds: float,
    parent_pid: int,
    cuda: tuple[int, torch.cuda.Event] | None,
) -> None:
    _exit_with_parent(parent_pid)
    timeout = timedelta(seconds=timeout_seconds)
    try:
        if cuda is not None:
            device_index, to_child = cuda
            torch.cuda.set_device(device_index)
            stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            from_child = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
        # Connecting is part of starting (a fresh process on a loaded machine), not of
        # waiting for peers: a floor keeps a millisecond timeout from failing the connect.
        store = create_store_client(store_addr, max(timeout, CHILD_CONNECT_FLOOR))
        wait_for_arrivals(
            store, store_addr, rank, world_size, timeout, f"{factory.__name__}.configure"
        )
        backend = factory._create_backend(store, rank, world_size, timeout)
    except Exception as error:
        conn.send(("failed", _describe(error)))
        return
    if cuda is None:
        conn.send(("ready", None))
        _serve_cpu(backend, conn)
    else:
        conn.send(("ready", from_child))  # pickled as an IPC handle
        _serve_cuda(backend, conn, stream, to_child, from_child)


def _shared_copy(tensor: torch.Tensor) -> torch.Tensor:
    # A blocking copy on the caller's current stream: it waits for the kernels that
    # produced the tensor there.
    copy = tensor.detach().to("cpu").clone()
    copy.share_memory_()  # type: ignore[no-untyped-call]
    return copy


def _release_slots(slots: list[_Slot]) -> None:
    """Releases, on a dead child's behalf, the IPC references it never released."""
    if not slots:
        return
    for handle, offset, device in slots:
        try:
            release = torch.UntypedStorage._release_ipc_counter
            release(handle, offset, device=device)  # type: ignore[no-untyped-call]
        except Exception:
            logger.warning("could not release a CUDA IPC reference of a dead child", exc_info=True)
    with contextlib.suppress(Exception):
        # Frees the blocks whose last reference that was.
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]


class _CudaLink:
    """The parent's side of a CUDA child: its device, streams and the two events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        with torch.cuda.device(device):
            self.submit_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self.reader_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self.to_child = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
        self.from_child: torch.cuda.Event | None = None

    def export(self, tensors: list[torch.Tensor]) -> tuple[list[Any], list[_Slot]]:
        """Orders the child after the caller's stream and shares ``tensors`` (no copy).

        Call it under the group's lock, right before sending: the child waits for
        the latest record of ``to_child``, and the submit stream has waited for every
        caller stream recorded so far, so that record covers this operation's inputs.
        """
        for tensor in tensors:
            if tensor.device != self.device:
                raise ValueError(
                    f"ProcessGroupBabyNCCL was configured on {self.device}; got a tensor on "
                    f"{tensor.device} (every tensor must be on the configured device)"
                )
        self.submit_stream.wait_stream(torch.cuda.current_stream(self.device))
        self.to_child.record(self.submit_stream)
        payload: list[Any] = []
        slots: list[_Slot] = []
        for tensor in tensors:
            rebuild, args = reduce_tensor(tensor.detach())  # type: ignore[no-untyped-call]
            payload.append((rebuild, args))
            handle = args[_COUNTER_HANDLE]
            if handle is not None:
                slots.append((handle, int(args[_COUNTER_OFFSET]), self.device.index or 0))
        return payload, slots

    def complete(self, future: Future[Any], value: Any) -> None:
        """Sets ``future`` on the reader stream, after the child's collective."""
        assert self.from_child is not None
        with torch.cuda.device(self.device), torch.cuda.stream(self.reader_stream):
            self.from_child.wait(self.reader_stream)
            future.set_result(value)  # records the future's event on the reader stream


class _Pending:
    def __init__(
        self,
        operation: str,
        future: Future[Any],
        originals: list[torch.Tensor],
        shared: list[torch.Tensor],
        timeout: timedelta,
        slots: list[_Slot],
    ) -> None:
        self.operation = operation
        self.timeout = timeout  # the group's timeout when the operation was issued
        self.deadline = time.monotonic() + timeout.total_seconds()
        self.future = future
        self.originals = originals
        self.shared = shared
        self.slots = slots


class _Child:
    """One child process and what the parent has outstanding with it."""

    def __init__(
        self,
        process: Any,
        conn: mp_connection.Connection,
        link: _CudaLink | None,
        timeout: timedelta,
    ) -> None:
        self.process = process
        self.conn = conn
        self.link = link
        self.timeout = timeout  # the group's timeout when this child was configured
        self.pending: dict[int, _Pending] = {}
        # op id -> IPC references the child has not released yet (done, not released).
        self.unreleased: dict[int, list[_Slot]] = {}
        self.gone: BabyProcessError | None = None


class ProcessGroupBaby(ProcessGroup):
    """A reconfigurable group whose backend runs in a child process (see the module doc).

    Supports ``allreduce``, ``allreduce_coalesced``, ``allgather``,
    ``allgather_into_tensor_coalesced``, ``broadcast`` (and ``broadcast_one``),
    ``barrier``, ``send`` and ``recv``; every other collective
    raises :class:`~dist_collectives.ft.UnsupportedOperationError` naming it.

    Args:
        timeout: How long the child may take to join the group, and one operation may
            take before the child is killed and the operation fails.
    """

    _uses_cuda_ipc = False

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self._timeout = timeout
        self._lock = threading.Lock()
        self._child_state: _Child | None = None
        self._ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._error: BabyProcessError | None = None
        self._shut_down = False

    @classmethod
    def _create_backend(cls, store: Store, rank: int, world_size: int, timeout: timedelta) -> Any:
        """Builds the torch backend; runs in the child."""
        raise NotImplementedError(f"{cls.__name__} must implement _create_backend")

    def _check_machine(self) -> None:
        """Raises when this machine cannot run the child's backend (before anything changes)."""

    def _configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Kills the current child (failing what is pending) and starts one in the new group.

        The arguments are checked first: a refused call (a reused address, a bad rank)
        leaves the current child and configuration as they were.

        Raises:
            StoreAddressReusedError: this group was configured on ``store_addr`` before.
            BabyProcessError: the child died, or could not join (a
                :class:`BabyTimeoutError` when that was a timeout: the message names the
                ranks that did not arrive).
        """
        self._check_machine()
        self._claim_configuration(store_addr, rank, world_size)
        timeout = self._timeout
        self._stop_child(BabyProcessError("the group was reconfigured"))
        link = None
        if self._uses_cuda_ipc:
            link = _CudaLink(torch.device("cuda", torch.cuda.current_device()))
        context = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        parent_conn, child_conn = context.Pipe()
        child = context.Process(
            target=_child_main,
            args=(
                type(self),
                child_conn,
                store_addr,
                rank,
                world_size,
                timeout.total_seconds(),
                os.getpid(),
                None if link is None else (link.device.index, link.to_child),
            ),
            name=f"ft-baby-{rank}",
            daemon=True,
        )
        child.start()
        child_conn.close()
        who = f"{type(self).__name__}.configure"
        if not parent_conn.poll(timeout.total_seconds() + CHILD_START_SECONDS):
            child.kill()
            child.join()
            raise BabyTimeoutError(
                f"{who} {timed_out_after_seconds(timeout)}: the child did not start and "
                f"join {store_addr} (+{CHILD_START_SECONDS:.0f} s allowed to start)"
            )
        try:
            status, detail = parent_conn.recv()
        except EOFError:
            child.join()
            raise BabyProcessError(
                f"the child exited with code {child.exitcode} while joining {store_addr}"
            ) from None
        if status != "ready":
            child.join()
            message, timed_out = detail
            if timed_out:
                raise BabyTimeoutError(
                    f"{who} {timed_out_after_seconds(timeout)}: the child could not join "
                    f"{store_addr}: {message}"
                )
            raise BabyProcessError(f"{who}: the child could not join {store_addr}: {message}")
        if link is not None:
            link.from_child = detail
        state = _Child(child, parent_conn, link, timeout)
        with self._lock:
            self._child_state = state
            self._error = None
            self._shut_down = False
        self._set_configuration(rank, world_size)
        self._reader = threading.Thread(
            target=self._read_replies, args=(state,), name="ft-baby-reader", daemon=True
        )
        self._reader.start()

    def set_timeout(self, timeout: timedelta) -> None:
        """Sets the timeout of the operations issued from now on, and of the next configure.

        Unlike the in-process groups, whose backend fixes its timeout when it is built,
        this bounds the running child's next operations at once, as torchft's baby
        groups do: an operation that outlives ``timeout`` aborts the group (its child is
        killed and :meth:`errored` says so).

        Raises:
            ValueError: ``timeout`` is not a positive :class:`~datetime.timedelta`.
        """
        super().set_timeout(timeout)
        with self._lock:
            if self._child_state is not None:
                self._child_state.timeout = timeout

    def error(self) -> BabyProcessError | None:
        """Why the child is gone (it died, hung or was stopped), or None.

        Stays set until the next successful :meth:`configure`. With CUDA tensors an
        operation completes once the child has enqueued it, so a child that dies
        afterwards, before the GPU finished, is reported only here: the
        :class:`Manager` checks it before it votes on a step.
        """
        return self._error

    def errored(self) -> BabyProcessError | None:
        """The same as :meth:`error` (torchft's name)."""
        return self._error

    def _stop_child(self, reason: BabyProcessError) -> None:
        with self._lock:
            state, self._child_state = self._child_state, None
            reader, self._reader = self._reader, None
        if state is None:
            return
        self._retire(state, reason, record=False, close=False)
        # The reader ends on the dead child's EOF; its connection is closed only then.
        # Closed under a reader still polling or reading it, the descriptor could be
        # reused by the next child's pipe (configure makes one right after) and the old
        # reader could take that child's bytes.
        if reader is not None and reader is not threading.current_thread():
            reader.join(_STOP_SECONDS)
        with contextlib.suppress(OSError):
            state.conn.close()

    def _retire(
        self, state: _Child, reason: BabyProcessError, *, record: bool = True, close: bool = True
    ) -> None:
        """Ends ``state``'s child (once), fails its pending work, releases what it held.

        Closes its connection too, unless ``close`` is False (the caller closes it once
        the reader has ended).
        """
        with self._lock:
            if state.gone is not None:
                return
            state.gone = reason
            pending, state.pending = state.pending, {}
            slots = [slot for op in pending.values() for slot in op.slots]
            slots += [slot for held in state.unreleased.values() for slot in held]
            state.unreleased = {}
            if record and self._child_state is state and self._error is None:
                self._error = reason
        if state.process.is_alive():
            state.process.kill()
        state.process.join(_STOP_SECONDS)
        if close:
            with contextlib.suppress(OSError):
                state.conn.close()
        for op in pending.values():
            with contextlib.suppress(RuntimeError):  # completed meanwhile
                op.future.set_exception(reason)
        if state.process.exitcode is not None:
            _release_slots(slots)
        elif slots:
            logger.warning(
                "the baby process %s did not exit; %d CUDA IPC references stay held",
                state.process.pid,
                len(slots),
            )

    def _read_replies(self, state: _Child) -> None:
        while True:
            try:
                ready = state.conn.poll(_WATCH_INTERVAL)
            except (OSError, ValueError):
                return  # closed by configure or shutdown
            if not ready:
                now = time.monotonic()
                with self._lock:
                    late = [op for op in state.pending.values() if op.deadline < now]
                if late:
                    first = late[0]
                    logger.warning(
                        "baby process group: %s timed out; killing the child", first.operation
                    )
                    # "aborted": torchft's errored() after such a timeout says so, and its
                    # tests match the word.
                    self._retire(
                        state,
                        BabyTimeoutError(
                            f"{type(self).__name__}.{first.operation} "
                            f"{timed_out_after_seconds(first.timeout)}; the group was aborted "
                            "and its child killed"
                        ),
                    )
                    return
                continue
            try:
                kind, op_id, detail = state.conn.recv()
            # TypeError: configure or shutdown closed the connection under this recv
            # (multiprocessing then reads from a handle of None).
            except (EOFError, OSError, ValueError, TypeError):
                state.process.join(_STOP_SECONDS)
                self._retire(
                    state, BabyProcessError(f"the child exited (code {state.process.exitcode})")
                )
                return
            if kind == "released":
                with self._lock:
                    state.unreleased.pop(op_id, None)
                continue
            with self._lock:
                op = state.pending.pop(op_id, None)
                if op is not None and op.slots:
                    state.unreleased[op_id] = op.slots
            if op is None:
                continue
            if kind == "error":
                message, timed_out = detail
                if timed_out:
                    error: Exception = BabyTimeoutError(
                        f"{type(self).__name__}.{op.operation} "
                        f"{timed_out_after_seconds(state.timeout)} in the child process: "
                        f"{message}"
                    )
                else:
                    error = RuntimeError(f"in the child process: {message}")
                op.future.set_exception(error)
            elif state.link is not None:
                state.link.complete(op.future, op.originals)
            else:
                # A blocking copy on this thread's stream: done when copy_ returns, and
                # the future (created with the tensors' devices) records its event after.
                for original, shared in zip(op.originals, op.shared, strict=True):
                    original.copy_(shared)
                op.future.set_result(op.originals)

    def _submit(self, operation: str, tensors: list[torch.Tensor], argument: Any) -> dist.Work:
        future: Future[Any] = future_for(tensors)
        with self._lock:
            state = self._child_state
            if state is None and self._shut_down:
                raise BabyClosedError(
                    f"{type(self).__name__}.{operation}: the group was shut down and its "
                    "handle is closed; call configure to start a new child"
                )
            if state is None:
                raise RuntimeError(
                    f"{type(self).__name__} is not configured (or was shut down); call "
                    "configure first"
                )
            if state.gone is not None:
                future.set_exception(
                    BabyProcessError(f"the child is gone ({state.gone}); call configure")
                )
                return FutureWork(future, f"{type(self).__name__}.{operation}")
            op_id = next(self._ids)
            shared: list[torch.Tensor] = []
            slots: list[_Slot] = []
            if state.link is not None:
                payload, slots = state.link.export(tensors)
            else:
                shared = [_shared_copy(t) for t in tensors]
                payload = shared
            state.pending[op_id] = _Pending(
                operation, future, tensors, shared, state.timeout, slots
            )
            try:
                state.conn.send((op_id, operation, payload, argument))
            except (OSError, ValueError) as error:
                state.pending.pop(op_id, None)
                future.set_exception(BabyProcessError(f"cannot reach the child: {error}"))
            else:
                slots = []
        _release_slots(slots)  # shared, but never sent
        # The reader fails the operation at its deadline; the wait's bound is a backstop
        # a little later, for a reader that is itself stuck.
        wait_limit = state.timeout + timedelta(seconds=_STOP_SECONDS + 1)
        return FutureWork(future, f"{type(self).__name__}.{operation}", wait_limit)

    def allreduce(self, *args: Any) -> dist.Work:
        """Allreduce, with torch's overloads: ``(tensors, options)`` or ``(tensor, op)``."""
        first = args[0]
        tensors = [first] if isinstance(first, torch.Tensor) else list(first)
        op = args[1] if len(args) > 1 else dist.ReduceOp.SUM
        return self._submit("allreduce", tensors, reduce_op_name(op))

    def allreduce_coalesced(self, *args: Any) -> dist.Work:
        """Allreduce of several tensors: ``(tensors, AllreduceCoalescedOptions)``."""
        tensors = list(args[0])
        op = args[1] if len(args) > 1 else dist.ReduceOp.SUM
        return self._submit("allreduce_coalesced", tensors, reduce_op_name(op))

    def allgather(self, *args: Any) -> dist.Work:
        """Allgather: ``(output_lists, inputs, options)`` or ``(outputs, input)``.

        Output list ``i`` receives every rank's input ``i``, in rank order.
        """
        outputs, inputs = args[0], args[1]
        if isinstance(inputs, torch.Tensor):
            outputs, inputs = [outputs], [inputs]
        layout = [len(output_list) for output_list in outputs]
        flat = [*inputs, *(t for output_list in outputs for t in output_list)]
        return self._submit("allgather", flat, (len(inputs), layout))

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], *options: Any
    ) -> dist.Work:
        """Allgathers each input into its output, in rank order.

        ``outputs[i]`` receives every rank's ``inputs[i]`` (``world_size`` times its
        elements).

        Raises:
            ValueError: the lists differ in length, or an output does not hold
                ``world_size`` times its input's elements.
        """
        if len(outputs) != len(inputs):
            raise ValueError(
                f"{type(self).__name__}.allgather_into_tensor_coalesced: {len(outputs)} "
                f"outputs for {len(inputs)} inputs"
            )
        world = self.size()
        output_lists = []
        for index, (output, input_) in enumerate(zip(outputs, inputs, strict=True)):
            if output.numel() != world * input_.numel() or not output.is_contiguous():
                raise ValueError(
                    f"{type(self).__name__}.allgather_into_tensor_coalesced: output {index} "
                    f"of shape {tuple(output.shape)} must be contiguous and hold "
                    f"world_size={world} times input {index} of shape {tuple(input_.shape)}"
                )
            # Views into the output: what the child writes into them lands in place.
            output_lists.append(list(output.view(world, *input_.shape).unbind(0)))
        return self.allgather(output_lists, list(inputs))

    def broadcast(self, *args: Any) -> dist.Work:
        """Broadcast, with torch's overloads: ``(tensors, options)`` or ``(tensor, root)``."""
        first = args[0]
        tensors = [first] if isinstance(first, torch.Tensor) else list(first)
        root = args[1] if len(args) > 1 else 0
        if isinstance(root, dist.BroadcastOptions):
            root = root.rootRank
        return self._submit("broadcast", tensors, int(root))

    def barrier(self, *args: Any) -> dist.Work:
        """A barrier across the group."""
        return self._submit("barrier", [], None)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """Sends ``tensors`` to rank ``dst`` (the Manager heals replicas with it)."""
        return self._submit("send", list(tensors), (int(dst), int(tag)))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        """Receives into ``tensors`` from rank ``src``."""
        return self._submit("recv", list(tensors), (int(src), int(tag)))

    def shutdown(self) -> None:
        """Stops the child; pending operations fail, later ones raise :class:`BabyClosedError`."""
        self._stop_child(
            BabyClosedError(f"{type(self).__name__} was shut down: its handle is closed")
        )
        with self._lock:
            self._shut_down = True

    def num_active_work(self) -> int:
        """How many operations were submitted to the child and have not completed yet."""
        with self._lock:
            state = self._child_state
            return 0 if state is None else len(state.pending)

    def child_pid(self) -> int | None:
        """The pid of the child process, or None when not configured."""
        state = self._child_state
        return None if state is None else int(state.process.pid)


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """A :class:`ProcessGroupBaby` running gloo in its child (tensors via shared memory)."""

    @classmethod
    def _create_backend(cls, store: Store, rank: int, world_size: int, timeout: timedelta) -> Any:
        return create_gloo_backend(store, rank, world_size, timeout)

    def getBackendName(self) -> str:  # torch's name
        """``"ft-baby-gloo"``."""
        return "ft-baby-gloo"


class ProcessGroupBabyNCCL(ProcessGroupBaby):
    """A :class:`ProcessGroupBaby` running NCCL in its child, on the current CUDA device.

    CUDA tensors go to the child through CUDA IPC, without a copy, and the Work
    synchronises on CUDA streams through interprocess events (see the module doc):
    ``wait()`` makes the caller's current stream wait for the collective. Every tensor
    must be on the device that was current at :meth:`configure`.

    Raises:
        RuntimeError: at :meth:`configure`, when torch has no CUDA or no NCCL or no GPU
            is visible (the message names what is missing).
    """

    _uses_cuda_ipc = True

    def _check_machine(self) -> None:
        reason = nccl_unavailable_reason()
        if reason is not None:
            raise RuntimeError(
                f"ProcessGroupBabyNCCL needs CUDA and a torch built with NCCL: {reason}; "
                "use ProcessGroupBabyGloo on this machine"
            )

    @classmethod
    def _create_backend(cls, store: Store, rank: int, world_size: int, timeout: timedelta) -> Any:
        return create_nccl_backend(store, rank, world_size, timeout)

    def getBackendName(self) -> str:  # torch's name
        """``"ft-baby-nccl"``."""
        return "ft-baby-nccl"
