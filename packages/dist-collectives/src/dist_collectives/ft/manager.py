"""The Manager: a quorum of live replicas per step, healing, and a commit decision.

One Manager runs in each replica (a process that holds a full copy of the model), or
in each rank of a replica group (``group_rank``, ``group_world_size``: the group holds
the model sharded across its ranks; rank ``i`` of each group averages and heals with
rank ``i`` of the others, and the group joins and leaves the quorum as a whole). Per
step the training loop calls::

    manager.start_quorum()               # returns at once; the quorum forms meanwhile
    loss = model(batch); loss.backward()
    for p in model.parameters():
        manager.allreduce(p.grad)        # averaged over participants; returns a future
    if manager.should_commit():          # False everywhere if the step failed anywhere
        optimizer.step()

Replicas agree through the job's TCPStore (``MASTER_ADDR:MASTER_PORT`` by default), see
:mod:`dist_collectives.ft.quorum`. A replica that sees an error writes it to the store
under the current quorum id; every other replica polls that key while a step is in
flight, so all of them stop waiting within the poll interval, not the group's timeout.

Each replica logs one line per event of a failure, on the logger of this module (here
wrapped; the failure's cause is cut to its first line)::

    replica replica0: step 15 failed: RuntimeError: Read error [127.0.0.1]:5014:
        Connection reset by peer. ...
    replica replica0: step 15 discarded on every replica
    replica replica0: quorum 1 with 3 replicas, rank 0, step 15, without replica3;
        configured in 4.1 ms
    replica replica0: recovered in 2.08 s: replica3 failed, step 15 discarded, step 15
        committed by quorum 1 with 3 replicas
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store  # type: ignore[attr-defined]  # public, not re-exported in the stubs
from torch.futures import Future

from dist_collectives.ft.errors import ManagerConfigError, ReplicaError
from dist_collectives.ft.manager_decisions import (
    COMMIT_FAIL,
    COMMIT_SAME,
    Failure,
    broken_group_message,
    commit_key,
    commit_proposal,
    error_key,
    failure_cause,
    group_address,
    heal_plan,
    lost_member_error,
    lost_members,
    lost_since,
    membership_change,
    overdue_error,
    read_commit,
    votes_key,
    watched_group_ranks,
)
from dist_collectives.ft.manager_futures import BufferPool, PendingAllreduce, WrappedFutures
from dist_collectives.ft.manager_state import StepState
from dist_collectives.ft.process_group import ProcessGroup, reduce_op_name
from dist_collectives.ft.quorum import (
    REGISTRY_VERSION_KEY,
    Liveness,
    Quorum,
    compute_quorum,
)
from dist_collectives.ft.state_transfer import recv_state, send_state
from dist_collectives.ft.store import connect_tcp_store
from dist_collectives.ft.work import WorkFuture, future_for

__all__ = ["Manager", "ManagerConfigError", "ReplicaError"]

logger = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "dist_collectives_ft"
_HEARTBEAT_CHECK_TICKS = 2
# The wait for a commit decision ends through the watcher, which fails the step at the
# deadline; the wait's own timeout, this much later, only catches a store that is gone.
_VOTE_WAIT_GRACE_SECONDS = 5.0


_T = TypeVar("_T")


def _default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _resolve_store(store_addr: str | None, store_port: int | None) -> tuple[str, int]:
    host = store_addr or os.environ.get("MASTER_ADDR")
    port_text = str(store_port) if store_port is not None else os.environ.get("MASTER_PORT")
    if not host or not port_text:
        raise ManagerConfigError(
            "Manager needs the job's store: pass store_addr and store_port, or set "
            f"MASTER_ADDR and MASTER_PORT (found MASTER_ADDR={os.environ.get('MASTER_ADDR')!r}, "
            f"MASTER_PORT={os.environ.get('MASTER_PORT')!r})"
        )
    try:
        port = int(port_text)
    except ValueError:
        raise ManagerConfigError(f"MASTER_PORT={port_text!r} is not an integer") from None
    return host, port


class Manager:
    """Forms a quorum of live replicas each step, heals joiners, decides commits.

    Reads ``MASTER_ADDR`` and ``MASTER_PORT`` when ``store_addr``/``store_port`` are
    None. A TCPStore server must already run there (torchrun and dist-launch host one);
    the Manager only connects to it.

    Args:
        pg: The reconfigurable group the replicas average gradients over; the Manager
            configures it whenever the quorum changes.
        load_state_dict: Called with a healthy peer's state when this replica heals.
        state_dict: Returns this replica's state, sent to replicas that heal.
        min_replica_size: A quorum needs at least this many replicas.
        replica_id: This replica's name, stable across restarts if given (default: host,
            pid and a random suffix).
        store_addr: Host of the job's store.
        store_port: Port of the job's store.
        timeout: How long a quorum, a collective or a commit may take.
        heartbeat_interval: How often this replica beats its heartbeat and polls for
            errors of other replicas (100 ms, torchft's default; every second beat
            also reads the others' heartbeats and the registry of newcomers).
        heartbeat_timeout: A replica whose heartbeat did not move for this long counts
            as dead.
        join_timeout: Form a quorum without a replica that looks alive but did not ask
            to join within this time (torchft's ``join_timeout``; 10 s).
        first_quorum_window: The job's first quorum forms only once no replica has
            announced itself (built its Manager) for this long, at most ``join_timeout``
            after this replica asked for it (2 s): replicas started together then begin
            together, instead of the late ones healing a step later. Later quorums do
            not wait for it.
        namespace: Key prefix in the store, to keep several managed groups apart.
        group_rank: This process's rank in its replica group (torchft's name; 0).
        group_world_size: The number of ranks in each replica group (1: a replica is
            one process). The ranks of one group pass the same ``replica_id``; group
            rank 0 joins the quorum for the whole group and the others read its
            decision; rank ``i`` of every group averages with rank ``i`` of the others
            and heals from rank ``i`` of a healthy group. Every group has the same size.
            A group whose rank stops beating is left out as a whole and must restart as
            a whole (see the fault-tolerance guide, "Replica groups").
        init_sync: Before the job's first step, every replica but one heals from that
            one (torchft's ``init_sync``, also on by default), so that replicas whose
            initial weights differ (an unseeded or device-dependent init) do not train
            on apart with every step committed. ``False`` saves that one state transfer
            where every replica initialises identically (seeded, same device kind).
            Every replica of a job passes the same value.
    """

    def __init__(
        self,
        pg: ProcessGroup,
        *,
        load_state_dict: Callable[[Any], None],
        state_dict: Callable[[], Any],
        min_replica_size: int = 1,
        replica_id: str | None = None,
        store_addr: str | None = None,
        store_port: int | None = None,
        timeout: timedelta = timedelta(seconds=60),
        heartbeat_interval: timedelta = timedelta(milliseconds=100),
        heartbeat_timeout: timedelta = timedelta(seconds=2),
        join_timeout: timedelta = timedelta(seconds=10),
        namespace: str = DEFAULT_NAMESPACE,
        first_quorum_window: timedelta = timedelta(seconds=2),
        group_rank: int = 0,
        group_world_size: int = 1,
        init_sync: bool = True,
    ) -> None:
        if min_replica_size < 1:
            raise ManagerConfigError(f"min_replica_size={min_replica_size} must be at least 1")
        if group_world_size < 1 or not 0 <= group_rank < group_world_size:
            raise ManagerConfigError(
                f"group_rank={group_rank} with group_world_size={group_world_size}: the "
                f"group size must be at least 1 and the rank in [0, {group_world_size})"
            )
        if group_world_size > 1 and replica_id is None:
            raise ManagerConfigError(
                f"group_world_size={group_world_size} needs a replica_id shared by the ranks "
                "of the replica group (each rank would otherwise name a group of its own)"
            )
        self._group_rank = group_rank
        self._group_world_size = group_world_size
        self._pg = pg
        self._load_state_dict = load_state_dict
        self._state_dict = state_dict
        self._min_replica_size = min_replica_size
        self._replica_id = replica_id or _default_replica_id()
        # How the log names this process: the replica, and its rank when in a group.
        self._label = (
            self._replica_id if group_world_size == 1 else f"{self._replica_id} rank {group_rank}"
        )
        self._timeout = timeout
        self._heartbeat_interval = heartbeat_interval
        self._join_timeout = join_timeout
        self._first_quorum_window = first_quorum_window
        self._init_sync = init_sync
        self._namespace = namespace
        self._host, self._port = _resolve_store(store_addr, store_port)

        # Separate connections: a shared TCPStore client serialises its callers, and
        # the quorum thread and the commit vote block in waits that must not delay the
        # error watcher, nor the ticker that closes a round (its liveness' connection).
        self._store = self._connect()
        self._quorum_store = self._connect()
        self._monitor_store = self._connect()
        self._quorum_liveness = Liveness(self._connect(), heartbeat_timeout)
        self._monitor_liveness = Liveness(self._monitor_store, heartbeat_timeout)

        # Shared between threads, behind one lock.
        self._state = StepState()
        self._buffers = BufferPool()
        self._wrapped = WrappedFutures()
        # Owned by the training thread: whether the last commit lets the next step reuse
        # its quorum, the future of this step's quorum, whether shutdown() ran, and how
        # many quorums this rank asked for (the key its group rank 0 publishes each
        # decision under).
        self._reuse_quorum = False
        self._quorum_future: concurrent.futures.Future[Quorum] | None = None
        self._closed = False
        self._quorum_requests = 0
        # Set here, read-only afterwards.
        # Looked up once: the lookup missed on most groups, and a miss costs an exception.
        error_of = getattr(pg, "error", None)
        self._error_of: Callable[[], object] | None = error_of if callable(error_of) else None
        self._sum_options = dist.AllreduceOptions()
        self._sum_options.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
        self._incarnation = 0
        if group_world_size > 1:
            self._join_group()

        if group_world_size > 1:
            self._monitor_liveness.beat_rank(self._group_name(), group_rank)
        if group_rank == 0:
            self._monitor_liveness.announce(self._replica_id)
        self._stop = threading.Event()
        self._monitor = threading.Thread(
            target=self._monitor_loop, name=f"ft-monitor-{self._replica_id}", daemon=True
        )
        self._monitor.start()

    def _join_group(self) -> None:
        """Checks the group size against the job's and counts this rank's incarnation.

        Every rank of a group counts its own starts; a group restarts as a whole, so its
        ranks agree on the count and use it to keep apart the decisions group rank 0
        publishes in each incarnation.
        """
        size = self._store.compare_set("group_world_size", "", str(self._group_world_size)).decode()
        if size != str(self._group_world_size):
            raise ManagerConfigError(
                f"replica {self._replica_id}: group_world_size={self._group_world_size}, "
                f"but the job's replica groups have {size} ranks; every group must have the "
                "same size (rank i of each group averages with rank i of the others)"
            )
        self._incarnation = int(
            self._store.add(f"incarnation/{self._replica_id}/{self._group_rank}", 1)
        )

    def _group_name(self) -> str:
        """This group in this incarnation: its ranks' heartbeats and decisions go under it."""
        return f"{self._replica_id}/{self._incarnation}"

    def _group_key(self, request: int) -> str:
        return f"group/{self._group_name()}/{request}"

    def _connect(self) -> Store:
        client = connect_tcp_store(self._host, self._port, self._timeout, shared=False)
        return PrefixStore(self._namespace, client)

    # -- queries ------------------------------------------------------------------------

    @property
    def replica_id(self) -> str:
        """This replica's name in the quorum (shared by the ranks of a replica group)."""
        return self._replica_id

    @property
    def group_rank(self) -> int:
        """This process's rank in its replica group."""
        return self._group_rank

    @property
    def group_world_size(self) -> int:
        """The number of ranks in each replica group."""
        return self._group_world_size

    def current_step(self) -> int:
        """The number of steps committed so far (a healed replica takes its source's)."""
        return self._state.step

    def errored(self) -> Exception | None:
        """The error of the current step, if any replica reported one."""
        return self._state.error

    @property
    def _quorum(self) -> Quorum | None:
        # This step's quorum once decided; read by the fault tests' workers.
        return self._state.quorum

    @property
    def _error_wall_time(self) -> float | None:
        # When this step's error was recorded; read by the fault tests' workers.
        return self._state.error_wall_time

    def _current_quorum(self) -> Quorum:
        quorum = self._wait_for_quorum()
        if quorum is None:
            raise ReplicaError(f"replica {self._replica_id}: no quorum: {self._state.error}")
        return quorum

    def num_participants(self) -> int:
        """Replicas whose gradients count in this step (healing replicas do not)."""
        return len(self._current_quorum().participants)

    def quorum_id(self) -> int:
        """The id of this step's quorum; it changes whenever the group is reconfigured."""
        return self._current_quorum().quorum_id

    def replica_rank(self) -> int:
        """This replica's rank in this step's quorum."""
        return self._current_quorum().replica_rank(self._replica_id)

    def replica_count(self) -> int:
        """Members of this step's quorum, healing ones included."""
        return len(self._current_quorum().members)

    def is_healing(self) -> bool:
        """Whether this replica is behind and heals in this step (its gradients count nothing)."""
        quorum = self._current_quorum()
        return quorum.is_behind(self._replica_id)

    # -- the step -----------------------------------------------------------------------

    def start_quorum(self) -> None:
        """Starts forming this step's quorum in the background and forgets the last error.

        The quorum, a reconfiguration of the group and healing all happen on a
        background thread; :meth:`allreduce` and :meth:`should_commit` wait for it.
        """
        if self._closed:
            raise RuntimeError(f"replica {self._replica_id}: the Manager was shut down")
        reuse, self._reuse_quorum = self._reuse_quorum, False
        generation, reused = self._state.begin_step(reuse=reuse)
        future: concurrent.futures.Future[Quorum] = concurrent.futures.Future()
        self._quorum_future = future
        if reused is not None:  # no store round trip at all
            future.set_result(reused)
            return

        self._quorum_requests += 1
        request = self._quorum_requests
        step = self._state.step

        def run() -> None:
            try:
                future.set_result(self._form_quorum(generation, request, step))
            except BaseException as error:
                future.set_exception(error)

        threading.Thread(target=run, name=f"ft-quorum-{generation}", daemon=True).start()
        if self._init_sync and step == 0:
            self._load_first_state()

    def _load_first_state(self) -> None:
        """Before this replica's first step: waits for the quorum, loads the state it sent.

        Runs in :meth:`start_quorum`, before the step's forward pass, so a replica that
        copies the first member's state (:attr:`Quorum.syncs_first_state`) computes
        its first gradients from the same weights as the others and takes part in the
        step (torchft zeroes those replicas' first gradients instead). A replica that
        joins a job already past step 0 heals as usual.
        """
        quorum = self._wait_for_quorum()
        if quorum is None or not quorum.syncs_first_state:
            return
        healed = self._state.take_healed()
        if healed is None:
            return
        state, _ = healed
        try:
            self._load_state_dict(state)
        except Exception as error:
            self.report_error(error)

    def _group_quorum(self, request: int, step: int) -> Quorum:
        """This group's decision: computed by group rank 0, read by the other ranks."""
        if self._group_world_size == 1:
            return self._compute_quorum(step)
        key = self._group_key(request)
        arrived = f"{key}/arrived"
        if self._group_rank > 0:
            # Rank 0 asks for the group only once every rank has asked for this step.
            if self._quorum_store.add(f"{key}/count", 1) == self._group_world_size - 1:
                self._quorum_store.set(arrived, "all")
            # The watcher ends the wait if rank 0 stops beating.
            broken = self._state.wait_for_group(awaited_key=key)
            if broken is not None:
                raise ReplicaError(broken)
            self._quorum_store.wait([key], self._timeout)
            raw = bytes(self._quorum_store.get(key))
            if raw.startswith(b"fail:"):
                raise ReplicaError(
                    f"replica {self._replica_id}: no quorum for the group: "
                    f"{raw[5:].decode(errors='replace')}"
                )
            return Quorum.from_json(raw)
        try:
            if self._state.wait_for_group(arrival_key=arrived) is None:
                # Ended by the last rank to arrive, or by the watcher when a rank stopped
                # beating (it writes "broken"): a group whose rank died mid-step never
                # joins the next round with the ranks it has left.
                self._quorum_store.wait([arrived], self._timeout)
            broken = self._state.group_broken
            if broken is not None:
                raise ReplicaError(broken)
            quorum = self._compute_quorum(step)
        except Exception as error:
            self._quorum_store.set(key, f"fail:{type(error).__name__}: {error}"[:1000])
            raise
        self._quorum_store.set(key, quorum.to_json())
        return quorum

    def _compute_quorum(self, step: int) -> Quorum:
        return compute_quorum(
            self._quorum_store,
            self._replica_id,
            step,
            liveness=self._quorum_liveness,
            min_replicas=self._min_replica_size,
            join_timeout=self._join_timeout,
            timeout=self._timeout,
            previous=self._state.last_quorum,
            first_quorum_window=self._first_quorum_window,
            init_sync=self._init_sync,
        )

    def _form_quorum(self, generation: int, request: int, step: int) -> Quorum:
        quorum = self._group_quorum(request, step)
        if not self._state.adopt_quorum(quorum, generation):
            return quorum  # a newer start_quorum took over; leave the group alone
        rank = quorum.replica_rank(self._replica_id)
        configured_id, configured_members = self._state.configured
        if quorum.quorum_id != configured_id:
            address = group_address(
                f"{self._host}:{self._port}/{self._namespace}",
                quorum.quorum_id,
                group_rank=self._group_rank,
                group_world_size=self._group_world_size,
            )
            started = time.perf_counter()
            self._pg.configure(address, rank, len(quorum.members))
            self._state.configured_for(quorum)
            logger.info(
                "replica %s: quorum %d with %d replicas, rank %d, step %d%s; configured in %.1f ms",
                self._label,
                quorum.quorum_id,
                len(quorum.members),
                rank,
                quorum.max_step,
                membership_change(configured_members, quorum.members),
                1000 * (time.perf_counter() - started),
            )
        plan = heal_plan(quorum, self._replica_id)
        if plan.receive_from is not None:
            self._state.received(*recv_state(self._pg, plan.receive_from), generation)
        elif plan.send_to:
            state = self._state_dict()
            for healer in plan.send_to:
                send_state(self._pg, state, step, healer)
        return quorum

    def _wait_for_quorum(self) -> Quorum | None:
        future = self._quorum_future
        if future is None:
            raise RuntimeError("call start_quorum() before allreduce() or should_commit()")
        if future.done() and future.exception() is None:
            return future.result()
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            done, _ = concurrent.futures.wait([future], timeout=0.01)
            if done:
                break
            if self._state.error is not None:
                return None
            if time.monotonic() > deadline:
                self.report_error(TimeoutError(f"no quorum within {self._timeout}"))
                return None
        error = future.exception()
        if error is not None:
            self.report_error(error if isinstance(error, Exception) else RuntimeError(error))
            return None
        return future.result()

    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = False,
        reduce_op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.AVG,
    ) -> WorkFuture:
        """Averages ``tensor`` in place over this step's participants.

        A contiguous floating-point tensor is divided by the number of participants
        first and then summed in place, with no copy and no work after the exchange;
        other tensors go through a copy that is summed, divided and copied back.

        Args:
            tensor: The tensor, reduced in place.
            should_quantize: Accepted for torchft's signature; the exchange is always
                in the tensor's own precision.
            reduce_op: ``AVG`` (the default) or ``SUM`` (summed over the participants,
                not divided), as in torchft.

        Returns:
            A future of ``tensor`` (a :class:`WorkFuture`, so torchft code that expects
            a Work can call ``wait()``, ``get_future()``, ``is_completed()`` on it). It
            never raises: after an error anywhere :meth:`should_commit` answers False
            and the tensor's values are unspecified (a healing replica's are zeros),
            since the exchange may have written part of the sum into it. The step is
            discarded everywhere, so nothing uses them.

        Raises:
            ValueError: ``reduce_op`` is neither AVG nor SUM.
        """
        op = reduce_op_name(reduce_op)
        if op not in ("AVG", "SUM"):
            raise ValueError(
                f"Manager.allreduce: reduce_op={op} is not supported; use ReduceOp.AVG "
                "(the average over the participants) or ReduceOp.SUM"
            )
        average = op == "AVG"
        # With CUDA tensors the future records an event where its result is set: on
        # the stream the group's own future runs ``finish`` on (after the exchange and
        # the division), so a waiter's stream is ordered after both.
        result = future_for(tensor, WorkFuture)
        quorum = self._wait_for_quorum()
        if quorum is None or self._state.error is not None:
            result.set_result(tensor)
            return result
        participants = len(quorum.participants) if average else 1
        if quorum.is_behind(self._replica_id):
            tensor.zero_()  # computed from stale weights: contributes nothing
        in_place = tensor.is_contiguous() and (tensor.is_floating_point() or tensor.is_complex())
        # Dividing first makes the sum the average: the exchange's own result is the
        # answer, and the callback below has no tensor work to do.
        buffer = tensor.div_(participants) if in_place else self._buffers.copy_of(tensor)
        pending = PendingAllreduce(result, tensor)
        generation = self._state.add_pending(pending)
        if generation is None:  # failed meanwhile; its failure may not have seen this one
            pending.complete()
            return result
        try:
            work = self._pg.allreduce([buffer], self._sum_options)
        except Exception as error:
            self._fail(error, generation)
            return result

        def finish(future: Future[Any]) -> None:
            try:
                future.value()
                swallowed = self._swallowed_error()
                if swallowed is not None:
                    raise swallowed
            except Exception as error:
                self._fail(error, generation)
                return
            if pending.future.done():
                return  # failed meanwhile: the step is discarded
            if not in_place:
                if buffer.is_floating_point() or buffer.is_complex():
                    torch.div(buffer, participants, out=tensor)
                else:
                    torch.floor_divide(buffer, participants, out=tensor)
                self._buffers.give_back(buffer)
            pending.complete()

        work.get_future().then(finish)
        return result

    def wrap_future(
        self, fut: Future[_T], default: _T, timeout: timedelta | None = None
    ) -> Future[_T]:
        """A future of ``fut``'s value; an error of ``fut`` goes to the manager instead.

        If ``fut`` fails, or is not done within ``timeout`` (the manager's timeout when
        None), the error is reported with :meth:`report_error` (so the step is not
        committed, on any replica) and the returned future completes with ``default``
        instead of raising, as torchft's ``wrap_future`` does.

        Args:
            fut: The future to wrap.
            default: The value to complete with after an error. With CUDA tensors it
                should hold tensors on the same devices as ``fut``'s value.
            timeout: How long ``fut`` may take.
        """
        result: Future[_T] = future_for(default)
        seconds = (timeout or self._timeout).total_seconds()

        def complete(value: _T) -> None:
            if result.done():
                return
            with contextlib.suppress(RuntimeError):  # completed by the other path meanwhile
                result.set_result(value)

        def fail(error: Exception) -> None:
            if result.done():
                return
            self.report_error(error)
            complete(default)

        def done(_: Future[_T]) -> None:
            self._wrapped.forget(key)
            try:
                value = fut.wait()  # raises its error; orders this stream after its events
            except Exception as error:
                fail(error)
                return
            complete(value)

        key = self._wrapped.register(seconds, fail)
        fut.add_done_callback(done)
        return result

    def _swallowed_error(self) -> Exception | None:
        """The error an error-swallowing group recorded instead of raising, if any."""
        if self._error_of is None:
            return None
        error = self._error_of()
        return error if isinstance(error, Exception) else None

    def report_error(self, error: Exception) -> None:
        """Fails this step here and, through the store, on every replica of the quorum."""
        self._fail(error, None)

    def _fail(self, error: Exception, generation: int | None, *, publish: bool = True) -> None:
        failed = self._state.fail(error, generation)
        if failed is None:
            return
        for pending in failed.pending:
            pending.complete()
        logger.warning(
            "replica %s: step %d failed: %s", self._label, failed.step, failure_cause(error)
        )
        quorum = failed.quorum
        if publish and quorum is not None:
            try:
                message = f"{self._replica_id}: {type(error).__name__}: {error}"[:1000]
                self._monitor_store.set(error_key(quorum), message)
                self._monitor_store.compare_set(commit_key(quorum), "", COMMIT_FAIL)
            except Exception:
                logger.warning("could not publish the error to the store", exc_info=True)

    def should_commit(self) -> bool:
        """Whether every replica of the quorum finished this step without an error.

        Waits for this replica's pending allreduces, applies a healed state, then votes;
        the decision is written once in the store, so every replica gets the same answer.
        """
        deadline = time.monotonic() + self._timeout.total_seconds()
        quorum = self._wait_for_quorum()
        # Each future completes through its exchange or a failure; past the deadline the
        # watcher fails the step, which completes them all.
        self._state.set_deadlines(allreduce=deadline, vote=None)
        for pending in self._state.pending():
            pending.future.wait()
        self._state.set_deadlines(allreduce=None, vote=None)
        # A group that records errors instead of raising them (the error-swallowing
        # wrapper; a baby group whose child died after its work was handed back on the
        # GPU streams) may have failed after the last allreduce completed.
        swallowed = self._swallowed_error()
        if swallowed is not None and self._state.error is None:
            self.report_error(swallowed)
        if quorum is None:
            self._state.end_step(None, committed=False, healed_step=None)
            logger.warning(
                "replica %s: step %d discarded: no quorum", self._label, self._state.step
            )
            return False
        healed_step: int | None = None
        healed = self._state.healed()
        if healed is not None:
            state, healed_step = healed
            try:
                self._load_state_dict(state)
            except Exception as error:
                self.report_error(error)
                healed_step = None
        committed = self._vote(quorum, deadline)
        recovered = self._state.end_step(quorum, committed=committed, healed_step=healed_step)
        if not committed:
            logger.warning(
                "replica %s: step %d discarded on every replica", self._label, quorum.max_step
            )
        elif recovered is not None:
            self._log_recovery(recovered, quorum)
        return committed

    def _log_recovery(self, failure: Failure, quorum: Quorum) -> None:
        lost = lost_since(failure, quorum)
        logger.info(
            "replica %s: recovered in %.2f s: %s, step %d discarded, step %d committed by "
            "quorum %d with %d replicas",
            self._label,
            time.monotonic() - failure.seen_at,
            f"{', '.join(lost)} failed" if lost else "no replica lost",
            failure.step,
            quorum.max_step,
            quorum.quorum_id,
            len(quorum.members),
        )

    def _vote(self, quorum: Quorum, deadline: float) -> bool:
        """Votes; True when the step is committed everywhere.

        Three store round trips on the way of the step's last voter: its ``add``, its
        ``compare_set`` of the decision, and the others' read of it once their ``wait``
        ends. The last voter writes ``ok:same`` when no replica announced itself since
        the quorum was decided, as far as its watcher has read the registry version
        (every ``_HEARTBEAT_CHECK_TICKS`` heartbeat intervals): the next step then
        reuses the quorum without a round; else it writes ``ok:full``. An error writes
        ``fail``. The first write wins. A replica that announced itself is thus taken
        in at the first commit after the voters' watchers saw it, a fraction of a
        second later (well within ``join_timeout``, which the new replica's round
        waits for the others).
        """
        key = commit_key(quorum)
        decision: bytes | None = None
        if self._state.error is None:
            proposal = commit_proposal(
                self._store.add(votes_key(quorum), 1),
                quorum,
                group_world_size=self._group_world_size,
                registry_version=self._state.registry_version,
            )
            if proposal is not None:
                decision = self._store.compare_set(key, "", proposal)
        if decision is None:
            decision = self._await_decision(key, deadline)
        outcome = read_commit(decision)
        self._reuse_quorum = outcome.reuse_quorum
        committed = outcome.committed
        if not committed and self._state.error is None:
            # Another replica failed the step before this one's watcher saw why: take
            # its reason now, so that errored() and the log say it before "discarded".
            reported = self._reported_error(self._store, quorum)
            self._fail(
                reported or ReplicaError("another replica failed the step"),
                self._state.generation,
                publish=False,
            )
        return committed

    @staticmethod
    def _reported_error(store: Store, quorum: Quorum) -> ReplicaError | None:
        """The error another replica wrote for ``quorum``, if any."""
        key = error_key(quorum)
        if not store.check([key]):
            return None
        return ReplicaError(f"reported by replica {store.get(key).decode(errors='replace')}")

    def _await_decision(self, key: str, deadline: float) -> bytes:
        """The commit decision, after one blocking wait (no check first: it is rarely there).

        The wait ends when the last voter writes the decision, or when any replica
        fails the step: each writes ``fail`` to the key (:meth:`_fail`), this replica's
        watcher too when a peer stops beating or the deadline passes. No wait with a
        short timeout, then: torch logs a warning each time one runs out.
        """
        if self._state.error is not None:  # failed before voting: publish it again, to be sure
            self._store.compare_set(key, "", COMMIT_FAIL)
        else:
            self._state.set_deadlines(allreduce=None, vote=deadline)
            try:
                grace = max(deadline - time.monotonic(), 0.0) + _VOTE_WAIT_GRACE_SECONDS
                self._store.wait([key], timedelta(seconds=grace))
            except Exception:  # torch raises DistStoreError (or RuntimeError) on a timeout
                if not self._store.check([key]):
                    self.report_error(TimeoutError(f"no commit decision within {self._timeout}"))
                    self._store.compare_set(key, "", COMMIT_FAIL)
            finally:
                self._state.set_deadlines(allreduce=None, vote=None)
        # The key exists now, so this reads it in one round trip (get would first wait
        # again): compare_set answers with the stored value unless it equals "ok:same",
        # which it then leaves as it is.
        return bytes(self._store.compare_set(key, COMMIT_SAME, COMMIT_SAME))

    # -- the watcher --------------------------------------------------------------------

    def _monitor_loop(self) -> None:
        interval = self._heartbeat_interval.total_seconds()
        ticks = 0
        while not self._stop.wait(interval):
            ticks += 1
            try:
                self._wrapped.expire()
                slow_tick = ticks % _HEARTBEAT_CHECK_TICKS == 0
                self._beat(check_group=slow_tick)
                # Errors are polled every tick; heartbeats, which only back up the error
                # path, and newcomers, which only wait a little longer, every few ticks,
                # to keep the store traffic small.
                if slow_tick:
                    version = int(self._monitor_store.add(REGISTRY_VERSION_KEY, 0))
                    self._state.saw_registry_version(version)
                self._watch_step(check_heartbeats=slow_tick)
            except Exception:
                if not self._stop.is_set():
                    logger.warning("ft monitor: store call failed", exc_info=True)

    def _beat(self, *, check_group: bool) -> None:
        """Beats this rank's heartbeat; group rank 0 beats the group's while it is whole.

        In a replica group, rank 0 watches every rank and the others watch rank 0. When a
        watched rank stops beating, the group is broken for good (it rejoins only by
        restarting whole): this rank stops beating, fails the step and ends its own wait
        for the group (rank 0's for its ranks, another rank's for rank 0's decision);
        rank 0 also marks the group as left, so that the other groups leave it out at once.
        """
        grouped = self._group_world_size > 1
        if grouped and check_group and self._state.group_broken is None:
            watched = watched_group_ranks(self._group_rank, self._group_world_size)
            stale = self._monitor_liveness.stale_ranks(self._group_name(), watched)
            if stale:
                self._break_group(stale)
        if self._state.group_broken is not None:
            return
        if grouped:
            self._monitor_liveness.beat_rank(self._group_name(), self._group_rank)
        if self._group_rank == 0:
            self._monitor_liveness.beat(self._replica_id)

    def _break_group(self, stale: list[int]) -> None:
        message = broken_group_message(self._replica_id, stale)
        waits = self._state.break_group(message)
        if waits is None:
            return
        if self._group_rank == 0:
            self._monitor_liveness.leave(self._replica_id)
            if waits.arrival_key is not None:
                self._monitor_store.compare_set(waits.arrival_key, "", "broken")
        elif waits.awaited_key is not None:
            self._monitor_store.compare_set(waits.awaited_key, "", f"fail:{message}"[:1000])
        logger.warning("%s", message)
        if waits.step_active:
            self._fail(ReplicaError(message), waits.generation)

    def _watch_step(self, *, check_heartbeats: bool) -> None:
        watched = self._state.watched_step()
        if watched is None:
            return
        quorum, generation = watched.quorum, watched.generation
        overdue = overdue_error(
            time.monotonic(),
            allreduce_deadline=watched.allreduce_deadline,
            allreduce_unfinished=any(not pending.future.done() for pending in watched.pending),
            vote_deadline=watched.vote_deadline,
            timeout=self._timeout,
        )
        if overdue is not None:
            self._fail(overdue, generation)
            return
        reported = self._reported_error(self._monitor_store, quorum)
        if reported is not None:
            self._fail(reported, generation)
            return
        if not check_heartbeats:
            return
        lost = lost_members(quorum, self._monitor_liveness.alive(), self._replica_id)
        if not lost:
            return
        key = commit_key(quorum)
        decision = self._monitor_store.get(key) if self._monitor_store.check([key]) else None
        error = lost_member_error(lost, decision)
        if error is not None:
            self._fail(error, generation)

    def shutdown(self) -> None:
        """Leaves the quorum for good, stops the watcher and releases the group."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._monitor.join(timeout=5)
        try:
            if self._group_rank == 0:  # the group leaves with its rank 0
                Liveness(self._store, timedelta(seconds=1)).leave(self._replica_id)
            else:  # a counter of 0 reads as "not started": rank 0 does not break the group
                self._store.set(f"hb/{self._group_name()}/{self._group_rank}", "0")
        except Exception:
            logger.warning("could not tell the store that %s left", self._replica_id, exc_info=True)
        self._pg.shutdown()
