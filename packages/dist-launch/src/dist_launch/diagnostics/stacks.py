"""Ranks' Python stacks as faulthandler dumps them: parsed, grouped and formatted.

Stacks are compared after dropping what differs between ranks at one place in the
code (thread ids, the launcher's own frames and threads). Pure: a test passes stacks
as text.
"""

from __future__ import annotations

import re
import sysconfig
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath

from dist_core.supervisor import RankOutcome

# Frames of the launcher's own machinery in faulthandler dumps: noise to the reader.
_LAUNCHER_FRAMES = re.compile(
    r'File "(<frozen runpy>|[^"]*/dist_launch/in_worker/(bootstrap|fork_server)\.py)"'
)


def _indent(text: str) -> str:
    return textwrap.indent(text.rstrip(), "    ")


# The thread of a worker's progress beacon (dist_launch.in_worker.beacon): the launcher's, not
# the script's.
_BEACON_FRAME = re.compile(r'File "[^"]*/dist_launch/in_worker/beacon\.py"')
_THREAD_HEADER_LINE = re.compile(r"^(?:Current thread|Thread) ")


def _without_beacon_thread(lines: list[str]) -> list[str]:
    blocks: list[list[str]] = [[]]
    for line in lines:
        if _THREAD_HEADER_LINE.match(line):
            blocks.append([])
        blocks[-1].append(line)
    kept = [block for block in blocks if not any(_BEACON_FRAME.search(line) for line in block)]
    return [line for block in kept for line in block]


def without_launcher_frames(stack: str) -> str:
    """A faulthandler dump without runpy's and dist-launch's own frames and threads."""
    lines = _without_beacon_thread(stack.splitlines())
    return "\n".join(line for line in lines if not _LAUNCHER_FRAMES.search(line))


# faulthandler's thread headers: the id differs from rank to rank, and which thread is
# "current" depends on which one the kernel gave the signal to; neither is a place in
# the code.
_THREAD_HEADER = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-fA-F]+", re.MULTILINE)


def _normalised(stack: str) -> str:
    """The stack as ranks at the same place in the code all dump it."""
    lines = without_launcher_frames(stack).splitlines()
    text = "\n".join(line.rstrip() for line in lines).strip("\n")
    return _THREAD_HEADER.sub("Thread", text)


def group_stacks(stacks: Mapping[int, str]) -> list[tuple[list[int], str]]:
    """Groups ranks whose stacks show the same place in the code.

    Stacks are compared after dropping what differs between ranks at the same place:
    the thread ids of faulthandler's headers (``Thread 0x00007f...``, ``Current thread
    0x...``, both shown as ``Thread``), the launcher's own frames, trailing blanks.
    File names and line numbers stay.

    Args:
        stacks: Each rank's stack, as faulthandler wrote it.

    Returns:
        ``(ranks, stack)`` pairs: the ranks sorted, the stack normalised, the groups
        ordered by their lowest rank.
    """
    groups: dict[str, list[int]] = {}
    for rank in sorted(stacks):
        groups.setdefault(_normalised(stacks[rank]), []).append(rank)
    return sorted(((ranks, stack) for stack, ranks in groups.items()), key=lambda g: g[0][0])


def format_rank_ranges(ranks: Sequence[int]) -> str:
    """``0-2, 5`` for ranks 0, 1, 2 and 5 (in any order, repeats ignored)."""
    parts: list[str] = []
    ordered = sorted(set(ranks))
    start = 0
    for index, rank in enumerate(ordered):
        if index + 1 < len(ordered) and ordered[index + 1] == rank + 1:
            continue  # the run goes on
        first = ordered[start]
        parts.append(str(first) if first == rank else f"{first}-{rank}")
        start = index + 1
    return ", ".join(parts)


def format_stacks(stacks: Mapping[int, str]) -> str:
    """The ranks' stacks, each distinct one once under the ranks that share it.

    ::

        ranks 0-2, 5: same stack
            Thread (most recent call first):
              File "train.py", line 9 in <module>
        rank 3:
            ...
    """
    blocks: list[str] = []
    for ranks, stack in group_stacks(stacks):
        if len(ranks) == 1:
            head = f"rank {ranks[0]}:"
        else:
            head = f"ranks {format_rank_ranges(ranks)}: same stack"
        blocks.append(f"{head}\n{_indent(stack or '(empty stack)')}")
    return "\n".join(blocks)


def format_stack_dump(
    outcomes: Sequence[RankOutcome], reason: str, launcher: str = "dist-launch"
) -> str:
    """Where every running rank is, on request, while the job goes on (e.g. SIGQUIT).

    Args:
        outcomes: The ranks, with ``live_stack`` just taken (``Supervisor.dump_stacks``);
            only the running ones are shown.
        reason: Why, shown in the header: ``SIGQUIT; nothing stopped``.
        launcher: The name the header starts with.
    """
    stacks = {o.rank: o.live_stack for o in outcomes if o.status == "running" and o.live_stack}
    if not stacks:
        return f"{launcher}: no running rank to show the stack of ({reason})"
    count = f"{len(stacks)} rank" + ("s" if len(stacks) > 1 else "")
    return f"{launcher}: stacks of {count} ({reason}):\n" + textwrap.indent(
        format_stacks(stacks), "  "
    )


_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>.+?)\s*$')
_THREAD_START = re.compile(r"^(?:Current thread|Thread)\b")
# Library code: what the interpreter and installed packages are; the rest is the user's.
_LIBRARY_DIRS = tuple(
    {
        str(path)
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (path := sysconfig.get_paths().get(key))
    }
)


@dataclass(frozen=True)
class Frame:
    """One line of a faulthandler dump."""

    file: str
    line: int
    function: str

    @property
    def is_library(self) -> bool:
        """True for the standard library, installed packages and frozen modules."""
        return self.file.startswith("<") or self.file.startswith(_LIBRARY_DIRS)

    def where(self) -> str:
        """``train.py:12``: the file's name and the line."""
        return f"{PurePath(self.file).name}:{self.line}"


def main_thread_frames(stack: str) -> list[Frame]:
    """The frames of the main thread in a dump, innermost first.

    faulthandler lists the newest thread first, so the main thread (the oldest) is the
    last block.
    """
    blocks: list[list[Frame]] = []
    for line in stack.splitlines():
        if _THREAD_START.match(line) or not blocks:
            blocks.append([])
        match = _FRAME.match(line)
        if match is not None:
            blocks[-1].append(Frame(match["file"], int(match["line"]), match["function"]))
    return next((frames for frames in reversed(blocks) if frames), [])
