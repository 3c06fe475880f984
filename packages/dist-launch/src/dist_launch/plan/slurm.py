"""The node settings ``srun`` gives a task, as defaults of the node flags.

Reads ``SLURM_JOB_ID``, ``SLURM_NODEID``, ``SLURM_STEP_ID`` (or ``SLURM_STEPID``),
``SLURM_PROCID``, ``SLURM_NNODES`` (or ``SLURM_JOB_NUM_NODES``), ``SLURM_JOB_NODELIST``
(or ``SLURM_NODELIST``) and ``SLURM_NTASKS`` (or ``SLURM_NPROCS``).

Only a task of a job step (``srun``) takes them: SLURM gives the batch script itself
``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS`` but no step id, and a launcher run
there directly runs this node's workers alone, as ``torchrun --standalone`` does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from dist_core.env import in_slurm_step
from dist_core.slurm import expand_hostlist, slurm_master_port
from dist_launch.plan.launch_plan import UsageError

logger = logging.getLogger(__name__)


def slurm_port(job_id: str, step_id: str | None = None) -> int:
    """The master port of a SLURM job step, by :func:`dist_core.slurm_master_port`.

    Args:
        job_id: ``SLURM_JOB_ID`` as set; only its digits count (none counts as 0), so
            that an odd id still gives every node of the job the same port.
        step_id: ``SLURM_STEP_ID`` as set; None outside a step.

    Raises:
        UsageError: The step id is not a number.
    """
    digits = "".join(ch for ch in job_id if ch.isdigit())
    step = None
    if step_id is not None:
        if not step_id.strip().isdigit():
            raise UsageError(f"SLURM_STEP_ID={step_id!r} is not a step number")
        step = int(step_id)
    return slurm_master_port(int(digits) if digits else 0, step)


def under_srun(environ: Mapping[str, str]) -> bool:
    """True when this process is a task started by ``srun`` (reads the SLURM variables)."""
    return (
        bool(environ.get("SLURM_JOB_ID"))
        and bool(environ.get("SLURM_NODEID"))
        and in_slurm_step(environ)
    )


def slurm_restart_count(environ: Mapping[str, str]) -> int:
    """How many times SLURM requeued this job (``SLURM_RESTART_COUNT``; 0 outside a job).

    SLURM sets it in the batch script and every step of a requeued job (a preemption,
    ``scontrol requeue``), from 1 on; absent before the first requeue.

    Raises:
        UsageError: It is not a number.
    """
    raw = environ.get("SLURM_RESTART_COUNT", "").strip()
    if not raw or not environ.get("SLURM_JOB_ID"):
        return 0
    if not raw.isdigit():
        raise UsageError(f"SLURM_RESTART_COUNT={raw!r} is not a count")
    return int(raw)


def _in_batch_script_of_several_nodes(environ: Mapping[str, str]) -> bool:
    nodes = environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES") or "1"
    return bool(environ.get("SLURM_JOB_ID")) and nodes.isdigit() and int(nodes) > 1


def slurm_settings(environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Node settings from srun's variables: name -> (value, source)."""
    if not under_srun(environ):
        if _in_batch_script_of_several_nodes(environ):
            logger.warning(
                "runs on this node only: no SLURM_STEP_ID, so this is the job's batch "
                "script, not one of its tasks; to use every node of the job, start one "
                "launcher per node: srun --ntasks-per-node=1 dist-launch ..."
            )
        return {}
    found: dict[str, tuple[str, str]] = {}
    for variable in ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
        if environ.get(variable):
            found["nnodes"] = (environ[variable], variable)
            break
    found["node_rank"] = (environ["SLURM_NODEID"], "SLURM_NODEID")
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist:
        try:
            hosts = expand_hostlist(nodelist)
        except ValueError as error:
            raise UsageError(str(error)) from None
        found["master_addr"] = (hosts[0], "first host of SLURM_JOB_NODELIST")
    step_id = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    port = slurm_port(environ["SLURM_JOB_ID"], step_id)
    found["master_port"] = (str(port), "SLURM_JOB_ID, SLURM_STEP_ID")
    ntasks = environ.get("SLURM_NTASKS") or environ.get("SLURM_NPROCS")
    nnodes = found.get("nnodes", ("", ""))[0]
    if ntasks and nnodes and ntasks.isdigit() and nnodes.isdigit() and int(ntasks) > int(nnodes):
        raise UsageError(
            f"SLURM_NTASKS={ntasks} tasks on SLURM_NNODES={nnodes} nodes: dist-launch starts "
            "the workers of a node itself and must run once per node (srun "
            "--ntasks-per-node=1 dist-launch ...)"
        )
    return found
