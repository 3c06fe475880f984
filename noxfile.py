"""Every session of the dist-* monorepo.

Plain ``nox`` runs the default sessions (tests of every package, integration, the
suites again on torch 2.14 and 2.11, lint, typecheck, docs, demo); ``nox -s bench``
runs the benchmarks.

Every venv is made with pip, and torch is pinned to ``TORCH_SPEC`` before anything
else is installed: on the project's machines that version is a local CPU build that
installs in seconds, while any other spec downloads a CUDA build of several GB. The
packages themselves declare only a lower bound on torch.

Packages are installed non-editable from this repository, each session with only what
it needs, and :func:`_check_provenance` fails the session when any installed
``dist-*`` distribution came from anywhere else (``dist-launch`` is also the name of an
unrelated project on the public index).
"""

from __future__ import annotations

import os
import shutil
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
PACKAGES_DIR = ROOT / "packages"
TORCH_SPEC = os.environ.get("DIST_TORCH_SPEC", "torch==2.13.0")
# The other torch versions CI tests, each in one venv holding all four packages: the
# newest release, and the lowest version every package declares (``torch>=2.11``).
# Both are CUDA builds that run on the CPU; on the project's machines they install from
# the package registry (about 4 GB each, a minute or two).
OTHER_TORCH_SPECS = {"2.14": "torch==2.14.1", "2.11": "torch==2.11.0"}

nox.options.default_venv_backend = "virtualenv"
nox.options.error_on_missing_interpreters = True
nox.options.sessions = [
    "tests",
    "integration",
    "torch",
    "cluster",
    "lint",
    "typecheck",
    "docs",
    "demo",
]


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


def _install_packages(
    session: nox.Session, packages: list[str], extras: str = "", torch_spec: str = TORCH_SPEC
) -> None:
    """Installs torch first (pinned), then the packages, non-editable, from this repo.

    A torch other than ``TORCH_SPEC`` is a CUDA build of several GB: pip's cache would
    hold a second copy of it, which is what ran a CI machine out of disk once, so it
    installs with ``--no-cache-dir``.
    """
    if torch_spec == TORCH_SPEC:
        session.install(torch_spec)
    else:
        session.install("--no-cache-dir", torch_spec)
    targets = []
    for package in packages:
        closure = _sibling_closure(package)
        for name in closure:
            suffix = extras if name == package else ""
            target = f"{PACKAGES_DIR / name}{suffix}"
            if target not in targets:
                targets.append(target)
    session.install(*targets)
    _check_provenance(session)


_PROVENANCE_CHECK = """
import json, sys
from importlib.metadata import distributions
from pathlib import Path
packages_dir = Path(sys.argv[1]).resolve()
bad = []
for dist in distributions():
    name = (dist.metadata["Name"] or "").lower().replace("_", "-")
    if not name.startswith("dist-"):
        continue
    raw = dist.read_text("direct_url.json")
    url = json.loads(raw).get("url", "") if raw else ""
    path = Path(url.removeprefix("file://")).resolve() if url.startswith("file://") else None
    if path is None or path.parent != packages_dir:
        bad.append(f"{name} {dist.version} from {url or 'a package index'}")
    else:
        print(f"{name} {dist.version} from {path}")
if bad:
    sys.exit("dist-* distributions not built from this repository: " + "; ".join(bad))
"""


def _check_provenance(session: nox.Session) -> None:
    """Fails when an installed dist-* distribution did not come from packages/."""
    session.run("python", "-c", _PROVENANCE_CHECK, str(PACKAGES_DIR), silent=False)


@nox.session
@nox.parametrize("package", PACKAGES, ids=PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's tests, in a venv holding only that package and what it declares."""
    _install_packages(session, [package], extras="[test]")
    session.run(
        "pytest",
        str(PACKAGES_DIR / package / "tests"),
        *session.posargs,
        env={"PYTHONDONTWRITEBYTECODE": "1"},
    )


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
def integration(session: nox.Session) -> None:
    """Tests that need several packages at once, real processes and real faults."""
    _install_packages(session, PACKAGES, extras="")
    session.install("pytest>=8", "pytest-timeout>=2")
    session.run("pytest", str(ROOT / "tests-integration"), *session.posargs)


# What the real-launcher session installs (Debian), and the programs it needs from them.
CLUSTER_APT_PACKAGES = ("slurm-wlm", "munge", "openmpi-bin")
CLUSTER_PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "mpirun")


@nox.session
def cluster(session: nox.Session) -> None:
    """Real srun, sbatch, scancel and mpirun against a one-host SLURM cluster.

    tests-cluster/ brings the cluster up itself (munged, slurmctld and slurmd as child
    processes, stopped on every exit path). Needs root: the Debian packages are
    installed with apt-get when a program is missing. Without root it is skipped, except
    in CI (``CI`` set), where it fails. Runs once, on ``TORCH_SPEC``.
    """
    if os.geteuid() != 0:
        reason = "needs root (apt-get, and slurmd runs jobs as any user)"
        if os.environ.get("CI"):
            session.error(f"nox -s cluster {reason}: CI must run the real launchers")
        session.skip(reason)
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    if any(shutil.which(program, path=path) is None for program in CLUSTER_PROGRAMS):
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
    session.run("pytest", str(ROOT / "tests-cluster"), "-n", "2", "--durations=0", *session.posargs)


@nox.session(name="torch")
@nox.parametrize("version", list(OTHER_TORCH_SPECS), ids=list(OTHER_TORCH_SPECS))
def other_torch(session: nox.Session, version: str) -> None:
    """Every package's tests and tests-integration on another torch, in one venv.

    ``nox -s "torch(2.14)"`` runs them on the newest torch, ``nox -s "torch(2.11)"`` on
    the lowest one the packages declare. One venv for all four packages, so that torch
    installs once per session.
    """
    free_gib = shutil.disk_usage(ROOT).free / 2**30
    session.log(f"{free_gib:.1f} GiB free on the disk of {ROOT}; this venv takes about 5 GiB")
    _install_packages(session, PACKAGES, extras="[test]", torch_spec=OTHER_TORCH_SPECS[version])
    session.run("python", "-m", "dist_core")  # its report names the torch it runs on
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    for package in PACKAGES:
        session.run("pytest", str(PACKAGES_DIR / package / "tests"), *session.posargs, env=env)
    session.run("pytest", str(ROOT / "tests-integration"), *session.posargs, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """Run ruff check and ruff format --check over the whole repository."""
    session.install("ruff>=0.6")
    session.run("ruff", "check", str(ROOT))
    session.run("ruff", "format", "--check", str(ROOT))


@nox.session
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


@nox.session
def docs(session: nox.Session) -> None:
    """The Sphinx site, warnings as errors, offline; then the docs tests (docs/tests)."""
    _install_packages(session, PACKAGES)
    # matplotlib draws the benchmarks page's figures; it is never a package dependency.
    session.install("sphinx>=7", "myst-parser>=3", "sphinx-argparse>=0.5", "matplotlib>=3.8")
    output = Path(session.create_tmp()) / "html"
    session.run("sphinx-build", "-W", "--keep-going", "-b", "html", str(ROOT / "docs"), str(output))
    session.log(f"docs built in {output}")
    session.install("pytest>=8", "pytest-timeout>=2")
    session.run("pytest", str(ROOT / "docs" / "tests"), *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: the MoE demo on 4 ranks, its export inspected, the fault-tolerant path.

    ``nox -s demo -- --steps 100`` passes extra arguments to examples/train.py.
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
