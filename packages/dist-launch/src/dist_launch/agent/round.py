"""One round of this node's workers: one owner, one result.

A :class:`Round` owns, from its start to its end, everything that lives for one round
of the job: the rendezvous's membership watch (a node closed the job, nodes join or
left), the job's progress board (c10d, several nodes), the hang watch, and the workers
(:class:`~dist_launch.workers.worker_group.WorkerGroup`). Every one is stopped on every
way out of :meth:`Round.run`, which returns one :class:`RoundResult`: how the round
ended and what the agent needs to decide what comes next
(:func:`~dist_launch.agent.next_step.decide_next`). The agent routes the signals it
receives to the round in progress (:meth:`Round.interrupt`, :meth:`Round.dump_stacks`,
:meth:`Round.resize`).

When the hang watch finds the group hung, the round stops nothing at first: it asks
every rank for its collective records (:mod:`dist_launch.watch.rank_requests`) and its
Python stack, waits for both (bounded), exchanges them with the other nodes on the job
board (c10d: every node raised the alarm by then), decides the verdict
(:func:`~dist_launch.diagnostics.verdict.decide_verdict`), prints it and writes
``hang.json``, and only then stops the workers. With ``--slow-ranks`` the round also
runs the slow-rank report (:mod:`dist_launch.watch.slow_rank_watch`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import re
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Literal

from dist_core.supervisor import GroupOutcome
from dist_launch.agent.event_loop import EventLoop
from dist_launch.diagnostics.failure_class import FailureClass, Fingerprint, classify_failure
from dist_launch.diagnostics.flight_records import (
    RankRecords,
    RecordsError,
    records_from_json,
    records_to_json,
)
from dist_launch.diagnostics.hang_json import RankPlace, hang_document
from dist_launch.diagnostics.hang_report import HangReport
from dist_launch.diagnostics.records_alive import alive_at
from dist_launch.diagnostics.stacks import format_stack_dump, without_launcher_frames
from dist_launch.diagnostics.verdict import decide_verdict
from dist_launch.output.log_layout import LogLayout, write_torch_error_file
from dist_launch.plan.hang_policy import HangPolicy
from dist_launch.plan.launch_plan import LaunchPlan
from dist_launch.rendezvous.job_board import JobBoard
from dist_launch.rendezvous.protocol import Assignment, FailureRecord, Rendezvous, RoundChange
from dist_launch.watch.cut_watch import (
    HANG_SILENCE_SECONDS,
    CutWatch,
    node_ranks,
    start_cut_watch,
)
from dist_launch.watch.file_timer import FILE_VARIABLE, FileTimerWatch
from dist_launch.watch.hang_watch import HangWatch, node_name
from dist_launch.watch.partition import Unreachable, decide_side
from dist_launch.watch.peer_probe import unreachable_peers
from dist_launch.watch.rank_requests import RankRequests
from dist_launch.watch.slow_rank_watch import SLOW_RANKS_FILE, SlowRankWatch
from dist_launch.workers.fork_server_client import ForkServerClient
from dist_launch.workers.worker_group import WorkerGroup

logger = logging.getLogger(__name__)

# How long the ranks may take to answer a hang's records request (their stacks are
# taken meanwhile, at most dist-core's STACK_DUMP_SECONDS).
RECORDS_SECONDS = 5.0
# How often the launcher looks for the ranks' answer files while it waits for them.
ANSWER_POLL_SECONDS = 0.02
# How long the other nodes' records of a hang are waited for; past it the verdict
# covers the nodes that answered.
HANG_EXCHANGE_SECONDS = 15.0
# The records a node shares for a hang's verdict: the last few of each group.
SHARED_OPS = 8
HANG_TOPIC = "hang"

_ADDRESS_IN_USE = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)


@dataclass(frozen=True)
class RoundContext:
    """What outlives a round: built once by the agent, given to every round.

    Attributes:
        node_env: The variables every worker of this node shares
            (:func:`~dist_launch.workers.environment.node_environment`).
        fork_server: The warm fork server, or None to start fresh interpreters.
        layout: The run's log directory, when some stream goes to a file.
        timers: torch elastic's timer server, when the launcher serves one.
        deadline: When ``--timeout`` ends (monotonic), or None.
    """

    node_env: Mapping[str, str]
    fork_server: ForkServerClient | None = None
    layout: LogLayout | None = None
    timers: FileTimerWatch | None = None
    deadline: float | None = None


RoundEnding = Literal[
    "succeeded", "failed", "hung", "timed_out", "interrupted", "changed", "start_failed"
]


@dataclass(frozen=True)
class RoundResult:
    """How a round ended.

    Attributes:
        ending: ``succeeded`` (every rank exited 0), ``failed`` (a rank failed),
            ``hung`` (no progress for ``--hang-timeout``, or an expired torch elastic
            timer), ``timed_out`` (``--timeout``), ``interrupted`` (a signal stopped the
            workers), ``changed`` (the rendezvous asked for a new round: :attr:`change`),
            ``start_failed`` (the workers could not be started: :attr:`message`).
        group: The workers' outcome; None when they never started.
        change: What the membership watch saw, if it saw something.
        hang: The hang's report, for ``hung``.
        record: This node's record of a failed or hung round, as shared with the
            other nodes (the rank it blames, and whether that is only an effect).
        address_in_use: The root cause's traceback says its master port was taken.
        learned_quiet: The longest quiet interval ``--hang-timeout auto`` learned so far.
        message: Why the workers could not be started.
        failure: For ``failed``, what kind of failure it was (worth a restart or not).
    """

    ending: RoundEnding
    group: GroupOutcome | None = None
    change: RoundChange | None = None
    hang: HangReport | None = None
    record: FailureRecord | None = None
    address_in_use: bool = False
    learned_quiet: float = 0.0
    message: str = ""
    failure: FailureClass | None = None


def address_in_use(outcome: GroupOutcome) -> bool:
    """True when the root cause's traceback says its master port was taken."""
    root = outcome.root_cause
    return (
        root is not None
        and root.record is not None
        and _ADDRESS_IN_USE.search(root.record.traceback) is not None
    )


def round_ending(
    outcome: GroupOutcome, hang: HangReport | None, change: RoundChange | None
) -> RoundEnding:
    """How a round whose workers ran ended, from their outcome and what was watched."""
    if outcome.status == "succeeded":
        return "succeeded"
    if change is not None and change.kind == "unreachable":
        return "changed"  # fenced off a cut: the store's side decides, not this one
    if hang is not None:
        return "hung"
    if change is not None and outcome.status == "interrupted":
        return "changed"
    if outcome.status in ("timed_out", "interrupted"):
        return outcome.status
    return "failed"


def hang_record(
    hang: HangReport, assignment: Assignment, host: str, local_ranks: range | None = None
) -> FailureRecord:
    """This node's record of a hang: the rank it blames, and whether it is another node's.

    The first rank behind the verdict's collective, when the records name one (an
    effect here when that rank runs on another node); else the odd rank out of the
    stacks, else this node's first rank (an effect: every rank here waits in the same
    place, so the rank they wait for, if any node can name it, is another node's).
    """
    verdict = hang.verdict
    if verdict is not None and verdict.collective is not None and verdict.behind:
        rank = verdict.behind[0]
        local = local_ranks if local_ranks is not None else range(rank, rank + 1)
        return FailureRecord(
            node=host,
            group_rank=assignment.group_rank,
            rank=rank,
            timestamp=time.time(),
            summary=f"hang: {verdict.headline()}",
            consequence=rank not in local,
        )
    odd = hang.odd_rank
    return FailureRecord(
        node=host,
        group_rank=assignment.group_rank,
        rank=odd if odd is not None else min(hang.stacks, default=assignment.base_rank),
        timestamp=time.time(),
        summary=f"hang: {hang.summary}",
        consequence=odd is None,
    )


def cut_record(lost: list[Unreachable], assignment: Assignment) -> FailureRecord:
    """This node's record of a hang whose ranks wait for nodes cut off from it: the cut.

    It names the first node cut off, and its first rank, as the failure's place.
    """
    first = lost[0]
    return FailureRecord(
        node=first.peer.host,
        group_rank=first.peer.node,
        rank=first.peer.ranks[0] if first.peer.ranks else assignment.base_rank,
        timestamp=time.time(),
        summary="cut off: " + "; ".join(node.describe() for node in lost),
        consequence=False,
    )


@dataclass(frozen=True)
class Collected:
    """What a hang's collection brought: every rank's records and stack, and where it runs."""

    records: dict[int, RankRecords]
    stacks: dict[int, str]
    places: dict[int, RankPlace]
    collect_s: float


class Round:
    """One round of this node's workers; see the module docstring.

    Args:
        plan: The launch plan.
        assignment: This node's place in the round.
        rdzv: The rendezvous that formed the round.
        context: What outlives the round.
        loop: The launcher's event loop.
        attempt: The round's number in this run.
        learned_quiet: What ``--hang-timeout auto`` learned in earlier rounds.
        previous_failure: The root cause's fingerprint of the last failed round, if any
            (the same error at the same place again is deterministic).
    """

    def __init__(
        self,
        plan: LaunchPlan,
        assignment: Assignment,
        rdzv: Rendezvous,
        context: RoundContext,
        loop: EventLoop,
        *,
        attempt: int,
        learned_quiet: float = 0.0,
        previous_failure: Fingerprint | None = None,
    ) -> None:
        self.plan = plan
        self.previous_failure = previous_failure
        self.assignment = assignment
        self.rdzv = rdzv
        self.context = context
        self.loop = loop
        self.attempt = attempt
        self.learned_quiet = learned_quiet
        self._group: WorkerGroup | None = None
        # (signum, delivered) received before the workers existed
        self._signals: list[tuple[int, bool]] = []
        self._change: RoundChange | None = None
        self._cut: CutWatch | None = None
        self._lost: list[Unreachable] = []  # the nodes cut off from this one, at a hang
        self._pids: list[int] = []
        self._quiet_since: Callable[[], float] = time.time

    # -- what the agent routes here -------------------------------------------------

    def interrupt(self, signum: int, *, delivered: bool = False) -> None:
        """A stopping signal: every worker gets it, after its stack was taken.

        With ``delivered``, it reached every worker already (the scheduler signalled
        them all): none is sent again; the grace period starts.
        """
        if self._group is None:
            self._signals.append((signum, delivered))
        else:
            self._group.interrupt(signum, delivered=delivered)

    def notify(self, signum: int) -> list[int]:
        """A notification (``--signals-to-forward``): every running worker gets it."""
        return [] if self._group is None else self._group.notify(signum)

    def dump_stacks(self) -> str | None:
        """Every running rank's stack, stopping nothing (SIGQUIT); None without workers."""
        group = self._group
        if group is None or group.supervisor is None or not group.supervisor.workers:
            return None
        group.supervisor.dump_stacks()
        return format_stack_dump(group.supervisor.outcomes, "SIGQUIT; nothing stopped")

    def resize(self) -> None:
        """The launcher's terminal was resized (SIGWINCH)."""
        if self._group is not None:
            self._group.resize()

    def _on_change(self, why: RoundChange) -> None:
        """On the loop (posted by the membership watch's thread): the round must end."""
        if self._change is None:
            self._change = why
            self.interrupt(signal.SIGTERM)

    def _on_fence(self, why: str) -> None:
        """On the loop (the cut watch): this side of a cut may not go on.

        Its workers are killed at once, with no grace period: a checkpoint written now
        could overwrite the one the side that goes on writes to the same path.
        """
        if self._change is None or self._change.kind != "unreachable":
            self._change = RoundChange("unreachable", why)
        self.interrupt(signal.SIGKILL)

    # -- the round ------------------------------------------------------------------

    def _hang_policy(self) -> HangPolicy:
        policy = self.plan.hang_policy
        if self.plan.target.no_python and policy.mode == "auto":
            return HangPolicy("off")  # no bootstrap: no stack to watch (documented)
        return policy

    def run(self) -> RoundResult:
        """Runs the round to its end; every part of it is stopped when this returns."""
        plan, loop = self.plan, self.loop
        deadline = self.context.deadline
        timeout = None if deadline is None else max(0.01, deadline - time.monotonic())
        with contextlib.ExitStack() as stack:
            watch = self.rdzv.watch(
                plan.monitor_interval, lambda why: loop.post(partial(self._on_change, why))
            )
            # Stopped first thing on the way out, then a change it posted meanwhile is read.
            stack.callback(loop.run_posted)
            stack.callback(watch.stop)
            policy = self._hang_policy()
            board = None
            if policy.enabled or plan.slow_ranks is not None:
                board = self.rdzv.job_board(policy.look_period)
            if board is not None:
                stack.callback(board.stop)
            group = stack.enter_context(
                WorkerGroup(
                    plan,
                    self.assignment,
                    self.context.node_env,
                    loop,
                    self.context.fork_server,
                    self.context.layout,
                    attempt=self.attempt,
                    timeout=timeout,
                )
            )
            # Introduced on the board before the workers start: a cut may come early.
            if board is not None:
                self._cut = start_cut_watch(
                    board, self.plan, self.assignment, group.hostname, self._on_fence, self.rdzv
                )
                stack.callback(setattr, self, "_cut", None)
                stack.callback(loop.remove_timer, loop.add_timer(self._cut.due))
            hang_watch = HangWatch(
                policy,
                group.run_dir,
                node_name(group.hostname, self.assignment.group_rank),
                self.context.timers,
                self.learned_quiet,
                board,
            )
            stack.callback(hang_watch.close)
            requests = None
            if not plan.target.no_python and (
                policy.enabled or self.context.timers is not None or plan.slow_ranks is not None
            ):
                requests = RankRequests(group.run_dir)
            self._group = group
            stack.callback(setattr, self, "_group", None)
            for signum, delivered in self._signals:
                group.interrupt(signum, delivered=delivered)
            node_variables = {}
            if self.context.timers is not None:
                node_variables[FILE_VARIABLE] = self.context.timers.path
            try:
                workers = group.start(
                    node_variables=node_variables,
                    rank_variables=partial(self._rank_variables, hang_watch, requests),
                    on_output=hang_watch.output,
                )
            except (OSError, RuntimeError) as error:
                return RoundResult(
                    "start_failed",
                    learned_quiet=hang_watch.quiet.longest_quiet,
                    message=f"error: could not start the workers: {error}",
                )
            for worker in workers:
                hang_watch.started(worker.rank, worker.pid)
            self._pids = [worker.pid for worker in workers if worker.pid is not None]
            self._quiet_since = lambda: time.time() - hang_watch.quiet.quiet_for(time.monotonic())
            stack.callback(loop.remove_timer, loop.add_timer(hang_watch.due))
            if requests is not None and plan.slow_ranks is not None:
                slow = self._slow_rank_watch(plan.slow_ranks, requests, board, group.hostname)
                stack.callback(loop.remove_timer, loop.add_timer(slow.due))
            records, asked_at = self._watch(group, hang_watch, requests)
            collected = None
            if hang_watch.reason is not None and not group.ended:
                # Nothing is stopped before every rank's records and stack are in hand.
                collected = self._collect(group, requests, board, records, asked_at)
                group.interrupt(signal.SIGTERM, take_stacks=False)
                loop.run_until(lambda: group.ended)
            outcome = group.finish()
            hang = self._hang_report(hang_watch, outcome, collected)
            if hang is not None:
                self._report_hang(hang, collected)
            else:
                group.write_error_files(outcome)
            host = group.hostname
            learned_quiet = hang_watch.quiet.longest_quiet
        return self._result(outcome, hang, host, learned_quiet)

    def _result(
        self, outcome: GroupOutcome, hang: HangReport | None, host: str, learned_quiet: float
    ) -> RoundResult:
        ending = round_ending(outcome, hang, self._change)
        record = None
        failure = None
        if ending == "hung":
            assert hang is not None
            base = self.assignment.base_rank
            record = hang_record(hang, self.assignment, host, range(base, base + self.plan.nproc))
            if self._lost:
                # The cut is the cause: every node's log names it, none waits for another's.
                record = cut_record(self._lost, self.assignment)
        elif ending == "failed":
            failure = classify_failure(outcome, self.previous_failure)
            record = dataclasses.replace(
                FailureRecord.of_round(outcome, self.assignment.group_rank), kind=failure.kind
            )
        elif ending == "timed_out":
            outcome.timeout = self.plan.timeout  # the job's, not this round's remainder
        return RoundResult(
            ending,
            outcome,
            change=self._change,
            hang=hang,
            record=record,
            address_in_use=address_in_use(outcome),
            learned_quiet=learned_quiet,
            failure=failure,
        )

    def _rank_variables(
        self, hang_watch: HangWatch, requests: RankRequests | None, rank: int
    ) -> dict[str, str]:
        variables = hang_watch.worker_variables(rank)
        if requests is not None:
            variables.update(requests.worker_variables(rank))
        return variables

    def _slow_rank_watch(
        self, window: float, requests: RankRequests, board: JobBoard | None, host: str
    ) -> SlowRankWatch:
        layout = self.context.layout
        base = self.assignment.base_rank
        return SlowRankWatch(
            window,
            requests,
            self.loop.call_in_thread,
            job_ranks=range(self.assignment.world_size),
            nodes={base + i: self.assignment.group_rank for i in range(self.plan.nproc)},
            board=board,
            log_file=None if layout is None else layout.launcher_dir / SLOW_RANKS_FILE,
            attempt=self.attempt,
            host=host,
        )

    def _watch(
        self, group: WorkerGroup, hang_watch: HangWatch, requests: RankRequests | None
    ) -> tuple[dict[int, RankRecords] | None, float]:
        """Runs the round until it ends or hangs; a suspected hang is checked first.

        The records have the last word before an alarm: the ranks' counters, read again
        once the beacons have answered (they look before they answer), and the records
        themselves (:func:`~dist_launch.diagnostics.records_alive.alive_at`). Nothing is
        signalled meanwhile.

        Returns:
            The records read for the suspicion that was confirmed, if any, and when
            they were asked for (monotonic).
        """
        loop = self.loop
        while True:
            loop.run_until(
                lambda: (
                    group.ended or hang_watch.reason is not None or hang_watch.suspicion is not None
                )
            )
            asked_at = time.monotonic()
            if hang_watch.suspicion is None:
                return None, asked_at
            records = None if group.ended else self._ask_records(requests)
            if group.ended:
                return None, asked_at  # the workers ended (meanwhile): their outcome says how
            now = time.monotonic()
            if hang_watch.look_again(now):
                hang_watch.dismiss(now)
                continue
            timeout = hang_watch.quiet.timeout()
            base = self.assignment.base_rank
            alive = None
            if records is not None and timeout is not None:
                alive = alive_at(
                    records,
                    ranks=range(base, base + self.plan.nproc),
                    now_ns=time.time_ns(),
                    within_s=timeout,
                )
            if alive is not None:
                hang_watch.dismiss(now, now - (time.time_ns() - alive) / 1e9)
                continue
            hang_watch.confirm()
            return records, asked_at

    def _probe_peers(self, hostname: str) -> list[Unreachable]:
        """Without a store (static): the peer hosts that do not answer.

        Fences this side when it reaches no majority of the nodes
        (:func:`~dist_launch.watch.partition.decide_side`): of two halves, neither goes on.
        """
        assignment = self.assignment
        nodes = assignment.group_world_size
        lost = unreachable_peers(
            self._pids,
            assignment.master_addr,
            assignment.master_port,
            nodes,
            assignment.group_rank,
            node_ranks(assignment.base_rank, self.plan.nproc, nodes, assignment.group_rank),
            hostname,
            self._quiet_since(),
        )
        if not lost:
            return lost
        decision = decide_side(
            has_store=False,
            store_reachable=False,
            reachable_nodes=max(1, nodes - len(lost)),
            round_nodes=nodes,
        )
        if decision.side == "fence":
            self._on_fence(
                f"{decision.why}: this node stops its workers (fenced off a cut)"
                + "".join(f"\n  {node.describe()}" for node in lost)
            )
        return lost

    def _ask_records(self, requests: RankRequests | None) -> dict[int, RankRecords] | None:
        """This node's ranks' records, waited for at most ``RECORDS_SECONDS``.

        Returns:
            The records by rank, or None when no rank can be asked or reading failed.
        """
        loop = self.loop
        started = time.monotonic()
        request = requests.send("hang") if requests is not None else None
        if requests is not None and request is not None:
            asked = len(request.asked)
            # The answers are files: nothing wakes the loop when one appears, so it
            # looks for them at a short cadence of its own while it waits.
            poll = loop.add_timer(lambda now: now + ANSWER_POLL_SECONDS)
            try:
                loop.run_until(
                    lambda: len(requests.answered(request)) >= asked, started + RECORDS_SECONDS
                )
            finally:
                loop.remove_timer(poll)
        if requests is None or request is None:
            return None
        parsing = loop.call_in_thread(lambda: requests.read(request), "records-read")
        loop.run_until(lambda: parsing.done)
        return parsing.result if parsing.error is None else None

    def _collect(
        self,
        group: WorkerGroup,
        requests: RankRequests | None,
        board: JobBoard | None,
        records_read: dict[int, RankRecords] | None,
        started: float,
    ) -> Collected:
        """Every rank's records and stack, this node's and (c10d) the other nodes'.

        Args:
            group: This node's workers.
            requests: The ranks' request channel, if they have one.
            board: The job board (several nodes), if any.
            records_read: This node's records, when the suspicion's check read them.
            started: When the records were asked for (monotonic).
        """
        assignment = self.assignment
        if self._cut is not None:
            self._lost = self._cut.at_hang()
        elif board is None and assignment.group_world_size > 1:
            self._lost = self._probe_peers(group.hostname)
        if records_read is None:
            records_read = self._ask_records(requests)
        # faulthandler's stacks once the beacons have answered: a beacon thread caught
        # writing its records was dumped as a frame or two of pathlib, without the
        # beacon's own frame that marks it as the launcher's, and read as the rank's place.
        stacks = group.take_stacks()
        records: dict[int, RankRecords] = dict(records_read or {})
        base, host = assignment.base_rank, group.hostname
        places: dict[int, RankPlace] = {}
        why = "no Python bootstrap (--no-python)" if self.plan.target.no_python else "none sent"
        for local_rank in range(self.plan.nproc):
            rank = base + local_rank
            places[rank] = RankPlace(assignment.group_rank, host, local_rank)
            records.setdefault(rank, RankRecords(rank, None, {}, missing=why))
        collect_s = time.monotonic() - started
        if board is not None and not self._lost:
            self._exchange(board, records, stacks, places)
        return Collected(records, stacks, places, collect_s)

    def _exchange(
        self,
        board: JobBoard,
        records: dict[int, RankRecords],
        stacks: dict[int, str],
        places: dict[int, RankPlace],
    ) -> None:
        """Shares this node's ranks' records and stacks; merges the other nodes' (bounded)."""
        own = {
            str(rank): {
                "records": records_to_json(records[rank], last=SHARED_OPS),
                "stack": without_launcher_frames(stacks.get(rank, "")),
                "place": [places[rank].node, places[rank].host, places[rank].local_rank],
            }
            for rank in places
        }
        board.share(HANG_TOPIC, json.dumps(own))
        deadline = time.monotonic() + HANG_EXCHANGE_SECONDS
        cut = self._cut
        self.loop.run_until(
            lambda: (
                board.shared(HANG_TOPIC) is not None
                or (cut is not None and bool(cut.unreachable(silent_after=HANG_SILENCE_SECONDS)))
            ),
            deadline,
        )
        shared = board.shared(HANG_TOPIC)
        if shared is None:
            logger.warning(
                "the other nodes' records did not arrive within %g s: the verdict covers "
                "this node's ranks",
                HANG_EXCHANGE_SECONDS,
            )
            return
        for node, payload in shared.items():
            try:
                for key, value in json.loads(payload).items():
                    rank = int(key)
                    records[rank] = records_from_json(value["records"], rank, f"node {node}")
                    stacks[rank] = str(value["stack"])
                    place_node, place_host, local_rank = value["place"]
                    places[rank] = RankPlace(int(place_node), str(place_host), int(local_rank))
            except (ValueError, KeyError, TypeError, RecordsError) as error:
                logger.warning("node %d's records could not be read: %s", node, error)

    def _hang_report(
        self, hang_watch: HangWatch, outcome: GroupOutcome, collected: Collected | None
    ) -> HangReport | None:
        reason = hang_watch.reason
        if reason is None:
            return None
        stacks = {rank.rank: rank.live_stack for rank in outcome.ranks if rank.live_stack}
        verdict = None
        if collected is not None:
            verdict = decide_verdict(
                collected.records,
                job_ranks=range(self.assignment.world_size),
                stacks=collected.stacks,
            )
        lost = self._lost
        if verdict is not None and lost:
            cut_off = {rank for node in lost for rank in node.peer.ranks}
            verdict = dataclasses.replace(
                verdict, unknown=tuple(r for r in verdict.unknown if r not in cut_off)
            )
        unreachable = tuple(node.describe() for node in lost)
        return HangReport(reason, hang_watch.node, stacks, verdict, unreachable)

    def _report_hang(self, hang: HangReport, collected: Collected | None) -> None:
        """Prints the hang's report; writes hang.txt, hang.json and each rank's error.json."""
        text = hang.format()
        path = self._write_hang_files(hang, collected)
        if path is not None:
            text += f"\ndist-launch: hang details in {path}"
        print(text, file=sys.stderr, flush=True)

    def _write_hang_files(self, hang: HangReport, collected: Collected | None) -> str | None:
        """The hang's files in the attempt's directory; returns hang.json's path, if written."""
        layout = self.context.layout
        if layout is None:
            return None
        # The attempt's directories exist: the worker group made them.
        attempt_dir = layout.attempt_dir(self.attempt)
        (attempt_dir / "hang.txt").write_text(hang.format() + "\n")
        now = time.time()
        base = self.assignment.base_rank
        for local_rank in range(self.plan.nproc):
            stack = without_launcher_frames(hang.stacks.get(base + local_rank, ""))
            write_torch_error_file(
                layout.error_file(self.attempt, local_rank),
                message=f"HangError: {hang.reason}; {hang.summary}",
                traceback=stack,
                timestamp=now,
            )
        if hang.verdict is None or collected is None:
            return None
        document = hang_document(
            reason=hang.reason,
            node=hang.node,
            attempt=self.attempt,
            time=datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat(timespec="seconds"),
            verdict=hang.verdict,
            records=collected.records,
            stacks=collected.stacks,
            places=collected.places,
            collect_s=collected.collect_s,
            unreachable=[node.to_json() for node in self._lost],
        )
        path = attempt_dir / "hang.json"
        path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
        return str(path)
