"""dist-launch in a Kubernetes pod with no flags: each operator's variables, and DNS waits."""

from __future__ import annotations

import logging

import pytest

from dist_launch.cli import build_parser
from dist_launch.plan.build import build_plan
from dist_launch.plan.launch_plan import LaunchPlan, UsageError
from dist_launch.rendezvous.factory import join_timeout, rendezvous_host
from dist_launch.rendezvous.host_names import UnresolvableHostError, wait_until_resolvable
from dist_launch.workers.environment import node_environment

POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def plan_in_pod(script: str, variables: dict[str, str], *flags: str) -> LaunchPlan:
    args = vars(build_parser().parse_args([*flags, script]))
    return build_plan(args, {**POD, **variables})


def nodes(plan: LaunchPlan) -> tuple[int, int, str, int | None]:
    return plan.nnodes, plan.node_rank, plan.master_addr, plan.master_port


def test_trainer_v2_sets_only_torchruns_variables(script: str) -> None:
    trainer = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "4",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "job-node-0-0.job",
        "PET_MASTER_PORT": "29400",
    }
    plan = plan_in_pod(script, trainer)
    assert (*nodes(plan), plan.nproc) == (2, 1, "job-node-0-0.job", 29400, 4)


def test_pytorchjob_v1_rank_is_the_pods_index_not_a_process_rank(script: str) -> None:
    # training-operator v1 without nprocPerNode: RANK = pod index, WORLD_SIZE = pods.
    old = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "RANK": "2", "WORLD_SIZE": "3"}
    plan = plan_in_pod(script, old, "-n", "4")
    assert nodes(plan) == (3, 2, "job-master-0", 23456)
    assert plan.world_size == 12
    assert plan.sources["node_rank"] == "RANK (PyTorchJob: the pod's index)"
    assert plan.sources["nnodes"] == "WORLD_SIZE (PyTorchJob: the pod count)"


def test_pytorchjob_v1_with_nproc_per_node_counts_processes_in_world_size(script: str) -> None:
    new = {
        "MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "RANK": "1",
        "WORLD_SIZE": "8",  # 2 pods x 4 processes
        "PET_NPROC_PER_NODE": "4",
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
    }
    plan = plan_in_pod(script, new)
    assert (*nodes(plan), plan.nproc, plan.world_size) == (2, 1, "job-master-0", 23456, 4, 8)
    assert plan.sources["master_addr"] == "MASTER_ADDR (PyTorchJob)"


def test_indexed_job_or_jobset_takes_its_index_as_the_node_rank(script: str) -> None:
    indexed = {"JOB_COMPLETION_INDEX": "3", "PET_NNODES": "4", "PET_MASTER_ADDR": "js-w-0-0.js"}
    plan = plan_in_pod(script, indexed)
    assert nodes(plan)[:3] == (4, 3, "js-w-0-0.js")
    assert plan.sources["node_rank"] == "JOB_COMPLETION_INDEX"


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"JOB_COMPLETION_INDEX": "0"}, "set PET_NNODES"),
        ({"JOB_COMPLETION_INDEX": "1", "PET_NNODES": "2"}, "set PET_MASTER_ADDR"),
    ],
)
def test_indexed_job_without_its_size_or_master_is_refused(
    script: str, variables: dict[str, str], named: str
) -> None:
    with pytest.raises(UsageError, match=f"JOB_COMPLETION_INDEX=.*{named}"):
        plan_in_pod(script, variables)


def test_leaderworkerset_leader_is_the_master(script: str) -> None:
    lws = {"LWS_LEADER_ADDRESS": "lws-0.lws", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2"}
    plan = plan_in_pod(script, lws)
    assert nodes(plan) == (4, 2, "lws-0.lws", None)  # the static default: 29500
    assert plan.sources["master_addr"] == "LWS_LEADER_ADDRESS"


@pytest.mark.parametrize(
    ("variables", "flags", "run_id"),
    [
        ({"MASTER_ADDR": "job-master-0", "RANK": "1", "WORLD_SIZE": "2"}, (), "job-master-0"),
        ({"PET_NNODES": "2", "PET_MASTER_ADDR": "tj-node-0-0.tj"}, (), "tj-node-0-0.tj"),
        ({"LWS_LEADER_ADDRESS": "lws-0.lws", "LWS_GROUP_SIZE": "2"}, (), "lws-0.lws"),
        (
            {"PET_NNODES": "1:2", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "tj-0:29400"},
            (),
            "tj-0",
        ),
        ({"PET_NNODES": "2", "PET_MASTER_ADDR": "h"}, ("--rdzv-id", "given"), "given"),
    ],
)
def test_pods_of_one_job_share_a_run_id_named_after_its_master(
    script: str, variables: dict[str, str], flags: tuple[str, ...], run_id: str
) -> None:
    ids = {plan_in_pod(script, variables, *flags).run_id for _ in range(2)}
    assert ids == {run_id}


def test_flags_pet_and_slurm_win_over_a_pods_variables(script: str) -> None:
    old = {"MASTER_ADDR": "job-master-0", "RANK": "2", "WORLD_SIZE": "3"}
    plan = plan_in_pod(
        script, {**old, "PET_NNODES": "5", "PET_NODE_RANK": "4"}, "--master-addr", "m"
    )
    assert nodes(plan)[:3] == (5, 4, "m")


def test_outside_a_pod_rank_and_world_size_are_not_node_settings(script: str) -> None:
    plan = build_plan(vars(build_parser().parse_args([script])), {"RANK": "2", "WORLD_SIZE": "3"})
    assert nodes(plan) == (1, 0, "127.0.0.1", None)


def test_a_pods_rank_and_world_size_reach_no_worker(script: str) -> None:
    plan = plan_in_pod(script, {"MASTER_ADDR": "m", "RANK": "1", "WORLD_SIZE": "2"})
    env = node_environment(plan, {**POD, "RANK": "1", "WORLD_SIZE": "2", "HOME": "/root"})
    assert "RANK" not in env and "WORLD_SIZE" not in env and env["HOME"] == "/root"


def test_the_host_waited_for_and_its_timeout(script: str) -> None:
    plan = plan_in_pod(script, {"PET_NNODES": "2", "PET_MASTER_ADDR": "lead.svc"})
    assert rendezvous_host(plan) == ("lead.svc", "PET_MASTER_ADDR")
    assert join_timeout(plan) == 600
    c10d = plan_in_pod(
        script,
        {"PET_RDZV_BACKEND": "c10d", "PET_RDZV_ENDPOINT": "ep.svc:29400"},
        "--rdzv-conf",
        "join_timeout=5",
    )
    assert rendezvous_host(c10d) == ("ep.svc", "PET_RDZV_ENDPOINT")
    assert join_timeout(c10d) == 5


class FakeDns:
    """A resolver that knows ``host`` from the ``known_after``-th lookup on, and a clock."""

    def __init__(self, known_after: int) -> None:
        self.known_after = known_after
        self.lookups = 0
        self.now = 0.0
        self.sleeps: list[float] = []

    def resolve(self, host: str) -> object:
        self.lookups += 1
        if self.lookups <= self.known_after:
            raise OSError(-2, "Name or service not known")
        return [("addr", host)]

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_a_name_that_resolves_late_is_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    dns = FakeDns(known_after=6)
    with caplog.at_level(logging.INFO):
        wait_until_resolvable(
            "lws-0.lws", "LWS_LEADER_ADDRESS", 60, resolve=dns.resolve,
            clock=lambda: dns.now, sleep=dns.sleep,
        )  # fmt: skip
    assert dns.lookups == 7
    assert dns.sleeps == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0]  # backoff, capped
    waiting = [r for r in caplog.records if "waiting up to" in r.getMessage()]
    assert len(waiting) == 1 and "lws-0.lws (from LWS_LEADER_ADDRESS)" in waiting[0].getMessage()


def test_a_name_that_never_resolves_is_named_at_the_deadline() -> None:
    dns = FakeDns(known_after=10**6)
    with pytest.raises(UnresolvableHostError, match=r"master-0\.svc \(from PET_MASTER_ADDR\).*3 s"):
        wait_until_resolvable(
            "master-0.svc", "PET_MASTER_ADDR", 3, resolve=dns.resolve,
            clock=lambda: dns.now, sleep=dns.sleep,
        )  # fmt: skip
    assert dns.now == pytest.approx(3.0)


def test_a_literal_address_is_never_looked_up() -> None:
    dns = FakeDns(known_after=10**6)
    for host in ("10.0.0.7", "::1", "[fe80::1]"):
        wait_until_resolvable(host, "flag", 3, resolve=dns.resolve)
    assert dns.lookups == 0
