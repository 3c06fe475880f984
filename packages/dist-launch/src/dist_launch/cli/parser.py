"""The ``dist-launch`` command line: torchrun's flags, parsed into a :class:`LaunchPlan`.

``dist-launch -n 4 train.py --lr 0.1`` starts four workers on this node with the
variables torchrun sets, prefixes their output with ``[rank{r}]: ``, and when one
fails stops the others and prints the root cause with its traceback first. Every flag
of ``torchrun --help`` (torch 2.13) is accepted in both spellings and from its
``PET_<FLAG>`` variable (see :mod:`dist_launch.plan.build`); the few that cannot be honoured
are refused by name with the reason. This module only parses: :mod:`dist_launch.agent.agent`
runs the plan.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from dist_launch.exit_codes import ExitCode
from dist_launch.plan.build import build_plan
from dist_launch.plan.hang_policy import AUTO_FACTOR, AUTO_FLOOR_SECONDS
from dist_launch.plan.launch_plan import LaunchPlan

PROG = "dist-launch"


def _spellings(name: str) -> list[str]:
    dashed = "--" + name.replace("_", "-")
    underscored = "--" + name
    return [dashed] if dashed == underscored else [dashed, underscored]


class _PrintCompletion(argparse.Action):
    """``--print-completion SHELL``: prints the shell's completion script, then exits.

    Acts while the line is parsed, as ``--help`` does, so no script is needed.
    """

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        shell = str(values)
        try:
            import shtab  # noqa: PLC0415 - optional, and only this flag needs it
        except ImportError:
            parser.error(
                f"{option_string} {shell}: needs the optional 'shtab' package "
                "(pip install shtab), as torchrun's does"
            )
        if shell not in shtab.SUPPORTED_SHELLS:
            parser.error(f"{option_string} {shell}: not one of {', '.join(shtab.SUPPORTED_SHELLS)}")
        print(shtab.complete(parser, shell=shell))
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: torchrun's flags (``-`` or ``_``) and dist-launch's own.

    Every default is None here: :func:`dist_launch.plan.build.build_plan` fills what was not
    given from ``PET_*``, SLURM, or the documented default, and records which.
    """
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=(
            "Run a script or module on N local processes (and across nodes), with "
            "torchrun's flags and variables; stop every rank when one fails and report "
            "the root cause first. Every flag can also come from PET_<FLAG>."
        ),
    )

    def value(name: str, help_text: str, *short: str, metavar: str | None = None) -> None:
        parser.add_argument(
            *short, *_spellings(name), dest=name, default=None, metavar=metavar, help=help_text
        )

    def switch(name: str, help_text: str, *short: str) -> None:
        parser.add_argument(
            *short,
            *_spellings(name),
            dest=name,
            action="store_const",
            const=True,
            default=None,
            help=help_text,
        )

    # Worker and node counts.
    value(
        "nnodes",
        "nodes: N, or MIN:MAX with --rdzv-backend c10d (default 1; under srun, SLURM_NNODES)",
        metavar="N|MIN:MAX",
    )
    value(
        "nproc_per_node",
        "workers on this node: N, auto, cpu, gpu or xpu (default 1)",
        "-n",
        metavar="N",
    )
    # Rendezvous.
    value(
        "rdzv_backend",
        "static (default; --master-addr/--node-rank), c10d (torch "
        "elastic's rendezvous; nodes may join in any order) or etcd (c10d's, its state "
        "in etcd: survives any one node; torchrun's etcd-v2 spelling runs on the v3 API)",
        metavar="static|c10d|etcd",
    )
    value(
        "rdzv_endpoint",
        "HOST[:PORT] of the c10d rendezvous store (port 29400 when left out, as with "
        "torchrun; under srun: first host of SLURM_JOB_NODELIST); with etcd, "
        "HOST[:PORT],... of its members (port 2379 when left out)",
        metavar="HOST[:PORT]",
    )
    value("rdzv_id", "job id shared by every node of the job", metavar="ID")
    value(
        "rdzv_conf",
        "rendezvous settings, k=v,... (join_timeout, last_call_timeout, "
        "close_timeout, read_timeout, keep_alive_interval, keep_alive_max_attempt, "
        "is_host; etcd: protocol, cacert, cert, key)",
        metavar="K=V,...",
    )
    switch(
        "standalone",
        "one node with its own rendezvous on a free port (the default when no node flag is given)",
    )
    # What runs and how.
    value(
        "max_restarts",
        "restart the job's workers up to this many times after a "
        "failure; with c10d the budget is job-wide (default 0)",
        metavar="N",
    )
    value(
        "monitor_interval",
        "seconds between checks of the rendezvous for nodes waiting "
        "to join (c10d; default 0.1); worker exits are seen at once",
        metavar="SECONDS",
    )
    value(
        "start_method",
        "forkserver (default: workers forked from one interpreter that "
        "imported torch once), spawn (a fresh interpreter per worker), fork (the same as "
        "forkserver)",
        metavar="forkserver|spawn|fork",
    )
    value("event_log_handler", "only 'null' (torchrun's default) is accepted", metavar="NAME")
    value("role", "ROLE_NAME of the workers (default 'default')", metavar="ROLE")
    switch("module", "the target is a module, run as python -m", "-m")
    switch("no_python", "run the target as a program, not with python")
    switch("run_path", "accepted: each worker always runs the script in its own interpreter")
    # Output.
    value(
        "log_dir",
        "write each rank's output and error.json to DIR/<run_id>/attempt_<n>/"
        "<local_rank>/ (torchrun's layout; on several nodes DIR/<run_id>/<node>/...; a "
        "re-run never overwrites)",
        metavar="DIR",
    )
    value(
        "redirects",
        "streams kept off the console, to --log-dir only: 0 none, 1 "
        "stdout, 2 stderr, 3 both, or per local rank 0:1,1:2",
        "-r",
        metavar="STD",
    )
    value(
        "tee",
        "streams shown and written to --log-dir (same format as --redirects)",
        "-t",
        metavar="STD",
    )
    value(
        "local_ranks_filter",
        "only these local ranks on the console, e.g. 0 or 0,2 (--log-dir still gets every rank)",
        metavar="RANKS",
    )
    value(
        "log_line_prefix_template",
        "prefix of each console line, with ${rank}, ${local_rank}, ${role_name} and "
        "${hostname} (default '[rank${rank}]: '; also TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)",
        metavar="TEMPLATE",
    )
    value("duplicate_stdout_filters", "refused: use --log-dir and grep", metavar="F,...")
    value("duplicate_stderr_filters", "refused: use --log-dir and grep", metavar="F,...")
    # Static rendezvous (torch.distributed.launch's).
    value(
        "node_rank",
        "this node's rank with --rdzv-backend static (default 0; under srun, SLURM_NODEID)",
        metavar="R",
    )
    value(
        "master_addr",
        "host of rank 0's store with static rendezvous (default "
        "127.0.0.1; under srun, the first host of SLURM_JOB_NODELIST)",
        metavar="HOST",
    )
    value(
        "master_port",
        "its port (default: a free port on one node, 29500 on several; "
        "under srun, derived from SLURM_JOB_ID)",
        metavar="PORT",
    )
    value(
        "local_addr",
        "this node's address as the others reach it (c10d; default: the "
        "address of the interface that routes to the rendezvous endpoint)",
        metavar="ADDR",
    )
    value("logs_specs", "refused: torchrun's LogsSpecs plugins are not loaded", metavar="NAME")
    value("numa_binding", "refused: not supported yet", metavar="MODE")
    value(
        "signals_to_handle",
        "signals forwarded to every worker before stopping them "
        "(default SIGTERM,SIGINT,SIGHUP,SIGQUIT; SIGQUIT dumps every rank's stack "
        "instead, stopping nothing)",
        metavar="SIG,...",
    )
    value(
        "signals_to_forward",
        "signals passed on to every worker without stopping anything, e.g. SIGUSR1 for "
        "SLURM's --signal=USR1@90 (default none; not one of --signals-to-handle)",
        metavar="SIG,...",
    )
    value(
        "shutdown_timeout",
        "seconds between SIGTERM and SIGKILL when stopping workers (the same as --grace-period)",
        metavar="SECONDS",
    )
    switch(
        "virtual_local_rank",
        "LOCAL_RANK=0 in every worker, each seeing only its own GPU through CUDA_VISIBLE_DEVICES",
    )
    parser.add_argument(
        *_spellings("print_completion"),
        action=_PrintCompletion,
        metavar="SHELL",
        help="print a completion script for SHELL (bash, zsh, ...: what shtab knows) and exit; "
        "needs the optional shtab package, as torchrun's does",
    )
    # dist-launch's own.
    value(
        "grace_period",
        "seconds between SIGTERM and SIGKILL, after a failure or a stop from outside: "
        "a rank that handles SIGTERM has this long to checkpoint (default 25, or 5 s "
        "less than the scheduler's kill wait where that is known and shorter: SLURM's "
        "KillWait, DIST_LAUNCH_KILL_WAIT; or TORCH_ELASTIC_SHUTDOWN_TIMEOUT)",
        metavar="SECONDS",
    )
    value("timeout", "stop the job after this long, showing where each rank was", metavar="SECONDS")
    value(
        "hang_timeout",
        "a job none of whose ranks on a node makes progress (a new Python stack, output, "
        "dist_launch.report_progress()) for this long is hung: every rank's stack is "
        "shown, the odd ranks named, then the group restarts (--max-restarts) or the "
        f"launcher exits with status {int(ExitCode.HUNG)}. auto (the default): "
        f"{AUTO_FACTOR:g} x the longest quiet interval seen, at least "
        f"{AUTO_FLOOR_SECONDS:g} s; off: never",
        metavar="SECONDS|auto|off",
    )
    value(
        "slow_ranks",
        "every SECONDS (default 60), name the ranks that enter collectives consistently "
        "late, from torch's flight recorder: a warning on the launcher's log and a line "
        "in slow_ranks.jsonl in the log directory; off: no report",
        metavar="SECONDS|off",
    )
    switch(
        "verbose",
        "print the timeout budget at start: every wait of the run, its value and where it "
        "came from (also in the run's error.json)",
    )
    value(
        "run_id",
        "TORCHELASTIC_RUN_ID (default: --rdzv-id, else the SLURM step or the pod's job on "
        "several nodes, else random on one node)",
        metavar="ID",
    )
    parser.add_argument(
        "target",
        metavar="script|module",
        help="the script (or, with -m, module; with --no-python, program)",
    )
    parser.add_argument("target_args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def plan_from_args(argv: Sequence[str] | None = None) -> LaunchPlan:
    """Parses and validates the command line (and the ``PET_*``/SLURM variables).

    Raises:
        UsageError: A value is out of range; the message names the flag.
        SystemExit: argparse's own errors and ``--help``.
    """
    args = build_parser().parse_args(argv)
    return build_plan(vars(args))
