"""Which run a launcher belongs to, and which folder of a shared ``--log-dir`` is its own.

Every launcher of one job (one per node) must name the same run, so that
``TORCHELASTIC_RUN_ID`` is the same on every rank and a ``--log-dir`` that the nodes
share holds one run. The run id is the first of:

1. ``--run-id`` (dist-launch's own flag);
2. ``--rdzv-id`` (or ``PET_RDZV_ID``) unless it is torchrun's default, ``none``;
3. a job of several nodes under ``srun``: ``<SLURM_JOB_ID>.<SLURM_STEP_ID>``, the
   step as SLURM names it (``sacct`` shows ``1234.0``);
4. a job of several nodes in a Kubernetes pod: the host every pod of the job reaches,
   which the operator names after the job: the master (static rendezvous; a
   PyTorchJob's ``<job>-master-0``, a Trainer v2 or JobSet ``<job>-node-0-0.<job>``,
   a LeaderWorkerSet group's leader) or the c10d endpoint's host;
5. one node: a random id (every run its own); several nodes: ``none``, as torchrun.

On several nodes each launcher writes into a folder of its own inside the run's
directory (:func:`node_log_folder`); one node keeps torchrun's layout unchanged.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from dist_core.env import in_slurm_step

# torchrun's --rdzv-id default: no id given.
NO_RDZV_ID = "none"


def _endpoint_host(endpoint: str) -> str:
    """The host of ``HOST[:PORT]`` or ``[IPv6]:PORT``."""
    if endpoint.startswith("["):
        return endpoint[1:].partition("]")[0]
    host, sep, port = endpoint.rpartition(":")
    if not sep or ":" in host or not port.isdigit():
        return endpoint  # no port, or an IPv6 address without brackets
    return host


def slurm_step_run_id(environ: Mapping[str, str]) -> str | None:
    """``<SLURM_JOB_ID>.<SLURM_STEP_ID>`` in a task of a job step (``srun``), else None.

    Reads ``SLURM_JOB_ID`` and ``SLURM_STEP_ID`` (or ``SLURM_STEPID``).
    """
    job = environ.get("SLURM_JOB_ID", "").strip()
    step = (environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or "").strip()
    if not job or not step or not in_slurm_step(environ):
        return None
    return f"{job}.{step}"


def kubernetes_run_id(
    environ: Mapping[str, str], *, elastic: bool, master_addr: str, rdzv_endpoint: str
) -> str | None:
    """The host every pod of the job reaches, in a Kubernetes pod; else None.

    Reads ``KUBERNETES_SERVICE_HOST`` (set in every container of a pod).

    Args:
        environ: The launcher's environment.
        elastic: True for ``--rdzv-backend c10d``.
        master_addr: The static rendezvous' master, as the plan resolved it.
        rdzv_endpoint: The c10d endpoint, as the plan resolved it.
    """
    if not environ.get("KUBERNETES_SERVICE_HOST"):
        return None
    host = _endpoint_host(rdzv_endpoint) if elastic else master_addr
    return host or None


def choose_run_id(
    *,
    given: str,
    rdzv_id: str,
    several_nodes: bool,
    environ: Mapping[str, str],
    elastic: bool,
    master_addr: str,
    rdzv_endpoint: str,
) -> tuple[str, str]:
    """The run id and where it came from; see the module docstring for the order.

    Reads the variables of :func:`slurm_step_run_id` and :func:`kubernetes_run_id`.

    Args:
        given: ``--run-id`` ("" when not given).
        rdzv_id: ``--rdzv-id`` as resolved (``none`` when not given).
        several_nodes: True when the job may span several nodes.
        environ: The launcher's environment.
        elastic: True for ``--rdzv-backend c10d``.
        master_addr: The static rendezvous' master, as the plan resolved it.
        rdzv_endpoint: The c10d endpoint, as the plan resolved it.
    """
    if given:
        return given, "--run-id"
    if rdzv_id and rdzv_id != NO_RDZV_ID:
        return rdzv_id, "--rdzv-id"
    if several_nodes:
        slurm = slurm_step_run_id(environ)
        if slurm is not None:
            return slurm, "SLURM_JOB_ID.SLURM_STEP_ID"
        pod = kubernetes_run_id(
            environ, elastic=elastic, master_addr=master_addr, rdzv_endpoint=rdzv_endpoint
        )
        if pod is not None:
            return pod, "the job's rendezvous host (Kubernetes)"
        return NO_RDZV_ID, "default"
    return uuid.uuid4().hex, "random"


def node_log_folder(*, several_nodes: bool, elastic: bool, node_rank: int, host: str) -> str | None:
    """This launcher's folder in the run's ``--log-dir`` directory; None on one node.

    On one node the run's directory is the launcher's own (torchrun's layout). On
    several, each node writes ``<run_id>/<folder>/attempt_<n>/<local_rank>/``: a static
    job's node rank is fixed, so the folder is ``node<rank>``; with c10d, torch's
    rendezvous hands out node ranks and may change them between rounds, so the folder
    is the host name.
    """
    if not several_nodes:
        return None
    return host if elastic else f"node{node_rank}"
