"""The Manager's executor: the store and group calls of a step, and the threads that make them.

It reads what the protocol needs (the store, the group, the clock), asks
:mod:`dist_collectives.ft.replica.manager_decisions` what follows, records the outcome in the
:class:`~dist_collectives.ft.replica.manager_state.StepState` and does it. The protocol itself,
step by step:

1. ``start_quorum`` starts a step and its
   :class:`~dist_collectives.ft.replica.generation.Generation`:
   it reuses the last quorum when the last commit allowed it, else it asks the
   *quorum worker* (:mod:`dist_collectives.ft.replica.quorum_worker`) to join a round
   (:mod:`dist_collectives.ft.coordination.quorum`; in a replica group only group rank 0 does, and
   publishes the decision to its ranks), configure the group when the quorum id
   changed, and send or receive a state to heal.
2. ``allreduce`` hands each tensor to the step's generation, which exchanges a buffer
   of its own and writes the result into the tensor only on success.
3. ``should_commit`` waits for the allreduces, loads a healed state and votes: the last
   voter writes the decision, the others wait for it.
4. Meanwhile the *watcher* thread (:mod:`dist_collectives.ft.replica.manager_watcher`), which
   the executor starts and stops, beats the heartbeats, reads the registry version,
   and fails the step when another replica reported an error, a member stopped
   beating, or a wait ran past its deadline; it also writes every failure to the
   store, so that the others stop waiting too.

Threads, and what each owns besides the shared :class:`StepState`:

- the training thread (the caller of the Manager): whether the next step may reuse
  the quorum, the future of this step's quorum, whether the executor was shut down,
  the count of quorum requests, and the vote's store connection;
- the quorum worker, started once: every quorum round, ``configure`` of the group and
  state transfer; its round connection and its liveness observer (through which it
  closes rounds);
- the watcher, started once: its own store connection and the liveness observer of
  heartbeats and of the replica group;
- callback threads (a group's, a wrapped future's): nothing; they record failures in
  the state and make no store call.

Every store connection is a :class:`~dist_collectives.ft.coordination.bounded_store.BoundedStore`
of its one owning thread: no store call outlasts the Manager's timeout, even with a
store server that stopped answering. The step's operations are its generation's,
behind that object's own condition; the buffer pool and the wrapped futures each have
their own lock (:mod:`dist_collectives.ft.replica.manager_futures`).
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
from dist_collectives.ft.coordination.quorum import (
    Liveness,
    Quorum,
    compute_quorum,
)
from dist_collectives.ft.errors import ManagerConfigError, ReplicaError
from dist_collectives.ft.groups.process_group import ProcessGroup
from dist_collectives.ft.groups.reconfigure import reconfigure_with_store
from dist_collectives.ft.groups.work import WorkFuture, future_for
from dist_collectives.ft.replica.generation import Generation
from dist_collectives.ft.replica.manager_config import ManagerConfig
from dist_collectives.ft.replica.manager_decisions import (
    COMMIT_FAIL,
    COMMIT_SAME,
    Configure,
    Failure,
    ReceiveState,
    commit_key,
    commit_proposal,
    describe_action,
    error_key,
    failure_cause,
    group_step,
    kept_a_failed_quorum,
    lost_since,
    membership_change,
    quorum_actions,
    read_commit,
    request_is_stale,
    votes_key,
)
from dist_collectives.ft.replica.manager_futures import BufferPool, WrappedFutures
from dist_collectives.ft.replica.manager_state import StepState
from dist_collectives.ft.replica.manager_watcher import Watcher, reported_error
from dist_collectives.ft.replica.quorum_worker import (
    QuorumRequest,
    QuorumWorker,
    QuorumWorkerTimeoutError,
)
from dist_collectives.ft.replica.state_transfer import recv_state, send_state

# The wait for a commit decision ends through the watcher, which fails the step at the
# deadline; the wait's own timeout, this much later, only catches a store that is gone.
_VOTE_WAIT_GRACE_SECONDS = 5.0
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
    ) -> None:
        self._pg = pg
        self._config = config
        self._load_state_dict = load_state_dict
        self._state_dict = state_dict
        self._log = log
        # Separate connections, one per thread: a TCPStore client serialises its
        # callers, and the quorum worker and the commit vote block in waits that must
        # not delay the error watcher (its own connection, below); the worker closes
        # rounds through a second one (its liveness') while the first waits.
        self._store = self._connect("vote")
        self._quorum_store = self._connect("quorum")
        self._quorum_liveness = Liveness(self._connect("round"), config.heartbeat_timeout)

        # Shared between threads: one lock each.
        self.state = StepState()
        self._buffers = BufferPool()
        self._wrapped = WrappedFutures()
        # Owned by the training thread: whether the last commit lets the next step reuse
        # its quorum, the future of this step's quorum, whether shutdown() ran, and how
        # many quorums this rank asked for (the key its group rank 0 publishes each
        # decision under).
        self._reuse_quorum = False
        self._quorum_future: concurrent.futures.Future[Quorum] | None = None
        self._quorum_waited_since: float | None = None
        self._closed = False
        self._quorum_requests = 0
        # Set here, read-only afterwards.
        # Looked up once: the lookup missed on most groups, and a miss costs an exception.
        error_of = getattr(pg, "error", None)
        self._error_of: Callable[[], object] | None = error_of if callable(error_of) else None
        self._incarnation = 0
        if config.grouped:
            self._join_group()
        self._watcher = Watcher(
            config,
            self.state,
            self._connect("watch"),
            self._wrapped,
            group_name=self._group_name(),
            fail=self.fail,
            log=log,
        )
        self._watcher.start()
        self._worker: QuorumWorker[Quorum] = QuorumWorker(
            f"ft-quorum-{config.replica_id}",
            self._serve_quorum,
            is_stale=lambda request: request_is_stale(request.generation, self.state.generation),
            drop=self._drop_quorum_request,
            log=log,
        )

    def _join_group(self) -> None:
        """Checks the group size against the job's and counts this rank's incarnation.

        Every rank of a group counts its own starts; a group restarts as a whole, so its
        ranks agree on the count and use it to keep apart the decisions group rank 0
        publishes in each incarnation.
        """
        config = self._config
        size = self._store.compare_set("group_world_size", "", str(config.group_world_size))
        if size.decode() != str(config.group_world_size):
            raise ManagerConfigError(
                f"replica {config.replica_id}: group_world_size={config.group_world_size}, "
                f"but the job's replica groups have {size.decode()} ranks; every group must "
                "have the same size (rank i of each group averages with rank i of the others)"
            )
        self._incarnation = int(
            self._store.add(f"incarnation/{config.replica_id}/{config.group_rank}", 1)
        )

    def _group_name(self) -> str:
        """This group in this incarnation: its ranks' heartbeats and decisions go under it."""
        return f"{self._config.replica_id}/{self._incarnation}"

    def _group_key(self, request: int) -> str:
        return f"group/{self._group_name()}/{request}"

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

    def _group_quorum(self, request: int, step: int) -> Quorum:
        """This group's decision: computed by group rank 0, read by the other ranks.

        Rank 0 asks for the group with the oldest step any of its ranks holds: a rank
        whose load of a healed state failed (or whose step failed before it loaded)
        holds an older state than a rank that loaded it, and the group must then heal
        again, every rank of it, or that rank trains on from its old state unseen.
        """
        config = self._config
        if config.group_world_size == 1:
            return self._compute_quorum(step)
        key = self._group_key(request)
        arrived = f"{key}/arrived"
        if config.group_rank > 0:
            self._quorum_store.set(f"{key}/step/{config.group_rank}", str(step))
            # Rank 0 asks for the group only once every rank has asked for this step.
            if self._quorum_store.add(f"{key}/count", 1) == config.group_world_size - 1:
                self._quorum_store.set(arrived, "all")
            # The watcher ends the wait if rank 0 stops beating.
            broken = self.state.wait_for_group(awaited_key=key)
            if broken is not None:
                raise ReplicaError(broken)
            self._quorum_store.wait([key], self._config.timeout)
            raw = bytes(self._quorum_store.get(key))
            if raw.startswith(b"fail:"):
                raise ReplicaError(
                    f"replica {self._config.replica_id}: no quorum for the group: "
                    f"{raw[5:].decode(errors='replace')}"
                )
            return Quorum.from_json(raw)
        try:
            if self.state.wait_for_group(arrival_key=arrived) is None:
                # Ended by the last rank to arrive, or by the watcher when a rank stopped
                # beating (it writes "broken"): a group whose rank died mid-step never
                # joins the next round with the ranks it has left.
                self._quorum_store.wait([arrived], self._config.timeout)
            broken = self.state.group_broken
            if broken is not None:
                raise ReplicaError(broken)
            others = [f"{key}/step/{rank}" for rank in range(1, config.group_world_size)]
            steps = [int(raw) for raw in self._quorum_store.multi_get(others)]
            quorum = self._compute_quorum(group_step(step, steps))
        except Exception as error:
            self._quorum_store.set(key, f"fail:{type(error).__name__}: {error}"[:1000])
            raise
        self._quorum_store.set(key, quorum.to_json())
        return quorum

    def _compute_quorum(self, step: int) -> Quorum:
        """The round's decision; one more round when it kept the id of a failed step.

        A step of this replica that failed on a configuration leaves that group unused
        for good: its exchanges may still run and would pair with the next step's.
        The round keeps the id only when nobody reported the failure under it before
        the round was decided (the watcher writes it as soon as it can); then this
        replica reports it and joins the next round, which gives a new id.
        """
        quorum = self._round(step, self.state.last_quorum)
        if kept_a_failed_quorum(quorum, self.state.failed_quorum_id):
            message = (
                f"{self._config.replica_id}: quorum {quorum.quorum_id} kept the id of a "
                "configuration whose step failed"
            )
            self._quorum_store.set(error_key(quorum), message)
            quorum = self._round(step, quorum)
        return quorum

    def _round(self, step: int, previous: Quorum | None) -> Quorum:
        return compute_quorum(
            self._quorum_store,
            self._config.replica_id,
            step,
            liveness=self._quorum_liveness,
            min_replicas=self._config.min_replica_size,
            join_timeout=self._config.join_timeout,
            timeout=self._config.timeout,
            previous=previous,
            first_quorum_window=self._config.first_quorum_window,
            init_sync=self._config.init_sync,
        )

    def _serve_quorum(self, request: QuorumRequest) -> Quorum:
        """On the quorum worker: the round, then the actions the decision calls for."""
        config = self._config
        self._worker.doing = f"the quorum round of step {request.step}"
        quorum = self._group_quorum(request.number, request.step)
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
        if self._config.grouped and self._config.group_rank == 0:
            with contextlib.suppress(Exception):  # they time out on their own otherwise
                self._quorum_store.set(self._group_key(request.number), "fail:superseded")

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
            message = f"{self._config.replica_id}: {type(error).__name__}: {error}"[:1000]
            self.state.to_publish(quorum, message)
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
        """Votes; True when the step is committed everywhere.

        Three store round trips on the way of the step's last voter: its ``add``, its
        ``compare_set`` of the decision, and the others' read of it once their ``wait``
        ends. The last voter writes ``ok:same`` when no replica announced itself or asked
        to join a round since the quorum was decided, as far as its watcher has read the
        registry version (every few heartbeat intervals, see the watcher): the next step
        then reuses the quorum without a round; else it writes ``ok:full``. An error
        writes ``fail``. The first write wins. A replica that announced itself (or waits
        in a round the members did not join) is thus taken in at the first commit after
        the voters' watchers saw it, a fraction of a second later (well within
        ``join_timeout``, which the new replica's round waits for the others).
        """
        key = commit_key(quorum)
        decision: bytes | None = None
        try:
            if self.state.error is None:
                proposal = commit_proposal(
                    self._store.add(votes_key(quorum), 1),
                    quorum,
                    group_world_size=self._config.group_world_size,
                    registry_version=self.state.registry_version,
                )
                if proposal is not None:
                    decision = self._store.compare_set(key, "", proposal)
            if decision is None:
                decision = self._await_decision(quorum, deadline)
        except StoreTimeoutError as error:
            # The store does not answer: no decision can be read, so this replica does
            # not commit; the watcher writes the failure once the store answers again.
            self.report_error(error)
            decision = COMMIT_FAIL.encode()
        outcome = read_commit(decision)
        self._reuse_quorum = outcome.reuse_quorum
        committed = outcome.committed
        if not committed and self.state.error is None:
            # Another replica failed the step before this one's watcher saw why: take
            # its reason now, so that errored() and the log say it before "discarded".
            try:
                reported = reported_error(self._store, quorum)
            except StoreTimeoutError:
                reported = None
            self.fail(
                reported or ReplicaError("another replica failed the step"),
                self.state.generation,
                publish=False,
            )
        return committed

    def _await_decision(self, quorum: Quorum, deadline: float) -> bytes:
        """The commit decision, after one blocking wait (no check first: it is rarely there).

        The wait ends when the last voter writes the decision, or when any replica
        fails the step: each writes ``fail`` to the key (:meth:`_fail`), this replica's
        watcher too when a peer stops beating or the deadline passes. No wait with a
        short timeout, then: torch logs a warning each time one runs out.
        """
        key = commit_key(quorum)
        if self.state.error is not None:  # failed before voting: publish it here, to be sure
            self._publish_failure(quorum)
        else:
            self.state.set_deadlines(allreduce=None, vote=deadline)
            try:
                grace = max(deadline - time.monotonic(), 0.0) + _VOTE_WAIT_GRACE_SECONDS
                self._store.wait([key], timedelta(seconds=grace))
            except StoreTimeoutError:
                raise
            except Exception:  # torch raises DistStoreError (or RuntimeError) on a timeout
                if not self._store.check([key]):
                    self.report_error(
                        TimeoutError(f"no commit decision within {self._config.timeout}")
                    )
                    self._publish_failure(quorum)
            finally:
                self.state.set_deadlines(allreduce=None, vote=None)
        # The key exists now, so this reads it in one round trip (get would first wait
        # again): compare_set answers with the stored value unless it equals "ok:same",
        # which it then leaves as it is.
        return bytes(self._store.compare_set(key, COMMIT_SAME, COMMIT_SAME))

    def _publish_failure(self, quorum: Quorum) -> None:
        """Writes this step's failure to the store from the training thread, before it ends.

        The watcher writes it too, as soon as it can; this write makes sure that
        ``err/<quorum id>`` exists before this replica asks for its next quorum, so that
        the round gives the group a new id instead of keeping the one whose exchanges
        failed.
        """
        error = self.state.error
        message = f"{self._config.replica_id}: {type(error).__name__}: {error}"[:1000]
        self._store.set(error_key(quorum), message)
        self._store.compare_set(commit_key(quorum), "", COMMIT_FAIL)

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
            if self._config.group_rank == 0:  # the group leaves with its rank 0
                Liveness(self._store, timedelta(seconds=1)).leave(self._config.replica_id)
            else:  # a counter of 0 reads as "not started": rank 0 does not break the group
                self._store.set(f"hb/{self._group_name()}/{self._config.group_rank}", "0")
        except Exception:
            self._log.warning(
                "could not tell the store that %s left", self._config.replica_id, exc_info=True
            )
        for store in (self._store, self._quorum_store, self._quorum_liveness.store):
            if isinstance(store, BoundedStore):
                store.close()
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
