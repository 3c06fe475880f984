"""One timeout budget: the run's clocks, the grace period they leave, and the inversions.

The decisions are pure functions, tested without a process; reading SLURM's KillWait
runs a real (stand-in) ``scontrol``, and the launcher's use of the budget runs the
real command.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
from launcher_nodes import run_launcher

from dist_launch.cli import build_parser
from dist_launch.plan.build import build_plan
from dist_launch.plan.hang_policy import parse_hang_timeout
from dist_launch.plan.kill_wait import KillWait, parse_kill_wait, read_kill_wait
from dist_launch.plan.launch_plan import LaunchPlan, UsageError
from dist_launch.plan.timeout_budget import (
    PgTimeout,
    Problems,
    TimeoutBudget,
    derive_grace_period,
    grace_problems,
    hang_problems,
    pg_timeout,
    timeout_budget,
)
from dist_launch.watch.cut_watch import fencing_bound

SCONTROL_KILL_WAIT = KillWait(30, "SLURM's KillWait (scontrol show config)")
DECLARED_KILL_WAIT = KillWait(30, "DIST_LAUNCH_KILL_WAIT", user_set=True)
POD_DEFAULT = KillWait(30, "Kubernetes' default terminationGracePeriodSeconds", assumed=True)


def plan_of(argv: list[str], environ: dict[str, str] | None = None) -> LaunchPlan:
    return build_plan(vars(build_parser().parse_args(argv)), environ or {})


# -- the grace period against the scheduler's kill wait -----------------------------------


@pytest.mark.parametrize(
    ("kill_wait", "grace"),
    [(None, 25), (SCONTROL_KILL_WAIT, 25), (KillWait(10, "s"), 5), (KillWait(4, "s"), 2)],
)
def test_the_default_grace_period_fits_a_known_kill_wait(
    kill_wait: KillWait | None, grace: float
) -> None:
    assert derive_grace_period(25, False, kill_wait) == grace


def test_a_given_grace_period_or_an_assumed_kill_wait_changes_nothing() -> None:
    assert derive_grace_period(40, True, KillWait(10, "s")) == 40
    assert derive_grace_period(25, False, KillWait(10, "pod", assumed=True)) == 25


def test_a_grace_period_past_the_schedulers_kill_wait_is_an_error() -> None:
    problems = grace_problems(40, "--grace-period", True, SCONTROL_KILL_WAIT)
    (error,) = problems.errors
    assert "--grace-period 40 s (--grace-period) is not shorter than" in error
    assert "30 s (SLURM's KillWait (scontrol show config))" in error
    assert "below 25 s" in error


@pytest.mark.parametrize("kill_wait", [DECLARED_KILL_WAIT, POD_DEFAULT])
def test_past_a_declared_or_assumed_kill_wait_it_is_a_warning(kill_wait: KillWait) -> None:
    problems = grace_problems(30, "--grace-period", True, kill_wait)
    assert not problems.errors and "is not shorter than" in problems.warnings[0]


def test_a_grace_period_leaving_no_time_to_report_is_a_warning() -> None:
    problems = grace_problems(28, "--grace-period", True, SCONTROL_KILL_WAIT)
    assert problems == Problems(warnings=problems.warnings)
    assert "leaves the launcher 2 s" in problems.warnings[0]
    assert grace_problems(25, "default", False, SCONTROL_KILL_WAIT) == Problems()
    assert grace_problems(90, "--grace-period", True, None) == Problems()


# -- --hang-timeout against the process group's timeout -----------------------------------


def test_a_hang_timeout_the_backend_always_beats_is_an_error() -> None:
    nccl = pg_timeout({"TORCH_DISTRIBUTED_BACKEND": "nccl"})
    (error,) = hang_problems(parse_hang_timeout("900"), nccl).errors
    assert "--hang-timeout 900 s is not shorter than the process group's timeout, 600 s" in error
    assert "DIST_LAUNCH_PG_TIMEOUT" in error
    assert hang_problems(parse_hang_timeout("590"), nccl) == Problems()


def test_against_a_declared_process_group_timeout_it_is_a_warning() -> None:
    declared = pg_timeout({"DIST_LAUNCH_PG_TIMEOUT": "120", "TORCH_DISTRIBUTED_BACKEND": "nccl"})
    assert declared == PgTimeout(120, "DIST_LAUNCH_PG_TIMEOUT", user_set=True)
    problems = hang_problems(parse_hang_timeout("120"), declared)
    assert not problems.errors and problems.warnings
    (auto,) = hang_problems(parse_hang_timeout("auto"), declared).warnings
    assert "--hang-timeout auto waits at least 300 s" in auto


def test_an_unknown_process_group_timeout_or_no_hang_detection_is_never_wrong() -> None:
    unknown = pg_timeout({})
    assert unknown.seconds is None
    assert hang_problems(parse_hang_timeout("5000"), unknown) == Problems()
    gloo = pg_timeout({"TORCH_DISTRIBUTED_BACKEND": "gloo"})
    assert hang_problems(parse_hang_timeout("off"), gloo) == Problems()
    assert hang_problems(parse_hang_timeout("auto"), gloo) == Problems()


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_a_malformed_declared_timeout_is_named(value: str) -> None:
    with pytest.raises(UsageError, match=f"DIST_LAUNCH_PG_TIMEOUT='{value}'"):
        pg_timeout({"DIST_LAUNCH_PG_TIMEOUT": value})
    with pytest.raises(UsageError, match=f"DIST_LAUNCH_KILL_WAIT='{value}'"):
        read_kill_wait({"DIST_LAUNCH_KILL_WAIT": value})


# -- the whole budget -----------------------------------------------------------------------


def test_the_budget_lists_every_clock_of_an_elastic_run(script: str) -> None:
    argv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", "--rdzv-conf", "read_timeout=7"]
    plan = plan_of([*argv, "--hang-timeout", "60", "--timeout", "3600", script])
    budget = timeout_budget(plan, pg_timeout({}), SCONTROL_KILL_WAIT)
    assert [wait.key for wait in budget.waits] == [
        "rdzv_join",
        "rdzv_last_call",
        "keep_alive",
        "reform_after_loss",
        "store_call",
        "process_group",
        "hang_timeout",
        "grace_period",
        "kill_wait",
        "job_timeout",
    ]
    timeouts = budget.as_json()
    assert timeouts["store_call"] == {"seconds": 7, "source": "--rdzv-conf read_timeout"}
    assert timeouts["rdzv_join"] == {"seconds": 600, "source": "torch's default"}
    assert timeouts["keep_alive"]["seconds"] == 15
    assert timeouts["hang_timeout"] == {"seconds": 60, "source": "flag"}
    assert timeouts["kill_wait"]["seconds"] == 30
    json.dumps(timeouts)  # error.json holds it
    lines = budget.lines()
    assert lines[0] == "timeout budget:" and len(lines) == 1 + len(budget.waits)
    assert any("rendezvous store call" in line and "7 s" in line for line in lines)
    assert budget.problems == Problems()


def test_the_budget_says_what_bounds_re_forming_after_a_lost_node(script: str) -> None:
    elastic = ["--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"]
    defaults = timeout_budget(plan_of([*elastic, script]), pg_timeout({}), None)
    reform = defaults.as_json()["reform_after_loss"]
    assert reform["seconds"] == 45  # torch's keep-alive 5 s x 3, then its 30 s last call
    assert "noticed within keep-alive 5 s x 3 = 15 s, + last call 30 s" in str(reform["source"])
    assert "keep_alive_interval=2,keep_alive_max_attempt=4,last_call_timeout=3" in str(
        reform["source"]
    )
    conf = "keep_alive_interval=2,keep_alive_max_attempt=4,last_call_timeout=3"
    tuned = plan_of([*elastic, "--rdzv-conf", conf, script])
    lines = timeout_budget(tuned, pg_timeout({}), None).lines()
    (line,) = [line for line in lines if "lost node: peers re-form within" in line]
    assert "11 s" in line and "keep-alive 2 s x 4 = 8 s, + last call 3 s; --rdzv-conf" in line
    fixed = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", script]
    reform = timeout_budget(plan_of(fixed), pg_timeout({}), None).as_json()["reform_after_loss"]
    assert reform["seconds"] is None and "only with a replacement" in str(reform["source"])


def etcd_budget(script: str, nnodes: str, conf: str = "") -> TimeoutBudget:
    """The budget of an etcd run, with the silence that fences its cut-off nodes."""
    argv = ["--nnodes", nnodes, "--rdzv-backend", "etcd", "--rdzv-endpoint", "h:2379"]
    plan = plan_of([*argv, *(["--rdzv-conf", conf] if conf else []), script])
    return timeout_budget(plan, pg_timeout({}), None, fencing_bound(plan))


def test_a_cut_side_fenced_after_the_others_go_on_is_a_warning(script: str) -> None:
    # The integration tests' settings: the others drop the cut node after 3 s and
    # start after a 2 s last call; the cut node is fenced after 5 s + etcd's 6 s.
    short = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2"
    budget = etcd_budget(script, "2:3", short)
    assert budget.as_json()["fenced_after"]["seconds"] == 11
    assert budget.problems.errors == ()
    (warning,) = budget.problems.warnings
    assert "fenced after 11 s" in warning and "next round 5 s after the cut" in warning
    assert "last_call_timeout above 8 s" in warning


def test_a_cut_side_fenced_first_is_no_warning(script: str) -> None:
    # torch's defaults (fenced after 21 s, the others go on after 45 s), a last call
    # long enough, and a fixed node count (the others wait for a replacement).
    assert etcd_budget(script, "2:3").problems == Problems()
    long_call = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=9"
    assert etcd_budget(script, "2:3", long_call).problems == Problems()
    short = "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=2"
    assert etcd_budget(script, "3", short).problems == Problems()


def test_a_static_run_has_no_rendezvous_clocks_and_takes_a_fitting_grace_period(
    script: str,
) -> None:
    budget = timeout_budget(plan_of([script]), pg_timeout({}), KillWait(12, "s"))
    assert "rdzv_join" not in budget.as_json()
    assert budget.grace_period == 7
    assert budget.as_json()["grace_period"]["source"].startswith("the default 25 s cut")


def test_the_grace_periods_source_is_the_flag_or_variable_that_gave_it(script: str) -> None:
    assert plan_of([script]).sources["grace_period"] == "default"
    assert plan_of(["--grace-period", "3", script]).sources["grace_period"] == "--grace-period"
    env = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "9"}
    assert plan_of([script], env).sources["grace_period"] == "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
    plan = plan_of(["--grace-period", "40", script])
    (error,) = timeout_budget(plan, pg_timeout({}), SCONTROL_KILL_WAIT).problems.errors
    assert "(--grace-period)" in error


# -- reading SLURM's KillWait ---------------------------------------------------------------

CONFIG = """\
Configuration data as of 2026-11-28T12:00:00
AccountingStorageBackupHost = (null)
KillOnBadExit           = 0
KillWait                = 12 sec
LaunchParameters        = (null)
"""


def test_killwait_is_read_from_scontrols_configuration() -> None:
    assert parse_kill_wait(CONFIG) == 12
    assert parse_kill_wait("KillOnBadExit = 0\n") is None


def _stand_in_scontrol(tmp_path: Path, body: str) -> Path:
    """An executable ``scontrol`` in its own directory (a real process, not a mock)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    program = folder / "scontrol"
    program.write_text(f"#!/bin/sh\necho called >> {tmp_path / 'calls'}\n{body}\n")
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    return folder


@pytest.mark.processes
def test_killwait_is_asked_of_scontrol_in_a_slurm_job_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _stand_in_scontrol(tmp_path, f"cat <<'EOF'\n{CONFIG}EOF")
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    assert read_kill_wait({}) is None
    assert not (tmp_path / "calls").exists()
    assert read_kill_wait({"SLURM_JOB_ID": "7"}) == KillWait(
        12, "SLURM's KillWait (scontrol show config)"
    )
    declared = read_kill_wait({"SLURM_JOB_ID": "7", "DIST_LAUNCH_KILL_WAIT": "20"})
    assert declared == KillWait(20, "DIST_LAUNCH_KILL_WAIT", user_set=True)
    assert (tmp_path / "calls").read_text().count("called") == 1


@pytest.mark.processes
def test_a_silent_scontrol_delays_the_start_by_its_short_timeout_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _stand_in_scontrol(tmp_path, "exec sleep 60")  # slurmctld does not answer
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    started = time.monotonic()
    assert read_kill_wait({"SLURM_JOB_ID": "7"}, scontrol_timeout=0.5) is None
    assert time.monotonic() - started < 10


def test_in_a_pod_the_kill_wait_is_kubernetes_default_assumed() -> None:
    assert read_kill_wait({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) == POD_DEFAULT


# -- the launcher ---------------------------------------------------------------------------


def _launch(tmp_path: Path, argv: list[str], **env: str) -> tuple[int, str]:
    return run_launcher(tmp_path, *argv, env={**os.environ, **env})


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_verbose_prints_the_budget_and_error_json_holds_it(tmp_path: Path) -> None:
    argv = ["--verbose", "--log-dir", "logs", "--run-id", "r", "--no-python", "false"]
    status, stderr = _launch(tmp_path, argv, DIST_LAUNCH_KILL_WAIT="10")
    assert status == 1, stderr
    assert "timeout budget:" in stderr
    assert "grace period 5 s: the scheduler's SIGKILL comes 10 s after its SIGTERM" in stderr
    extra = json.loads((tmp_path / "logs/r/error.json").read_text())["message"]["extraInfo"]
    assert extra["timeouts"]["grace_period"]["seconds"] == 5
    assert extra["timeouts"]["kill_wait"] == {"seconds": 10, "source": "DIST_LAUNCH_KILL_WAIT"}


@pytest.mark.processes
@pytest.mark.timeout(240)
def test_an_inversion_stops_the_start_with_status_2(tmp_path: Path) -> None:
    status, stderr = _launch(
        tmp_path, ["--hang-timeout", "900", "--no-python", "true"], TORCH_DISTRIBUTED_BACKEND="nccl"
    )
    assert status == 2, stderr
    assert "error: --hang-timeout 900 s is not shorter than" in stderr
    argv = ["--grace-period", "40", "--no-python", "true"]
    status, stderr = _launch(tmp_path, argv, DIST_LAUNCH_KILL_WAIT="30")
    assert status == 0, stderr
    assert "WARNING: --grace-period 40 s (--grace-period) is not shorter" in stderr
