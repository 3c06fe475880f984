"""The rendezvous implementations: the shared contract, then each one's own.

The c10d rendezvous runs on :mod:`fake_rendezvous`'s dict-backed store and handler,
several nodes on threads of this process, with no process started. The etcd rendezvous
is held to the same contract against a real etcd server (the ``etcd_endpoint``
fixture starts one, so those cases are marked ``processes``); its own multi-node tests
are in ``test_etcd_rendezvous.py``.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from fake_rendezvous import FakeJob, FakeStore

from dist_launch.plan.build import build_plan
from dist_launch.plan.launch_plan import LaunchPlan
from dist_launch.rendezvous.c10d import C10dRendezvous, connect_c10d
from dist_launch.rendezvous.etcd import connect_etcd
from dist_launch.rendezvous.launcher_heartbeat import SILENT_AFTER_SECONDS
from dist_launch.rendezvous.launchers_store import launchers_store_port
from dist_launch.rendezvous.protocol import (
    Assignment,
    FailureRecord,
    Rendezvous,
    RendezvousUsageError,
    RoundChange,
)
from dist_launch.rendezvous.static import SharedStore, StaticRendezvous
from dist_launch.rendezvous.store_deadline import StoreDeadline

BOUND = 5.0  # seconds any thread of these tests may take
ROUND_0 = "torch.rendezvous.job.0/"  # the fake's store prefix of the first round


def plan_of(script: str, **flags: str) -> LaunchPlan:
    return build_plan({"target": script, **flags}, environ={})


def c10d_plan(script: str, nproc: int = 2, **flags: str) -> LaunchPlan:
    return plan_of(
        script,
        rdzv_backend="c10d",
        rdzv_endpoint="node0:29400",
        rdzv_id="job",
        nproc_per_node=str(nproc),
        **flags,
    )


def record(
    rank: int, group_rank: int = 0, timestamp: float = 100.0, consequence: bool = False
) -> FailureRecord:
    return FailureRecord(
        node=f"host{group_rank}",
        group_rank=group_rank,
        rank=rank,
        timestamp=timestamp,
        summary=f"rank {rank} failed with exit code 3",
        consequence=consequence,
    )


def static_one_node(script: str) -> Rendezvous:
    return StaticRendezvous.open(plan_of(script, nproc_per_node="2"))


def c10d_one_node(script: str) -> Rendezvous:
    return C10dRendezvous(c10d_plan(script), FakeJob().handler(0))


def etcd_one_node(script: str, endpoint: str) -> Rendezvous:
    plan = plan_of(
        script,
        rdzv_backend="etcd",
        rdzv_endpoint=endpoint,
        rdzv_id=uuid.uuid4().hex,
        nproc_per_node="2",
    )
    return connect_etcd(plan)


@pytest.fixture(
    params=[
        static_one_node,
        c10d_one_node,
        pytest.param(etcd_one_node, marks=pytest.mark.processes),
    ],
    ids=["static", "c10d", "etcd"],
)
def rendezvous(request: pytest.FixtureRequest, script: str) -> Iterator[Rendezvous]:
    if request.param is etcd_one_node:
        rdzv = etcd_one_node(script, request.getfixturevalue("etcd_endpoint"))
    else:
        make: Callable[[str], Rendezvous] = request.param
        rdzv = make(script)
    yield rdzv
    rdzv.close()


# -- the contract: what the agent relies on, whichever backend --------------------------


def test_a_lone_node_gets_every_rank(rendezvous: Rendezvous) -> None:
    assignment = rendezvous.next_round()
    assert (assignment.group_rank, assignment.group_world_size) == (0, 1)
    assert (assignment.base_rank, assignment.world_size) == (0, 2)
    assert assignment.restart_count == 0
    assert 0 < assignment.master_port < 65536


def test_each_counted_failure_shows_in_the_next_round(rendezvous: Rendezvous) -> None:
    for expected in (1, 2):
        rendezvous.next_round()
        count = rendezvous.count_failure(record(rank=1))
        assert count.restarts == expected
        assert "rank 1 failed with exit code 3" in count.first_failure
    assert rendezvous.next_round().restart_count == 2


def test_a_formed_round_is_not_re_forming(rendezvous: Rendezvous) -> None:
    rendezvous.next_round()
    assert not rendezvous.membership_changing()


def test_closing_the_job_never_raises_and_keeps_its_reason(rendezvous: Rendezvous) -> None:
    assert rendezvous.closing_reason() is None
    rendezvous.next_round()
    rendezvous.close_job("restart budget spent")
    assert rendezvous.closing_reason() in (None, "restart budget spent")


def test_a_lone_node_passes_the_exit_barrier_at_once(rendezvous: Rendezvous) -> None:
    rendezvous.next_round()
    started = time.monotonic()
    rendezvous.exit_barrier()
    assert time.monotonic() - started < BOUND


def test_a_replaced_master_port_is_the_next_rounds(rendezvous: Rendezvous) -> None:
    old = rendezvous.next_round().master_port
    replaced = rendezvous.replace_master_port()
    if replaced is not None:
        assert replaced[0] == old and replaced[1] != old
        assert rendezvous.next_round().master_port == replaced[1]


def test_a_watch_stops_when_asked(rendezvous: Rendezvous) -> None:
    rendezvous.next_round()
    changes: list[RoundChange] = []
    watch = rendezvous.watch(0.01, changes.append)
    watch.stop()
    watch.stop()
    assert changes == []


def test_close_may_be_called_twice(rendezvous: Rendezvous) -> None:
    rendezvous.next_round()
    rendezvous.close()
    rendezvous.close()


# -- static ----------------------------------------------------------------------------


def test_static_nodes_take_their_ranks_from_the_plan(script: str) -> None:
    plan = plan_of(
        script, nnodes="3", node_rank="2", nproc_per_node="4", master_addr="node0", master_port="1"
    )
    assignment = StaticRendezvous(plan).next_round()
    assert (assignment.group_rank, assignment.base_rank, assignment.world_size) == (2, 8, 12)
    assert (assignment.master_addr, assignment.master_port) == ("node0", 1)


def test_static_restarts_of_one_node_are_its_own(script: str) -> None:
    plan = plan_of(script, master_addr="node0")
    count = StaticRendezvous.open(plan).count_failure(record(rank=1, group_rank=0))
    assert (count.scope, count.restarts) == ("node", 1)
    assert count.first_failure == "rank 1 failed with exit code 3"


def test_static_master_port_taken_on_node_0_is_a_usage_error(script: str) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with pytest.raises(RendezvousUsageError, match=f"--master-port {port} is already in use"):
            StaticRendezvous.open(plan_of(script, master_port=str(port)))


def test_static_port_of_several_nodes_is_fixed(script: str) -> None:
    plan = plan_of(script, nnodes="2", node_rank="1", master_addr="node0")
    rdzv = StaticRendezvous(plan)
    assert rdzv.next_round().master_port == 29500
    assert rdzv.replace_master_port() is None


def test_static_port_given_by_the_user_is_never_replaced(script: str) -> None:
    rdzv = StaticRendezvous(plan_of(script, nnodes="2", node_rank="1", master_port="29999"))
    assert rdzv.replace_master_port() is None


def static_nodes(script: str, nodes: int = 2, **flags: str) -> list[StaticRendezvous]:
    """The launchers of a static job, sharing one dict-backed launchers' store."""
    store = FakeStore()
    rdzvs = []
    for node in range(nodes):
        plan = plan_of(script, nnodes=str(nodes), node_rank=str(node), master_addr="node0", **flags)
        shared = SharedStore(store, StoreDeadline("node0:29501", BOUND))
        rdzvs.append(StaticRendezvous(plan, shared))
    return rdzvs


def join_static(rdzvs: list[StaticRendezvous]) -> list[Assignment]:
    with ThreadPoolExecutor(len(rdzvs)) as pool:
        return list(pool.map(lambda rdzv: rdzv.next_round(), rdzvs))


def test_static_store_port_is_beside_the_master_port_unless_given(script: str) -> None:
    plan = plan_of(script, nnodes="2", master_port="29600")
    assert launchers_store_port(plan, 29600) == 29601
    given = plan_of(script, nnodes="2", rdzv_conf="store_port=31000")
    assert launchers_store_port(given, 29500) == 31000
    with pytest.raises(RendezvousUsageError, match="store_port=29500"):
        launchers_store_port(plan_of(script, rdzv_conf="store_port=29500"), 29500)


def test_static_nodes_count_a_failed_round_once_and_name_its_cause(script: str) -> None:
    nodes = static_nodes(script, max_restarts="1")
    assert [a.restart_count for a in join_static(nodes)] == [0, 0]
    cause = nodes[1].count_failure(record(rank=3, group_rank=1))
    assert (cause.scope, cause.restarts) == ("job", 1)
    assert cause.first_failure.startswith("rank 3 on node 1 (host1)")
    nodes[0].cause_wait_seconds = 60 * BOUND  # the cause is there already
    effect = nodes[0].count_failure(record(rank=0, group_rank=0, consequence=True))
    assert (effect.restarts, effect.first_failure) == (1, cause.first_failure)
    assert [a.restart_count for a in join_static(nodes)] == [1, 1]


def test_static_watch_restarts_every_node_after_a_counted_failure(script: str) -> None:
    nodes = static_nodes(script, max_restarts="1")
    join_static(nodes)
    assert nodes[0]._round_change() is None  # a healthy round: no false alarm
    nodes[1].count_failure(record(rank=3, group_rank=1))
    change = nodes[0]._round_change()
    assert change is not None and change.kind == "membership", change
    assert "restart 1 of 1" in str(change)


def test_static_closing_reaches_every_node_with_its_reason(script: str) -> None:
    nodes = static_nodes(script)
    join_static(nodes)
    count = nodes[1].count_failure(record(rank=3, group_rank=1))
    assert count.restarts == 1
    assert nodes[0]._round_change() is None  # past the budget: wait for the closing
    nodes[1].close_job(f"restart budget spent; first failure: {count.first_failure}")
    change = nodes[0]._round_change()
    assert change is not None and change.kind == "closed"
    reason = nodes[0].closing_reason()
    assert reason is not None and "rank 3 on node 1 (host1)" in reason


def test_static_watch_reports_the_closing_from_its_thread(script: str) -> None:
    nodes = static_nodes(script)
    join_static(nodes)
    seen: list[RoundChange] = []
    changed = threading.Event()
    watch = nodes[0].watch(0.01, lambda change: (seen.append(change), changed.set()))
    try:
        nodes[1].close_job("node 1 was interrupted by SIGTERM")
        assert changed.wait(BOUND)
    finally:
        watch.stop()
    assert [change.kind for change in seen] == ["closed"]


def test_static_round_waits_for_every_node_and_names_the_missing(script: str) -> None:
    (first, _) = static_nodes(script, rdzv_conf="join_timeout=0.3")
    with pytest.raises(TimeoutError, match=r"node\(s\) 1 did not join round 0"):
        first.next_round()


def test_static_round_ends_its_wait_when_the_job_is_closed(script: str) -> None:
    first, second = static_nodes(script)
    second.close_job("node 1 failed before the round")
    with pytest.raises(RuntimeError, match="node 1 failed before the round"):
        first.next_round()


class RefusingStore(FakeStore):
    """A store whose node is gone: every read is refused."""

    def check(self, keys: list[str]) -> bool:
        raise ConnectionResetError("connection reset by peer")


def test_static_store_that_refuses_is_unreachable_and_names_node_0(script: str) -> None:
    plan = plan_of(script, nnodes="2", node_rank="1", master_addr="node0")
    shared = SharedStore(RefusingStore(), StoreDeadline("node0:29501", BOUND))
    rdzv = StaticRendezvous(plan, shared)
    rdzv._round_store = shared.view("round/0/")
    change = rdzv._round_change()
    assert change is not None and change.kind == "unreachable"
    assert "node 0 (node0:29501), which serves the launchers' store" in str(change)
    assert "connection reset by peer" in str(change)


def test_static_nodes_pass_the_exit_barrier_together(script: str) -> None:
    nodes = static_nodes(script)
    join_static(nodes)
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda rdzv: rdzv.exit_barrier(), nodes))
        list(pool.map(lambda rdzv: rdzv.close(), nodes))


def test_static_nodes_but_0_end_without_waiting_for_the_others(script: str) -> None:
    nodes = static_nodes(script)
    join_static(nodes)
    started = time.monotonic()
    nodes[1].close()  # node 0 has not ended: only node 0, which serves the store, waits
    assert time.monotonic() - started < BOUND
    nodes[0].close()  # node 1 has ended: at once


def test_static_node_0_stops_waiting_for_a_node_whose_launcher_stopped_beating(
    script: str,
) -> None:
    nodes = static_nodes(script)
    join_static(nodes)
    heartbeat = nodes[1]._heartbeat
    assert heartbeat is not None
    heartbeat.stop()  # node 1's launcher is gone (SIGKILL) without ending
    started = time.monotonic()
    nodes[0].close()
    # Its heartbeat is silent after SILENT_AFTER_SECONDS, long before the 15 s wait.
    assert time.monotonic() - started < SILENT_AFTER_SECONDS + BOUND


def test_static_consequence_stops_waiting_for_the_cause_of_a_dead_node(script: str) -> None:
    """A node that died reports nothing: its silence ends the wait, and node 0's end."""
    nodes = static_nodes(script)
    join_static(nodes)
    heartbeat = nodes[1]._heartbeat
    assert heartbeat is not None
    heartbeat.stop()  # node 1's launcher and workers are gone (SIGKILL)
    nodes[0].cause_wait_seconds = 4 * BOUND  # far longer than the heartbeats' silence
    started = time.monotonic()
    count = nodes[0].count_failure(record(rank=0, group_rank=0, consequence=True))
    assert count.first_failure.startswith("rank 0 on node 0")
    nodes[0].close()  # the heartbeats followed for the cause say node 1 is gone
    assert time.monotonic() - started < SILENT_AFTER_SECONDS + BOUND


def test_static_node_0_waits_for_a_beating_node_that_has_not_ended(script: str) -> None:
    nodes = static_nodes(script)
    join_static(nodes)
    ended = threading.Event()
    closing = threading.Thread(target=lambda: (nodes[0].close(), ended.set()))
    closing.start()
    # The false alarm: node 1 still beats, so node 0 keeps the store for it.
    assert not ended.wait(SILENT_AFTER_SECONDS + 1.0)
    nodes[1].close()
    assert ended.wait(BOUND)
    closing.join(BOUND)


# -- c10d ------------------------------------------------------------------------------


def join_all(rdzvs: list[C10dRendezvous]) -> list[Assignment]:
    with ThreadPoolExecutor(len(rdzvs)) as pool:
        futures = [pool.submit(rdzv.next_round) for rdzv in rdzvs]
        return [future.result(timeout=BOUND) for future in futures]


def test_c10d_ranks_follow_each_nodes_worker_count(script: str) -> None:
    job = FakeJob(nodes=2)
    first = C10dRendezvous(c10d_plan(script, nproc=2), job.handler(0))
    second = C10dRendezvous(c10d_plan(script, nproc=3), job.handler(1))
    a, b = join_all([first, second])
    assert (a.base_rank, b.base_rank, a.world_size, b.world_size) == (0, 2, 5, 5)
    assert (b.master_addr, b.master_port) == ("node0", 29511)


def test_c10d_counts_a_failed_round_once_for_the_whole_job(script: str) -> None:
    job = FakeJob(nodes=2)
    nodes = [C10dRendezvous(c10d_plan(script), job.handler(r)) for r in range(2)]
    join_all(nodes)
    late = nodes[0].count_failure(record(rank=0, group_rank=0, timestamp=200.0))
    early = nodes[1].count_failure(record(rank=3, group_rank=1, timestamp=100.0))
    assert (late.scope, late.restarts, early.restarts) == ("job", 1, 1)
    # Node 1's rank failed first, though node 0 reported first.
    assert early.first_failure.startswith("rank 3 on node 1 (host1)")
    job.next_round()
    assert [a.restart_count for a in join_all(nodes)] == [1, 1]


def test_c10d_consequence_waits_for_the_cause_from_another_node(script: str) -> None:
    """Node 0's ranks only wait on a peer; node 1 names its rank 3 later: both logs agree."""
    job = FakeJob(nodes=2)
    nodes = [C10dRendezvous(c10d_plan(script), job.handler(r)) for r in range(2)]
    join_all(nodes)
    nodes[0].cause_wait_seconds = 60 * BOUND  # the cause arrives long before
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(
            nodes[0].count_failure, record(rank=0, timestamp=100.0, consequence=True)
        )
        job.store.wait([ROUND_0 + "dist_launch/failure/0"])  # node 0 reported
        assert not waiting.done()
        cause = nodes[1].count_failure(record(rank=3, group_rank=1, timestamp=101.0))
        effect = waiting.result(timeout=BOUND)
    assert cause.first_failure.startswith("rank 3 on node 1 (host1)")
    assert effect.first_failure.startswith("rank 3 on node 1 (host1)")
    assert (effect.restarts, cause.restarts) == (1, 1)


def test_c10d_consequence_alone_is_the_first_failure_after_the_wait(script: str) -> None:
    """No other node reports (it died): the wait is bounded and the node names its own."""
    job = FakeJob(nodes=2)
    nodes = [C10dRendezvous(c10d_plan(script), job.handler(r)) for r in range(2)]
    join_all(nodes)
    nodes[0].cause_wait_seconds = 0.2
    count = nodes[0].count_failure(record(rank=1, consequence=True))
    assert count.first_failure.startswith("rank 1 on node 0 (host0)")


def test_c10d_consequences_of_every_node_end_the_wait(script: str) -> None:
    """Every node only waits (a whole-job deadlock): no node waits for a cause."""
    job = FakeJob(nodes=2)
    nodes = [C10dRendezvous(c10d_plan(script), job.handler(r)) for r in range(2)]
    join_all(nodes)
    for node in nodes:
        node.cause_wait_seconds = 60 * BOUND
    with ThreadPoolExecutor(2) as pool:
        counts = [
            pool.submit(node.count_failure, record(rank=2 * r, group_rank=r, consequence=True))
            for r, node in enumerate(nodes)
        ]
        firsts = {future.result(timeout=BOUND).first_failure for future in counts}
    assert len(firsts) == 1, firsts


def test_c10d_closing_reaches_every_node(script: str) -> None:
    job = FakeJob(nodes=2)
    nodes = [C10dRendezvous(c10d_plan(script), job.handler(r)) for r in range(2)]
    join_all(nodes)
    nodes[0].close_job("restart budget spent (0 job-wide)")
    assert nodes[1].closing_reason() == "restart budget spent (0 job-wide)"
    assert nodes[1].is_closed()
    with pytest.raises(RuntimeError, match="closed"):
        nodes[1].next_round()


def test_c10d_exit_barrier_waits_for_the_last_node(
    script: str, caplog: pytest.LogCaptureFixture
) -> None:
    job = FakeJob(nodes=2)
    nodes = [C10dRendezvous(c10d_plan(script), job.handler(r)) for r in range(2)]
    join_all(nodes)
    with ThreadPoolExecutor(1) as pool:
        first_done = pool.submit(nodes[0].exit_barrier)
        job.store.wait([ROUND_0 + "dist_launch/succeeded"])  # node 0 is in the barrier
        assert not first_done.done()
        nodes[1].exit_barrier()
        first_done.result(timeout=BOUND)
    assert "not every node finished" not in caplog.text


def test_c10d_counts_the_nodes_whose_workers_finished(script: str) -> None:
    job = FakeJob(nodes=2)
    nodes = [C10dRendezvous(c10d_plan(script), job.handler(r)) for r in range(2)]
    join_all(nodes)
    assert nodes[0].nodes_finished() == 0
    with ThreadPoolExecutor(1) as pool:
        second_done = pool.submit(nodes[1].exit_barrier)
        # node 1 is in the barrier (node 0's first look made the counter, at 0)
        job.store.wait_for_value(ROUND_0 + "dist_launch/succeeded", b"1")
        assert nodes[0].nodes_finished() == 1
        nodes[0].exit_barrier()
        second_done.result(timeout=BOUND)


def test_c10d_re_forms_when_nodes_wait_or_are_lost(script: str) -> None:
    job = FakeJob(nodes=2)
    nodes = [C10dRendezvous(c10d_plan(script), job.handler(r)) for r in range(2)]
    join_all(nodes)
    assert not nodes[0].membership_changing()
    job.waiting = 1
    assert nodes[0].membership_changing()
    job.waiting, job.participants = 0, 1
    assert nodes[0].lost_nodes() == 1 and nodes[0].membership_changing()


def test_c10d_watch_reports_waiting_nodes_once(script: str) -> None:
    job = FakeJob(nodes=1)
    rdzv = C10dRendezvous(c10d_plan(script), job.handler(0))
    rdzv.next_round()
    job.waiting = 2
    changes: list[RoundChange] = []
    seen = threading.Event()

    def on_change(change: RoundChange) -> None:
        changes.append(change)
        seen.set()

    watch = rdzv.watch(0.01, on_change)
    assert seen.wait(BOUND)
    watch.stop()
    assert changes == [RoundChange("membership", "2 node(s) waiting to join")]


def test_c10d_close_stops_torchs_heartbeats(script: str) -> None:
    job = FakeJob()
    handler = job.handler(0)
    C10dRendezvous(c10d_plan(script), handler).close()
    assert handler.shut_down


def test_c10d_unreachable_endpoint_names_it(script: str) -> None:
    plan = plan_of(script, rdzv_backend="c10d", rdzv_endpoint="node0:notaport", nproc_per_node="1")
    with pytest.raises(ConnectionError, match="cannot reach the rendezvous at node0:notaport"):
        connect_c10d(plan)


def test_a_lost_c10d_store_is_named_by_its_node_with_the_way_out(script: str) -> None:
    plan = plan_of(
        script, nnodes="1:2", rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:29400", rdzv_id="j"
    )
    rdzv = C10dRendezvous(plan, handler=object())
    at = 1_800_000_000.0
    text = rdzv.lost_store(TimeoutError("no answer"), at)
    assert text.startswith("127.0.0.1, which served the rendezvous, stopped answering at ")
    assert time.strftime("%H:%M:%S", time.localtime(at)) in text
    way_out = "a job survives the loss of any node with --rdzv-backend etcd"
    assert text.endswith(f"(no answer); {way_out}")
