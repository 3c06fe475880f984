"""The node settings a Kubernetes pod's variables give, as defaults of the node flags.

Read only in a pod (``KUBERNETES_SERVICE_HOST`` set), after the flags, ``PET_*`` and
SLURM (:mod:`dist_launch.plan.sources`). What each operator sets, and what it becomes:

- Kubeflow Trainer v2 (TrainJob) sets only ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
  ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT``: torchrun's own
  variables, read as every ``PET_*`` is; nothing here.
- Kubeflow PyTorchJob (training-operator v1) sets ``MASTER_ADDR`` and ``MASTER_PORT``
  (the master replica's service), ``RANK`` (the pod's index: the **node** rank) and
  ``WORLD_SIZE`` (the pod count; or pods x processes where it also sets
  ``PET_NPROC_PER_NODE`` and ``PET_NNODES``, which then win). A pod's ``RANK`` and
  ``WORLD_SIZE`` never reach a worker as its own: each worker gets its process rank.
- An Indexed Job, or a JobSet's, sets ``JOB_COMPLETION_INDEX`` (the node rank) and
  nothing that gives the node count or the master: :func:`check_kubernetes_settings`
  asks for them rather than run a silent single node.
- LeaderWorkerSet sets ``LWS_LEADER_ADDRESS`` (the master), ``LWS_GROUP_SIZE`` (the
  node count) and ``LWS_WORKER_INDEX`` (the node rank, 0 for the leader); the port is
  torchrun's several-node default, 29500.
"""

from __future__ import annotations

from collections.abc import Mapping

from dist_launch.plan.launch_plan import UsageError
from dist_launch.plan.sources import Settings, SettingsBySource


def in_pod(environ: Mapping[str, str]) -> bool:
    """True in a Kubernetes pod (``KUBERNETES_SERVICE_HOST``, set in every container)."""
    return bool(environ.get("KUBERNETES_SERVICE_HOST"))


def _pytorchjob(environ: Mapping[str, str]) -> SettingsBySource:
    found: SettingsBySource = {"master_addr": (environ["MASTER_ADDR"], "MASTER_ADDR (PyTorchJob)")}
    if environ.get("MASTER_PORT"):
        found["master_port"] = (environ["MASTER_PORT"], "MASTER_PORT (PyTorchJob)")
    if environ.get("RANK"):
        found["node_rank"] = (environ["RANK"], "RANK (PyTorchJob: the pod's index)")
    # With PET_NPROC_PER_NODE the operator's WORLD_SIZE counts processes, not pods.
    per_pod = environ.get("PET_NNODES") or environ.get("PET_NPROC_PER_NODE")
    if environ.get("WORLD_SIZE") and not per_pod:
        found["nnodes"] = (environ["WORLD_SIZE"], "WORLD_SIZE (PyTorchJob: the pod count)")
    return found


def kubernetes_settings(environ: Mapping[str, str]) -> SettingsBySource:
    """Node settings from a pod's variables: name -> (value, source); empty outside a pod."""
    if not in_pod(environ):
        return {}
    if environ.get("LWS_LEADER_ADDRESS"):
        found: SettingsBySource = {
            "master_addr": (environ["LWS_LEADER_ADDRESS"], "LWS_LEADER_ADDRESS"),
        }
        for name, variable in (("nnodes", "LWS_GROUP_SIZE"), ("node_rank", "LWS_WORKER_INDEX")):
            if environ.get(variable):
                found[name] = (environ[variable], variable)
        return found
    if environ.get("MASTER_ADDR"):
        return _pytorchjob(environ)
    if environ.get("JOB_COMPLETION_INDEX"):
        return {"node_rank": (environ["JOB_COMPLETION_INDEX"], "JOB_COMPLETION_INDEX")}
    return {}


def check_kubernetes_settings(settings: Settings) -> None:
    """Refuses a pod whose node rank came from its index but whose job size is unknown.

    An Indexed Job (or a JobSet's) gives each pod ``JOB_COMPLETION_INDEX`` and nothing
    else: running it as one node would start N separate one-node jobs.

    Raises:
        UsageError: The node count, or (several nodes, static) the master, is missing;
            the message names the variables that give them.
    """
    if settings.source("node_rank") != "JOB_COMPLETION_INDEX":
        return
    index = settings.text("node_rank")
    if settings.source("nnodes") == "default":
        raise UsageError(
            f"JOB_COMPLETION_INDEX={index} gives this pod's node rank, but nothing gives "
            "the node count: set PET_NNODES (or --nnodes) in the pod spec, and the master "
            "with PET_MASTER_ADDR (or --master-addr; a JobSet's headless service name, "
            "e.g. <jobset>-<job>-0-0.<jobset>)"
        )
    backend = settings.text("rdzv_backend")
    if backend == "static" and settings.source("master_addr") == "default":
        raise UsageError(
            f"JOB_COMPLETION_INDEX={index} with {settings.text('nnodes')} nodes, but "
            "nothing names the master: set PET_MASTER_ADDR (or --master-addr) to the "
            "host of index 0 (a JobSet's headless service name, e.g. "
            "<jobset>-<job>-0-0.<jobset>)"
        )
