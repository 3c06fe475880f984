"""One timeout budget: every wait of a run, where each comes from, and the inversions.

A run waits on many clocks: torch's rendezvous (join, last call, keep-alive), its store
(one call), the workers' process group (a collective), ``--hang-timeout``,
``--grace-period`` and, outside, the scheduler's SIGKILL after its SIGTERM. Some orders
guarantee a bad ending:

- a ``--hang-timeout`` at or above the process group's timeout: the backend ends a
  stuck collective first (NCCL's watchdog aborts it), so the hang's report never
  comes;
- a ``--grace-period`` at or above the scheduler's kill wait: the scheduler's SIGKILL
  ends the launcher before the workers' checkpoint ends or the report is written;
- (a warning) an elastic job whose cut-off node is fenced only after its peers may
  have started their next round without it: both sides' workers run for a while.

Such an inversion is an error at start, or a warning when the user set both values on
purpose (the flag and the variable that declares the other). A grace period the user
did not give is derived from a known kill wait instead (:func:`derive_grace_period`).
Every decision here is a pure function of the plan and the values read elsewhere
(:mod:`dist_launch.plan.kill_wait`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dist_launch.plan.hang_policy import AUTO_FLOOR_SECONDS, HangPolicy
from dist_launch.plan.kill_wait import KillWait
from dist_launch.plan.launch_plan import LaunchPlan
from dist_launch.plan.values import seconds_from_variable

PG_TIMEOUT_VARIABLE = "DIST_LAUNCH_PG_TIMEOUT"
# Seconds the launcher keeps, after the grace period, to reap, pass on the last output,
# report and exit before the scheduler's own SIGKILL.
REPORT_RESERVE_SECONDS = 5.0
# torch's default process-group timeouts, by backend (NCCL's applies with
# TORCH_NCCL_ASYNC_ERROR_HANDLING, which the launcher sets unless the user did).
TORCH_PG_TIMEOUTS = {"nccl": 600.0, "gloo": 1800.0}
# The --rdzv-conf keys that bound re-forming after a lost node.
RE_FORM_KEYS = ("keep_alive_interval", "keep_alive_max_attempt", "last_call_timeout")


@dataclass(frozen=True)
class Wait:
    """One clock of the run.

    Attributes:
        key: Its name in ``error.json`` (``extraInfo.timeouts``).
        label: Its name in the launcher's log.
        seconds: How long; None for no limit, or unknown.
        source: Where the value came from (a flag, a variable, a default).
    """

    key: str
    label: str
    seconds: float | None
    source: str


@dataclass(frozen=True)
class PgTimeout:
    """The workers' process-group timeout, as far as the launcher can know it.

    Attributes:
        seconds: The timeout; None when unknown.
        source: Where it came from.
        user_set: True when the user declared it (``DIST_LAUNCH_PG_TIMEOUT``).
    """

    seconds: float | None
    source: str
    user_set: bool = False


def pg_timeout(environ: Mapping[str, str]) -> PgTimeout:
    """The process group's timeout: declared by the user, else torch's for the backend.

    The script passes its own ``timeout=`` to ``init_process_group``, which the launcher
    cannot see: ``DIST_LAUNCH_PG_TIMEOUT`` (seconds) declares it. Without it, torch's
    default for a backend named by ``TORCH_DISTRIBUTED_BACKEND`` (dist-core's) is
    assumed; else it is unknown. Reads those two variables.

    Raises:
        UsageError: ``DIST_LAUNCH_PG_TIMEOUT`` is not a positive number of seconds.
    """
    declared = seconds_from_variable(environ, PG_TIMEOUT_VARIABLE)
    if declared is not None:
        return PgTimeout(declared, PG_TIMEOUT_VARIABLE, user_set=True)
    backend = environ.get("TORCH_DISTRIBUTED_BACKEND", "").strip().lower()
    if backend in TORCH_PG_TIMEOUTS:
        return PgTimeout(
            TORCH_PG_TIMEOUTS[backend],
            f"torch's default for {backend} (TORCH_DISTRIBUTED_BACKEND={backend})",
        )
    return PgTimeout(None, "unknown: torch's default is 600 s for nccl, 1800 s for gloo")


def derive_grace_period(grace: float, user_set: bool, kill_wait: KillWait | None) -> float:
    """The grace period to use: the user's, else the default cut to fit the kill wait.

    A known (not assumed) kill wait shorter than the default plus the launcher's
    reserve gets ``kill wait - REPORT_RESERVE_SECONDS`` (at least half the kill wait).
    """
    if user_set or kill_wait is None or kill_wait.assumed:
        return grace
    fits = max(kill_wait.seconds - REPORT_RESERVE_SECONDS, kill_wait.seconds / 2)
    return min(grace, fits)


@dataclass(frozen=True)
class Problems:
    """What a budget's inversions amount to: errors stop the start, warnings do not."""

    errors: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()

    def __add__(self, other: Problems) -> Problems:
        return Problems(self.errors + other.errors, self.warnings + other.warnings)


def grace_problems(
    grace: float, grace_source: str, user_set: bool, kill_wait: KillWait | None
) -> Problems:
    """Whether the grace period ends before the scheduler's SIGKILL, with room to report."""
    if kill_wait is None:
        return Problems()
    limit = kill_wait.seconds
    said = f"--grace-period {grace:g} s ({grace_source})"
    if grace >= limit:
        message = (
            f"{said} is not shorter than the scheduler's kill wait, {limit:g} s "
            f"({kill_wait.source}): the scheduler's SIGKILL comes before the workers' "
            f"checkpoint ends and before the launcher reports; use a grace period below "
            f"{max(limit - REPORT_RESERVE_SECONDS, limit / 2):g} s or raise the kill wait"
        )
        if kill_wait.user_set or kill_wait.assumed:
            return Problems(warnings=(message,))
        return Problems(errors=(message,))
    if grace > limit - REPORT_RESERVE_SECONDS:
        return Problems(
            warnings=(
                f"{said} leaves the launcher {limit - grace:g} s before the scheduler's "
                f"SIGKILL at {limit:g} s ({kill_wait.source}) to reap, report and exit; "
                f"{REPORT_RESERVE_SECONDS:g} s is safe",
            )
        )
    return Problems()


def hang_problems(policy: HangPolicy, pg: PgTimeout) -> Problems:
    """Whether ``--hang-timeout`` can fire before the process group's own timeout."""
    if pg.seconds is None or not policy.enabled:
        return Problems()
    if policy.mode == "auto":
        if pg.seconds > AUTO_FLOOR_SECONDS:
            return Problems()
        return Problems(
            warnings=(
                f"--hang-timeout auto waits at least {AUTO_FLOOR_SECONDS:g} s, not less than "
                f"the process group's timeout, {pg.seconds:g} s ({pg.source}): a collective "
                "that hangs fails on the backend's timeout first, without the hang report; "
                "give --hang-timeout a number of seconds below it",
            )
        )
    assert policy.seconds is not None
    if policy.seconds < pg.seconds:
        return Problems()
    message = (
        f"--hang-timeout {policy.seconds:g} s is not shorter than the process group's "
        f"timeout, {pg.seconds:g} s ({pg.source}): the backend ends a stuck collective "
        "first, so the hang report never comes; use a shorter --hang-timeout, or pass a "
        f"longer timeout to init_process_group and declare it in {PG_TIMEOUT_VARIABLE}"
    )
    if pg.user_set:
        return Problems(warnings=(message,))
    return Problems(errors=(message,))


def fencing_problems(plan: LaunchPlan, fenced_after: float | None) -> Problems:
    """Whether a node cut off from the job is fenced before its peers go on without it.

    Its peers drop it once its heartbeats are ``keep_alive_interval x
    keep_alive_max_attempt`` old and start their next round after the last call
    (``--nnodes MIN:MAX`` only: a fixed count waits for a replacement). The cut-off
    node stops its workers after ``fenced_after`` seconds of its store's silence; when
    that comes later, its workers (and their checkpoints) outlive the start of the
    others' round.

    Args:
        plan: The launch plan.
        fenced_after: Seconds of silence that fence a node
            (:func:`~dist_launch.watch.cut_watch.fencing_bound`); None: not known.
    """
    if fenced_after is None or not plan.elastic or plan.min_nodes == plan.max_nodes:
        return Problems()
    timeouts = plan.rdzv_timeouts
    goes_on = timeouts.node_dead_after + timeouts.last_call
    if fenced_after < goes_on:
        return Problems()
    return Problems(
        warnings=(
            f"a node cut off from the job is fenced after {fenced_after:g} s of its store's "
            f"silence, but the others may start their next round {goes_on:g} s after the "
            f"cut (keep-alive {timeouts.node_dead_after:g} s + last_call_timeout "
            f"{timeouts.last_call:g} s): for a while both sides' workers run (and may "
            "write checkpoints); keep --rdzv-conf last_call_timeout above "
            f"{fenced_after - timeouts.node_dead_after:g} s where the cut side must stop "
            "first",
        )
    )


@dataclass(frozen=True)
class TimeoutBudget:
    """Every clock of a run, shortest role first, and what is wrong with their order.

    Attributes:
        waits: The run's clocks, in the order the launcher lists them.
        grace_period: The grace period to use (:func:`derive_grace_period`).
        problems: The inversions found.
    """

    waits: tuple[Wait, ...]
    grace_period: float
    problems: Problems

    def lines(self) -> list[str]:
        """The budget as the launcher prints it with ``--verbose``, one clock a line."""
        width = max(len(wait.label) for wait in self.waits)
        rows = ["timeout budget:"]
        for wait in self.waits:
            value = "none" if wait.seconds is None else f"{wait.seconds:g} s"
            rows.append(f"  {wait.label:<{width}}  {value:>8}  ({wait.source})")
        return rows

    def as_json(self) -> dict[str, dict[str, object]]:
        """The budget for ``error.json``: ``{key: {"seconds", "source"}}``."""
        return {wait.key: {"seconds": wait.seconds, "source": wait.source} for wait in self.waits}


def _conf_source(plan: LaunchPlan, key: str) -> str:
    return f"--rdzv-conf {key}" if key in plan.rdzv_conf else "torch's default"


def _rendezvous_waits(plan: LaunchPlan) -> list[Wait]:
    if not plan.elastic:
        return []
    timeouts = plan.rdzv_timeouts
    given = any(key in plan.rdzv_conf for key in ("keep_alive_interval", "keep_alive_max_attempt"))
    source = "--rdzv-conf" if given else "torch's defaults"
    keep_alive = (
        f"keep_alive_interval {timeouts.keep_alive_interval:g} s x keep_alive_max_attempt "
        f"{timeouts.keep_alive_max_attempt}, {source}"
    )
    return [
        Wait("rdzv_join", "rendezvous join", timeouts.join, _conf_source(plan, "join_timeout")),
        Wait(
            "rdzv_last_call",
            "rendezvous last call",
            timeouts.last_call,
            _conf_source(plan, "last_call_timeout"),
        ),
        Wait("keep_alive", "node declared dead after", timeouts.node_dead_after, keep_alive),
        _reform_wait(plan),
        Wait(
            "store_call",
            "rendezvous store call",
            timeouts.read,
            _conf_source(plan, "read_timeout"),
        ),
    ]


def _reform_wait(plan: LaunchPlan) -> Wait:
    """What bounds the peers' re-forming after a lost node: keep-alive plus last call."""
    timeouts = plan.rdzv_timeouts
    noticed = (
        f"a lost node is noticed within keep-alive {timeouts.keep_alive_interval:g} s x "
        f"{timeouts.keep_alive_max_attempt} = {timeouts.node_dead_after:g} s"
    )
    if plan.min_nodes == plan.max_nodes:
        return Wait(
            "reform_after_loss",
            "lost node: peers re-form within",
            None,
            f"{noticed}; --nnodes {plan.min_nodes} re-forms only with a replacement "
            f"(up to the join timeout); --nnodes MIN:MAX re-forms without it",
        )
    given = any(key in plan.rdzv_conf for key in RE_FORM_KEYS)
    tune = (
        "--rdzv-conf"
        if given
        else "torch's defaults; lower them with --rdzv-conf "
        "keep_alive_interval=2,keep_alive_max_attempt=4,last_call_timeout=3"
    )
    return Wait(
        "reform_after_loss",
        "lost node: peers re-form within",
        timeouts.reform_after_loss,
        f"{noticed}, + last call {timeouts.last_call:g} s; {tune}",
    )


def _hang_wait(policy: HangPolicy, source: str) -> Wait:
    if policy.mode == "auto":
        return Wait(
            "hang_timeout",
            "--hang-timeout",
            AUTO_FLOOR_SECONDS,
            f"auto ({source}): at least this, 5 x the longest quiet interval seen",
        )
    if policy.mode == "off":
        return Wait("hang_timeout", "--hang-timeout", None, f"off ({source})")
    return Wait("hang_timeout", "--hang-timeout", policy.seconds, source)


def timeout_budget(
    plan: LaunchPlan, pg: PgTimeout, kill_wait: KillWait | None, fenced_after: float | None = None
) -> TimeoutBudget:
    """The run's budget: its clocks, the grace period to use, the inversions.

    Args:
        plan: The launch plan (its sources say which values the user gave).
        pg: The process group's timeout (:func:`pg_timeout`).
        kill_wait: The scheduler's kill wait (:func:`~dist_launch.plan.kill_wait.read_kill_wait`).
        fenced_after: Seconds of store silence that fence a cut-off node
            (:func:`fencing_problems`); None when not known.
    """
    grace_source = plan.sources.get("grace_period", "default")
    grace_user_set = grace_source != "default"
    grace = derive_grace_period(plan.grace_period, grace_user_set, kill_wait)
    if grace != plan.grace_period:
        grace_source = f"the default {plan.grace_period:g} s cut to fit the kill wait"
    waits = [
        *_rendezvous_waits(plan),
        Wait("process_group", "process group timeout", pg.seconds, pg.source),
        _hang_wait(plan.hang_policy, plan.sources.get("hang_timeout", "default")),
        Wait("grace_period", "--grace-period", grace, grace_source),
        Wait(
            "kill_wait",
            "scheduler's SIGTERM to SIGKILL",
            None if kill_wait is None else kill_wait.seconds,
            "unknown" if kill_wait is None else kill_wait.source,
        ),
    ]
    if plan.timeout is not None:
        waits.append(Wait("job_timeout", "--timeout", plan.timeout, "flag"))
    if fenced_after is not None and plan.elastic:
        fencing = "the store's silence: keep-alive bound (5 s at least), + 6 s on etcd"
        waits.append(Wait("fenced_after", "cut-off node fenced after", fenced_after, fencing))
    problems = (
        grace_problems(grace, grace_source, grace_user_set, kill_wait)
        + hang_problems(plan.hang_policy, pg)
        + fencing_problems(plan, fenced_after)
    )
    return TimeoutBudget(tuple(waits), grace, problems)
