"""Every session of the dist-* monorepo.

Plain ``nox`` runs the default sessions: ``prefetch`` (the other torch builds, installed
in the background), each package's tests, integration, the real cluster launchers, every
suite again on the newest torch (2.15) and on the lowest the packages declare (2.11),
lint, typecheck, docs, and a summary of where the time went. The demo's commands run in
integration (``tests-integration/test_demo.py``); ``nox -s demo`` runs the demo itself.
The whole run has a budget of 30 minutes on the project's 2-core machine
(``docs/testing.md`` says how to measure it). ``nox -s fast`` runs every in-process
test of the four packages; ``nox -s bench`` runs the benchmarks.

Every venv is made with pip, and torch is pinned before anything else is installed.
Each torch build is installed once, into a template venv under ``.nox/_torch``, and
linked into every venv that needs it (hard links, like a package manager's cache): the
eight sessions on ``TORCH_SPEC`` (2.13.0, a local CPU build on the project's machines)
pay for one install. The other versions are CUDA builds of several GB from the package
registry. The packages themselves declare only a lower bound on torch.

Packages are installed non-editable from this repository, each session with only what
it needs, from wheels built once per run (:func:`_wheel`), and :func:`_check_provenance`
fails the session when any installed ``dist-*`` distribution came from anywhere else
(``dist-launch`` is also the name of an unrelated project on the public index).

Tests run side by side (pytest-xdist): most of them wait on real processes, so more
workers than cores keep the machine busy (``DIST_TEST_WORKERS`` overrides the count).
Every session records its wall and CPU time, and every pytest run its per-test times,
under ``.nox/_timings/<run>/``; the ``summary`` session prints them.
"""

from __future__ import annotations

import atexit
import csv
import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nox

ROOT = Path(__file__).resolve().parent
PACKAGES_DIR = ROOT / "packages"
TORCH_SPEC = os.environ.get("DIST_TORCH_SPEC", "torch==2.13.0")
# The other torch versions, each in one venv holding all four packages: the newest
# release (2.15) and the lowest version every package declares (``torch>=2.11``) are
# default sessions; 2.14 runs on request (``nox -s "torch(2.14)"``). All are CUDA builds
# that run on the CPU; on the project's machines they install from the package
# registry (about 4 GB each, a minute or two).
OTHER_TORCH_SPECS = {"2.15": "torch==2.15.0", "2.11": "torch==2.11.0", "2.14": "torch==2.14.1"}
# Some of the project's machines cap pip at torch 2.14.1 with a constraints file in
# pip's configuration; an empty constraints file in its place lifts the cap for the
# sessions that install another torch (an empty PIP_CONSTRAINT would not).
_UNCAPPED = {"PIP_CONSTRAINT": os.devnull}
# pytest-xdist workers per pytest run: most tests wait on real processes, not the CPU.
TEST_WORKERS = os.environ.get("DIST_TEST_WORKERS", str(2 * (os.cpu_count() or 1)))
# Bound on one torch template's install (a CUDA build of about 4 GB: a minute or two).
TEMPLATE_INSTALL_SECONDS = 1800

nox.options.default_venv_backend = "virtualenv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = [
    "prefetch",
    "tests",
    "integration",
    "cluster",
    "torch(2.15)",
    "torch(2.11)",
    "lint",
    "typecheck",
    "docs",
    "fast_reuse",
    "summary",
]

# One directory per nox invocation: the summary reads only this run's timings.
_TIMINGS = ROOT / ".nox" / "_timings" / time.strftime("%Y%m%d-%H%M%S")
# The packages' wheels, built once per nox invocation from packages/ (:func:`_wheel`).
_WHEELS = ROOT / ".nox" / "_wheels" / _TIMINGS.name


def _discover_packages() -> list[str]:
    return sorted(
        path.name for path in PACKAGES_DIR.iterdir() if (path / "pyproject.toml").is_file()
    )


PACKAGES = _discover_packages()


def _project(package: str) -> dict[str, object]:
    with (PACKAGES_DIR / package / "pyproject.toml").open("rb") as handle:
        project: dict[str, object] = tomllib.load(handle)["project"]
    return project


def _requirement_name(requirement: str) -> str:
    name = requirement
    for separator in "<>=!~;[ (":
        name = name.split(separator, 1)[0]
    return name.strip().lower().replace("_", "-")


def _sibling_closure(package: str) -> list[str]:
    """The package and every dist-* package it depends on, transitively."""
    seen: list[str] = []
    pending = [package]
    while pending:
        current = pending.pop()
        if current in seen:
            continue
        seen.append(current)
        dependencies = _project(current).get("dependencies", [])
        assert isinstance(dependencies, list)
        for requirement in dependencies:
            name = _requirement_name(str(requirement))
            if name in PACKAGES:
                pending.append(name)
    return seen


def _site_packages(venv: Path) -> Path:
    [site] = venv.glob("lib/python*/site-packages")
    return site


# Distributions of a fresh venv itself, never linked from the template.
_VENV_OWN = frozenset({"pip", "setuptools", "wheel"})


def _link_installed(template: Path, venv: Path) -> None:
    """Hard-links every distribution installed in ``template`` into ``venv``.

    Each file a distribution's RECORD lists is linked, not copied, so a venv costs no
    extra disk and no unpacking; console scripts (``torchrun``) are written anew with
    the target venv's interpreter in their first line. pip then sees the distributions
    as installed, exactly as if it had installed them.
    """
    source, target = _site_packages(template), _site_packages(venv)
    for record in sorted(source.glob("*.dist-info/RECORD")):
        if record.parent.name.split("-")[0].lower() in _VENV_OWN:
            continue
        with record.open(newline="") as handle:
            paths = [row[0] for row in csv.reader(handle) if row]
        for relative in paths:
            origin = source / relative
            if relative.startswith("../../../bin/"):
                script = venv / "bin" / Path(relative).name
                lines = origin.read_text().splitlines(keepends=True)
                if lines and lines[0].startswith("#!"):
                    lines[0] = f"#!{venv / 'bin' / 'python'}\n"
                script.write_text("".join(lines))
                script.chmod(0o755)
                continue
            destination = target / relative
            if destination.exists() or not origin.is_file():
                continue
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.link(origin, destination)


def _pip_env(torch_spec: str) -> dict[str, str] | None:
    """The environment of pip installs beside ``torch_spec``: uncapped unless it is local."""
    return None if torch_spec == TORCH_SPEC else _UNCAPPED


def _template_dir(*specs: str) -> Path:
    return ROOT / ".nox" / "_torch" / "+".join(spec.replace("==", "-") for spec in specs)


def _template_pip(template: Path, *specs: str) -> list[str]:
    """The pip command that installs ``specs`` into ``template``."""
    downloaded = ["--no-cache-dir"] if specs[0] != TORCH_SPEC else []
    return [str(template / "bin" / "python"), "-m", "pip", "install", "-q", *downloaded, *specs]


# Template installs the ``prefetch`` session started in the background: template -> pip.
# The noxfile owns them: :func:`_torch_template` waits for one, and nox's exit stops any
# still running (its template stays incomplete and is installed again next time).
_PREFETCHING: dict[Path, subprocess.Popen[bytes]] = {}


def _stop_prefetching() -> None:
    for process in _PREFETCHING.values():
        if process.poll() is None:
            process.kill()
            process.wait()


atexit.register(_stop_prefetching)


def _torch_template(session: nox.Session, *specs: str) -> Path:
    """A venv under ``.nox/_torch`` holding ``specs`` (torch first), installed once.

    Every venv that needs the same build links it from here (:func:`_link_installed`)
    instead of unpacking it again. A torch other than ``TORCH_SPEC`` is a CUDA build of
    several GB: it installs with ``--no-cache-dir`` (pip's cache would hold a second
    copy, which ran a CI machine out of disk once) and with pip's torch cap lifted. A
    template the ``prefetch`` session is installing is waited for.
    """
    template = _template_dir(*specs)
    if (template / "complete").exists():
        return template
    prefetching = _PREFETCHING.pop(template, None)
    if prefetching is not None:
        session.log(f"waiting for the install of {template.name} that prefetch started")
        log = template.parent / f"{template.name}.log"
        try:
            returncode = prefetching.wait(timeout=TEMPLATE_INSTALL_SECONDS)
        except subprocess.TimeoutExpired:
            prefetching.kill()
            prefetching.wait()
            session.error(
                f"installing {' '.join(specs)} took over {TEMPLATE_INSTALL_SECONDS} s;"
                f" pip's output: {log}"
            )
        if returncode != 0:
            session.error(f"installing {' '.join(specs)} failed; pip's output: {log}")
    else:
        shutil.rmtree(template, ignore_errors=True)
        session.run(sys.executable, "-m", "venv", str(template), external=True)
        session.run(*_template_pip(template, *specs), env=_pip_env(specs[0]), external=True)
    (template / "complete").touch()
    return template


def _install_torch(session: nox.Session, torch_spec: str) -> None:
    """Installs torch pinned to ``torch_spec`` before anything else, linked from its template."""
    _link_installed(_torch_template(session, torch_spec), Path(session.virtualenv.location))
    session.install(torch_spec, env=_pip_env(torch_spec))  # checks the links: pip finds it


def _install_packages(
    session: nox.Session, packages: list[str], extras: str = "", torch_spec: str = TORCH_SPEC
) -> None:
    """Installs torch first (pinned), then the packages, non-editable, from this repo."""
    _install_torch(session, torch_spec)
    targets = []
    for package in packages:
        closure = _sibling_closure(package)
        for name in closure:
            suffix = extras if name == package else ""
            target = f"{_wheel(session, name)}{suffix}"
            if target not in targets:
                targets.append(target)
    session.install(*targets, env=_pip_env(torch_spec))
    _check_provenance(session)


def _wheel(session: nox.Session, package: str) -> Path:
    """The wheel of ``packages/<package>``, built once per nox run (``_WHEELS``).

    Every session installs the same build instead of building it again: about 35
    installs of a package in a full run, each of which paid for a build environment.
    """
    pattern = f"{package.replace('-', '_')}-*.whl"
    if not any(_WHEELS.glob(pattern)):
        session.run(
            sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(_WHEELS),
            str(PACKAGES_DIR / package), external=True,
        )  # fmt: skip
    [wheel] = _WHEELS.glob(pattern)
    return wheel


_PROVENANCE_CHECK = """
import json, sys
from importlib.metadata import distributions
from pathlib import Path
wheels_dir = Path(sys.argv[1]).resolve()
bad = []
for dist in distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if not name.startswith("dist-"):
        continue
    raw = dist.read_text("direct_url.json")
    url = json.loads(raw).get("url", "") if raw else ""
    path = Path(url.removeprefix("file://")).resolve() if url.startswith("file://") else None
    if path is None or path.parent != wheels_dir:
        bad.append(f"{name} {dist.version} from {url or 'a package index'}")
    else:
        print(f"{name} {dist.version} from {path}")
if bad:
    sys.exit("dist-* distributions not built from this repository: " + "; ".join(bad))
"""


def _check_provenance(session: nox.Session) -> None:
    """Fails when an installed dist-* distribution is not a wheel this run built."""
    session.run("python", "-c", _PROVENANCE_CHECK, str(_WHEELS), silent=False)


def _cpu_seconds() -> float:
    """CPU time the machine has spent busy (user, system, interrupts) since it booted.

    Read from ``/proc/stat``, so that it counts every process a session started, those
    its commands never waited for included (a multiprocessing fork server and the ranks
    it forked, which a child-usage count misses); on a machine running nothing else it
    is the session's own. Elsewhere, the CPU time of the commands nox waited for.
    """
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        return usage.ru_utime + usage.ru_stime
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _timed(function: Callable[..., None]) -> Callable[..., None]:
    """Records the session's wall and CPU time (:func:`_cpu_seconds`) for ``summary``."""

    @functools.wraps(function)
    def session_body(session: nox.Session, *args: Any, **kwargs: Any) -> None:
        started, used = time.monotonic(), _cpu_seconds()
        status = "failed"
        try:
            function(session, *args, **kwargs)
            status = "success"
        finally:
            record = {
                "session": session.name,
                "wall": round(time.monotonic() - started, 1),
                "cpu": round(_cpu_seconds() - used, 1),
                "status": status,
            }
            _TIMINGS.mkdir(parents=True, exist_ok=True)
            (_TIMINGS / f"{_file_name(session.name)}.json").write_text(json.dumps(record))

    return session_body


def _file_name(session_name: str) -> str:
    return "".join(c if c.isalnum() or c in ".-" else "_" for c in session_name)


def _pytest(
    session: nox.Session,
    *args: str,
    dist: str = "worksteal",
    env: dict[str, str] | None = None,
    workers: str = TEST_WORKERS,
) -> None:
    """Runs pytest with the run's workers, keeping its per-test times for ``summary``.

    ``dist`` is pytest-xdist's distribution mode: ``worksteal`` balances tests of uneven
    length; ``loadscope`` keeps each class on one worker, in order.
    """
    _TIMINGS.mkdir(parents=True, exist_ok=True)
    runs = len(list(_TIMINGS.glob(f"{_file_name(session.name)}.*.xml")))
    junit = _TIMINGS / f"{_file_name(session.name)}.{runs}.xml"
    session.run(
        "pytest",
        "-n",
        workers,
        "--dist",
        dist,
        f"--junitxml={junit}",
        "-o",
        f"junit_suite_name={session.name}",
        *args,
        *session.posargs,
        env={"PYTHONDONTWRITEBYTECODE": "1", **_shared_torch_site(), **(env or {})},
    )


def _shared_torch_site() -> dict[str, str]:
    """What tests-integration's install test may reuse of this run, as variables.

    ``DIST_TEST_TORCH_SITE``: the site-packages of the ``TORCH_SPEC`` template, if made;
    ``DIST_TEST_WHEELS``: the run's wheels of the packages, once built. The test makes
    a venv of its own: it links that torch instead of unpacking it again, and installs
    the wheels instead of building them again.
    """
    wheels = {"DIST_TEST_WHEELS": str(_WHEELS)} if _WHEELS.is_dir() else {}
    template = ROOT / ".nox" / "_torch" / TORCH_SPEC.replace("==", "-")
    if not (template / "complete").exists():
        return wheels
    return {"DIST_TEST_TORCH_SITE": str(_site_packages(template)), **wheels}


@nox.session(python=False)
@_timed
def prefetch(session: nox.Session) -> None:
    """Starts installing the other torch builds the default sessions need, in the background.

    Each is a CUDA build of about 4 GB whose install keeps one core busy for about a
    minute; started first, at the lowest CPU priority, it uses the time the package
    tests leave a core idle (their processes wait on each other) instead of the
    torch sessions' own. The sessions that link a template wait for its install
    (:func:`_torch_template`).
    """
    for name in nox.options.sessions or []:
        version = name.removeprefix("torch(").removesuffix(")")
        if name.startswith("torch(") and version in OTHER_TORCH_SPECS:
            spec = OTHER_TORCH_SPECS[version]
            template = _template_dir(spec)
            if (template / "complete").exists() or template in _PREFETCHING:
                continue
            shutil.rmtree(template, ignore_errors=True)
            session.run(sys.executable, "-m", "venv", str(template), external=True)
            with (template.parent / f"{template.name}.log").open("wb") as log:
                _PREFETCHING[template] = subprocess.Popen(
                    _template_pip(template, spec),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **(_pip_env(spec) or {})},
                    preexec_fn=lambda: os.nice(19),
                )
            session.log(f"installing {spec} into {template} in the background")


# Scenarios the cluster session runs once, on TORCH_SPEC, where etcd is installed and the
# session runs as root: three hosts (network namespaces), each with an etcd member and
# a launcher, for half a minute a test. The integration and other-torch sessions leave
# them out.
ONCE_IN_CLUSTER = (ROOT / "tests-integration" / "test_etcd_nodes.py",)
_NOT_ONCE_IN_CLUSTER = [f"--ignore={path}" for path in ONCE_IN_CLUSTER]
# Jobs across hosts (network namespaces: cut cables, lost and preempted nodes): what
# they test is the launchers' protocol over a network, not torch's API, and each takes
# 20-60 s; the ``integration`` session runs them once, the other torches' sessions not.
ONCE_IN_INTEGRATION = tuple(
    ROOT / "tests-integration" / name for name in ("test_multinode.py", "test_two_hosts.py")
)
_NOT_ONCE_IN_INTEGRATION = [f"--ignore={path}" for path in ONCE_IN_INTEGRATION]


@nox.session
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
@_timed
def tests(session: nox.Session, package: str) -> None:
    """One package's tests, in a venv holding only that package and what it declares."""
    _install_packages(session, [package], extras="[test]")
    _pytest(session, str(PACKAGES_DIR / package / "tests"))


_WORK_TREE_CHECK = """
import json, sys
from importlib.metadata import distributions
from pathlib import Path
packages_dir = Path(sys.argv[1]).resolve()
bad, found = [], []
for dist in distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if not name.startswith("dist-"):
        continue
    raw = dist.read_text("direct_url.json")
    info = json.loads(raw) if raw else {}
    url = info.get("url", "")
    path = Path(url.removeprefix("file://")).resolve() if url.startswith("file://") else None
    editable = info.get("dir_info", {}).get("editable", False)
    if not editable or path != packages_dir / name:
        bad.append(f"{name} {dist.version} from {url or 'a package index'}")
    else:
        found.append(name)
if bad:
    sys.exit("dist-* distributions not installed editable from this work tree: " + "; ".join(bad))
print(f"testing the work tree {packages_dir.parent} ({', '.join(sorted(found))}, editable)")
"""


def _install_work_tree(session: nox.Session) -> None:
    """Torch (pinned), then every package editable from the work tree, checked.

    With ``-R`` (reuse the venv, install nothing) the editable installs already point at
    the work tree, so the lane tests the code as it is now; the check says which tree.
    """
    venv = Path(session.virtualenv.location)
    if not any(_site_packages(venv).glob("torch-*.dist-info")):
        _install_torch(session, TORCH_SPEC)
    # One build backend in the venv for the four editable builds, instead of four
    # isolated build environments (about 40 s of the lane's first run here).
    session.install("hatchling>=1.18", "editables")
    editables = [f"-e{PACKAGES_DIR / package}[test]" for package in PACKAGES]
    session.install("--no-build-isolation", *editables)
    session.run("python", "-c", _WORK_TREE_CHECK, str(PACKAGES_DIR), silent=False)


@nox.session
def fast(session: nox.Session) -> None:
    """The fast lane: every in-process test of the four packages (no ``processes`` mark).

    For the edit-test loop: the packages are installed editable from the work tree, so
    ``nox -R -s fast`` reuses the venv and still tests the code as it is now. The root
    conftest fails any test in it that starts a process, so the lane stays in one
    process.
    """
    _install_work_tree(session)
    test_dirs = [str(PACKAGES_DIR / package / "tests") for package in PACKAGES]
    session.run("pytest", "-m", "not processes", "-q", *test_dirs, *session.posargs)


# What fast_reuse runs of the fast lane: one quick test, enough to show which code ran.
_FAST_REUSE_SELECTION = ["-k", "test_hang_timeout_values", "-p", "no:randomly"]


@nox.session(python=False)
@_timed
def fast_reuse(session: nox.Session) -> None:
    """The edit-test loop as the README gives it: ``nox -s fast``, then ``nox -R -s fast``.

    Both in a scratch venv directory, on a few tests: the second run must reuse the
    venv, install nothing, and pass the work-tree check (it failed when the lane
    installed wheels).
    """
    envdir = Path(session.create_tmp()).resolve() / "fast-reuse"
    shutil.rmtree(envdir, ignore_errors=True)
    command = [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"),
               "--envdir", str(envdir), "-s", "fast"]  # fmt: skip
    session.run(*command, "--", *_FAST_REUSE_SELECTION, external=True)
    started = time.monotonic()
    session.run(*command[:-2], "-R", "-s", "fast", "--", *_FAST_REUSE_SELECTION, external=True)
    session.log(f"nox -R -s fast took {time.monotonic() - started:.1f} s")
    shutil.rmtree(envdir, ignore_errors=True)


@nox.session
def cuda(session: nox.Session) -> None:
    """Only the tests marked ``cuda``, of every package; fails where torch sees no GPU.

    Not a default session: CI has no GPU. On a GPU machine, ``nox -s cuda`` runs the
    GPU checks alone (plain ``nox`` runs them too, with everything else).
    """
    _install_packages(session, PACKAGES, extras="[test]")
    session.run(
        "python",
        "-c",
        "import sys; from dist_core.devices import cuda_device_count as n; "
        "sys.exit(0 if n() else 'nox -s cuda: torch sees no CUDA device here')",
    )
    test_dirs = [str(PACKAGES_DIR / package / "tests") for package in PACKAGES]
    session.run("pytest", "-m", "cuda", *test_dirs, *session.posargs)


@nox.session
@_timed
def integration(session: nox.Session) -> None:
    """Tests that need several packages at once, real processes and real faults."""
    _install_packages(session, PACKAGES, extras="")
    session.install("pytest>=8", "pytest-timeout>=2", "pytest-xdist>=3")
    _pytest(session, str(ROOT / "tests-integration"), *_NOT_ONCE_IN_CLUSTER)


# What the real-launcher session installs (Debian), and the programs it needs from them.
# iproute2 and util-linux (nsenter, unshare): the two-node cluster's network namespaces.
CLUSTER_APT_PACKAGES = (
    "slurm-wlm", "munge", "openmpi-bin", "etcd-server", "iproute2", "util-linux",
)  # fmt: skip
CLUSTER_PROGRAMS = (
    "munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "mpirun",
    "ip", "nsenter", "unshare",
)  # fmt: skip
# etcd-server's, for dist-launch's etcd rendezvous tests.
ETCD_PROGRAMS = ("etcd",)
# dist-launch's tests of its etcd rendezvous (they start etcd servers themselves).
ETCD_TESTS = ("test_etcd_rendezvous.py", "test_rendezvous.py")


@nox.session
@_timed
def cluster(session: nox.Session) -> None:
    """Real srun, sbatch, scancel and mpirun against SLURM clusters of 1 to 3 nodes; etcd.

    tests-cluster/ brings the clusters up itself (munged, slurmctld and slurmd as child
    processes, stopped on every exit path; the two-node cluster's nodes are network
    namespaces, removed on every exit path). Needs root: the Debian packages are
    installed with apt-get when a program is missing. Without root it is skipped, except
    in CI (``CI`` set), where it fails. Runs once, on ``TORCH_SPEC``. Then dist-launch's
    etcd rendezvous tests run against the etcd servers they start, and the jobs on etcd
    across three namespace hosts (:data:`ONCE_IN_CLUSTER`), required to run
    (``DIST_LAUNCH_REQUIRE_ETCD``, also for tests-cluster's job on etcd under SLURM):
    elsewhere they skip when etcd is not installed.
    """
    if os.geteuid() != 0:
        reason = "needs root (apt-get, and slurmd runs jobs as any user)"
        if os.environ.get("CI"):
            session.error(f"nox -s cluster {reason}: CI must run the real launchers")
        session.skip(reason)
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    needed = (*CLUSTER_PROGRAMS, *ETCD_PROGRAMS)
    if any(shutil.which(program, path=path) is None for program in needed):
        apt_env = {"DEBIAN_FRONTEND": "noninteractive"}
        session.run("apt-get", "update", external=True, env=apt_env)
        session.run(
            "apt-get",
            "install",
            "-y",
            "--no-install-recommends",
            *CLUSTER_APT_PACKAGES,
            external=True,
            env=apt_env,
        )
    _install_packages(session, ["dist-core", "dist-launch"])
    session.install("pytest>=8", "pytest-timeout>=2", "pytest-xdist>=3")
    # Each xdist worker brings up a cluster of its own (three daemons). The tests wait
    # on schedulers and networks more than they compute (1.3 CPU s a second with two
    # workers): three keep both cores busy.
    _pytest(
        session, str(ROOT / "tests-cluster"), workers="3", env={"DIST_LAUNCH_REQUIRE_ETCD": "1"}
    )
    etcd_tests = [str(PACKAGES_DIR / "dist-launch" / "tests" / name) for name in ETCD_TESTS]
    etcd_tests += [str(path) for path in ONCE_IN_CLUSTER]
    _pytest(
        session,
        "-m",
        "processes",
        "-k",
        "etcd",
        *etcd_tests,
        workers="2",
        env={"DIST_LAUNCH_REQUIRE_ETCD": "1"},
    )


# What the other torches' sessions repeat of the process tests: one test of each part of
# torch's API the packages use, where a torch release could change what they see. Every
# in-process test (the fast lane) runs on them too. The rest (the launchers' own
# mechanics: signals, output, hang verdicts, the command line; the ft replica
# protocol's fault scenarios, which use the same gloo calls as the tests kept here;
# Kubernetes' variables, installs, the demo) runs once, on TORCH_SPEC, in the package
# and integration sessions. Names are pytest node ids under the package's tests/.
OTHER_TORCH_PROCESS_TESTS = {
    # Collectives and autograd all_to_all; the ft process groups (gloo abort and
    # reconfigure, the baby group's subprocess); torch's reconfigurable groups under the
    # Manager through a kill (2.14+; on 2.11 the test that says what is missing); the
    # heal's state transfer.
    "dist-collectives": (
        "test_all_to_all.py", "test_collectives.py",
        "ft/test_process_groups.py", "ft/test_configure.py",
        "ft/test_torchft_0_2_behaviour.py", "ft/test_torchft_compat.py",
        "ft/test_state_transfer.py",
        "ft/test_manager_faults.py::test_torchs_reconfigurable_gloo_group_under_the_manager_survives_a_kill",
        "ft/test_manager_faults.py::test_a_manager_moves_torchs_own_reconfigurable_group_through_a_kill",
        "ft/test_manager_faults.py::test_without_torchs_reconfigurable_groups_building_one_says_what_is_missing",
    ),
    # init_process_group, backend choice, run_ranks (the session prints the environment
    # report itself).
    "dist-core": ("test_backend.py", "test_ranks.py", "test_testing.py"),
    # torch's elastic rendezvous and stores, its flight recorder and collective records
    # (as the hang report reads them), its elastic timer, torchrun's c10d and log prefix.
    "dist-launch": (
        "test_rendezvous.py", "test_etcd_rendezvous.py", "test_store_deadline.py",
        "test_records.py",
        "test_hang.py::test_a_rank_in_another_collective_is_named",
        "test_hang.py::test_an_expired_torch_elastic_timer_is_handled_as_a_hang",
        "test_torchrun_flags.py::test_c10d_on_loopback_two_nodes",
        "test_torchrun_flags.py::test_log_line_prefix_template_as_torch_2_14_renders_it",
    ),
    # Tensors through the exchange and the Hugging Face export (safetensors, dtypes).
    "dist-workspace": (
        "test_exchange.py::test_values_arrive_in_ranks_order",
        "test_hf_export.py::test_every_rank_writes_its_shard_of_one_checkpoint",
        "test_hf_export.py::test_integer_and_bool_tensors_are_exported_bit_exact_and_one_file_is_model_safetensors",
    ),
}  # fmt: skip
# tests-integration's, likewise: a torchrun parity run (the installed torchrun's).
OTHER_TORCH_INTEGRATION_TESTS = ("test_torchrun_parity.py",)


def other_torch_selection() -> tuple[list[str], list[str]]:
    """The other torches' tests: the test directories and the process tests' paths.

    Every test directory is for the fast lane; the paths are those of
    :data:`OTHER_TORCH_PROCESS_TESTS` and tests-integration's, longest first.
    """
    # The longest first (dist-collectives' reconfigurable groups through a kill take
    # 40-55 s, the torchrun parity run 35-45 s): pytest-xdist hands tests out in this
    # order, and a long test handed out last leaves the other workers idle at the end.
    order = ["dist-collectives", "dist-launch", "dist-workspace", "dist-core"]
    packages = sorted(PACKAGES, key=lambda name: order.index(name) if name in order else 0)
    directories = [str(PACKAGES_DIR / package / "tests") for package in packages]
    integration = ROOT / "tests-integration"
    processes = [str(integration / name) for name in OTHER_TORCH_INTEGRATION_TESTS]
    for package in packages:
        tests = PACKAGES_DIR / package / "tests"
        for name in OTHER_TORCH_PROCESS_TESTS.get(package, ()):
            processes.append(str(tests / name))
    return [*directories, str(integration)], processes


@nox.session
def torchrun_multinode(session: nox.Session) -> None:
    """tests-integration's jobs across hosts under torchrun too, beside dist-launch.

    Not a default session: it checks that each scenario is one torchrun passes (the
    comparison the issues' tables give), not this project's code. Needs root.
    """
    _install_packages(session, PACKAGES, extras="")
    session.install("pytest>=8", "pytest-timeout>=2", "pytest-xdist>=3")
    path = str(ROOT / "tests-integration" / "test_multinode.py")
    _pytest(session, path, "-k", "torchrun", env={"DIST_TEST_TORCHRUN": "1"})


@nox.session(name="torch")
@nox.parametrize("version", list(OTHER_TORCH_SPECS), ids=list(OTHER_TORCH_SPECS))
@_timed
def other_torch(session: nox.Session, version: str) -> None:
    """Every package's in-process tests and the process tests of torch's API, on another torch.

    ``nox -s "torch(2.15)"`` runs them on the newest torch, ``nox -s "torch(2.11)"`` on
    the lowest one the packages declare (both default sessions), ``nox -s "torch(2.14)"``
    on the release before the newest. One venv for all four packages, so that torch
    installs once per session. Two pytest runs: the fast lane of every test directory,
    then the process tests of what changes between torch versions
    (:data:`OTHER_TORCH_PROCESS_TESTS`); the others run once, on ``TORCH_SPEC``.
    """
    free_gib = shutil.disk_usage(ROOT).free / 2**30
    session.log(f"{free_gib:.1f} GiB free on the disk of {ROOT}; this venv takes about 5 GiB")
    _install_packages(session, PACKAGES, extras="[test]", torch_spec=OTHER_TORCH_SPECS[version])
    session.run("python", "-m", "dist_core")  # its report names the torch it runs on
    directories, processes = other_torch_selection()
    once = [*_NOT_ONCE_IN_CLUSTER, *_NOT_ONCE_IN_INTEGRATION]
    _pytest(session, "-m", "not processes", *directories, *once)
    _pytest(session, "-m", "processes", *processes, *once)


@nox.session
@_timed
def lint(session: nox.Session) -> None:
    """Run ruff check and ruff format --check over the whole repository."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))


@nox.session
@_timed
def typecheck(session: nox.Session) -> None:
    """Run mypy --strict on every package's sources."""
    _install_packages(session, PACKAGES)
    session.install("mypy>=1.11")
    source_dirs = [str(PACKAGES_DIR / package / "src") for package in PACKAGES]
    modules = [arg for package in PACKAGES for arg in ("-p", package.replace("-", "_"))]
    session.run(
        "mypy",
        "--config-file",
        str(ROOT / "pyproject.toml"),
        *modules,
        env={"MYPYPATH": os.pathsep.join(source_dirs)},
    )


# The docs' before-composer blocks run Composer's own launcher. mosaicml 0.32.1 pins a
# torch (<2.7.1) that is not on the project's machines; its distributed API runs on the
# lowest torch we test, 2.11.0, whose build the torch(2.11) session installed already
# (the Composer venv links it), with the torchvision made for it.
COMPOSER = ("mosaicml==0.32.1", OTHER_TORCH_SPECS["2.11"], "torchvision==0.26.0")


def _composer_venv(session: nox.Session) -> Path:
    """A venv with Composer, for the docs' before-composer blocks; its bin directory."""
    venv = ROOT / ".nox" / "_peers" / "composer"
    if not (venv / "complete").exists():
        shutil.rmtree(venv, ignore_errors=True)
        session.run(sys.executable, "-m", "venv", str(venv), external=True)
        package, torch_spec, torchvision_spec = COMPOSER
        _link_installed(_torch_template(session, torch_spec), venv)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        requirements = ROOT / "docs" / "tests" / "requirements-composer.txt"
        specs = [torch_spec, torchvision_spec, "-r", str(requirements)]
        session.run(*pip, *specs, env=_pip_env(torch_spec), external=True)
        session.run(*pip, "--no-deps", package, external=True)
        (venv / "complete").touch()
    return venv / "bin"


@nox.session
@_timed
def docs(session: nox.Session) -> None:
    """The Sphinx site, warnings as errors, offline; then the docs tests (docs/tests).

    The migration guides' "before" blocks run the peers' own code: torchft and Model
    Optimizer are installed beside the packages, Composer in a venv of its own.
    """
    _install_packages(session, PACKAGES)
    # matplotlib draws the benchmarks page's figures; it is never a package dependency.
    session.install("sphinx>=7", "myst-parser>=3", "sphinx-argparse>=0.5", "matplotlib>=3.8")
    output = Path(session.create_tmp()) / "html"
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", str(ROOT / "docs"), str(output))
    session.log(f"docs built in {output}")
    session.install("pytest>=8", "pytest-timeout>=2", "pytest-xdist>=3")
    session.install("-r", str(ROOT / "docs" / "tests" / "requirements-peers.txt"))
    composer = _composer_venv(session)
    # A page's blocks run in page order in one directory: one worker per page (a class).
    _pytest(
        session,
        str(ROOT / "docs" / "tests"),
        dist="loadscope",
        env={"DIST_DOCS_PEER_COMPOSER": str(composer)},
    )


@nox.session
@_timed
def demo(session: nox.Session) -> None:
    """The main job: the MoE demo on 4 ranks, its export inspected, the fault-tolerant path.

    ``nox -s demo -- --steps 100`` passes extra arguments to examples/train.py. Not a
    default session: the integration session runs the same commands and checks what
    they print and write (``tests-integration/test_demo.py``).
    """
    _install_packages(session, PACKAGES)
    export_dir = Path(session.create_tmp()) / "moe-export"
    shutil.rmtree(export_dir, ignore_errors=True)
    session.run("python", "-m", "dist_core")
    session.run(
        "dist-launch",
        "-n",
        "4",
        str(ROOT / "examples" / "train.py"),
        "--export-dir",
        str(export_dir),
        *session.posargs,
    )
    session.run("dist-workspace", "inspect", str(export_dir / "workspace"))
    session.log(f"exported {export_dir / 'model.safetensors'} and {export_dir / 'config.json'}")
    session.run(
        "python",
        str(ROOT / "examples" / "train.py"),
        "--fault-tolerant",
        "--kill-rank",
        "3",
        "--kill-at-step",
        "15",
        "--steps",
        "40",
    )


# The soak runs on the newest torch release (not a default session).
SOAK_TORCH_SPEC = "torch==2.15.0"


@nox.session
def soak(session: nox.Session) -> None:
    """The ft soak on the newest torch: ``benchmarks/ft.py --only soak``. Not a default session.

    Runs the replica groups' lose-a-rank-and-rejoin scenario of dist-collectives' tests
    30 times in a row and writes how many runs ended with shards that differ between
    groups to docs/_data/bench/ft.json (about a minute a run here; ``nox -s soak --
    --soak-runs 5`` for fewer).
    """
    _install_packages(session, ["dist-collectives"], extras="[test]", torch_spec=SOAK_TORCH_SPEC)
    session.run("python", str(ROOT / "benchmarks" / "ft.py"), "--only", "soak", *session.posargs)


@nox.session
def hang_soak(session: nox.Session) -> None:
    """False alarms of the hang detection on healthy quiet loops. Not a default session.

    ``benchmarks/launch.py --only quiet-soak``: every loop of examples/quiet_loops.py 20
    times under ``--hang-timeout 5`` with two busy processes beside it (about 12 s a run
    on a quiet 2-core machine; ``nox -s hang_soak -- --soak-runs 5`` for fewer). Writes
    the counts to docs/_data/bench/launch.json.
    """
    _install_packages(session, ["dist-launch"])
    session.run("python", str(ROOT / "benchmarks" / "launch.py"), "--only", "quiet-soak",
                *session.posargs)  # fmt: skip


# torchft's own tests of its process groups, run against dist_collectives.ft through
# an import-only shim written at run time (no torchft code is committed here).
TORCHFT_SPEC = "torchft==0.2.0"
TORCHFT_SHIM = {
    "__init__.py": "",
    "process_group.py": (
        "from dist_collectives.ft import *  # noqa: F403\n"
        "from dist_collectives.ft.wrappers import _SwallowingWork as _ErrorSwallowingWork\n"
        "from dist_collectives.ft.reconfigure import rendezvous_of as _rendezvous\n"
    ),
    "manager.py": "from dist_collectives.ft import Manager\n",
    "work.py": "from dist_collectives.ft import DummyWork as _DummyWork\n",
}
TORCHFT_MIN_PASSED = 46
_UNPACK_TORCHFT_TEST = """
import sys, zipfile
from pathlib import Path
wheel, out = Path(sys.argv[1]), Path(sys.argv[2])
source = zipfile.ZipFile(next(wheel.glob("torchft-*.whl"))).read("torchft/process_group_test.py")
text = source.decode()
for name in ("TCPStore", "PrefixStore"):
    target = f"torchft.process_group.{name}"
    assert target in text, f"process_group_test.py no longer patches {target}"
    text = text.replace(target, f"dist_collectives.ft.store.{name}")
(out / "process_group_test.py").write_text(text)
"""
_COUNT_PASSED = """
import sys, xml.etree.ElementTree as ET
suite = ET.parse(sys.argv[1]).getroot().iter("testsuite").__next__()
total, failed = int(suite.get("tests")), int(suite.get("failures")) + int(suite.get("errors"))
skipped = int(suite.get("skipped"))
passed = total - failed - skipped
print(f"torchft 0.2.0 process_group_test.py: {passed} passed, {failed} failed, {skipped} skipped")
sys.exit(0 if passed >= int(sys.argv[2]) else f"fewer than {sys.argv[2]} passed")
"""


# How pytest's process ends when libstdc++ aborts it at interpreter exit, after its
# report is written ("terminate called without an active exception"; torch's teardown
# abort that docs/tests/test_code_blocks.py describes). torchft 0.2.0's file on ours
# ended so once after all 47 tests had run. Counted when the report exists.
_TEARDOWN_ABORT_CODE = -signal.SIGABRT


def _run_test_files(
    session: nox.Session, run_dir: Path, files: tuple[str, ...], **env: str
) -> Path:
    """Runs ``files`` in ``run_dir`` with settings of their own; the JUnit report's path."""
    (run_dir / "pytest.ini").write_text("[pytest]\n")  # none of this repository's settings
    report = run_dir / "report.xml"
    report.unlink(missing_ok=True)
    session.chdir(run_dir)
    session.run(
        "pytest",
        "-c",
        str(run_dir / "pytest.ini"),
        "--rootdir",
        str(run_dir),
        "-q",
        "-p",
        "no:cacheprovider",
        "--timeout",
        "600",
        "--junitxml",
        str(report),
        *files,
        *session.posargs,
        # parameterized numbers the cases of a set in its iteration order: one seed,
        # so that both runs give each case the same name.
        env={"PYTHONHASHSEED": "0", **env},
        success_codes=[0, 1, _TEARDOWN_ABORT_CODE],
    )
    if not report.exists():
        session.error(f"pytest ended without writing {report} (aborted before its end)")
    return report


@nox.session
def torchft_compat(session: nox.Session) -> None:
    """Runs torchft 0.2.0's own process_group_test.py against dist_collectives.ft (not default).

    Downloads the torchft wheel into the session, takes its test file (the two
    ``patch("torchft.process_group.TCPStore")``/``PrefixStore`` targets renamed), writes
    a ``torchft`` package beside it that only re-exports ``dist_collectives.ft``, and
    runs the file once; it fails when fewer than 46 of its CPU tests pass (one reads
    private attributes of torchft's baby group and fails). About 3 minutes here.
    """
    _install_packages(session, ["dist-collectives"], extras="[test]")
    session.install("parameterized", "numpy")
    run_dir = Path(session.create_tmp()).resolve() / "torchft-compat"
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "torchft").mkdir(parents=True)
    wheel_dir = run_dir / "wheel"
    session.run("pip", "download", "--no-deps", TORCHFT_SPEC, "-d", str(wheel_dir))
    session.run("python", "-c", _UNPACK_TORCHFT_TEST, str(wheel_dir), str(run_dir))
    for name, text in TORCHFT_SHIM.items():
        (run_dir / "torchft" / name).write_text(text)
    report = _run_test_files(session, run_dir, ("process_group_test.py",), PYTHONPATH=str(run_dir))
    session.run("python", "-c", _COUNT_PASSED, str(report), str(TORCHFT_MIN_PASSED))


# torchft 0.3's API (set_rank_info, get_reconfigure_handle, reconfigure,
# reconfigure_with_store): the newest torchft on the package index, torchft-nightly,
# ships its own tests of it. They run twice on the newest torch: against the real
# torchft-nightly (the reference count) and against dist_collectives.ft through the
# import-only shim above; a test the reference passes must pass on ours, or be named here.
TORCHFT_NIGHTLY_SPEC = "torchft-nightly==2026.10.26"
TORCHFT_NIGHTLY_TESTS = ("process_group_test.py", "reconfigure_test.py")
# What the real torchft-nightly needs at run time beyond torch (its wheel's metadata).
TORCHFT_NIGHTLY_DEPENDENCIES = (
    "opentelemetry-api>=1.39.0",
    "opentelemetry-sdk>=1.39.0",
    "opentelemetry-exporter-otlp-proto-http>=1.39.0",
)
# patch() targets the tests name in torchft's module, and where ours looks them up.
TORCHFT_NIGHTLY_PATCH_TARGETS = {
    "torchft.process_group.create_store_client": "dist_collectives.ft.reconfigure.exchange_store",
    "torchft.process_group.TCPStore": "dist_collectives.ft.store.TCPStore",
    "torchft.process_group.PrefixStore": "dist_collectives.ft.store.PrefixStore",
}
# Tests the reference passes and ours does not, each with the reason.
TORCHFT_NIGHTLY_KNOWN_MISSES = {
    "process_group_test.ProcessGroupTest.test_reconfigure_baby_process_group": (
        "reads torchft's baby group's private _future_thread, _future_pipe and _p"
    ),
    "reconfigure_test.ReconfigureTest.test_manager_reconfigure_pg": (
        "calls the private Manager._reconfigure_pg(quorum_id, handles) of torchft's "
        "lighthouse-driven Manager; ours moves its group through the store"
    ),
}
_UNPACK_TORCHFT_NIGHTLY_TESTS = """
import json, sys, zipfile
from pathlib import Path
wheel, reference, ours = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
names, targets = json.loads(sys.argv[4]), json.loads(sys.argv[5])
archive = zipfile.ZipFile(next(wheel.glob("torchft_nightly-*.whl")))
for name in names:
    text = archive.read(f"torchft/{name}").decode()
    (reference / name).write_text(text)
    for target, replacement in targets.items():
        text = text.replace(target, replacement)
    (ours / name).write_text(text)
"""
_COMPARE_TORCHFT_RUNS = """
import json, sys, xml.etree.ElementTree as ET
def outcomes(path):
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}.{case.get('name')}"
        tags = {child.tag for child in case}
        result[name] = ("failed" if tags & {"failure", "error"} else
                        "skipped" if "skipped" in tags else "passed")
    return result
def count(label, result):
    values = list(result.values())
    print(f"{label}: {values.count('passed')} passed, {values.count('failed')} failed, "
          f"{values.count('skipped')} skipped of {len(values)}")
reference, ours, known = outcomes(sys.argv[1]), outcomes(sys.argv[2]), json.loads(sys.argv[3])
count("torchft-nightly itself", reference)
count("dist_collectives.ft", ours)
missed = sorted(n for n, o in reference.items() if o == "passed" and ours.get(n) != "passed")
for name in missed:
    print(f"  passes on torchft-nightly only: {name}: {known.get(name, 'NOT EXPLAINED')}")
unexplained = [name for name in missed if name not in known]
sys.exit(f"unexplained: {unexplained}" if unexplained else 0)
"""


@nox.session
def torchft_nightly_compat(session: nox.Session) -> None:
    """torchft-nightly's own process-group and reconfigure tests, on it and on ours (not default).

    On the newest torch (torch 2.14 added the reconfigurable groups the files test):
    downloads the torchft-nightly wheel into the session, runs its
    ``process_group_test.py`` and ``reconfigure_test.py`` against the real torchft
    (the reference), then the same files, their ``patch()`` targets renamed, against
    ``dist_collectives.ft`` through the import-only ``torchft`` shim of
    ``torchft_compat``. Prints both counts; fails when a test passes on the reference
    but not on ours, unless it is named in ``TORCHFT_NIGHTLY_KNOWN_MISSES`` with why.
    About 10 minutes here (the torch 2.15 install included).
    """
    torch_spec = OTHER_TORCH_SPECS["2.15"]
    _install_packages(session, ["dist-collectives"], extras="[test]", torch_spec=torch_spec)
    session.install("parameterized", "numpy", *TORCHFT_NIGHTLY_DEPENDENCIES)
    run_dir = Path(session.create_tmp()).resolve() / "torchft-nightly-compat"
    shutil.rmtree(run_dir, ignore_errors=True)
    reference, ours, wheel_dir = run_dir / "reference", run_dir / "ours", run_dir / "wheel"
    (ours / "torchft").mkdir(parents=True)
    reference.mkdir()
    session.run("pip", "download", "--no-deps", TORCHFT_NIGHTLY_SPEC, "-d", str(wheel_dir))
    session.install("--no-deps", str(next(wheel_dir.glob("torchft_nightly-*.whl"))))
    names, targets = json.dumps(TORCHFT_NIGHTLY_TESTS), json.dumps(TORCHFT_NIGHTLY_PATCH_TARGETS)
    unpack = (_UNPACK_TORCHFT_NIGHTLY_TESTS, str(wheel_dir), str(reference), str(ours))
    session.run("python", "-c", *unpack, names, targets)
    for name, text in TORCHFT_SHIM.items():
        (ours / "torchft" / name).write_text(text)
    reference_report = _run_test_files(session, reference, TORCHFT_NIGHTLY_TESTS)
    # The shim comes first on the path, before the real torchft in site-packages.
    ours_report = _run_test_files(session, ours, TORCHFT_NIGHTLY_TESTS, PYTHONPATH=str(ours))
    known = json.dumps(TORCHFT_NIGHTLY_KNOWN_MISSES)
    compare = (_COMPARE_TORCHFT_RUNS, str(reference_report), str(ours_report), known)
    session.run("python", "-c", *compare)


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark under benchmarks/, side by side with its peers; prints ratios.

    Each benchmark also writes its measurements to docs/_data/bench/<name>.json (commit
    them to update the docs' figures), drawn here into the session's tmp/figures.
    """
    _install_packages(session, PACKAGES)
    for requirements in sorted((ROOT / "benchmarks").glob("requirements*.txt")):
        session.install("-r", str(requirements))
    session.install("matplotlib>=3.8")  # draws the figures below; never a package dependency
    scripts = sorted((ROOT / "benchmarks").glob("*.py"))
    selected = [s for s in scripts if not session.posargs or s.stem in session.posargs]
    for script in selected:
        session.run("python", str(script))
    # Each benchmark wrote docs/_data/bench/<name>.json; draw them as the docs will.
    figures = Path(session.create_tmp()) / "figures"
    session.run("python", str(ROOT / "docs" / "_ext" / "bench_plots.py"), str(figures))


@nox.session(python=False)
def summary(session: nox.Session) -> None:
    """Where this run's time went: sessions' wall and CPU time, the limit, the slowest tests.

    The last default session, so that CI's output ends with it. CPU time is the time the
    machine spent busy during the session (:func:`_cpu_seconds`): far below twice the
    wall time on 2 cores means the session mostly waited.
    """
    records = [json.loads(path.read_text()) for path in sorted(_TIMINGS.glob("*.json"))]
    if not records:
        session.log(f"no timings recorded under {_TIMINGS}")
        return
    total = sum(record["wall"] for record in records)
    lines = [f"{'session':<32} {'wall s':>8} {'cpu s':>8} {'cpu/wall':>8}  status"]
    for record in sorted(records, key=lambda record: str(record["session"])):
        ratio = record["cpu"] / record["wall"] if record["wall"] else 0.0
        lines.append(
            f"{record['session']:<32} {record['wall']:>8.0f} {record['cpu']:>8.0f}"
            f" {ratio:>8.2f}  {record['status']}"
        )
    lines.append(f"{'all timed sessions':<32} {total:>8.0f}   ({total / 60:.1f} min)")
    # The machine's limit for this run: its busy CPU time spread over every CPU. No
    # ordering or parallelism of the same work finishes sooner on this machine.
    busy = sum(record["cpu"] for record in records)
    cpus = os.cpu_count() or 1
    lines.append(
        f"{'machine limit':<32} {busy / cpus:>8.0f}   ({busy:.0f} CPU s on {cpus} CPUs:"
        f" {busy / cpus / 60:.1f} min at full use)"
    )
    tests: list[tuple[float, str, str]] = []
    for junit in _TIMINGS.glob("*.xml"):
        for suite in ElementTree.parse(junit).iter("testsuite"):
            owner = suite.get("name", junit.stem)
            for case in suite.iter("testcase"):
                # JUnit's classname is the test file's path with dots, then its class if
                # any: show it as pytest does.
                parts = case.get("classname", "").split(".")
                test_class = [parts.pop()] if parts and parts[-1].startswith("Test") else []
                name = "::".join(["/".join(parts) + ".py", *test_class, case.get("name", "")])
                tests.append((float(case.get("time") or 0.0), owner, name))
    tests.sort(reverse=True)
    lines.append("20 slowest tests:")
    lines.extend(f"{seconds:8.1f} s  {owner}  {name}" for seconds, owner, name in tests[:20])
    session.log("time of this run (.nox/_timings/" + _TIMINGS.name + "):\n" + "\n".join(lines))
