"""Groups whose backend runs in a child process ("baby" process groups).

A collective that waits for a dead or hung peer cannot be interrupted inside gloo or
NCCL; it can only be killed with the process that runs it. So the backend lives in a
child: the parent shares each tensor with it through shared memory, sends the
operation over a pipe, and copies the result back when the child answers. When the
child dies, or an operation outlives the timeout (the child is then killed), every
pending operation fails in the parent, and the next :meth:`configure` starts a fresh
child.

The pipe carries this process's own messages to its own child (operation names,
shared-memory tensors, error strings); nothing from another host is unpickled.
"""

from __future__ import annotations

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
import torch.multiprocessing
from torch._C._distributed_c10d import Store
from torch.futures import Future

from dist_collectives.ft.gloo import create_gloo_backend
from dist_collectives.ft.process_group import DEFAULT_TIMEOUT, ProcessGroup, reduce_op_name
from dist_collectives.ft.store import create_store_client
from dist_collectives.ft.work import FutureWork

logger = logging.getLogger(__name__)

_WATCH_INTERVAL = 0.05
_STOP_SECONDS = 2.0
_PARENT_POLL_SECONDS = 0.5
# Starting the child imports torch, which takes seconds on a loaded machine; that is
# not the group's fault, so it does not count against the group's timeout.
CHILD_START_SECONDS = 60.0


class BabyProcessError(RuntimeError):
    """The child process that runs the backend died, hung or failed to start."""


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


def _child_main(
    factory: type[ProcessGroupBaby],
    conn: mp_connection.Connection,
    store_addr: str,
    rank: int,
    world_size: int,
    timeout_seconds: float,
    parent_pid: int,
) -> None:
    _exit_with_parent(parent_pid)
    timeout = timedelta(seconds=timeout_seconds)
    try:
        backend = factory._create_backend(
            create_store_client(store_addr, timeout), rank, world_size, timeout
        )
    except Exception as error:
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        op_id, operation, tensors, argument = message
        try:
            if operation == "allreduce":
                work = backend.allreduce(tensors, getattr(dist.ReduceOp, argument))
            elif operation == "broadcast":
                options = dist.BroadcastOptions()
                options.rootRank = argument
                work = backend.broadcast(tensors, options)
            elif operation == "send":
                peer, tag = argument
                work = backend.send(tensors, peer, tag)
            elif operation == "recv":
                peer, tag = argument
                work = backend.recv(tensors, peer, tag)
            elif operation == "barrier":
                work = backend.barrier()
            else:
                raise ValueError(f"unknown operation {operation!r}")
            work.wait()
            conn.send((op_id, None))
        except Exception as error:
            conn.send((op_id, f"{type(error).__name__}: {error}"))


def _shared_copy(tensor: torch.Tensor) -> torch.Tensor:
    copy = tensor.detach().to("cpu").clone()
    copy.share_memory_()  # type: ignore[no-untyped-call]
    return copy


class _Pending:
    def __init__(
        self,
        future: Future[Any],
        originals: list[torch.Tensor],
        shared: list[torch.Tensor],
        deadline: float,
    ) -> None:
        self.future = future
        self.originals = originals
        self.shared = shared
        self.deadline = deadline


class ProcessGroupBaby(ProcessGroup):
    """A reconfigurable group whose backend runs in a child process (see the module doc).

    Supports ``allreduce``, ``broadcast``, ``barrier``, ``send`` and ``recv`` on CPU
    tensors.

    Args:
        timeout: How long the child may take to join the group, and one operation may
            take before the child is killed and the operation fails.
    """

    def __init__(self, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
        super().__init__()
        self._timeout = timeout
        self._lock = threading.Lock()
        self._child: Any = None
        self._conn: mp_connection.Connection | None = None
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count()
        self._reader: threading.Thread | None = None

    @classmethod
    def _create_backend(cls, store: Store, rank: int, world_size: int, timeout: timedelta) -> Any:
        """Builds the torch backend; runs in the child."""
        raise NotImplementedError(f"{cls.__name__} must implement _create_backend")

    def configure(self, store_addr: str, rank: int, world_size: int) -> None:
        """Kills the current child (failing what is pending) and starts one in the new group.

        Raises:
            BabyProcessError: the child died or could not join within the timeout.
        """
        self._claim_configuration(store_addr, rank, world_size)
        self._stop_child(BabyProcessError("the group was reconfigured"))
        context = mp.get_context("spawn")
        parent_conn, child_conn = context.Pipe()
        child = context.Process(
            target=_child_main,
            args=(
                type(self),
                child_conn,
                store_addr,
                rank,
                world_size,
                self._timeout.total_seconds(),
                os.getpid(),
            ),
            name=f"ft-baby-{rank}",
            daemon=True,
        )
        child.start()
        child_conn.close()
        if not parent_conn.poll(self._timeout.total_seconds() + CHILD_START_SECONDS):
            child.kill()
            child.join()
            raise BabyProcessError(
                f"the child did not start and join {store_addr} within {self._timeout} "
                f"(+{CHILD_START_SECONDS:.0f} s to start)"
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
            raise BabyProcessError(f"the child could not join {store_addr}: {detail}")
        with self._lock:
            self._child, self._conn = child, parent_conn
        self._reader = threading.Thread(
            target=self._read_replies, args=(child, parent_conn), name="ft-baby-reader", daemon=True
        )
        self._reader.start()

    def _stop_child(self, reason: Exception) -> None:
        with self._lock:
            child, conn, self._child, self._conn = self._child, self._conn, None, None
        if child is None:
            return
        if child.is_alive():
            child.kill()
        child.join(_STOP_SECONDS)
        assert conn is not None
        conn.close()
        self._fail_all(reason)

    def _fail_all(self, reason: Exception) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for op in pending.values():
            op.future.set_exception(reason)

    def _read_replies(self, child: Any, conn: mp_connection.Connection) -> None:
        while True:
            try:
                ready = conn.poll(_WATCH_INTERVAL)
            except (OSError, ValueError):
                return  # closed by configure or shutdown
            if not ready:
                now = time.monotonic()
                with self._lock:
                    late = [i for i, op in self._pending.items() if op.deadline < now]
                if late and self._child is child:
                    logger.warning("baby process group: operation timed out; killing the child")
                    child.kill()
                    self._fail_all(
                        BabyProcessError(
                            f"an operation took longer than {self._timeout}; the child was killed"
                        )
                    )
                continue
            try:
                op_id, error = conn.recv()
            except (EOFError, OSError):
                child.join(_STOP_SECONDS)
                if self._child is child:
                    self._fail_all(BabyProcessError(f"the child exited (code {child.exitcode})"))
                return
            with self._lock:
                op = self._pending.pop(op_id, None)
            if op is None:
                continue
            if error is not None:
                op.future.set_exception(RuntimeError(f"in the child process: {error}"))
                continue
            for original, shared in zip(op.originals, op.shared, strict=True):
                original.copy_(shared)
            op.future.set_result(op.originals)

    def _submit(self, operation: str, tensors: list[torch.Tensor], argument: Any) -> dist.Work:
        future: Future[Any] = Future()
        with self._lock:
            conn = self._conn
            if conn is None:
                raise RuntimeError(
                    f"{type(self).__name__} is not configured (or was shut down); call "
                    "configure first"
                )
            op_id = next(self._ids)
            shared = [_shared_copy(t) for t in tensors]
            deadline = time.monotonic() + self._timeout.total_seconds()
            self._pending[op_id] = _Pending(future, tensors, shared, deadline)
            try:
                conn.send((op_id, operation, shared, argument))
            except (OSError, ValueError) as error:
                self._pending.pop(op_id, None)
                future.set_exception(BabyProcessError(f"cannot reach the child: {error}"))
        return FutureWork(future)

    def allreduce(self, *args: Any) -> dist.Work:
        """Allreduce, with torch's overloads: ``(tensors, options)`` or ``(tensor, op)``."""
        first = args[0]
        tensors = [first] if isinstance(first, torch.Tensor) else list(first)
        op = args[1] if len(args) > 1 else dist.ReduceOp.SUM
        return self._submit("allreduce", tensors, reduce_op_name(op))

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
        """Stops the child; pending operations fail."""
        self._stop_child(BabyProcessError("the group was shut down"))

    def child_pid(self) -> int | None:
        """The pid of the child process, or None when not configured."""
        child = self._child
        return None if child is None else int(child.pid)


class ProcessGroupBabyGloo(ProcessGroupBaby):
    """A :class:`ProcessGroupBaby` running gloo in its child."""

    @classmethod
    def _create_backend(cls, store: Store, rank: int, world_size: int, timeout: timedelta) -> Any:
        return create_gloo_backend(store, rank, world_size, timeout)

    def getBackendName(self) -> str:  # torch's name
        """``"ft-baby-gloo"``."""
        return "ft-baby-gloo"
