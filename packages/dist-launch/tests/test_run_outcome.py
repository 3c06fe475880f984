"""How a run ended, as one value: its exit status, its report, and the agent's decisions.

No process is started: the group outcomes are built by hand, the rendezvous is the
static one or the c10d one on :mod:`fake_rendezvous`'s store.
"""

from __future__ import annotations

import io
import signal

import pytest
from fake_rendezvous import FakeJob

from dist_core.rank_files import ErrorRecord
from dist_core.supervisor import GroupOutcome, RankOutcome
from dist_launch.agent.agent import Agent
from dist_launch.agent.next_step import decide_next, needs_membership
from dist_launch.agent.round import RoundResult, hang_record
from dist_launch.agent.run_outcome import (
    RunOutcome,
    exit_code_of,
    format_run_outcome,
    report_run_outcome,
)
from dist_launch.diagnostics.hang_report import HangReport
from dist_launch.exit_codes import ExitCode
from dist_launch.plan.build import build_plan
from dist_launch.plan.launch_plan import LaunchPlan
from dist_launch.rendezvous.c10d import C10dRendezvous
from dist_launch.rendezvous.protocol import Assignment, FailureRecord, Rendezvous
from dist_launch.rendezvous.static import StaticRendezvous

PROG = "dist-launch"


def failed_group(returncode: int = 3, rank: int = 1) -> GroupOutcome:
    ranks = [
        RankOutcome(r, r, 0, status="stopped", returncode=-15, stop_signal=15) for r in range(2)
    ]
    ranks[rank] = RankOutcome(rank, rank, 0, status="failed", returncode=returncode, ended_at=1.0)
    return GroupOutcome("failed", ranks)


@pytest.mark.parametrize(
    ("outcome", "status"),
    [
        (RunOutcome("succeeded"), ExitCode.SUCCESS),
        # The rank's own exit code is in the report, not the launcher's.
        (RunOutcome("failed", failed_group(returncode=3), failure="error"), ExitCode.FAILED),
        (RunOutcome("failed", failed_group(), failure="deterministic"), ExitCode.FAILED),
        (
            RunOutcome("failed", failed_group(returncode=-9), failure="infrastructure"),
            ExitCode.INFRASTRUCTURE,
        ),
        (RunOutcome("failed"), ExitCode.FAILED),
        (RunOutcome("timed_out", GroupOutcome("timed_out", [], timeout=5.0)), ExitCode.TIMEOUT),
        (RunOutcome("interrupted", signum=signal.SIGTERM), ExitCode.PREEMPTED),
        (RunOutcome("interrupted", signum=signal.SIGHUP), ExitCode.PREEMPTED),
        (RunOutcome("interrupted", failed_group(), signum=signal.SIGINT), ExitCode.INTERRUPTED),
        (RunOutcome("closed", message="the job was closed: x"), ExitCode.FAILED),
        (RunOutcome("rendezvous_failed", message="error: x"), ExitCode.INFRASTRUCTURE),
        (RunOutcome("start_failed", message="error: x"), ExitCode.INFRASTRUCTURE),
        (RunOutcome("usage", message="error: x"), ExitCode.USAGE),
        (RunOutcome("hung", failed_group(returncode=-15)), ExitCode.HUNG),
    ],
)
def test_each_outcome_has_its_documented_exit_status(outcome: RunOutcome, status: int) -> None:
    assert exit_code_of(outcome) == status


def test_an_outcome_names_the_rank_and_its_exit_code() -> None:
    outcome = RunOutcome("failed", failed_group(returncode=7, rank=0))
    assert (outcome.rank, outcome.returncode) == (0, 7)
    assert (RunOutcome("closed").rank, RunOutcome("closed").returncode) == (None, None)


def test_the_report_comes_first_and_the_launchers_words_last() -> None:
    text = format_run_outcome(
        RunOutcome("failed", failed_group(), message="restart budget spent"), PROG
    )
    lines = text.splitlines()
    assert lines[0] == "dist-launch: rank 1 (local rank 1, node 0) failed first with exit code 3"
    assert lines[-1] == "dist-launch: restart budget spent"


def test_an_interruption_ends_with_the_signal_name() -> None:
    text = format_run_outcome(RunOutcome("interrupted", signum=signal.SIGTERM), PROG)
    assert text == "dist-launch: interrupted by SIGTERM"


def test_a_success_prints_nothing() -> None:
    stream = io.StringIO()
    assert (
        report_run_outcome(RunOutcome("succeeded", GroupOutcome("succeeded", [])), PROG, stream)
        == 0
    )
    assert stream.getvalue() == ""


def test_the_report_is_printed_once_with_the_status() -> None:
    stream = io.StringIO()
    status = report_run_outcome(RunOutcome("usage", message="error: bad flag"), PROG, stream)
    assert (status, stream.getvalue()) == (2, "dist-launch: error: bad flag\n")


# -- the agent carrying out its decision after a round, against a rendezvous -----------


def plan_of(script: str, **flags: str) -> LaunchPlan:
    return build_plan({"target": script, "nproc_per_node": "2", **flags}, environ={})


def carry_out(plan: LaunchPlan, rdzv: Rendezvous, result: RoundResult) -> RunOutcome | None:
    """What the agent does after a round with ``result`` (None: the next round)."""
    agent = Agent(plan)
    try:
        action = decide_next(
            result,
            interrupted=None,
            port_retries=0,
            membership_changing=needs_membership(result) and rdzv.membership_changing(),
            node_rank=0,
            host="h",
            max_restarts=plan.max_restarts,
        )
        return agent.carry_out(action, rdzv)
    finally:
        agent.loop.close()


def failed_round(rdzv: Rendezvous, group: GroupOutcome) -> RoundResult:
    assignment: Assignment = rdzv.next_round()
    record = FailureRecord.of_round(group, assignment.group_rank)
    return RoundResult("failed", group, record=record)


def test_static_restarts_until_this_nodes_budget_is_spent(
    script: str, caplog: pytest.LogCaptureFixture
) -> None:
    plan = plan_of(script, max_restarts="1", master_port="29998")
    rdzv = StaticRendezvous(plan)
    assert carry_out(plan, rdzv, failed_round(rdzv, failed_group())) is None
    assert "restarting the local worker group (restart 1 of 1) after: rank 1 failed" in caplog.text
    ended = carry_out(plan, rdzv, failed_round(rdzv, failed_group()))
    assert ended is not None and (ended.status, ended.message) == ("failed", "")


def test_c10d_spent_budget_closes_the_job_and_says_why(script: str) -> None:
    plan = plan_of(
        script, rdzv_backend="c10d", rdzv_endpoint="node0:29400", rdzv_id="job", max_restarts="0"
    )
    job = FakeJob()
    rdzv = C10dRendezvous(plan, job.handler(0))
    ended = carry_out(plan, rdzv, failed_round(rdzv, failed_group()))
    assert ended is not None and ended.status == "failed"
    assert ended.message.startswith(
        "restart budget spent (0 job-wide); first failure: rank 1 on node 0"
    )
    assert job.closed


def test_c10d_lost_peers_while_re_forming_cost_no_restart(script: str) -> None:
    plan = plan_of(
        script, rdzv_backend="c10d", rdzv_endpoint="node0:29400", rdzv_id="job", max_restarts="0"
    )
    job = FakeJob(waiting=1)  # a node waits to join: the job re-forms
    group = failed_group()
    # Its only failed rank says no more than that a peer vanished.
    group.ranks[1].record = ErrorRecord(
        rank=1,
        timestamp=1.0,
        exception="RuntimeError",
        message="Connection reset by peer",
        traceback="RuntimeError: Connection reset by peer",
        exitcode=1,
    )
    assert group.ranks[1].is_peer_failure
    rdzv = C10dRendezvous(plan, job.handler(0))
    assert carry_out(plan, rdzv, failed_round(rdzv, group)) is None
    assert not job.closed
    job.waiting = 0  # the same failure in a stable job spends the budget
    rdzv = C10dRendezvous(plan, job.handler(0))
    assert carry_out(plan, rdzv, failed_round(rdzv, group)) is not None


def hung_round(rdzv: Rendezvous, group: GroupOutcome, hang: HangReport) -> RoundResult:
    assignment: Assignment = rdzv.next_round()
    return RoundResult("hung", group, hang=hang, record=hang_record(hang, assignment, "h"))


SLEEPING = 'Thread 0x1 (most recent call first):\n  File "/job/loader.py", line 4 in load\n'
WAITING = 'Thread 0x2 (most recent call first):\n  File "/job/train.py", line 9 in step\n'


def test_a_hang_restarts_within_the_budget_then_ends_hung(
    script: str, caplog: pytest.LogCaptureFixture
) -> None:
    plan = plan_of(script, max_restarts="1", master_port="29997")
    rdzv = StaticRendezvous(plan)
    hang = HangReport(
        "no rank made progress for 3 s", "h (node 0)", {0: WAITING, 1: SLEEPING, 2: WAITING}
    )
    assert carry_out(plan, rdzv, hung_round(rdzv, failed_group(), hang)) is None
    assert "restart 1 of 1) after: hang: ranks 0, 2 are at train.py:9 in step" in caplog.text
    assert "rank 1 is elsewhere: loader.py:4 in load" in caplog.text
    ended = carry_out(plan, rdzv, hung_round(rdzv, failed_group(), hang))
    assert ended is not None and ended.status == "hung"
    assert exit_code_of(ended) == ExitCode.HUNG
    assert format_run_outcome(ended, PROG).endswith("exit status 75")


def test_a_hang_on_c10d_names_the_odd_rank_to_every_node(script: str) -> None:
    plan = plan_of(
        script, rdzv_backend="c10d", rdzv_endpoint="node0:29400", rdzv_id="job", max_restarts="0"
    )
    job = FakeJob()
    hang = HangReport("why", "h (node 0)", {0: WAITING, 1: SLEEPING, 2: WAITING})
    rdzv = C10dRendezvous(plan, job.handler(0))
    ended = carry_out(plan, rdzv, hung_round(rdzv, failed_group(), hang))
    assert ended is not None and ended.status == "hung"
    assert ended.message.startswith("restart budget spent (0 job-wide); first failure: rank 1 ")
    assert job.closed
