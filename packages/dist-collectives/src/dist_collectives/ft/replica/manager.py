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
:mod:`dist_collectives.ft.coordination.quorum`. A replica that sees an error writes it to the store
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

The Manager is a facade over small modules, after torch elastic's dynamic rendezvous:

- :mod:`~dist_collectives.ft.replica.manager_config`: its arguments, checked once;
- :mod:`~dist_collectives.ft.replica.manager_decisions`: what happens next, as pure functions
  (the commit vote, quorum reuse, who heals from whom, the watcher's verdicts);
- :mod:`~dist_collectives.ft.replica.manager_state`: what its threads share, behind one lock,
  and which thread owns what;
- :mod:`~dist_collectives.ft.replica.manager_executor`: the store and group calls of a step,
  and the threads that make them;
- :mod:`~dist_collectives.ft.replica.quorum_worker`: the one thread that forms quorums,
  configures the group and heals;
- :mod:`~dist_collectives.ft.replica.manager_watcher`: the watcher thread the executor runs;
- :mod:`~dist_collectives.ft.replica.generation`: a step's operations, exchanged through
  buffers of its own;
- :mod:`~dist_collectives.ft.coordination.bounded_store`: store calls that return within the
  timeout;
- :mod:`~dist_collectives.ft.replica.manager_futures`: the buffers and futures it reuses.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.futures import Future

from dist_collectives.ft.coordination.quorum import Quorum
from dist_collectives.ft.errors import ManagerConfigError, ReplicaError
from dist_collectives.ft.groups.process_group import ProcessGroup, reduce_op_name
from dist_collectives.ft.groups.work import WorkFuture
from dist_collectives.ft.replica.manager_config import (
    DEFAULT_NAMESPACE,
    ManagerConfig,
    check_arguments,
    check_group,
    default_replica_id,
    resolve_store,
)
from dist_collectives.ft.replica.manager_executor import ManagerExecutor

__all__ = ["Manager", "ManagerConfigError", "ReplicaError"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class Manager:
    """Forms a quorum of live replicas each step, heals joiners, decides commits.

    Reads ``MASTER_ADDR`` and ``MASTER_PORT`` when ``store_addr``/``store_port`` are
    None. A TCPStore server must already run there (torchrun and dist-launch host one);
    the Manager only connects to it.

    Args:
        pg: The reconfigurable group the replicas average gradients over; the Manager
            moves it to the quorum's members whenever the quorum changes. One of these
            groups, which are told who this process is (``set_rank_info``), or a torch
            group that ``supports_reconfigure`` (torch 2.14+'s, built with
            ``init_process_group(..., enable_reconfigure=True)``), moved by
            :func:`~dist_collectives.ft.reconfigure_with_store`.
        load_state_dict: Called with a healthy peer's state when this replica heals.
        state_dict: Returns this replica's state, sent to replicas that heal.
        min_replica_size: A quorum needs at least this many replicas.
        replica_id: This replica's name, stable across restarts if given (default: host,
            pid and a random suffix).
        store_addr: Host of the job's store.
        store_port: Port of the job's store.
        timeout: How long a quorum, a collective or a commit may take.
        heartbeat_interval: How often this replica's watcher polls for errors of other
            replicas (100 ms, torchft's default; every second tick it also reads the
            others' heartbeats).
        heartbeat_timeout: A replica whose heartbeat did not move for this long counts
            as dead. A rank beats four times per heartbeat timeout (500 ms by
            default), or every ``heartbeat_interval`` when that is longer, and reads
            the registry of newcomers with its beat (at least every second).
        join_timeout: Form a quorum without a replica that looks alive but did not ask
            to join within this time (torchft's ``join_timeout``; 10 s).
        first_quorum_window: The job's first quorum forms only once no replica has
            announced itself (built its Manager) or asked to join for this long, at most
            ``join_timeout`` after this replica asked for it (2 s): replicas started
            together then begin together, instead of the late ones healing a step
            later. Later quorums do not wait for it.
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

    Raises:
        ManagerConfigError: (a ``ValueError``) ``pg`` cannot be reconfigured (the
            message names it), or the sizes, ranks or store are wrong.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
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
        check_group(pg)
        check_arguments(min_replica_size, group_rank, group_world_size, replica_id)
        host, port = resolve_store(store_addr, store_port, os.environ)
        self._config = ManagerConfig(
            replica_id=replica_id or default_replica_id(),
            host=host,
            port=port,
            min_replica_size=min_replica_size,
            timeout=timeout,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
            join_timeout=join_timeout,
            first_quorum_window=first_quorum_window,
            namespace=namespace,
            group_rank=group_rank,
            group_world_size=group_world_size,
            init_sync=init_sync,
        )
        if isinstance(pg, ProcessGroup):
            # No global rank: a replica's processes need not know their job-wide ranks.
            pg.set_rank_info(self._config.replica_id, group_rank, group_world_size)
        self._executor = ManagerExecutor(
            pg, self._config, load_state_dict=load_state_dict, state_dict=state_dict, log=logger
        )

    # -- queries ------------------------------------------------------------------------

    @property
    def replica_id(self) -> str:
        """This replica's name in the quorum (shared by the ranks of a replica group)."""
        return self._config.replica_id

    @property
    def group_rank(self) -> int:
        """This process's rank in its replica group."""
        return self._config.group_rank

    @property
    def group_world_size(self) -> int:
        """The number of ranks in each replica group."""
        return self._config.group_world_size

    @property
    def timeout(self) -> timedelta:
        """How long a quorum, a collective or a commit may take (the ``timeout`` argument).

        A :class:`ManagedProcessGroup`'s waits give up a little after it.
        """
        return self._config.timeout

    def current_step(self) -> int:
        """The number of steps committed so far (a healed replica takes its source's)."""
        return self._executor.state.step

    def errored(self) -> Exception | None:
        """The error of the current step, if any replica reported one."""
        return self._executor.state.error

    @property
    def _quorum(self) -> Quorum | None:
        # This step's quorum once decided; the fault tests' workers read it.
        return self._executor.state.quorum

    @property
    def _error_wall_time(self) -> float | None:
        # When this step's error was recorded; the fault tests' workers read it.
        return self._executor.state.error_wall_time

    def num_participants(self) -> int:
        """Replicas whose gradients count in this step (healing replicas do not)."""
        return len(self._executor.current_quorum().participants)

    def quorum_id(self) -> int:
        """The id of this step's quorum; it changes whenever the group is reconfigured.

        An integer, as torchft 0.2 returned (0, 1, 2, ...); :meth:`quorum_uuid` gives the
        UUID that torchft 0.3 logs and names groups by.
        """
        return self._executor.current_quorum().quorum_id

    def quorum_uuid(self) -> str:
        """The UUID of this step's quorum: new exactly when :meth:`quorum_id` changes.

        It is in the Manager's log of each configuration, and a torch reconfigurable
        group of a Manager whose replicas are single processes is named
        ``torchft_<uuid>_rank_<n>`` from it (:attr:`Quorum.communicator_uuid`).
        """
        return self._executor.current_quorum().quorum_uuid

    def replica_rank(self) -> int:
        """This replica's rank in this step's quorum."""
        return self._executor.current_quorum().replica_rank(self._config.replica_id)

    def replica_count(self) -> int:
        """Members of this step's quorum, healing ones included."""
        return len(self._executor.current_quorum().members)

    def is_healing(self) -> bool:
        """Whether this replica is behind and heals in this step (its gradients count nothing)."""
        return self._executor.current_quorum().is_behind(self._config.replica_id)

    # -- the step -----------------------------------------------------------------------

    def start_quorum(self) -> None:
        """Starts forming this step's quorum in the background and forgets the last error.

        The quorum, a reconfiguration of the group and healing all happen on the
        Manager's quorum worker thread; :meth:`allreduce` and :meth:`should_commit`
        wait for it, at most the Manager's ``timeout``.
        """
        self._executor.start_quorum()

    def allreduce(
        self,
        tensor: torch.Tensor | list[torch.Tensor],
        should_quantize: bool = False,
        reduce_op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.AVG,
    ) -> WorkFuture:
        """Averages ``tensor`` in place over this step's participants.

        The group exchanges a buffer the step owns, never ``tensor`` itself: a
        floating-point tensor is divided by the number of participants on its way into
        the buffer, the buffer is summed, and the result is copied into ``tensor`` once
        the exchange succeeded (integers are floor-divided on the way back).

        Args:
            tensor: The tensor, reduced in place; or a list of tensors of one dtype on
                one device, exchanged together in one buffer (as the DDP hook does with
                a backward's gradients) and each reduced in place.
            should_quantize: Accepted for torchft's signature; the exchange is always
                in the tensor's own precision.
            reduce_op: ``AVG`` (the default) or ``SUM`` (summed over the participants,
                not divided), as in torchft.

        Returns:
            A future of ``tensor`` (a :class:`WorkFuture`, so torchft code that expects
            a Work can call ``wait()``, ``get_future()``, ``is_completed()`` on it). It
            never raises. After an error anywhere, :meth:`should_commit` answers False
            and ``tensor`` holds what it held before the call: once the step failed,
            no exchange of it writes into ``tensor`` any more, even one that completes
            late (a group whose peer died may run until its own timeout). A healing
            replica sends zeros and receives the average.

        Raises:
            ValueError: ``reduce_op`` is neither AVG nor SUM.
        """
        op = reduce_op_name(reduce_op)
        if op not in ("AVG", "SUM"):
            raise ValueError(
                f"Manager.allreduce: reduce_op={op} is not supported; use ReduceOp.AVG "
                "(the average over the participants) or ReduceOp.SUM"
            )
        return self._executor.allreduce(tensor, average=op == "AVG")

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
        return self._executor.wrap_future(fut, default, timeout)

    def report_error(self, error: Exception) -> None:
        """Fails this step here and, through the store, on every replica of the quorum."""
        self._executor.report_error(error)

    def should_commit(self) -> bool:
        """Whether every replica of the quorum finished this step without an error.

        Waits for this replica's pending allreduces, applies a healed state, then votes;
        the decision is written once in the store, so every replica gets the same answer.
        """
        return self._executor.should_commit()

    def shutdown(self) -> None:
        """Leaves the quorum for good, stops the watcher and releases the group."""
        self._executor.shutdown()
