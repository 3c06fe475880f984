"""Every code block of the migration guides runs, in page order, as a reader would run it.

A page's blocks share one fresh directory, so a block may write a file that a later
block runs. The first word of a fence's info string is the language; further words
say how the block runs:

- ``python``: written to a file and run with ``python <file>`` (one process; CPU).
- ``bash`` (or ``sh``, ``shell``): run with ``bash -euo pipefail``. ``python``,
  ``dist-launch`` and ``dist-workspace`` there are this interpreter's (``python -m
  dist_launch``, ...), so the commands run the packages under test.
- ``file=NAME``: not run; written to ``NAME`` for a later block (a script that a
  ``dist-launch -n 2 NAME`` block starts). Its syntax is checked.
- ``before-LIB``: the code a user migrates from, run with LIB's own code. It runs in
  the interpreter of the venv whose ``bin`` directory ``DIST_DOCS_PEER_<LIB>`` names
  (``nox -s docs`` makes one for Composer, whose torch pin excludes ours), else in this
  interpreter where LIB's module is importable (see ``BEFORE``; the docs session
  installs torchft and Model Optimizer). Elsewhere it is skipped with the reason, and
  under ``CI`` it fails: CI runs every block. ``before-torchrun`` always runs: torchrun
  ships with torch. A ``before-LIB file=NAME`` block is only written, so it needs
  nothing.

Blocks in other languages (``text`` for sample output, ``toml``) are not run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs" / "guides").glob("migrate-from-*.md"))
PYTHON = frozenset({"python", "py"})
SHELL = frozenset({"bash", "sh", "shell"})
# before-LIB: the module whose presence lets the block run.
BEFORE = {
    "torchrun": "torch",
    "composer": "composer",
    "torchft": "torchft",
    "modelopt": "modelopt",
    "ml-starter": "ml",
}
BLOCK_TIMEOUT = 240.0
# What libstdc++ prints when a thread unwinds through a destructor at interpreter exit.
# Under torchrun on torch 2.13 a rank does it after its script has finished in about one
# run in 30: a gloo worker thread frees the last work's Python object while Py_FinalizeEx
# runs (seen in a core dump: ~AsyncWork -> decref -> take_gil -> pthread_exit). dist-launch
# workers end with os._exit after the atexit handlers, so it never reaches them.
TORCH_TEARDOWN_ABORT = "terminate called without an active exception"
_FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    words: tuple[str, ...]
    code: str

    @property
    def file_name(self) -> str | None:
        for word in self.words:
            if word.startswith("file="):
                return word.removeprefix("file=")
        return None

    @property
    def before(self) -> str | None:
        for word in self.words:
            if word.startswith("before-"):
                return word.removeprefix("before-")
        return None

    @property
    def runs(self) -> bool:
        return self.language in PYTHON | SHELL

    @property
    def id(self) -> str:
        kind = f"before-{self.before}" if self.before else "after"
        return f"{self.page.stem}:{self.line}:{self.language}:{kind}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of a MyST page, in order (fences at column 0)."""
    blocks = []
    lines = page.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None or opening.group(2).strip().startswith("{"):
            index += 1
            continue
        fence, info = opening.group(1), opening.group(2).split()
        body = []
        end = index + 1
        while end < len(lines) and not (
            lines[end].startswith(fence) and not lines[end].strip(fence[0]).strip()
        ):
            body.append(lines[end])
            end += 1
        language = info[0] if info else ""
        blocks.append(Block(page, index + 1, language, tuple(info[1:]), "\n".join(body) + "\n"))
        index = end + 1
    return blocks


ALL_BLOCKS = [block for page in PAGES for block in blocks_of(page) if block.runs]


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    """One working directory per page, shared by its blocks."""
    return {page: tmp_path_factory.mktemp(page.stem) for page in PAGES}


@pytest.fixture(scope="module")
def shims(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python``, ``dist-launch`` and ``dist-workspace`` commands of this interpreter."""
    directory = tmp_path_factory.mktemp("bin")
    commands = {
        "python": "",
        "python3": "",
        "dist-launch": "-m dist_launch",
        "dist-workspace": "-m dist_workspace",
    }
    for name, arguments in commands.items():
        shim = directory / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" {arguments} "$@"\n')
        shim.chmod(0o755)
    return directory


def _environment(shims: Path) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(shims), str(Path(sys.executable).parent), env.get("PATH", "")]
    env["PATH"] = os.pathsep.join(path)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a block starts as a user's fresh shell would
    return env


def _as_from_a_terminal() -> None:
    """``preexec_fn``: SIGINT and SIGQUIT at their default, as in a user's terminal.

    A CI script that starts ``nox`` in the background (a shell without job control)
    hands pytest, and every block it runs, SIGINT and SIGQUIT ignored; a launcher keeps
    an ignored signal ignored, so a block that shows Ctrl-C would wait for nothing.
    """
    for signum in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)


def _run(command: list[str], cwd: Path, env: dict[str, str], block: Block) -> None:
    try:
        done = subprocess.run(
            command,
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT,
            check=False,
            preexec_fn=_as_from_a_terminal,
        )
    except subprocess.TimeoutExpired as error:
        output = f"{error.stdout}{error.stderr}"
        pytest.fail(f"{block.id} ran longer than {BLOCK_TIMEOUT:g} s:\n{output}")
    aborted_after_its_output = (
        block.before == "torchrun" and bool(done.stdout) and TORCH_TEARDOWN_ABORT in done.stderr
    )
    if done.returncode != 0 and not aborted_after_its_output:
        pytest.fail(
            f"{block.id} exited with {done.returncode}\n--- code ---\n{block.code}"
            f"--- stdout ---\n{done.stdout}--- stderr ---\n{done.stderr}"
        )


def run_block(block: Block, workdirs: dict[Path, Path], shims: Path) -> None:
    """Runs one block as the module docstring says, in its page's directory."""
    workdir = workdirs[block.page]
    if block.language in PYTHON:
        compile(block.code, f"{block.page.name}:{block.line}", "exec")
    if block.file_name is not None:
        (workdir / block.file_name).write_text(block.code, encoding="utf-8")
        return
    env = _environment(shims)
    python = sys.executable
    if block.before is not None:
        peer = _peer_bin(block)
        if peer is not None:  # the peer's own venv: its python and commands come first
            env["PATH"] = os.pathsep.join([str(peer), *env["PATH"].split(os.pathsep)[1:]])
            python = str(peer / "python")
    if block.language in PYTHON:
        script = workdir / f"block_{block.line}.py"
        script.write_text(block.code, encoding="utf-8")
        _run([python, script.name], workdir, env, block)
    else:
        _run(["bash", "-euo", "pipefail", "-c", block.code], workdir, env, block)


def _page_tests(page: Path) -> type:
    """A test class for one page: its blocks, in page order.

    One class per page because a page's blocks share one directory and build on each
    other: pytest-xdist's ``--dist loadscope`` gives each class whole to one worker, in
    order, while pages run side by side.
    """

    class Page:
        @pytest.mark.processes
        @pytest.mark.parametrize(
            "block", [block for block in ALL_BLOCKS if block.page == page], ids=lambda b: b.id
        )
        def test_block_runs(self, block: Block, workdirs: dict[Path, Path], shims: Path) -> None:
            run_block(block, workdirs, shims)

    name = "Test" + "".join(word.capitalize() for word in page.stem.split("-"))
    Page.__name__ = Page.__qualname__ = name
    return Page


for _page in PAGES:
    _tests = _page_tests(_page)
    globals()[_tests.__name__] = _tests


def _peer_bin(block: Block) -> Path | None:
    """The bin directory of the venv a before block runs in; None: this interpreter's.

    Skips the block where neither has the peer's code, or fails it under ``CI``.
    """
    assert block.before is not None
    module = BEFORE.get(block.before)
    assert module is not None, f"{block.id}: unknown before-{block.before} (known: {BEFORE})"
    variable = f"DIST_DOCS_PEER_{block.before.upper().replace('-', '_')}"
    if os.environ.get(variable):
        return Path(os.environ[variable])
    if importlib.util.find_spec(module) is not None:
        return None
    problem = (
        f"a 'before' block for {block.before}: its module {module!r} is not installed here "
        f"and {variable} names no venv that has it (nox -s docs installs every peer)"
    )
    if os.environ.get("CI"):
        pytest.fail(problem)
    pytest.skip(problem)


def test_every_guide_is_in_the_toctree_and_shows_before_and_after() -> None:
    assert PAGES, "no docs/guides/migrate-from-*.md"
    index = (ROOT / "docs" / "index.rst").read_text(encoding="utf-8")
    for page in PAGES:
        assert f"guides/{page.stem}" in index, f"{page.name} is not in docs/index.rst"
        blocks = [block for block in blocks_of(page) if block.runs]
        assert any(block.before for block in blocks), f"{page.name} has no before block"
        assert any(not block.before for block in blocks), f"{page.name} has no after block"


def test_blocks_are_parsed_with_their_words() -> None:
    page = ROOT / "docs" / "guides" / "migrate-from-torchrun.md"
    words = {block.words for block in blocks_of(page)}
    assert ("before-torchrun",) in words
    assert any(word.startswith("file=") for ws in words for word in ws)
