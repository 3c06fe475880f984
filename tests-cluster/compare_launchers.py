"""Every real-SLURM and MPI scenario of issue 32, with one interpreter's packages: a table row each.

Not a test (it asserts nothing): it prints what happened, for the closing note's table
of dist-launch (before and after a change, with ``--python`` naming the venv) beside
torchrun (the same venv's torch). Needs root and what ``nox -s cluster`` installs::

    python tests-cluster/compare_launchers.py --python /path/to/venv/bin/python

Times are wall-clock seconds on this machine; run it alone (nothing else busy) when
they matter.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from job_output import envs, ranks_of, two_steps_at_once  # noqa: E402
from one_host_slurm import SlurmCluster, one_host_slurm  # noqa: E402
from processes import read_until, wait_for_file, wait_for_text  # noqa: E402

SCRIPTS = HERE / "scripts"
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe"]  # one job at a time here
ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TORCH_DISTRIBUTED_BACKEND": "gloo"}


class Compare:
    """The scenarios, each returning one cell of text, for one venv's interpreter."""

    def __init__(self, slurm: SlurmCluster, python: str) -> None:
        self.slurm = slurm
        self.py = python
        self.dist_launch = [python, "-m", "dist_launch"]
        # One node each time: --standalone picks a free port (29500 may be taken here).
        self.torchrun = [python, "-m", "torch.distributed.run", "--standalone"]

    def forwards(self, launcher: list[str]) -> bool:
        """Whether ``launcher`` has ``--signals-to-forward`` (dist-launch 0.4 on)."""
        shown = subprocess.run([*launcher, "--help"], capture_output=True, text=True, check=False)
        return "--signals-to-forward" in shown.stdout

    def _dir(self) -> Path:
        return Path(tempfile.mkdtemp(prefix="cmp-", dir=self.slurm.root))

    def _last_error(self, text: str) -> str:
        errors = re.findall(r"(\w+(?:Error|Exception)): ([^\n]{0,60})", text)
        return f"{errors[-1][0]}: {errors[-1][1]}" if errors else "failed"

    # -- dist-core ------------------------------------------------------------------

    def report_under_srun(self) -> str:
        done = self.slurm.run(["srun", "-n4", self.py, "-m", "dist_core"], ENV, timeout=120)
        ranks = sorted(int(r) for r in re.findall(r"^  rank: (\d+)$", done.stdout, re.M))
        return f"ranks {ranks} of {done.stdout.count('world_size: 4')}x world 4"

    def _group(self, argv: list[str], env: dict[str, str] | None = None) -> str:
        done = self.slurm.run(argv, {**ENV, **(env or {})}, timeout=120)
        formed = ranks_of(done.stdout)
        if done.returncode == 0 and formed:
            return f"ok ({len(formed)} ranks)"
        return self._last_error(done.stderr)

    def init_under_srun(self) -> str:
        return self._group(["srun", "-K", "-n4", self.py, str(SCRIPTS / "init_group.py")])

    def init_in_sbatch_step(self) -> str:
        body = f"srun -K {self.py} {SCRIPTS / 'init_group.py'}\n"
        state, out = self.slurm.batch(body, "-n4", env=ENV, timeout=120)
        formed = ranks_of(out)
        return f"ok ({len(formed)} ranks)" if state == "COMPLETED" else self._last_error(out)

    def init_under_mpirun(self) -> str:
        return self._group([*MPIRUN, "-np", "4", self.py, str(SCRIPTS / "init_group.py")])

    def two_mpirun(self) -> str:
        meet = self._dir()
        argv = [*MPIRUN, "-np", "2", self.py, str(SCRIPTS / "init_group.py"), "--from-dist-env"]
        # Each its own session directory: Open MPI's shared one races (see the tests).
        sessions = [["--mca", "orte_tmpdir_base", str(self._dir())] for _ in range(2)]
        jobs = [
            self.slurm.popen(
                [*MPIRUN, *session, *argv[len(MPIRUN) :], "--meet", str(meet), "2"], ENV
            )
            for session in sessions
        ]
        outs = [job.communicate(timeout=120) for job in jobs]
        if all(job.returncode == 0 for job in jobs):
            return "both ok"
        return self._last_error("".join(err for _, err in outs))

    def mpirun_in_step(self) -> str:
        argv = ["srun", "-n1", "-c4", *MPIRUN, "-np", "4", self.py, str(SCRIPTS / "show_env.py")]
        done = self.slurm.run(argv, ENV, timeout=60)
        seen = [(e["rank"], e["world_size"]) for e in envs(done.stdout)]
        return ", ".join(f"{r}/{w}" for r, w in seen) or done.stderr[-80:]

    def python_in_batch(self) -> str:
        state, out = self.slurm.batch(
            f"exec {self.py} {SCRIPTS / 'show_env.py'}\n", "--ntasks=4", env=ENV, timeout=60
        )
        found = envs(out)
        return f"world size {found[0]['world_size']}" if found else state

    def two_steps(self) -> str:
        meet = self._dir()
        step = f"srun -K --exact -n2 -c1 {self.py} {SCRIPTS / 'init_group.py'}"
        body = two_steps_at_once(f"{step} --from-dist-env --meet {meet} 2", meet)
        state, out = self.slurm.batch(body, "-n4", "-c1", env=ENV, timeout=120)
        return "both ok" if state == "COMPLETED" else self._last_error(out)

    # -- launchers ------------------------------------------------------------------

    def launcher_in_batch(self, launcher: list[str]) -> str:
        launch = " ".join([*launcher, "--nproc-per-node", "2", str(SCRIPTS / "init_group.py")])
        state, out = self.slurm.batch(f"exec {launch}\n", "--ntasks=4", env=ENV, timeout=120)
        return "ok" if state == "COMPLETED" else f"{state}: {out.strip().splitlines()[-1][:70]}"

    def start_to_first_step(self, launcher: list[str]) -> str:
        work = self._dir()
        argv = [
            "srun",
            "-n1",
            *launcher,
            "--nproc-per-node",
            "4",
            str(SCRIPTS / "checkpoint_on_sigterm.py"),
        ]
        started = time.monotonic()
        srun = self.slurm.popen([*argv, str(work), "0.1"], ENV)
        try:
            read_until(srun, "training", 4, timeout=120)
            took = time.monotonic() - started
        finally:
            srun.kill()
            srun.wait(30)
            self.slurm.cancel_everything()
        return f"{took:.1f}"

    def failing_rank(self, launcher: list[str]) -> str:
        argv = ["srun", "-n1", *launcher, "--nproc-per-node", "4", str(SCRIPTS / "fail_rank.py")]
        srun = self.slurm.popen(argv, ENV)
        _out, err = srun.communicate(timeout=120)
        ended = time.time()
        failed_at = _failure_time(err)
        shown = (
            "traceback" if "ValueError: rank 1 fails on purpose" in _report(err) else "no traceback"
        )
        took = f"{ended - failed_at:.2f} s" if failed_at else "?"
        return f"{took} / {shown} / exit {srun.returncode}"

    def two_launcher_steps(self, launcher: list[str]) -> str:
        meet = self._dir()
        launch = " ".join(
            [
                *launcher,
                "--nproc-per-node",
                "2",
                str(SCRIPTS / "init_group.py"),
                "--meet",
                str(meet),
                "2",
            ]
        )
        body = two_steps_at_once(f"srun --exact -n1 -c1 {launch}", meet)
        state, out = self.slurm.batch(body, "-n2", "-c1", env=ENV, timeout=180)
        return "both ok" if state == "COMPLETED" else self._last_error(out + _read(meet))

    def _signal_training(
        self, launcher: list[str], flags: tuple[str, ...], script: str, scancel: list[str]
    ) -> tuple[Path, int | None]:
        """4 ranks of ``script`` under ``srun -n1 launcher``, ``scancel``ed once training."""
        work = self._dir()
        argv = ["srun", "-n1", "-J", work.name, *launcher, *flags, "--nproc-per-node", "4"]
        srun = self.slurm.popen([*argv, str(SCRIPTS / script), str(work)], ENV)
        try:
            read_until(srun, "training", 4, timeout=120)
            self.slurm.scancel(self.slurm.job_id(work.name), *scancel)
            srun.communicate(timeout=90)
        finally:
            srun.kill()
            srun.wait(30)
        return work, srun.returncode

    def preemption(
        self, launcher: list[str], scancel: list[str], flags: tuple[str, ...] = ()
    ) -> str:
        work, status = self._signal_training(launcher, flags, "checkpoint_on_sigterm.py", scancel)
        done = _checkpoints(work)
        terms = sorted({c["SIGTERM"] for c in done.values()})
        return f"{len(done)} of 4 / {terms or '-'} / exit {status}"

    def batch_full(self, launcher: list[str]) -> str:
        work = self._dir()
        out = work / "out.txt"
        launch = " ".join(
            [
                *launcher,
                "--nproc-per-node",
                "4",
                str(SCRIPTS / "checkpoint_on_sigterm.py"),
                str(work),
            ]
        )
        job = self.slurm.sbatch(f"#!/bin/bash\nexec {launch}\n", "-o", str(out), env=ENV)
        wait_for_text(out, "training", 4, timeout=120)
        self.slurm.scancel(job, "--full", "--signal=TERM")
        info = self.slurm.wait_job(job, 90)
        done = _checkpoints(work)
        terms = sorted({c["SIGTERM"] for c in done.values()})
        return f"{len(done)} of 4 / {terms or '-'} / {info.get('ExitCode')}"

    def usr1(self, launcher: list[str], flags: tuple[str, ...]) -> str:
        scancel = ["--signal=USR1"]
        work, status = self._signal_training(launcher, flags, "notify_on_usr1.py", scancel)
        notified = sorted(p.read_text() for p in work.glob("notified-*"))
        kept = "kept training" if len(notified) == 4 else "killed"
        return f"{kept} ({len(notified)} of 4 notified), exit {status}"

    def requeue(self, launcher: list[str]) -> str:
        work = self._dir()
        launch = " ".join(
            [*launcher, "--nproc-per-node", "1", str(SCRIPTS / "restart_count.py"), str(work)]
        )
        job = self.slurm.sbatch(
            f"#!/bin/bash\nexec {launch}\n", "--requeue", "-o", "/dev/null", env=ENV
        )
        wait_for_file(work / "restart-0", timeout=120)
        self.slurm.requeue_now(job)
        try:
            self.slurm.wait_job(job, 60, states=("COMPLETED",))
        except Exception:
            self.slurm.cancel_everything()
        seen = sorted(p.name.split("-")[1] for p in work.glob("restart-*"))
        return f"counts seen {seen}"

    def exit_codes(self, launcher: list[str]) -> str:
        work = self._dir()
        cases = {
            "error": "raise ValueError('x')\n",
            "import": "import no_such_module\n",
            "sigkill": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",
        }
        codes = []
        for name, text in cases.items():
            script = work / f"{name}.py"
            script.write_text(text)
            done = subprocess.run(
                [*launcher, "--nproc-per-node", "2", str(script)],
                capture_output=True, timeout=120, check=False, cwd=work,
            )  # fmt: skip
            codes.append(f"{name} {done.returncode}")
        return ", ".join(codes)


def _read(directory: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in directory.glob("*.txt"))


def _report(stderr: str) -> str:
    """What the launcher printed after the ranks' own lines."""
    lines = [line for line in stderr.splitlines() if not line.startswith("[rank")]
    return "\n".join(lines)


def _failure_time(stderr: str) -> float | None:
    match = re.search(r"FAILED_AT (\d+\.\d+)", stderr)
    return float(match.group(1)) if match else None


def _checkpoints(directory: Path) -> dict[int, dict[str, int]]:
    done = {}
    for path in directory.glob("ckpt-*.done"):
        rank = int(path.name.split("-")[1].split(".")[0])
        if path.stat().st_size == 16 << 16:
            done[rank] = json.loads((directory / f"ckpt-{rank}.json").read_text())
    return done


def main() -> None:
    """Prints the table for ``--python``'s venv (dist-launch and torchrun side by side)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--only", nargs="*", default=[])
    args = parser.parse_args()
    with one_host_slurm(first_job_id=random.randrange(1, 20000)) as slurm:
        c = Compare(slurm, args.python)
        # dist-core alone: no launcher, so no torchrun column.
        core: list[tuple[str, Callable[[], str]]] = [
            ("srun -n4 python -m dist_core", c.report_under_srun),
            ("srun -n4 init_process_group_from_backend", c.init_under_srun),
            ("sbatch step, same", c.init_in_sbatch_step),
            ("mpirun -np 4, same", c.init_under_mpirun),
            ("two mpirun at once", c.two_mpirun),
            ("mpirun -np 4 inside srun (rank/world)", c.mpirun_in_step),
            ("plain python in --ntasks=4 batch", c.python_in_batch),
            ("two steps of one allocation (init_dist)", c.two_steps),
        ]
        # Each with dist-launch, then torchrun (None: not a torchrun scenario).
        term, spawn = ["--signal=TERM"], ("--start-method", "spawn")
        launchers: list[tuple[str, Callable[[list[str]], str], bool]] = [
            ("launcher in --ntasks=4 batch script", c.launcher_in_batch, True),
            ("srun -n1 launcher -n 4: start to first step (s)", c.start_to_first_step, True),
            ("failing rank: end after failure / traceback / exit", c.failing_rank, True),
            ("two launcher steps in one allocation", c.two_launcher_steps, True),
            (
                "scancel --signal=TERM, 8 s ckpt: complete / SIGTERMs / exit",
                lambda launcher: c.preemption(launcher, term),
                True,
            ),
            ("plain scancel, same", lambda launcher: c.preemption(launcher, []), True),
            (
                "same as the first, --start-method spawn",
                lambda launcher: c.preemption(launcher, term, spawn),
                False,
            ),
            ("batch launcher, scancel --full --signal=TERM", c.batch_full, True),
            (
                "scancel --signal=USR1 (notify)",
                lambda launcher: c.usr1(
                    launcher, ("--signals-to-forward", "USR1") if c.forwards(launcher) else ()
                ),
                True,
            ),
            ("requeue: restart count seen", c.requeue, True),
            ("exit code: error / import error / SIGKILL", c.exit_codes, True),
        ]
        rows: list[tuple[str, Callable[[], str], Callable[[], str] | None]] = [
            (name, run, None) for name, run in core
        ]
        for name, scenario, both in launchers:
            ours = functools.partial(scenario, c.dist_launch)
            rows.append((name, ours, functools.partial(scenario, c.torchrun) if both else None))
        print("| scenario | dist-launch / dist-core | torchrun |")
        print("|---|---|---|")
        for name, ours, theirs in rows:
            if args.only and not any(word in name for word in args.only):
                continue
            cells = []
            for run in (ours, theirs):
                if run is None:
                    cells.append("n/a")
                    continue
                try:
                    cells.append(run())
                except Exception as error:
                    cells.append(f"error: {type(error).__name__}: {str(error)[:80]}")
                slurm.cancel_everything()
            print(f"| {name} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
