"""The Manager's executor: a step's calls to the coordinator and the group, and their threads.

It keeps no protocol of its own, as torchft's Manager keeps none: the quorum and the
commit are calls to its :class:`~dist_collectives.ft.coordination.coordinator.ReplicaCoordinator`
(by default the job's store's,
:class:`~dist_collectives.ft.coordination.store_coordinator.StoreCoordinator`, which owns
every store key and value). It asks :mod:`dist_collectives.ft.replica.manager_decisions`
what follows, records the outcome in the
:class:`~dist_collectives.ft.replica.manager_state.StepState` and does it:

1. ``start_quorum`` starts a step and its
   :class:`~dist_collectives.ft.replica.generation.Generation`: it reuses the last
   quorum when the last verdict allowed it, else it asks the *quorum worker*
   (:mod:`dist_collectives.ft.replica.quorum_worker`) for the coordinator's quorum,
   configures the group when the quorum id changed, and sends or receives a state to
   heal.
2. ``allreduce`` hands each tensor to the step's generation, which exchanges a buffer
   of its own and writes the result into the tensor only on success.
3. ``should_commit`` waits for the allreduces, loads a healed state and votes through
   the coordinator.
4. Meanwhile the *watcher* thread (:mod:`dist_collectives.ft.replica.manager_watcher`)
   beats through the coordinator, reads the registry version, and fails the step when
   another replica reported an error, a member stopped beating, or a wait ran past its
   deadline; it also reports every failure, so that the others stop waiting too.

Threads, and what each owns besides the shared :class:`StepState`:

- the training thread (the caller of the Manager): whether the next step may reuse
  the quorum, the future of this step's quorum, whether the executor was shut down,
  the count of quorum requests; it calls the coordinator's ``vote`` and ``leave``;
- the quorum worker, started once: every quorum request, ``configure`` of the group
  and state transfer; it calls the coordinator's ``quorum`` and ``drop``;
- the watcher, started once: the coordinator's other calls;
- callback threads (a group's, a wrapped future's): nothing; they record failures in
  the state and make no call to the coordinator.

The store coordinator gives each of these threads its own
:class:`~dist_collectives.ft.coordination.bounded_store.BoundedStore`: no store call
outlasts the Manager's timeout, even with a store server that stopped answering. The
step's operations are its generation's, behind that object's own condition; the buffer
pool and the wrapped futures each have their own lock
(:mod:`dist_collectives.ft.replica.manager_futures`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.futures import Future

from dist_collectives.ft.coordination.bounded_store import BoundedStore, StoreTimeoutError
from dist_collectives.ft.coordination.coordinator import (
    FailureReport,
    JoinRequest,
    ReplicaCoordinator,
    Verdict,
)
from dist_collectives.ft.coordination.quorum import Quorum
from dist_collectives.ft.coordination.store_coordinator import StoreCoordinator
from dist_collectives.ft.errors import ReplicaError
from dist_collectives.ft.groups.process_group import ProcessGroup
from dist_collectives.ft.groups.reconfigure import reconfigure_with_store
from dist_collectives.ft.groups.work import WorkFuture, future_for
from dist_collectives.ft.replica.generation import Generation
from dist_collectives.ft.replica.manager_config import ManagerConfig
from dist_collectives.ft.replica.manager_decisions import (
    Configure,
    Failure,
    ReceiveState,
    describe_action,
    failure_cause,
    lost_since,
    membership_change,
    quorum_actions,
    request_is_stale,
)
from dist_collectives.ft.replica.manager_futures import BufferPool, WrappedFutures
from dist_collectives.ft.replica.manager_state import StepState
from dist_collectives.ft.replica.manager_watcher import Watcher
from dist_collectives.ft.replica.quorum_worker import (
    QuorumRequest,
    QuorumWorker,
    QuorumWorkerTimeoutError,
)
from dist_collectives.ft.replica.state_transfer import recv_state, send_state

# The training thread waits this much longer than the timeout for the quorum worker, so
# that the worker's own bounded error (a store call that timed out, naming the call)
# reaches it before its own "still busy" one.
_QUORUM_WAIT_GRACE_SECONDS = 1.0
# How long shutdown() waits for the quorum worker to finish what it is doing.
_WORKER_STOP_SECONDS = 5.0

_T = TypeVar("_T")


class ManagerExecutor:
    """Runs the protocol of one :class:`~dist_collectives.ft.Manager` (see the module doc).

    Connects to the store, joins the replica group, announces this replica and starts
    the watcher when built.

    Args:
        pg: The reconfigurable group the replicas average over.
        config: The Manager's checked settings.
        load_state_dict: Called with a healthy peer's state when this replica heals.
        state_dict: Returns this replica's state, sent to replicas that heal.
        log: Where the Manager's log lines go (its module's logger: the lines are
            documented there).
        coordinator: Speaks to the other replicas; by default the job's store's
            (:class:`~dist_collectives.ft.coordination.store_coordinator.StoreCoordinator`).

    Raises:
        ManagerConfigError: This rank's replica group size differs from the job's.
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        config: ManagerConfig,
        *,
        load_state_dict: Callable[[Any], None],
        state_dict: Callable[[], Any],
        log: logging.Logger,
        coordinator: ReplicaCoordinator | None = None,
    ) -> None:
        self._pg = pg
        self._config = config
        self._load_state_dict = load_state_dict
        self._state_dict = state_dict
        self._log = log
        # Shared between threads: one lock each.
        self.state = StepState()
        self._buffers = BufferPool()
        self._wrapped = WrappedFutures()
        # Every word with the other replicas goes through the coordinator; the store's
        # gives each of this executor's threads its own bounded connection.
        self._coordinator: ReplicaCoordinator = coordinator or StoreCoordinator(
            config.coordinator_settings(), self._connect, self.state
        )
        # Owned by the training thread: whether the last commit lets the next step reuse
        # its quorum, the future of this step's quorum, whether shutdown() ran, and how
        # many quorums this rank asked for (the number its group rank 0 answers each
        # request under).
        self._reuse_quorum = False
        self._quorum_future: concurrent.futures.Future[Quorum] | None = None
        self._quorum_waited_since: float | None = None
        self._closed = False
        self._quorum_requests = 0
        # Set here, read-only afterwards.
        # Looked up once: the lookup missed on most groups, and a miss costs an exception.
        error_of = getattr(pg, "error", None)
        self._error_of: Callable[[], object] | None = error_of if callable(error_of) else None
        self._coordinator.join()
        self._watcher = Watcher(
            config, self.state, self._coordinator, self._wrapped, fail=self.fail, log=log
        )
        self._watcher.start()
        self._worker: QuorumWorker[Quorum] = QuorumWorker(
            f"ft-quorum-{config.replica_id}",
            self._serve_quorum,
            is_stale=lambda request: request_is_stale(request.generation, self.state.generation),
            drop=self._drop_quorum_request,
            log=log,
        )

    def _connect(self, role: str) -> BoundedStore:
        return BoundedStore(
            self._config.host,
            self._config.port,
            prefix=self._config.namespace,
            timeout=self._config.timeout,
            label=f"{role}-{self._config.replica_id}",
        )

    # -- the step -----------------------------------------------------------------------

    def current_quorum(self) -> Quorum:
        """This step's quorum, once formed.

        Raises:
            ReplicaError: No quorum formed (the step failed first, or timed out).
        """
        quorum = self.wait_for_quorum()
        if quorum is None:
            raise ReplicaError(f"replica {self._config.replica_id}: no quorum: {self.state.error}")
        return quorum

    def start_quorum(self) -> None:
        """Starts a step: reuses the last quorum, or asks the quorum worker to form one."""
        if self._closed:
            raise RuntimeError(f"replica {self._config.replica_id}: the Manager was shut down")
        reuse, self._reuse_quorum = self._reuse_quorum, False
        generation, reused = self.state.begin_step(
            reuse=reuse, open_generation=self._open_generation
        )
        self._quorum_waited_since = None
        if reused is not None:  # no store round trip at all
            future: concurrent.futures.Future[Quorum] = concurrent.futures.Future()
            future.set_result(reused)
            self._quorum_future = future
            return
        self._quorum_requests += 1
        step = self.state.step
        self._quorum_future = self._worker.submit(
            QuorumRequest(generation, self._quorum_requests, step)
        )
        if self._config.init_sync and step == 0:
            self._load_first_state()

    def _open_generation(self, number: int) -> Generation:
        """The :class:`Generation` of the step ``number``: its operations on the group."""
        return Generation(
            number,
            self._pg,
            self._buffers,
            on_error=lambda error: self.fail(error, number),
            swallowed_error=self._swallowed_error,
            copy_wait=self._config.timeout.total_seconds(),
        )

    def _load_first_state(self) -> None:
        """Before this replica's first step: waits for the quorum, loads the state it sent.

        Runs in :meth:`start_quorum`, before the step's forward pass, so a replica that
        copies the first member's state (:attr:`Quorum.syncs_first_state`) computes
        its first gradients from the same weights as the others and takes part in the
        step (torchft zeroes those replicas' first gradients instead). A replica that
        joins a job already past step 0 heals as usual.
        """
        quorum = self.wait_for_quorum()
        if quorum is None or not quorum.syncs_first_state:
            return
        healed = self.state.take_healed()
        if healed is None:
            return
        state, _ = healed
        try:
            self._load_state_dict(state)
        except Exception as error:
            self.report_error(error)

    def _serve_quorum(self, request: QuorumRequest) -> Quorum:
        """On the quorum worker: the round, then the actions the decision calls for."""
        config = self._config
        self._worker.doing = f"the quorum round of step {request.step}"
        join = JoinRequest(
            request.number,
            request.step,
            previous=self.state.last_quorum,
            failed_quorum_id=self.state.failed_quorum_id,
        )
        quorum = self._coordinator.quorum(join, time.monotonic() + config.timeout.total_seconds())
        if not self.state.adopt_quorum(quorum, request.generation):
            return quorum  # a newer start_quorum took over; leave the group alone
        configured_id, configured_members = self.state.configured
        actions = quorum_actions(
            quorum,
            config.replica_id,
            configured_id=configured_id,
            store_address=f"{config.host}:{config.port}/{config.namespace}",
            group_rank=config.group_rank,
            group_world_size=config.group_world_size,
        )
        for action in actions:
            self._worker.doing = describe_action(action)
            if isinstance(action, Configure):
                started = time.perf_counter()
                move_group(self._pg, action, config.timeout)
                self.state.configured_for(quorum)
                self._log.info(
                    "replica %s: quorum %d with %d replicas, rank %d, step %d%s; configured "
                    "in %.1f ms (quorum %s)",
                    config.label,
                    quorum.quorum_id,
                    len(quorum.members),
                    action.rank,
                    quorum.max_step,
                    membership_change(configured_members, quorum.members),
                    1000 * (time.perf_counter() - started),
                    quorum.quorum_uuid,
                )
            elif isinstance(action, ReceiveState):
                self.state.received(*recv_state(self._pg, action.source), request.generation)
            else:
                state = self._state_dict()
                for healer in action.healers:
                    send_state(self._pg, state, request.step, healer)
        return quorum

    def _drop_quorum_request(self, request: QuorumRequest) -> None:
        """On the quorum worker: a superseded request; its group ranks stop waiting for it."""
        self._coordinator.drop(request.number)

    def wait_for_quorum(self) -> Quorum | None:
        """This step's quorum; None when the step failed or timed out before it formed."""
        future = self._quorum_future
        if future is None:
            raise RuntimeError("call start_quorum() before allreduce() or should_commit()")
        if future.done() and future.exception() is None:
            return future.result()
        if self._quorum_waited_since is None:
            self._quorum_waited_since = time.monotonic()
        deadline = (
            self._quorum_waited_since
            + self._config.timeout.total_seconds()
            + _QUORUM_WAIT_GRACE_SECONDS
        )
        while True:
            done, _ = concurrent.futures.wait([future], timeout=0.01)
            if done:
                break
            if self.state.error is not None:
                return None
            if time.monotonic() > deadline:
                self.report_error(
                    QuorumWorkerTimeoutError(
                        f"no quorum within {self._config.timeout}: the quorum worker is "
                        f"still {self._worker.doing}"
                    )
                )
                return None
        error = future.exception()
        if error is not None:
            self.report_error(error if isinstance(error, Exception) else RuntimeError(error))
            return None
        return future.result()

    def allreduce(self, tensor: torch.Tensor | list[torch.Tensor], *, average: bool) -> WorkFuture:
        """Sums ``tensor`` over this step's participants, or averages it (the step's generation).

        Returns:
            A future of ``tensor`` that never raises (see ``Manager.allreduce``).
        """
        quorum = self.wait_for_quorum()
        generation = self.state.current()
        if quorum is None or generation is None or self.state.error is not None:
            result = future_for(tensor, WorkFuture)
            result.set_result(tensor)
            return result
        return generation.allreduce(
            tensor,
            participants=len(quorum.participants) if average else 1,
            behind=quorum.is_behind(self._config.replica_id),
        )

    def wrap_future(self, fut: Future[_T], default: _T, timeout: timedelta | None) -> Future[_T]:
        """``fut``'s value, or ``default`` after its error or timeout (``Manager.wrap_future``)."""
        result: Future[_T] = future_for(default)
        seconds = (timeout or self._config.timeout).total_seconds()

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
        self.fail(error, None)

    def fail(self, error: Exception, generation: int | None, *, publish: bool = True) -> None:
        """Fails the step of ``generation`` (None: the current one), unless it failed already.

        Fails the step's :class:`Generation` first (once that returns, no operation of
        the step writes into a caller's tensor again, and the step's futures are
        complete), logs the failure and, with ``publish``, has the watcher write it to
        the store, where every other replica's watcher or vote finds it. Any thread may
        call it; it makes no store call.
        """
        failed = self.state.fail(error, generation)
        if failed is None:
            return
        if failed.generation is not None:
            failed.generation.fail()
        self._log.warning(
            "replica %s: step %d failed: %s", self._config.label, failed.step, failure_cause(error)
        )
        quorum = failed.quorum
        if publish and quorum is not None:
            self.state.to_publish(quorum, FailureReport.of(self._config.replica_id, error).message)
            self._watcher.wake()

    def should_commit(self) -> bool:
        """Ends the step: waits for its allreduces, loads a healed state, votes."""
        deadline = time.monotonic() + self._config.timeout.total_seconds()
        quorum = self.wait_for_quorum()
        # Each future completes through its exchange or a failure; past the deadline the
        # watcher fails the step, which completes them all.
        self.state.set_deadlines(allreduce=deadline, vote=None)
        generation = self.state.current()
        for future in generation.futures() if generation is not None else ():
            future.wait()
        self.state.set_deadlines(allreduce=None, vote=None)
        # A group that records errors instead of raising them (the error-swallowing
        # wrapper; a baby group whose child died after its work was handed back on the
        # GPU streams) may have failed after the last allreduce completed.
        swallowed = self._swallowed_error()
        if swallowed is not None and self.state.error is None:
            self.report_error(swallowed)
        if quorum is None:
            self.state.end_step(None, committed=False, healed_step=None)
            self._log.warning(
                "replica %s: step %d discarded: no quorum", self._config.label, self.state.step
            )
            return False
        healed_step: int | None = None
        healed = self.state.healed()
        if healed is not None:
            state, healed_step = healed
            try:
                self._load_state_dict(state)
            except Exception as error:
                self.report_error(error)
                healed_step = None
        committed = self._vote(quorum, deadline)
        recovered = self.state.end_step(quorum, committed=committed, healed_step=healed_step)
        if not committed:
            self._log.warning(
                "replica %s: step %d discarded on every replica",
                self._config.label,
                quorum.max_step,
            )
        elif recovered is not None:
            self._log_recovery(recovered, quorum)
        return committed

    def _log_recovery(self, failure: Failure, quorum: Quorum) -> None:
        lost = lost_since(failure, quorum)
        self._log.info(
            "replica %s: recovered in %.2f s: %s, step %d discarded, step %d committed by "
            "quorum %d with %d replicas",
            self._config.label,
            time.monotonic() - failure.seen_at,
            f"{', '.join(lost)} failed" if lost else "no replica lost",
            failure.step,
            quorum.max_step,
            quorum.quorum_id,
            len(quorum.members),
        )

    def _vote(self, quorum: Quorum, deadline: float) -> bool:
        """Votes through the coordinator; True when the step is committed everywhere.

        A verdict that lets the next step reuse the quorum skips its round. A replica
        that announced itself (or waits in a round the members did not join) is taken
        in at the first commit after the voters' watchers saw it, a fraction of a
        second later (well within ``join_timeout``).
        """
        error = self.state.error
        failure = None if error is None else FailureReport.of(self._config.replica_id, error)
        try:
            verdict = self._coordinator.vote(
                quorum, deadline, failure=failure, registry_version=self.state.registry_version
            )
        except StoreTimeoutError as timeout:
            # The store does not answer: no verdict can be read, so this replica does
            # not commit; the watcher writes the failure once the store answers again.
            self.report_error(timeout)
            verdict = Verdict(committed=False)
        if verdict.timed_out:
            # The coordinator reported it to the others already.
            self.fail(
                TimeoutError(f"no commit decision within {self._config.timeout}"),
                None,
                publish=False,
            )
        self._reuse_quorum = verdict.reuse_quorum
        if not verdict.committed and self.state.error is None:
            # Another replica failed the step before this one's watcher saw why: take
            # its reason now, so that errored() and the log say it before "discarded".
            reported = verdict.failure
            self.fail(
                ReplicaError(f"reported by replica {reported}")
                if reported is not None
                else ReplicaError("another replica failed the step"),
                self.state.generation,
                publish=False,
            )
        return verdict.committed

    def shutdown(self) -> None:
        """Leaves the quorum for good, stops the worker and the watcher, releases the group."""
        if self._closed:
            return
        self._closed = True
        # A worker still in a round of a failed step ends when its bounded calls do;
        # shutdown does not wait the whole timeout for it.
        wait = min(self._config.timeout.total_seconds(), _WORKER_STOP_SECONDS)
        if not self._worker.stop(wait):
            self._log.warning(
                "replica %s: the quorum worker is still %s after %.0f s; leaving it",
                self._config.label,
                self._worker.doing,
                wait,
            )
        self._watcher.stop()
        try:
            self._coordinator.leave()  # the group leaves with its rank 0
        except Exception:
            self._log.warning(
                "could not tell the store that %s left", self._config.replica_id, exc_info=True
            )
        self._coordinator.close()
        self._pg.shutdown()


def move_group(pg: dist.ProcessGroup, action: Configure, timeout: timedelta) -> None:
    """Moves ``pg`` to the members of ``action``'s quorum, on ``action.address``.

    These groups rendezvous there themselves (``configure``); torch's own
    reconfigurable groups exchange their handles there
    (:func:`~dist_collectives.ft.reconfigure_with_store`) and reconfigure in place.
    """
    if isinstance(pg, ProcessGroup):
        pg.configure(action.address, action.rank, action.world_size)
    else:
        reconfigure_with_store(
            pg,
            action.address,
            action.rank,
            action.world_size,
            timeout,
            communicator_uuid=action.communicator_uuid,
        )
