"""The agent's decision after a round, row by row (no process, no rendezvous)."""

from __future__ import annotations

import signal

import pytest

from dist_core.supervisor import GroupOutcome, RankOutcome
from dist_launch.agent.next_step import (
    PORT_RETRIES,
    Action,
    CountFailure,
    End,
    ExitBarrier,
    JobClosed,
    Rejoin,
    ReplacePort,
    Restart,
    decide_after_count,
    decide_next,
    needs_membership,
)
from dist_launch.agent.round import RoundResult
from dist_launch.agent.run_outcome import RunOutcome, exit_code_of
from dist_launch.diagnostics.failure_class import FailureClass, FailureKind, Fingerprint
from dist_launch.exit_codes import ExitCode
from dist_launch.rendezvous.protocol import FailureCount, FailureRecord, RoundChange

DETERMINISTIC = FailureClass(
    "deterministic",
    Fingerprint("ImportError", "train.py:3"),
    "ImportError at train.py:3 before the process group existed",
)
NOT_RESTARTING = (
    "not restarting: rank 1 on node 0 (h): "
    "ImportError at train.py:3 before the process group existed "
    "(a restart would fail the same way)"
)
GROUP = GroupOutcome("failed", [RankOutcome(0, 0, 0, status="failed", returncode=1)])
CAUSE = FailureRecord("h", 0, 1, 1.0, "ValueError: x")
EFFECT = FailureRecord("h", 0, 1, 1.0, "peer vanished", consequence=True)


def result(ending: str, **fields: object) -> RoundResult:
    return RoundResult(ending, GROUP, **fields)  # type: ignore[arg-type]


def decide(
    round_result: RoundResult,
    *,
    interrupted: int | None = None,
    port_retries: int = 0,
    membership_changing: bool = False,
    can_leave: bool = False,
) -> Action:
    return decide_next(
        round_result,
        interrupted=interrupted,
        port_retries=port_retries,
        membership_changing=membership_changing,
        node_rank=1,
        host="h",
        max_restarts=2,
        can_leave=can_leave,
    )


ROWS: list[tuple[str, RoundResult, dict[str, object], Action]] = [
    (
        "succeeded",
        result("succeeded"),
        {},
        ExitBarrier(RunOutcome("succeeded", GROUP)),
    ),
    (
        "succeeded-even-if-interrupted",
        result("succeeded"),
        {"interrupted": signal.SIGTERM},
        ExitBarrier(RunOutcome("succeeded", GROUP)),
    ),
    (
        "interrupted",
        result("failed", record=CAUSE),
        {"interrupted": signal.SIGINT},
        End(
            RunOutcome("interrupted", GROUP, signum=signal.SIGINT),
            close_job="node h was interrupted by SIGINT",
        ),
    ),
    (
        "preempted-node-of-an-elastic-job",
        result("failed", record=CAUSE),
        {"interrupted": signal.SIGTERM, "can_leave": True},
        End(
            RunOutcome("interrupted", GROUP, signum=signal.SIGTERM),
            leave="node h was interrupted by SIGTERM; the other nodes go on without it",
        ),
    ),
    (
        "interrupted-before-a-hang",
        result("hung", record=CAUSE),
        {"interrupted": signal.SIGTERM},
        End(
            RunOutcome("interrupted", GROUP, signum=signal.SIGTERM),
            close_job="node h was interrupted by SIGTERM",
        ),
    ),
    (
        "start-failed",
        RoundResult("start_failed", message="error: could not start the workers: x"),
        {},
        End(RunOutcome("start_failed", message="error: could not start the workers: x")),
    ),
    (
        "hung",
        result("hung", record=CAUSE),
        {},
        CountFailure(
            CAUSE,
            RunOutcome(
                "hung",
                GROUP,
                message="the group hung and no restart is left (--max-restarts 2): exit status 75",
            ),
        ),
    ),
    (
        "closed-by-another-node",
        result("changed", change=RoundChange("closed")),
        {},
        JobClosed(),
    ),
    (
        "store-unreachable",
        result("changed", change=RoundChange("unreachable", "the store does not answer")),
        {},
        End(
            RunOutcome(
                "rendezvous_failed",
                message="error: unreachable: the store does not answer; this node stops",
            )
        ),
    ),
    (
        "membership",
        result("changed", change=RoundChange("membership", "1 node(s) waiting to join")),
        {},
        Rejoin("1 node(s) waiting to join: stopping this node's workers to re-form the job"),
    ),
    (
        "timed-out",
        result("timed_out"),
        {},
        End(RunOutcome("timed_out", GROUP), close_job="node 1 timed out (--timeout)"),
    ),
    (
        "address-in-use",
        result("failed", record=CAUSE, address_in_use=True),
        {"port_retries": PORT_RETRIES - 1},
        ReplacePort(CountFailure(CAUSE, RunOutcome("failed", GROUP))),
    ),
    (
        "address-in-use-retries-spent",
        result("failed", record=CAUSE, address_in_use=True),
        {"port_retries": PORT_RETRIES},
        CountFailure(CAUSE, RunOutcome("failed", GROUP)),
    ),
    (
        "lost-peers-while-re-forming",
        result("failed", record=EFFECT),
        {"membership_changing": True},
        Rejoin(
            "this node's ranks lost their peers while the job re-forms; "
            "rejoining (not counted as a restart)"
        ),
    ),
    (
        "lost-peers-in-a-stable-job",
        result("failed", record=EFFECT),
        {"membership_changing": False},
        CountFailure(EFFECT, RunOutcome("failed", GROUP)),
    ),
    (
        "a-cause-while-re-forming-is-counted",
        result("failed", record=CAUSE),
        {"membership_changing": True},
        CountFailure(CAUSE, RunOutcome("failed", GROUP)),
    ),
    (
        "failed",
        result("failed", record=CAUSE),
        {},
        CountFailure(CAUSE, RunOutcome("failed", GROUP)),
    ),
    # Exit codes (issue 32): what a failure is decides whether a restart is spent.
    (
        "a-preemption-spends-no-restart",
        result("failed", record=CAUSE, failure=FailureClass("infrastructure")),
        {"interrupted": signal.SIGTERM},
        End(
            RunOutcome("interrupted", GROUP, signum=signal.SIGTERM),
            close_job="node h was interrupted by SIGTERM",
        ),
    ),
    (
        "a-deterministic-failure-spends-no-restart",
        result("failed", record=CAUSE, failure=DETERMINISTIC),
        {},
        End(
            RunOutcome("failed", GROUP, message=NOT_RESTARTING, failure="deterministic"),
            close_job=NOT_RESTARTING,
        ),
    ),
    (
        "a-taken-port-is-replaced-before-a-repeat-counts-as-deterministic",
        result("failed", record=CAUSE, failure=DETERMINISTIC, address_in_use=True),
        {},
        ReplacePort(CountFailure(CAUSE, RunOutcome("failed", GROUP, failure="deterministic"))),
    ),
    (
        "an-infrastructure-failure-is-counted",
        result("failed", record=CAUSE, failure=FailureClass("infrastructure")),
        {},
        CountFailure(CAUSE, RunOutcome("failed", GROUP, failure="infrastructure")),
    ),
    (
        "another-error-is-counted",
        result("failed", record=CAUSE, failure=FailureClass("error")),
        {},
        CountFailure(CAUSE, RunOutcome("failed", GROUP, failure="error")),
    ),
]


@pytest.mark.parametrize(
    ("round_result", "inputs", "action"), [r[1:] for r in ROWS], ids=[r[0] for r in ROWS]
)
def test_decision(round_result: RoundResult, inputs: dict[str, object], action: Action) -> None:
    assert decide(round_result, **inputs) == action  # type: ignore[arg-type]


def test_only_a_failure_that_is_an_effect_reads_the_membership() -> None:
    assert needs_membership(result("failed", record=EFFECT))
    assert not needs_membership(result("failed", record=CAUSE))
    assert not needs_membership(result("hung", record=EFFECT))


FINAL = RunOutcome("failed", GROUP)

COUNT_ROWS: list[tuple[str, FailureCount | Exception, Restart | End]] = [
    (
        "node-within-budget",
        FailureCount(2, "node", "rank 1 failed"),
        Restart("restarting the local worker group (restart 2 of 2) after: rank 1 failed"),
    ),
    (
        "job-within-budget",
        FailureCount(1, "job", "rank 1 on node 0 (h): x"),
        Restart("restarting the job (restart 1 of 2, job-wide) after: rank 1 on node 0 (h): x"),
    ),
    ("node-budget-spent", FailureCount(3, "node", "rank 1 failed"), End(FINAL)),
    (
        "job-budget-spent",
        FailureCount(3, "job", "rank 1 on node 0 (h): x"),
        End(
            RunOutcome(
                "failed",
                GROUP,
                message="restart budget spent (2 job-wide); first failure: rank 1 on node 0 (h): x",
            ),
            close_job="restart budget spent (2 job-wide); first failure: rank 1 on node 0 (h): x",
        ),
    ),
    (
        "store-unreachable",
        ConnectionError("refused"),
        End(
            RunOutcome(
                "failed",
                GROUP,
                message="the rendezvous store is unreachable (refused); cannot restart",
            )
        ),
    ),
]


@pytest.mark.parametrize(
    ("count", "action"), [r[1:] for r in COUNT_ROWS], ids=[r[0] for r in COUNT_ROWS]
)
def test_decision_after_count(count: FailureCount | Exception, action: Restart | End) -> None:
    assert decide_after_count(count, FINAL, max_restarts=2) == action


@pytest.mark.parametrize(
    ("own", "first", "exits"),
    [
        # Ranks that only lost a peer to another node's ValueError: 1, as that node.
        ("infrastructure", "error", ExitCode.FAILED),
        # A peer's rank killed by a signal (OOM): 137 everywhere.
        ("error", "infrastructure", ExitCode.INFRASTRUCTURE),
        # The first failure has no class (a hang, a cut): this node's own.
        ("infrastructure", "", ExitCode.INFRASTRUCTURE),
    ],
)
def test_every_node_exits_with_the_class_of_the_jobs_first_failure(
    own: FailureKind, first: str, exits: ExitCode
) -> None:
    count = FailureCount(3, "job", "rank 3 on node 1 (h): x", first)
    action = decide_after_count(count, RunOutcome("failed", GROUP, failure=own), max_restarts=2)
    assert isinstance(action, End)
    assert exit_code_of(action.outcome) == exits
