"""DistEnv.from_environ for every source, every malformed value, and the precedence."""

from __future__ import annotations

import pytest

import dist_core
from dist_core import DistEnv, DistEnvError
from dist_core.openmpi import openmpi_master_port
from dist_core.slurm import expand_hostlist, parse_tasks_per_node

TORCHRUN = {
    "RANK": "5",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "2",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node0",
    "MASTER_PORT": "29400",
}
# Every task of a job step has a step id; a batch script has none.
STEP = {"SLURM_STEP_ID": "0"}
SLURM = {
    **STEP,
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "10",
    "SLURM_TASKS_PER_NODE": "4(x2),2",
    "SLURM_JOB_NODELIST": "gpu[01-04,07],cpu3",
    "SLURM_JOB_ID": "4242",
}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "3",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
}


def test_two_mpirun_jobs_on_one_host_get_different_ports() -> None:
    # OMPI_MCA_ess_base_jobid as Open MPI 4.1 set it for three mpirun jobs here.
    ports = {
        DistEnv.from_environ({**OPENMPI, "OMPI_MCA_ess_base_jobid": jobid}).master_port
        for jobid in ("1029636097", "1048969217", "1048444929")
    }
    assert len(ports) == 3 and all(12000 <= port < 32000 for port in ports)
    namespaced = {**OPENMPI, "PMIX_NAMESPACE": "prterun-vm-4242@1"}
    assert DistEnv.from_environ(namespaced).master_port == openmpi_master_port(namespaced)
    assert openmpi_master_port({**namespaced, "PMIX_NAMESPACE": "prterun-vm-4243@1"}) != (
        openmpi_master_port(namespaced)
    )
    given = {**OPENMPI, "OMPI_MCA_ess_base_jobid": "1029636097", "MASTER_PORT": "2345"}
    assert DistEnv.from_environ(given).master_port == 2345
    assert DistEnv.from_environ(OPENMPI).master_port == 29500  # nothing to derive it from
    with pytest.raises(DistEnvError, match="OMPI_MCA_ess_base_jobid=x"):
        DistEnv.from_environ({**OPENMPI, "OMPI_MCA_ess_base_jobid": "x"})


def test_nothing_set_is_rank_zero_of_one() -> None:
    env = DistEnv.from_environ({})
    assert env == DistEnv(0, 0, 0, 1, 1, "127.0.0.1", 29500)
    assert env.source == "default"


def test_torchrun_variables() -> None:
    env = DistEnv.from_environ(TORCHRUN)
    assert (env.rank, env.local_rank, env.node_rank) == (5, 1, 2)
    assert (env.world_size, env.local_world_size) == (8, 2)
    assert (env.master_addr, env.master_port, env.source) == ("node0", 29400, "torchrun")


def test_torchrun_node_rank_and_defaults() -> None:
    env = DistEnv.from_environ({"RANK": "3", "WORLD_SIZE": "4"})
    assert (env.local_rank, env.local_world_size, env.node_rank) == (3, 4, 0)
    env = DistEnv.from_environ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert (env.local_rank, env.node_rank) == (1, 1)
    env = DistEnv.from_environ({"RANK": "3", "WORLD_SIZE": "4", "NODE_RANK": "7"})
    assert env.node_rank == 7


def test_a_batch_script_is_not_a_task_of_the_job() -> None:
    # SLURM 22.05 gives the batch script of `sbatch --ntasks=4` these, and no step id.
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    batch.update({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"})
    env = DistEnv.from_environ(batch)
    assert (env.rank, env.world_size, env.source) == (0, 1, "default")
    assert DistEnv.from_environ({**batch, "SLURM_STEPID": "3"}).source == "slurm"


def test_composer_single_variable_world_of_one() -> None:
    assert DistEnv.from_environ({"WORLD_SIZE": "1"}).rank == 0
    assert DistEnv.from_environ({"LOCAL_RANK": "0"}).world_size == 1


def test_slurm_variables_with_compressed_lists() -> None:
    env = DistEnv.from_environ(SLURM)
    assert (env.rank, env.local_rank, env.node_rank) == (6, 2, 1)
    assert (env.world_size, env.local_world_size) == (10, 4)
    assert env.master_addr == "gpu01"
    assert env.master_port == 12000 + 4242 % 20000
    assert env.source == "slurm"


def test_slurm_last_node_of_uneven_task_counts() -> None:
    env = DistEnv.from_environ(
        {**SLURM, "SLURM_PROCID": "9", "SLURM_LOCALID": "1", "SLURM_NODEID": "2"}
    )
    assert (env.local_world_size, env.local_rank, env.node_rank) == (2, 1, 2)


def test_slurm_ntasks_per_node_and_master_overrides() -> None:
    env = DistEnv.from_environ(
        {**SLURM, "SLURM_NTASKS_PER_NODE": "5", "MASTER_ADDR": "head", "MASTER_PORT": "1234"}
    )
    assert (env.local_world_size, env.master_addr, env.master_port) == (5, "head", 1234)


def test_slurm_nodelist_fallback_variable() -> None:
    environ = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}
    environ["SLURM_NODELIST"] = "a[9-10]"
    assert DistEnv.from_environ(environ).master_addr == "a9"


def test_openmpi_variables() -> None:
    env = DistEnv.from_environ(OPENMPI)
    assert (env.rank, env.local_rank, env.node_rank, env.world_size) == (3, 3, 0, 4)
    assert env.source == "openmpi"


def test_openmpi_multi_node_needs_master() -> None:
    multi = {**OPENMPI, "OMPI_COMM_WORLD_SIZE": "8"}
    with pytest.raises(DistEnvError, match="MASTER_ADDR and MASTER_PORT"):
        DistEnv.from_environ(multi)
    env = DistEnv.from_environ({**multi, "MASTER_ADDR": "h0", "MASTER_PORT": "2000"})
    assert (env.node_rank, env.master_addr) == (0, "h0")
    env = DistEnv.from_environ(
        {
            **multi,
            "OMPI_COMM_WORLD_RANK": "6",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "MASTER_ADDR": "h0",
            "MASTER_PORT": "2000",
        }
    )
    assert env.node_rank == 1


@pytest.mark.parametrize(
    ("sources", "expected"),
    [
        ((TORCHRUN, SLURM, OPENMPI), "torchrun"),
        ((TORCHRUN, SLURM), "torchrun"),
        ((TORCHRUN, OPENMPI), "torchrun"),
        # mpirun inside a SLURM step: every rank has the step's SLURM_PROCID.
        ((SLURM, OPENMPI), "openmpi"),
    ],
)
def test_precedence_when_several_sources_are_set(
    sources: tuple[dict[str, str], ...], expected: str
) -> None:
    merged: dict[str, str] = {}
    for source in sources:
        merged.update(source)
    assert DistEnv.from_environ(merged).source == expected


def test_master_variables_alone_do_not_make_a_torchrun_job() -> None:
    env = DistEnv.from_environ({"MASTER_ADDR": "h", "MASTER_PORT": "4000", **OPENMPI})
    assert env.source == "openmpi"
    assert (env.master_addr, env.master_port) == ("h", 4000)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "5", "WORLD_SIZE": "4"}, "RANK=5 with WORLD_SIZE=4"),
        ({"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "x"}, "LOCAL_RANK=x"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK=x"),
        ({"RANK": "0", "WORLD_SIZE": "four"}, "WORLD_SIZE=four"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
        ({"RANK": "-1", "WORLD_SIZE": "4"}, "RANK=-1"),
        ({"WORLD_SIZE": "4"}, "WORLD_SIZE=4 but RANK is not set"),
        ({"RANK": "2"}, "RANK=2 but WORLD_SIZE is not set"),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"},
            "LOCAL_RANK=3 with LOCAL_WORLD_SIZE=2",
        ),
        (
            {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "8"},
            "LOCAL_WORLD_SIZE=8 with WORLD_SIZE=4",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "y"}, "LOCAL_WORLD_SIZE=y"),
        ({"RANK": "0", "WORLD_SIZE": "2", "NODE_RANK": "z"}, "NODE_RANK=z"),
        (
            {"RANK": "0", "WORLD_SIZE": "2", "NODE_RANK": "1", "GROUP_RANK": "0"},
            "NODE_RANK=1 with GROUP_RANK=0",
        ),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT=http"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "two words"}, "MASTER_ADDR=two words"),
        ({**STEP, "SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "SLURM_PROCID=4 with SLURM_NTASKS=4"),
        ({**STEP, "SLURM_PROCID": "a", "SLURM_NTASKS": "4"}, "SLURM_PROCID=a"),
        (
            {**STEP, "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "4(y2)"},
            "SLURM_TASKS_PER_NODE=4(y2)",
        ),
        (
            {
                **STEP,
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "4",
                "SLURM_NODEID": "3",
                "SLURM_TASKS_PER_NODE": "2(x2)",
            },
            "SLURM_NODEID=3 with SLURM_TASKS_PER_NODE=2(x2)",
        ),
        (
            {**STEP, "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "gpu[01-"},
            "SLURM_JOB_NODELIST=gpu[01-",
        ),
        (
            {**STEP, "SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "j1"},
            "SLURM_JOB_ID=j1",
        ),
        (
            {
                **STEP,
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "4",
                "SLURM_LOCALID": "9",
                "SLURM_NTASKS_PER_NODE": "4",
            },
            "SLURM_LOCALID=9 with SLURM_NTASKS_PER_NODE=4",
        ),
        (
            {"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"},
            "OMPI_COMM_WORLD_RANK=4 with OMPI_COMM_WORLD_SIZE=4",
        ),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE is not set"),
        (
            {
                "OMPI_COMM_WORLD_RANK": "0",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "q",
            },
            "OMPI_COMM_WORLD_LOCAL_RANK=q",
        ),
    ],
)
def test_malformed_or_inconsistent_values_name_variable_and_value(
    environ: dict[str, str], message: str
) -> None:
    with pytest.raises(DistEnvError) as info:
        DistEnv.from_environ(environ)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_to_environ_round_trips_and_writes_nothing() -> None:
    import os

    before = dict(os.environ)
    env = DistEnv.from_environ(TORCHRUN)
    written = env.to_environ()
    assert dict(os.environ) == before
    assert written["RANK"] == "5" and written["GROUP_RANK"] == "2" and written["NODE_RANK"] == "2"
    assert written["MASTER_ADDR"] == "node0" and written["MASTER_PORT"] == "29400"
    assert all(isinstance(value, str) for value in written.values())
    assert DistEnv.from_environ(written) == env


def test_constructor_validates() -> None:
    with pytest.raises(DistEnvError, match="RANK=4 with WORLD_SIZE=2"):
        DistEnv(rank=4, world_size=2, local_world_size=2)


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    assert DistEnv.from_environ().rank == 5


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
        ("node1", ["node1"]),
        ("a,b", ["a", "b"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
        ("x[007]", ["x007"]),
    ],
)
def test_expand_hostlist(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["", "a[1-", "a]1[", "a[2-1]", "a[x]", "a,,b", "a[[1]]"])
def test_expand_hostlist_rejects_malformed(hostlist: str) -> None:
    with pytest.raises(DistEnvError, match="SLURM_JOB_NODELIST="):
        expand_hostlist(hostlist)


@pytest.mark.parametrize(
    ("value", "counts"),
    [("4(x2),2", [4, 4, 2]), ("8", [8]), ("1,2,3", [1, 2, 3]), ("2(x3)", [2, 2, 2])],
)
def test_parse_tasks_per_node(value: str, counts: list[int]) -> None:
    assert parse_tasks_per_node(value) == counts


@pytest.mark.parametrize("job_id", [0, 4242, 19999, 20000, 987654321])
@pytest.mark.parametrize("step_id", [None, 0, 1, 7, 4294967294])
def test_slurm_master_port_stays_below_the_ephemeral_range(
    job_id: int, step_id: int | None
) -> None:
    port = dist_core.slurm_master_port(job_id, step_id)
    assert 12000 <= port < 32768
    assert port == dist_core.slurm_master_port(job_id + 20000, step_id)


def test_steps_of_one_job_never_share_a_master_port() -> None:
    # Concurrent steps of one allocation (srun --exact ... &) each host a store.
    ports = {dist_core.slurm_master_port(4242, step) for step in range(20000)}
    assert len(ports) == 20000
    assert dist_core.slurm_master_port(4242, 0) == dist_core.slurm_master_port(4242)


def test_a_steps_master_port_names_its_step() -> None:
    env = DistEnv.from_environ({**SLURM, "SLURM_STEP_ID": "2"})
    assert env.master_port == dist_core.slurm_master_port(4242, 2)
    with pytest.raises(DistEnvError, match="SLURM_STEP_ID=x"):
        DistEnv.from_environ({**SLURM, "SLURM_STEP_ID": "x"})
