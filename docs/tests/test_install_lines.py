"""No doc or README tells a user to install one of our packages from a package index.

Our four names are not ours on the public index: ``dist-core``, ``dist-collectives``
and ``dist-workspace`` are free for anyone to register, and ``dist-launch`` already
belongs to an unrelated project. Until we publish under names we own, every install
line installs from this repository: a path (``pip install ./packages/dist-core``), a
URL (``git+https://...#subdirectory=packages/dist-core``) or a built wheel file.

This test scans the README, the package READMEs and changelogs, every page of the docs
and everything under examples/ for install commands (pip, pip3, ``python -m pip``,
uv, pipx, poetry, pdm, conda, mamba) and fails on any argument that names one of our
distributions as a bare index requirement, in any spelling: ``dist_launch``,
``Dist.Launch``, ``dist-core[test]``, ``"dist-launch==0.1.1"``, ``dist-core>=0.2``.

docs/install.md explains why, and shows the wrong command once, in a paragraph marked
with the comment ``% not-an-install-instruction``. That marker is honoured in that
file only.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = frozenset({"dist-core", "dist-launch", "dist-collectives", "dist-workspace"})
MARKER = "not-an-install-instruction"
MARKER_FILE = "docs/install.md"

# A command that installs packages, up to the word after which requirements follow.
_INSTALL = re.compile(
    r"(?:\b(?:python(?:3(?:\.\d+)?)?\s+-m\s+)?pip3?\s+(?:install|download)"
    r"|\buv\s+(?:pip\s+install|add|tool\s+install|run\s+--with)"
    r"|\bpipx\s+(?:install|inject\s+\S+)"
    r"|\bpoetry\s+add|\bpdm\s+add|\brye\s+add|\bhatch\s+add"
    r"|\b(?:conda|mamba|micromamba)\s+install)\b",
    re.IGNORECASE,
)
# Where a command ends on its line: a shell operator, a comment, or the end of inline code.
_END = re.compile(r"&&|\|\||[;|`)]|\s#|\\$")
# Options whose next word is their value (not a requirement).
_VALUED = frozenset(
    {
        "-r", "--requirement", "-c", "--constraint", "-i", "--index-url",
        "--extra-index-url", "-f", "--find-links", "-t", "--target", "--prefix",
        "--root", "--src", "--python", "-p", "--platform", "--python-version",
        "--implementation", "--abi", "--upgrade-strategy", "-C", "--config-settings",
        "--group", "-G", "--extra", "-E", "--channel", "--index", "--default-index",
        "--only-binary", "--no-binary", "--progress-bar", "--report", "--log",
        "--cache-dir", "--proxy", "--retries", "--timeout", "--exists-action",
        "--trusted-host", "--cert", "--client-cert", "--source", "-n", "--name",
    }
)  # fmt: skip
_NAME = re.compile(r"^([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)(.*)$", re.DOTALL)


@dataclass(frozen=True)
class Finding:
    """One install line that names one of our distributions as an index requirement."""

    path: str
    line: int
    name: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: installs {self.name!r} from an index: {self.text}"


def canonical(name: str) -> str:
    """The PEP 503 form of a distribution name: lower case, runs of -_. as one -."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _is_location(word: str) -> bool:
    """A path, a URL or an archive file: what pip installs without asking an index."""
    return (
        "/" in word
        or "\\" in word
        or word.startswith((".", "~", "$"))
        or "://" in word
        or word.startswith(("git+", "hg+", "svn+", "bzr+", "file:"))
        or word.endswith((".whl", ".tar.gz", ".zip", ".tar.bz2", ".tgz"))
    )


def index_requirements(arguments: str) -> list[str]:
    """Our names that ``arguments`` (what follows ``pip install``) asks an index for."""
    try:
        words = shlex.split(arguments, comments=False, posix=True)
    except ValueError:  # an unbalanced quote in prose: fall back to plain words
        words = arguments.split()
    found = []
    skip_next = False
    for index, raw in enumerate(words):
        if skip_next:
            skip_next = False
            continue
        word = raw.strip("\"'`,")
        if word.startswith("-"):
            skip_next = word in _VALUED
            continue
        if not word or _is_location(word):
            continue
        match = _NAME.match(word)
        if match is None:
            continue
        name, rest = canonical(match.group(1)), match.group(2).strip()
        if name not in OURS:
            continue
        following = words[index + 1] if index + 1 < len(words) else ""
        # PEP 508 direct reference, "dist-core @ git+https://...", in one word or three.
        if rest.startswith("@"):
            target = rest[1:].strip() or (words[index + 2] if index + 2 < len(words) else "")
            if _is_location(target):
                continue
        elif following == "@" and index + 2 < len(words) and _is_location(words[index + 2]):
            continue
        if rest == "" or rest[0] in "[=<>!~;@(^*":
            found.append(name)
    return found


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines with shell continuations (a trailing backslash) joined; 1-based numbers."""
    joined: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if pending is not None:
            line = pending[1] + " " + line.lstrip()
            number = pending[0]
            pending = None
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1])
            continue
        joined.append((number, line))
    if pending is not None:
        joined.append(pending)
    return joined


def _exempt_lines(text: str) -> set[int]:
    """Lines of the paragraph (or fenced block) that follows each marker comment."""
    lines = text.splitlines()
    exempt: set[int] = set()
    for index, line in enumerate(lines):
        if MARKER not in line:
            continue
        fence = None
        for following in range(index + 1, len(lines)):
            current = lines[following].strip()
            if fence is None and not current:
                break
            exempt.add(following + 1)
            if fence is None and current.startswith(("```", "~~~")):
                fence = current[:3]
            elif fence is not None and current.startswith(fence):
                break
    return exempt


def scan_text(text: str, path: str = "<text>", *, honour_marker: bool = False) -> list[Finding]:
    """Every install command in ``text`` that asks an index for one of our names."""
    exempt = _exempt_lines(text) if honour_marker else set()
    requirements_file = Path(path).name.startswith("requirements") and path.endswith(".txt")
    findings = []
    for number, line in _logical_lines(text):
        if number in exempt:
            continue
        if requirements_file:
            stripped = line.split("#", 1)[0].strip()
            if stripped and not stripped.startswith("-"):
                names = index_requirements(stripped)
                findings += [Finding(path, number, n, line.strip()) for n in names]
            continue
        for match in _INSTALL.finditer(line):
            tail = line[match.end() :]
            end = _END.search(tail)
            arguments = tail[: end.start()] if end else tail
            for name in index_requirements(arguments):
                findings.append(Finding(path, number, name, line.strip()))
    return findings


def documents() -> list[Path]:
    """Every file a user reads install instructions in."""
    paths = [ROOT / "README.md"]
    paths += sorted((ROOT / "packages").glob("*/*.md"))
    paths += sorted(
        p
        for p in (ROOT / "docs").rglob("*")
        if p.suffix in {".md", ".rst", ".txt"} and "_build" not in p.parts
    )
    paths += sorted(p for p in (ROOT / "examples").rglob("*") if p.is_file())
    return [p for p in paths if p.is_file() and "__pycache__" not in p.parts]


def scan_repository() -> list[Finding]:
    """Every offending install line in the files of :func:`documents`."""
    findings = []
    for path in documents():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        relative = path.relative_to(ROOT).as_posix()
        findings += scan_text(text, relative, honour_marker=relative == MARKER_FILE)
    return findings


def test_no_doc_installs_our_packages_from_an_index() -> None:
    findings = scan_repository()
    assert not findings, (
        "these lines tell the user to install one of our distributions from a package "
        "index, where the name is not ours (see docs/install.md); install from this "
        "repository instead, e.g. `pip install ./packages/dist-core ./packages/dist-launch`:\n"
        + "\n".join(str(f) for f in findings)
    )


def test_the_scan_covers_the_readmes_the_docs_and_the_examples() -> None:
    scanned = {p.relative_to(ROOT).as_posix() for p in documents()}
    assert {"README.md", "docs/quickstart.rst", MARKER_FILE} <= scanned
    assert {f"packages/{name}/README.md" for name in OURS} <= scanned
    assert any(p.startswith("examples/") for p in scanned)


def test_the_install_page_says_why_and_installs_from_the_repository() -> None:
    text = (ROOT / MARKER_FILE).read_text(encoding="utf-8")
    assert "unrelated project" in text
    assert "pip install ./packages/dist-core ./packages/dist-launch" in text
    assert "#subdirectory=packages/" in text
    assert "python -m build" in text


# The quickstart's install line before this test existed, and variants of it.
OLD_QUICKSTART = """\
Each package installs on its own; a trainer takes all four, an export tool only
dist-workspace::

    pip install dist-core dist-launch dist-collectives dist-workspace
"""


def test_fails_on_the_old_quickstart_line() -> None:
    findings = scan_text(OLD_QUICKSTART, "docs/quickstart.rst")
    assert [f.name for f in findings] == [
        "dist-core",
        "dist-launch",
        "dist-collectives",
        "dist-workspace",
    ]
    assert all(f.line == 4 for f in findings)


@pytest.mark.parametrize(
    "line",
    [
        "pip install dist-launch",
        "pip3 install -U dist_launch",
        "python -m pip install 'dist-core>=0.2,<0.3'",
        "python3.11 -m pip install --upgrade Dist.Workspace==0.2.0",
        'To pin one package: ``pip install "dist-launch==0.1.0" dist-core``.',
        "an export tool can `pip install dist-workspace` alone",
        "pip install torch dist-collectives[test]",
        "pip install -r requirements.txt dist-core~=0.2",
        "uv pip install dist-core",
        "uv add dist-launch",
        "uv tool install dist-launch",
        "pipx install dist-launch",
        "poetry add dist-workspace@^0.2",
        "pdm add dist-core",
        "conda install -c conda-forge dist-core",
        "pip install --index-url https://example.org/simple dist-core",
        "pip install \\\n    dist-core",
        "RUN pip install --no-cache-dir dist-launch && echo done",
    ],
)
def test_finds_an_index_install_of_our_names(line: str) -> None:
    assert scan_text(line), line


@pytest.mark.parametrize(
    "line",
    [
        "pip install ./packages/dist-core ./packages/dist-launch",
        "python -m pip install packages/dist-core",
        "pip install -e ./packages/dist-workspace[test]",
        'pip install "./packages/dist-collectives[test]"',
        "pip install 'git+https://<your-git-host>/<org>/dist.git#subdirectory=packages/dist-core'",
        "pip install 'dist-core @ git+https://<your-git-host>/<org>/dist.git#subdirectory=packages/dist-core'",
        "pip install dist-core @ file:///src/dist/packages/dist-core",
        "pip install wheels/dist_core-0.2.0-py3-none-any.whl",
        "pip install dist_launch-0.1.1-py3-none-any.whl",
        "pip install nox && nox -s docs",
        "pip install torch dist-corefoo",
        "pip uninstall dist-launch",
        "dist-launch -n 4 train.py",
        "pip install ./packages/dist-core  # not dist-launch from an index",
    ],
)
def test_allows_paths_urls_wheels_and_other_names(line: str) -> None:
    assert scan_text(line) == [], line


def test_the_marker_exempts_only_the_paragraph_after_it_and_only_where_honoured() -> None:
    text = "% not-an-install-instruction\nwrong: pip install dist-launch\n\npip install dist-core\n"
    assert [f.name for f in scan_text(text, honour_marker=True)] == ["dist-core"]
    assert [f.name for f in scan_text(text)] == ["dist-launch", "dist-core"]


def test_requirements_files_under_examples_are_scanned() -> None:
    text = "torch>=2.4\ndist-core==0.2.0\n./packages/dist-launch\n"
    assert [f.name for f in scan_text(text, "examples/requirements.txt")] == ["dist-core"]
