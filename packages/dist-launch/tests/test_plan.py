"""The command line: torchrun's flag set, PET_ variables and srun's defaults, resolved."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from dist_launch.cli import build_parser
from dist_launch.plan.build import build_plan
from dist_launch.plan.launch_plan import LaunchPlan, UsageError, describe_sources
from dist_launch.plan.slurm import slurm_port
from dist_launch.rendezvous.protocol import Assignment
from dist_launch.workers.environment import worker_environment


def plan_of(argv: list[str], environ: dict[str, str] | None = None) -> LaunchPlan:
    return build_plan(vars(build_parser().parse_args(argv)), environ or {})


def torchrun_options() -> list[str]:
    """Every option string of the installed torch's torchrun parser (CI: torch 2.11, 2.13, 2.14)."""
    from torch.distributed.run import get_args_parser

    strings: list[str] = []
    for action in get_args_parser()._actions:
        strings.extend(s for s in action.option_strings if s not in ("-h", "--help"))
    return strings


def test_every_torchrun_option_string_is_known() -> None:
    ours = {s for action in build_parser()._actions for s in action.option_strings}
    missing = sorted(set(torchrun_options()) - ours)
    assert not missing, f"torchrun flags dist-launch does not accept: {missing}"


def test_torchrun_defaults_run_one_node(script: str) -> None:
    plan = plan_of([script])
    assert (plan.nproc, plan.min_nodes, plan.max_nodes, plan.node_rank) == (1, 1, 1, 0)
    assert plan.rdzv_backend == "static" and plan.master_port is None
    assert plan.monitor_interval == pytest.approx(0.1)
    assert signal.SIGTERM in plan.signals_to_handle and signal.SIGQUIT in plan.signals_to_handle


@pytest.mark.parametrize("spelling", ["--nproc-per-node", "--nproc_per_node", "-n"])
def test_both_spellings(script: str, spelling: str) -> None:
    assert plan_of([spelling, "3", script]).nproc == 3


def test_standalone_is_one_node_whatever_else_was_said(script: str) -> None:
    plan = plan_of(["--standalone", "--nnodes", "4", "--rdzv-backend", "c10d", "-n", "2", script])
    assert (plan.min_nodes, plan.rdzv_backend, plan.standalone) == (1, "static", True)
    assert plan.sources["nnodes"] == "--standalone"


def test_min_max_nodes_with_c10d(script: str) -> None:
    plan = plan_of(
        ["--nnodes", "2:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400", script]
    )
    assert (plan.min_nodes, plan.max_nodes, plan.elastic) == (2, 4, True)
    assert plan.rdzv_id == plan.run_id


def test_static_min_max_waits_for_max_as_torchrun(script: str) -> None:
    plan = plan_of(["--nnodes", "1:2", "--node-rank", "1", script])
    assert plan.nnodes == 2


def test_nproc_words(script: str) -> None:
    assert plan_of(["-n", "cpu", script]).nproc >= 1
    assert plan_of(["-n", "auto", script]).nproc >= 1


def test_rdzv_conf_parsed(script: str) -> None:
    plan = plan_of(
        [
            "--rdzv-backend=c10d",
            "--rdzv-endpoint=h:1",
            "--rdzv-conf",
            "join_timeout=5,last_call_timeout=1",
            script,
        ]
    )
    assert dict(plan.rdzv_conf) == {"join_timeout": "5", "last_call_timeout": "1"}


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["--rdzv-backend", "zookeeper"], "--rdzv-backend='zookeeper'"),
        (["--rdzv-backend", "etcd"], "--rdzv-backend etcd needs --rdzv-endpoint"),
        (["--rdzv-backend", "etcd-v2"], "--rdzv-backend etcd-v2 needs --rdzv-endpoint"),
        (["--rdzv-backend", "c10d"], "--rdzv-endpoint"),
        (["--nnodes", "3:2"], "--nnodes=3:2"),
        (["--nnodes", "2", "--node-rank", "2"], "--node-rank=2"),
        (["--master-port", "70000"], "--master-port=70000"),
        (["--max-restarts", "-1"], "--max-restarts=-1"),
        (["--monitor-interval", "0"], "--monitor-interval=0"),
        (["--start-method", "thread"], "--start-method='thread'"),
        (["--event-log-handler", "console"], "--event-log-handler"),
        (["--logs-specs", "x"], "--logs-specs"),
        (["--numa-binding", "node"], "--numa-binding"),
        (["--duplicate-stdout-filters", "apple"], "--duplicate-stdout-filters"),
        (["--signals-to-handle", "SIGNOPE"], "--signals-to-handle"),
        (["--local-ranks-filter", "x"], "--local-ranks-filter"),
        (["--redirects", "7"], "--redirects"),
        (["-n", "0"], "--nproc-per-node=0"),
        (["--no-python", "-m"], "--no-python"),
    ],
)
def test_bad_or_unsupported_values_are_named(script: str, argv: list[str], names: str) -> None:
    with pytest.raises(UsageError, match=names.replace("[", r"\[")):
        plan_of([*argv, script])


def test_signals_to_forward_from_flag_or_pet(script: str) -> None:
    assert plan_of([script]).signals_to_forward == ()
    plan = plan_of(["--signals-to-forward", "USR1,SIGUSR2", script])
    assert plan.signals_to_forward == (signal.SIGUSR1, signal.SIGUSR2)
    assert plan_of(["--signals_to_forward", "usr1", script]).signals_to_forward == (signal.SIGUSR1,)
    pet = plan_of([script], {"PET_SIGNALS_TO_FORWARD": "SIGUSR1"})
    assert pet.signals_to_forward == (signal.SIGUSR1,)
    # Forwarding SIGTERM means taking it out of the handled ones.
    plan = plan_of(["--signals-to-handle", "INT", "--signals-to-forward", "TERM", script])
    assert (plan.signals_to_handle, plan.signals_to_forward) == (
        (signal.SIGINT,),
        (signal.SIGTERM,),
    )


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("SIGTERM", "SIGTERM is also in --signals-to-handle"),
        ("USR1,QUIT", "SIGQUIT cannot be forwarded"),
        ("KILL", "SIGKILL cannot be forwarded"),
        ("CHLD", "SIGCHLD cannot be forwarded"),
        ("WINCH", "SIGWINCH cannot be forwarded"),
        ("USR9", "--signals-to-forward: 'USR9' is not a signal name"),
    ],
)
def test_signals_that_cannot_be_forwarded_are_named(script: str, value: str, names: str) -> None:
    with pytest.raises(UsageError, match=names):
        plan_of(["--signals-to-forward", value, script])


def test_gpu_count_on_a_host_without_that_device(script: str) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device: -n gpu is valid here")
    with pytest.raises(UsageError, match="--nproc-per-node=gpu"):
        plan_of(["-n", "gpu", script])


def test_missing_script_is_named(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"nope\.py"):
        plan_of([str(tmp_path / "nope.py")])


def test_pet_variables_configure_a_pod_without_flags(script: str) -> None:
    environ = {
        "PET_NNODES": "2",
        "PET_NPROC_PER_NODE": "4",
        "PET_RDZV_BACKEND": "c10d",
        "PET_RDZV_ENDPOINT": "master-0:29400",
        "PET_RDZV_ID": "job-7",
        "PET_MAX_RESTARTS": "3",
    }
    plan = plan_of([script], environ)
    assert (plan.min_nodes, plan.nproc, plan.rdzv_backend) == (2, 4, "c10d")
    assert (plan.rdzv_endpoint, plan.rdzv_id, plan.max_restarts) == ("master-0:29400", "job-7", 3)
    assert plan.sources["nproc_per_node"] == "PET_NPROC_PER_NODE"


def test_static_pet_variables_as_pytorchjob_sets_them(script: str) -> None:
    environ = {
        "PET_NNODES": "2",
        "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "job-master-0",
        "PET_MASTER_PORT": "23456",
    }
    plan = plan_of([script], environ)
    assert (plan.nnodes, plan.node_rank, plan.master_addr, plan.master_port) == (
        2,
        1,
        "job-master-0",
        23456,
    )


def test_flags_win_over_pet_variables(script: str) -> None:
    plan = plan_of(["-n", "2", script], {"PET_NPROC_PER_NODE": "8"})
    assert plan.nproc == 2 and plan.sources["nproc_per_node"] == "flag"


def test_pet_switches(script: str) -> None:
    plan = plan_of([script], {"PET_STANDALONE": "1", "PET_VIRTUAL_LOCAL_RANK": "1"})
    assert plan.standalone and plan.virtual_local_rank


SRUN = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_NNODES": "3",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_NODEID": "2",
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "3",
    "SLURM_JOB_NODELIST": "gpu-[07-09]",
}


def test_srun_defaults_the_node_flags(script: str) -> None:
    plan = plan_of(["-n", "4", script], SRUN)
    assert (plan.nnodes, plan.node_rank, plan.master_addr) == (3, 2, "gpu-07")
    assert plan.master_port == slurm_port("4242") == 12000 + 4242
    line = describe_sources(plan)
    assert "SLURM_NNODES" in line and "SLURM_NODEID" in line and "SLURM_JOB_NODELIST" in line


def test_two_jobs_on_one_node_get_different_ports() -> None:
    assert slurm_port("1001") != slurm_port("1002")


def test_two_steps_of_one_allocation_get_different_ports(script: str) -> None:
    ports = {plan_of([script], {**SRUN, "SLURM_STEP_ID": str(s)}).master_port for s in range(8)}
    assert len(ports) == 8


def test_a_malformed_step_id_is_named(script: str) -> None:
    with pytest.raises(UsageError, match="SLURM_STEP_ID='x'"):
        plan_of([script], {**SRUN, "SLURM_STEP_ID": "x"})


def test_flags_and_pet_win_over_slurm(script: str) -> None:
    plan = plan_of(["--nnodes", "1", "--node-rank", "0", script], {**SRUN, "PET_MASTER_PORT": "1"})
    assert (plan.nnodes, plan.node_rank, plan.master_port) == (1, 0, 1)


def test_srun_c10d_endpoint_from_the_nodelist(script: str) -> None:
    plan = plan_of(["--rdzv-backend", "c10d", script], SRUN)
    assert plan.rdzv_endpoint == f"gpu-07:{12000 + 4242}"


def test_srun_with_a_task_per_gpu_is_refused(script: str) -> None:
    with pytest.raises(UsageError, match="SLURM_NTASKS=12"):
        plan_of([script], {**SRUN, "SLURM_NTASKS": "12"})


def test_a_batch_script_is_not_srun(script: str) -> None:
    batch = {k: v for k, v in SRUN.items() if k not in ("SLURM_STEP_ID", "SLURM_PROCID")}
    assert plan_of([script], batch).nnodes == 1


def test_a_batch_script_of_several_tasks_runs_this_node_alone(
    script: str, caplog: pytest.LogCaptureFixture
) -> None:
    # SLURM gives `sbatch --ntasks=4 -N3`'s batch script SLURM_PROCID=0 but no step id.
    batch = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    batch.update({"SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "4"})
    plan = plan_of(["-n", "2", script], batch)
    assert (plan.nnodes, plan.node_rank, plan.sources["nnodes"]) == (1, 0, "default")
    assert "srun --ntasks-per-node=1 dist-launch" in caplog.text


def test_a_requeued_jobs_restart_count_is_where_the_workers_count_from(script: str) -> None:
    assert plan_of([script], SRUN).restart_base == 0
    plan = plan_of([script], {**SRUN, "SLURM_RESTART_COUNT": "2"})
    assert (plan.restart_base, plan.sources["restart_base"]) == (2, "SLURM_RESTART_COUNT")
    assert "restarts so far=2 (SLURM_RESTART_COUNT)" in describe_sources(plan)
    assert plan_of([script], {"SLURM_RESTART_COUNT": "2"}).restart_base == 0  # not in a job
    with pytest.raises(UsageError, match="SLURM_RESTART_COUNT='x'"):
        plan_of([script], {**SRUN, "SLURM_RESTART_COUNT": "x"})
    # The workers count this launcher's own restarts on top.
    round_ = Assignment(0, 1, 0, 1, "h", 1, restart_count=1)
    assert worker_environment(plan, round_, {})["TORCHELASTIC_RESTART_COUNT"] == "3"


def test_launchers_of_one_srun_step_share_its_run_id(script: str) -> None:
    plans = [plan_of([script], {**SRUN, "SLURM_NODEID": str(n)}) for n in range(3)]
    assert {p.run_id for p in plans} == {"4242.0"}
    assert plans[0].sources["run_id"] == "SLURM_JOB_ID.SLURM_STEP_ID"
    assert "run_id=4242.0 (SLURM_JOB_ID.SLURM_STEP_ID)" in describe_sources(plans[0])
    c10d = plan_of(["--rdzv-backend", "c10d", script], SRUN)
    assert c10d.run_id == c10d.rdzv_id == "4242.0"  # the rendezvous is the step's too


def test_run_id_and_rdzv_id_win_over_slurms(script: str) -> None:
    assert plan_of(["--rdzv-id", "mine", script], SRUN).run_id == "mine"
    assert plan_of(["--run-id", "r", "--rdzv-id", "mine", script], SRUN).run_id == "r"
    assert plan_of([script], {**SRUN, "PET_RDZV_ID": "pet"}).run_id == "pet"


def test_one_node_keeps_a_run_id_of_its_own(script: str) -> None:
    one = {**SRUN, "SLURM_NNODES": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "1"}
    one["SLURM_NODEID"] = "0"
    first, second = plan_of([script], one), plan_of([script], one)
    assert first.run_id != second.run_id and len(first.run_id) == 32  # random, as before
    assert plan_of(["--nnodes", "2", "--node-rank", "1", script]).run_id == "none"


def test_rendezvous_timeouts_are_torchs_unless_rdzv_conf_sets_them(script: str) -> None:
    default = plan_of([script]).rdzv_timeouts
    assert (default.join, default.last_call, default.close, default.read) == (600, 30, 30, 60)
    assert default.node_dead_after == 15
    conf = "read_timeout=7,join_timeout=20,keep_alive_interval=2,keep_alive_max_attempt=4"
    given = plan_of(["--rdzv-conf", conf, script]).rdzv_timeouts
    assert (given.read, given.join, given.node_dead_after) == (7, 20, 8)
    assert given.round_forms_within == 20 + 30


@pytest.mark.parametrize(
    ("conf", "named"),
    [
        ("read_timeout=0", "read_timeout=0"),
        ("join_timeout=soon", "join_timeout=soon"),
        ("keep_alive_max_attempt=1.5", "keep_alive_max_attempt=1.5"),
    ],
)
def test_a_malformed_rendezvous_timeout_is_named(script: str, conf: str, named: str) -> None:
    with pytest.raises(UsageError, match=f"--rdzv-conf {named}"):
        plan_of(["--rdzv-conf", conf, script])


def test_shutdown_timeout_is_the_grace_period(script: str) -> None:
    assert plan_of(["--shutdown-timeout", "7", script]).grace_period == 7
    assert plan_of([script], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "9"}).grace_period == 9
    assert plan_of(["--grace-period", "2", "--shutdown-timeout", "7", script]).grace_period == 2


def test_fork_is_served_by_the_fork_server(script: str) -> None:
    assert plan_of(["--start-method", "fork", script]).start_method == "forkserver"


def test_log_line_prefix_template_from_flag_pet_or_torchelastic(script: str) -> None:
    flag = plan_of(["--log-line-prefix-template", "[${rank}]", script])
    assert flag.routing.prefix_template == "[${rank}]"
    pet = plan_of([script], {"PET_LOG_LINE_PREFIX_TEMPLATE": "<${local_rank}>"})
    assert pet.routing.prefix_template == "<${local_rank}>"
    elastic = plan_of([script], {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "${hostname}: "})
    assert elastic.routing.prefix_template == "${hostname}: "
    assert plan_of([script]).routing.console_prefix(3, 1, "default", "h") == b"[rank3]: "
    rendered = elastic.routing.console_prefix(3, 1, "trainer", "node7")
    assert rendered == b"node7: "


@pytest.mark.parametrize("step", ["0", "3", "4294967294"])
def test_srun_master_port_is_the_one_dist_core_derives(script: str, step: str) -> None:
    # One rule for both packages: a worker's DistEnv and its launcher agree.
    from dist_core import DistEnv

    environ = {**SRUN, "SLURM_STEP_ID": step}
    plan = plan_of(["-n", "4", script], environ)
    assert plan.master_port == DistEnv.from_environ(environ).master_port


@pytest.mark.parametrize(
    ("argv", "environ", "window"),
    [
        ([], {}, 60.0),
        (["--slow-ranks", "5"], {}, 5.0),
        (["--slow_ranks", "2.5"], {}, 2.5),
        (["--slow-ranks", "off"], {}, None),
        ([], {"PET_SLOW_RANKS": "off"}, None),
        ([], {"PET_SLOW_RANKS": "30"}, 30.0),
        (["--slow-ranks", "10"], {"PET_SLOW_RANKS": "off"}, 10.0),
    ],
)
def test_slow_ranks_window(
    script: str, argv: list[str], environ: dict[str, str], window: float | None
) -> None:
    assert plan_of([*argv, script], environ).slow_ranks == window


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--slow-ranks", "0.5"], {}, r"--slow-ranks='0.5': the window must be at least 1 s"),
        (["--slow-ranks", "x"], {}, r"--slow-ranks='x': expected a number of seconds or 'off'"),
        ([], {"PET_SLOW_RANKS": "soon"}, r"--slow-ranks \(from PET_SLOW_RANKS\)='soon'"),
    ],
)
def test_bad_slow_ranks_window_is_named(
    script: str, argv: list[str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        plan_of([*argv, script], environ)
