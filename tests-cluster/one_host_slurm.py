"""A SLURM cluster for tests: munged, slurmctld and each slurmd as child processes.

:func:`slurm_cluster` runs the daemons of any layout (each slurmd and the controller
run by the argv prefix of its :class:`Machine`: nothing for this host, ``nsenter ...``
for a network namespace; see multi_node_slurm.py); :func:`one_host_slurm`, the
one-node cluster of this host. Either writes a configuration into a temporary directory of its own
(ports from :func:`dist_core.ports.get_unused_port`, a unique cluster name, its own
munge key and socket), starts the daemons in the foreground as children of the
calling process (under ``setpriv --pdeathsig KILL``: a SIGKILLed pytest takes them
along), waits until every node is idle, and yields a :class:`SlurmCluster` whose methods
run ``srun``, ``sbatch``, ``scancel`` and ``scontrol`` against it. On every way out it
cancels every job, stops the daemons by PID (SIGTERM, SIGKILL after
:data:`STOP_SECONDS`), kills what the cluster started and escaped its tracking, and
removes the directory.

SLURM's ``proctrack/linuxproc`` finds a step's processes by parentage only: a process
reparented to init (a batch script's child whose shell died first) escapes it. The
backstop is the environment: every job process carries ``SLURM_CONF=<root>/slurm.conf``,
and tests put ``DIST_TEST_TAG=<tag>`` in each job's environment
(:func:`processes.leftovers`).

Needs root (slurmd runs jobs as any user) and the Debian packages ``slurm-wlm``,
``munge`` and ``openmpi-bin`` (for the ``mpirun`` tests).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from processes import kill_pids, pids_holding, pids_with_variable

from dist_core.ports import get_unused_port

# The programs the cluster and the tests run.
TOOLS = (
    "munged",
    "slurmctld",
    "slurmd",
    "srun",
    "sbatch",
    "scancel",
    "scontrol",
    "sinfo",
    "squeue",
    "mpirun",
    "setpriv",
)
# How long each daemon gets to end after SIGTERM before SIGKILL.
STOP_SECONDS = 5.0
# How long the nodes may take to become idle (about 1 s here).
UP_SECONDS = 20.0

_SLURM_CONF = """\
ClusterName={cluster}
SlurmctldHost={controller}({controller_addr})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/run/munge.sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
FirstJobId={first_job_id}
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


_NODE_LINE = "NodeName={name} NodeAddr={address} CPUs={cpus} RealMemory=1000 State=UNKNOWN\n"


@dataclass(frozen=True)
class Machine:
    """Where a daemon runs: a SLURM node, or the controller's host.

    Attributes:
        name: Its host name (``NodeName``, ``SlurmctldHost``).
        address: The address the others reach it at (``NodeAddr``).
        prefix: The argv that runs the rest of a command there (empty: this host).
    """

    name: str
    address: str
    prefix: tuple[str, ...] = ()


class ClusterError(RuntimeError):
    """The cluster did not come up, or a SLURM command failed; carries the logs' tails."""


def missing_tools() -> list[str]:
    """The programs of :data:`TOOLS` that are not on ``PATH`` (or ``/usr/sbin``)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [tool for tool in TOOLS if shutil.which(tool, path=path) is None]


def _node_name() -> str:
    """This host's name when it resolves to an address here, else ``localhost``."""
    name = socket.gethostname()
    with contextlib.suppress(OSError):
        socket.getaddrinfo(name, None)
        return name
    return "localhost"


def _tail(path: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return "(no log)"


@dataclass(frozen=True)
class SlurmCluster:
    """A running cluster; every command runs against it (``SLURM_CONF``), on the
    controller's host (``prefix``)."""

    root: Path
    conf: Path
    nodes: tuple[str, ...]
    cpus: int  # each node's
    prefix: tuple[str, ...] = ()

    @property
    def node(self) -> str:
        """The first node's name."""
        return self.nodes[0]

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment, pointed at the cluster, with ``extra`` on top."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_"))}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def command(
        self, argv: Sequence[str], *, timeout: float = 30.0, env: Mapping[str, str] | None = None
    ) -> str:
        """Runs a SLURM client command to its end; returns its stdout.

        Raises:
            ClusterError: It failed (with its stderr and the controller's log tail).
        """
        done = subprocess.run(
            [*self.prefix, *argv],
            env=self.env(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise ClusterError(
                f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}\n"
                f"slurmctld.log:\n{_tail(self.root / 'log' / 'slurmctld.log')}"
            )
        return done.stdout

    def run(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, *, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``argv`` (``srun ...``, ``mpirun ...``) to its end; kills it at ``timeout``.

        Raises:
            subprocess.TimeoutExpired: It ran longer than ``timeout`` seconds (and was
                killed, with its process group).
        """
        process = self.popen(argv, env, process_group=0)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate(timeout=10)
            raise
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    def popen(
        self, argv: Sequence[str], env: Mapping[str, str] | None = None, **popen: Any
    ) -> subprocess.Popen[str]:
        """Starts ``argv`` (``srun ...``, ``mpirun ...``) with the cluster's environment."""
        return subprocess.Popen(
            [*self.prefix, *argv],
            env=self.env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            **popen,
        )

    def sbatch(self, script: str, *options: str, env: Mapping[str, str] | None = None) -> int:
        """Submits ``script`` (its text) as a batch job; returns the job id."""
        path = self.root / "scripts" / f"job-{uuid.uuid4().hex[:8]}.sh"
        path.write_text(script)
        path.chmod(0o755)
        out = self.command(["sbatch", "--parsable", *options, str(path)], env=env)
        return int(out.strip().split(";")[0])

    def batch(
        self, body: str, *options: str, env: Mapping[str, str] | None = None, timeout: float
    ) -> tuple[str, str]:
        """Runs a bash batch script to its end; returns its state and its output.

        Raises:
            ClusterError: It did not end within ``timeout`` seconds.
        """
        out = self.root / "scripts" / f"out-{uuid.uuid4().hex[:8]}.txt"
        job_id = self.sbatch(f"#!/bin/bash\n{body}", *options, "-o", str(out), env=env)
        state = self.wait_job(job_id, timeout)["JobState"]
        return state, out.read_text(errors="replace") if out.exists() else ""

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as key=value pairs (empty once SLURM forgot it)."""
        try:
            out = self.command(["scontrol", "show", "job", "-o", str(job_id)])
        except ClusterError:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int, timeout: float, states: Sequence[str] = ()) -> dict[str, str]:
        """Polls the job until it is in one of ``states`` (default: ended); returns it.

        Raises:
            ClusterError: Not there within ``timeout`` seconds.
        """
        ended = (
            "COMPLETED",
            "FAILED",
            "CANCELLED",
            "TIMEOUT",
            "NODE_FAIL",
            "PREEMPTED",
            "OUT_OF_MEMORY",
        )
        wanted = tuple(states) or ended
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in wanted:
                return info
            if time.monotonic() > deadline:
                raise ClusterError(f"job {job_id} not in {wanted} after {timeout:g} s: {info}")
            time.sleep(0.05)

    def wait_step_running(self, job_id: int, timeout: float) -> None:
        """Polls until the job has a running step (``srun`` inside it started).

        Raises:
            ClusterError: None within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.command(["squeue", "-h", "-s", "-j", str(job_id), "-o", "%i %T"])
            if any(line.split()[-1] == "RUNNING" for line in out.splitlines() if line.strip()):
                return
            time.sleep(0.05)
        raise ClusterError(f"job {job_id} has no running step after {timeout:g} s")

    def job_id(self, name: str, timeout: float = 10.0) -> int:
        """The id of the job named ``name`` (``srun -J NAME``), once SLURM knows it.

        Raises:
            ClusterError: No such job within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.command(["squeue", "-h", "-n", name, "-o", "%i"]).split()
            if out:
                return int(out[0])
            time.sleep(0.05)
        raise ClusterError(f"no job named {name} after {timeout:g} s")

    def scancel(self, job_id: int, *options: str) -> None:
        """``scancel [OPTIONS] JOB``."""
        self.command(["scancel", *options, str(job_id)])

    def requeue_now(self, job_id: int) -> None:
        """Requeues a batch job and starts it again at once (not after ``CredExpire``)."""
        self.command(["scontrol", "requeue", str(job_id)])
        self.wait_job(job_id, 30.0, states=("PENDING",))
        self.command(["scontrol", "update", f"jobid={job_id}", "StartTime=now"])

    def cancel_everything(self) -> None:
        """Kills every job of the cluster and waits (bounded) until the queue is empty."""
        with contextlib.suppress(ClusterError, subprocess.TimeoutExpired):
            self.command(["scancel", "--full", "--signal=KILL", "--user=root"])
            self.command(["scancel", "--user=root"])
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            try:
                if not self.command(["squeue", "-h", "-o", "%i"]).strip():
                    return
            except (ClusterError, subprocess.TimeoutExpired):
                return
            time.sleep(0.1)


def _start(argv: Sequence[str], log: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            ["setpriv", "--pdeathsig", "KILL", "--", *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
        )


def _stop(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to each, then SIGKILL to those alive after :data:`STOP_SECONDS`; reaps."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + STOP_SECONDS
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_SECONDS)


def _wait_until(check: Callable[[], bool], timeout: float, what: str, logs: Sequence[Path]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    tails = "\n".join(f"{log.name}:\n{_tail(log)}" for log in logs)
    raise ClusterError(f"{what} not within {timeout:g} s\n{tails}")


def _write_config(
    root: Path, controller: Machine, nodes: Sequence[Machine], cpus: int, first_job_id: int
) -> Path:
    for sub in ("run", "log", "state", "spool", "scripts", "munge"):
        (root / sub).mkdir()
    # munged refuses a socket whose directories others cannot traverse, and a key
    # anyone else can read.
    root.chmod(0o755)
    (root / "run").chmod(0o755)
    (root / "scripts").chmod(0o755)
    (root / "munge").chmod(0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    conf = root / "slurm.conf"
    conf.write_text(
        _SLURM_CONF.format(
            cluster=f"t{uuid.uuid4().hex[:10]}",
            controller=controller.name,
            controller_addr=controller.address,
            ctld_port=get_unused_port(),
            slurmd_port=get_unused_port(),
            root=root,
            first_job_id=first_job_id,
            nodes="".join(
                _NODE_LINE.format(name=node.name, address=node.address, cpus=cpus) for node in nodes
            ),
        )
    )
    return conf


def _start_munged(root: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """munged on this host, its socket under ``root/run`` (reached from any namespace)."""
    log = root / "log"
    socket_path = root / "run" / "munge.sock"
    munged = _start(
        [
            "munged",
            "-F",
            "--force",
            f"--socket={socket_path}",
            f"--key-file={root / 'munge' / 'munge.key'}",
            f"--pid-file={root / 'run' / 'munged.pid'}",
            f"--seed-file={root / 'munge' / 'seed'}",
            f"--log-file={log / 'munged.log'}",
        ],
        log / "munged.out",
        env,
    )
    try:
        _wait_until(
            socket_path.exists, 5.0, "munged's socket", [log / "munged.out", log / "munged.log"]
        )
    except ClusterError:
        _stop([munged])
        raise
    return munged


@contextlib.contextmanager
def slurm_cluster(
    controller: Machine, nodes: Sequence[Machine], *, cpus: int, first_job_id: int
) -> Iterator[SlurmCluster]:
    """A running cluster: munged here, slurmctld on ``controller``, a slurmd per node.

    Each daemon runs as ``setpriv --pdeathsig KILL -- <machine's prefix> <daemon> -D
    ...``: every step of the prefix must exec the next, so that the daemon is the
    process this one started (stopped by its PID, killed when this process dies).
    Each node has ``cpus`` CPUs; job ids start at ``first_job_id``.

    Raises:
        ClusterError: A daemon did not start, or a node did not become idle; the
            message holds the logs' last lines.
    """
    root = Path(tempfile.mkdtemp(prefix="dist-slurm-"))
    daemons: dict[str, subprocess.Popen[bytes]] = {}
    cluster: SlurmCluster | None = None
    try:
        conf = _write_config(root, controller, nodes, cpus, first_job_id)
        env = {**os.environ, "SLURM_CONF": str(conf)}
        log = root / "log"
        daemons["munged"] = _start_munged(root, env)
        daemons["slurmctld"] = _start(
            [*controller.prefix, "slurmctld", "-D", "-f", str(conf)], log / "slurmctld.out", env
        )
        for node in nodes:
            daemons[f"slurmd {node.name}"] = _start(
                [*node.prefix, "slurmd", "-D", "-N", node.name, "-f", str(conf)],
                log / f"slurmd-{node.name}.out",
                env,
            )
        cluster = SlurmCluster(root, conf, tuple(n.name for n in nodes), cpus, controller.prefix)
        logs = [log / "slurmctld.log", *(log / f"slurmd-{n.name}.log" for n in nodes)]

        def idle() -> bool:
            for name, daemon in daemons.items():
                if daemon.poll() is not None:
                    outs = [log / "slurmctld.out", *(log / f"slurmd-{n.name}.out" for n in nodes)]
                    raise ClusterError(
                        f"{name} exited {daemon.returncode}\n"
                        + "\n".join(f"{path.name}:\n{_tail(path)}" for path in [*logs, *outs])
                    )
            assert cluster is not None
            with contextlib.suppress(ClusterError, subprocess.TimeoutExpired):
                states = cluster.command(["sinfo", "-h", "-N", "-o", "%T"], timeout=5).split()
                return states == ["idle"] * len(nodes)
            return False

        _wait_until(idle, UP_SECONDS, f"{len(nodes)} idle node(s)", logs)
        yield cluster
    finally:
        if cluster is not None:
            cluster.cancel_everything()
        started = list(daemons.values())
        # slurmd first: without its controller it ignores SIGTERM for seconds.
        _stop(started[:0:-1])
        _stop(started[:1])
        # slurmstepd daemonizes and job processes may have escaped linuxproc.
        kill_pids(pids_with_variable("SLURM_CONF", str(root / "slurm.conf")))
        kill_pids(pids_holding(root))
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def one_host_slurm(*, cpus: int = 16, first_job_id: int = 1) -> Iterator[SlurmCluster]:
    """A running cluster of one node, this host, with ``cpus`` CPUs (more than the
    machine may have).

    Job ids start at ``first_job_id``. SLURM derives a step's master port from its job
    id (dist-core's ``slurm_master_port``): clusters running side by side on one host
    (one per pytest-xdist worker) need job ids that differ modulo 20000, as the jobs
    of one real cluster do.

    Raises:
        ClusterError: A daemon did not start, or the node did not become idle; the
            message holds the logs' last lines.
    """
    here = Machine(_node_name(), "127.0.0.1")
    with slurm_cluster(here, [here], cpus=cpus, first_job_id=first_job_id) as cluster:
        yield cluster
