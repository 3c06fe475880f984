"""A one-host SLURM cluster for tests: munged, slurmctld and slurmd as child processes.

:func:`one_host_slurm` writes a configuration into a temporary directory of its own
(ports from :func:`dist_core.ports.get_unused_port`, a unique cluster name, its own
munge key and socket), starts the three daemons in the foreground as children of the
calling process (under ``setpriv --pdeathsig KILL``: a SIGKILLed pytest takes them
along), waits until the node is idle, and yields a :class:`SlurmCluster` whose methods
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
# How long the node may take to become idle (about 1 s here).
UP_SECONDS = 20.0

_SLURM_CONF = """\
ClusterName={cluster}
SlurmctldHost={node}(127.0.0.1)
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
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
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
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


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
    """A running one-host cluster; every command runs against it (``SLURM_CONF``)."""

    root: Path
    conf: Path
    node: str
    cpus: int

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
            list(argv),
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
            list(argv),
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


def _start(argv: list[str], log: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            ["setpriv", "--pdeathsig", "KILL", "--", *argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
        )


def _daemon_name(daemon: subprocess.Popen[bytes]) -> str:
    argv = daemon.args
    assert isinstance(argv, list)
    return str(argv[4])  # after setpriv --pdeathsig KILL --


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


def _write_config(root: Path, node: str, cpus: int, first_job_id: int) -> Path:
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
            node=node,
            ctld_port=get_unused_port(),
            slurmd_port=get_unused_port(),
            root=root,
            cpus=cpus,
            first_job_id=first_job_id,
        )
    )
    return conf


@contextlib.contextmanager
def one_host_slurm(*, cpus: int = 16, first_job_id: int = 1) -> Iterator[SlurmCluster]:
    """A running cluster of one node with ``cpus`` CPUs (more than the machine may have).

    Job ids start at ``first_job_id``. SLURM derives a step's master port from its job
    id (dist-core's ``slurm_master_port``): clusters running side by side on one host
    (one per pytest-xdist worker) need job ids that differ modulo 20000, as the jobs
    of one real cluster do.

    Raises:
        ClusterError: A daemon did not start, or the node did not become idle; the
            message holds the logs' last lines.
    """
    root = Path(tempfile.mkdtemp(prefix="dist-slurm-"))
    daemons: list[subprocess.Popen[bytes]] = []
    cluster: SlurmCluster | None = None
    try:
        node = _node_name()
        conf = _write_config(root, node, cpus, first_job_id)
        env = {**os.environ, "SLURM_CONF": str(conf)}
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
        daemons.append(munged)
        _wait_until(
            socket_path.exists, 5.0, "munged's socket", [log / "munged.out", log / "munged.log"]
        )
        daemons.append(_start(["slurmctld", "-D", "-f", str(conf)], log / "slurmctld.out", env))
        daemons.append(
            _start(["slurmd", "-D", "-N", node, "-f", str(conf)], log / "slurmd.out", env)
        )
        cluster = SlurmCluster(root, conf, node, cpus)

        def idle() -> bool:
            for daemon in daemons:
                if daemon.poll() is not None:
                    raise ClusterError(
                        f"{_daemon_name(daemon)} exited {daemon.returncode}\n"
                        + "\n".join(
                            f"{name}:\n{_tail(log / name)}"
                            for name in (
                                "slurmctld.log",
                                "slurmd.log",
                                "slurmctld.out",
                                "slurmd.out",
                            )
                        )
                    )
            assert cluster is not None
            with contextlib.suppress(ClusterError, subprocess.TimeoutExpired):
                return cluster.command(["sinfo", "-h", "-o", "%T"], timeout=5).strip() == "idle"
            return False

        _wait_until(idle, UP_SECONDS, "an idle node", [log / "slurmctld.log", log / "slurmd.log"])
        yield cluster
    finally:
        if cluster is not None:
            cluster.cancel_everything()
        # slurmd first: without its controller it ignores SIGTERM for seconds.
        _stop(daemons[:0:-1])
        _stop(daemons[:1])
        # slurmstepd daemonizes and job processes may have escaped linuxproc.
        kill_pids(pids_with_variable("SLURM_CONF", str(root / "slurm.conf")))
        kill_pids(pids_holding(root))
        shutil.rmtree(root, ignore_errors=True)
