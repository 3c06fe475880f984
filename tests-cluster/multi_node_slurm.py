"""A SLURM cluster of several nodes on this machine, each node a network namespace.

:func:`multi_node_slurm` makes a network of namespaces on one switch (tests-integration's
:mod:`netns`): a controller host ``ctl`` and nodes ``node1``, ``node2``, ... each with
its own address, host name and hosts file. munged runs here (its socket is a file every
namespace reaches); slurmctld runs on ``ctl``, each ``slurmd -D -N nodeK`` on its node,
started as::

    nsenter --net=/run/netns/<ns> unshare --mount --uts --propagation private \\
        sh -c 'mount --bind <hosts file> /etc/hosts && hostname nodeK && exec slurmd ...'

(``ip netns exec`` remounts /sys, and slurmd 22.05 then fails its cgroup check). Every
client command (``srun``, ``sbatch``, ``scancel``, ...) runs on ``ctl`` too, as on a login
node: nothing in this machine's own network namespace is touched, and a job's steps
talk to their ``srun`` over the switch.

On every way out the jobs are cancelled, the daemons stopped by PID, and every process
left in a namespace killed with it; a SIGKILLed test process takes the daemons along
(``setpriv --pdeathsig``) and its namespaces are removed by :mod:`netns`'s watcher.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from one_host_slurm import ClusterError, Machine, SlurmCluster, slurm_cluster

sys.path.append(str(Path(__file__).resolve().parent.parent / "tests-integration"))

from netns import Host, Network, network

CONTROLLER = "ctl"


@dataclass(frozen=True)
class MultiNodeCluster:
    """A running cluster and the namespaces under it, by node name."""

    slurm: SlurmCluster
    network: Network

    def host(self, node: str) -> Host:
        """The namespace of node ``node`` (``node1``, ...)."""
        for host in self.network.hosts:
            if host.name == node:
                return host
        raise KeyError(f"no node {node} in {[h.name for h in self.network.hosts]}")

    def mark_down(self, node: str) -> None:
        """Tells SLURM that ``node`` is down (its jobs end as NODE_FAIL), as the controller
        finds out itself once the node stops answering (``SlurmdTimeout``, minutes)."""
        self.slurm.command(["scontrol", "update", f"nodename={node}", "state=down", "reason=lost"])


@contextlib.contextmanager
def multi_node_slurm(
    count: int = 2, *, cpus: int = 16, first_job_id: int = 1
) -> Iterator[MultiNodeCluster]:
    """A running cluster of ``count`` nodes (``node1`` ...), ``cpus`` CPUs each.

    Raises:
        ClusterError: A daemon did not start, or a node did not become idle.
    """
    names = (CONTROLLER, *(f"node{k}" for k in range(1, count + 1)))
    with network(count + 1, names) as net:
        controller, *nodes = (
            Machine(host.name, host.address, tuple(host.enter())) for host in net.hosts
        )
        with slurm_cluster(controller, nodes, cpus=cpus, first_job_id=first_job_id) as slurm:
            yield MultiNodeCluster(slurm, net)


__all__ = ["ClusterError", "MultiNodeCluster", "multi_node_slurm"]
