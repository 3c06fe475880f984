"""The launcher's report of a failed, timed-out or interrupted group, and its exit status."""

from __future__ import annotations

import re
import signal
import textwrap
from collections.abc import Mapping, Sequence

from dist_core.supervisor import GroupOutcome, RankOutcome

# Exit status of a group stopped by --timeout, as coreutils' timeout(1) uses.
TIMEOUT_EXIT_STATUS = 124


def describe_returncode(returncode: int | None) -> str:
    """``exit code 3`` or ``signal SIGKILL`` (``-N`` means killed by signal N)."""
    if returncode is None:
        return "no exit status (still running)"
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def exit_status(returncode: int) -> int:
    """The shell's convention: the code itself, or 128 + N for signal N."""
    return 128 - returncode if returncode < 0 else returncode


def group_exit_status(outcome: GroupOutcome) -> int:
    """0 on success; the root cause's status; 128 + N after signal N; 124 on timeout."""
    if outcome.status == "succeeded":
        return 0
    if outcome.status == "interrupted" and outcome.signum is not None:
        return 128 + outcome.signum
    if outcome.status == "timed_out":
        return TIMEOUT_EXIT_STATUS
    root = outcome.root_cause
    if root is None or root.returncode is None or root.returncode == 0:
        return 1
    return exit_status(root.returncode)


def one_line_cause(outcome: GroupOutcome) -> str:
    """``rank 3 failed with exit code 1 (ValueError: ...)``, or the group's status."""
    root = outcome.root_cause
    if root is None:
        return outcome.status
    what = f"rank {root.rank} failed with {describe_returncode(root.returncode)}"
    if root.record is not None:
        what += f" ({root.record.summary})"
    return what


def _who(rank: RankOutcome) -> str:
    return f"rank {rank.rank} (local rank {rank.local_rank}, node {rank.node_rank})"


# Frames of the launcher's own machinery in faulthandler dumps: noise to the reader.
_LAUNCHER_FRAMES = re.compile(r'File "(<frozen runpy>|[^"]*/dist_launch/_(bootstrap|zygote)\.py)"')
SUMMARY_CHARS = 240


def _indent(text: str) -> str:
    return textwrap.indent(text.rstrip(), "    ")


# The thread of a worker's progress beacon (dist_launch.progress): the launcher's, not
# the script's.
_BEACON_FRAME = re.compile(r'File "[^"]*/dist_launch/progress\.py"')
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


def _short(text: str) -> str:
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 3] + "..."


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


def _stacks_of(ranks: Sequence[RankOutcome]) -> dict[int, str]:
    """The live stacks of the ranks that were still running when they were taken."""
    return {
        rank.rank: rank.live_stack
        for rank in ranks
        if rank.live_stack and rank.status in ("stopped", "running")
    }


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


def _other_rank_line(rank: RankOutcome, root: RankOutcome | None) -> str:
    if rank.status == "succeeded":
        what = "finished (exit code 0)"
    elif rank.status == "failed":
        if rank.record is not None:
            what = f"failed too: {_short(rank.record.summary)}"
        else:
            what = f"failed too with {describe_returncode(rank.returncode)}"
        if rank.is_peer_failure:
            what += " (a consequence: a peer vanished)"
    elif rank.status == "stopped":
        sent = signal.Signals(rank.stop_signal).name if rank.stop_signal else "a signal"
        after = f" after rank {root.rank} failed" if root is not None else ""
        what = f"stopped by the launcher ({sent}{after}), ended with " + describe_returncode(
            rank.returncode
        )
    else:
        what = "still running: it could not be killed"
    return f"  {_who(rank)}: {what}"


def _where_they_were(ranks: Sequence[RankOutcome]) -> list[str]:
    stacks = _stacks_of(ranks)
    if not stacks:
        return []
    return ["where they were:", textwrap.indent(format_stacks(stacks), "  ")]


def format_report(outcome: GroupOutcome, launcher: str = "dist-launch") -> str:
    """The report: the root cause and its traceback first, then one line per other rank.

    Then where the ranks that were still running were, identical stacks once
    (:func:`format_stacks`).
    """
    root = outcome.root_cause
    lines: list[str] = []
    if outcome.status == "interrupted" and outcome.signum is not None:
        name = signal.Signals(outcome.signum).name
        stopped = sum(1 for rank in outcome.ranks if rank.stop_signal is not None)
        lines.append(f"{launcher}: interrupted by {name}; stopped {stopped} rank(s)")
        lines.extend(_where_they_were(outcome.ranks))
        return "\n".join(lines)
    if root is not None:
        lines.append(
            f"{launcher}: {_who(root)} failed first with {describe_returncode(root.returncode)}"
        )
        if root.record is not None:
            lines.append(root.record.traceback.rstrip())
        elif root.crash_stack:
            lines.append("Python stack at the crash (faulthandler):")
            lines.append(without_launcher_frames(root.crash_stack))
        else:
            lines.append(
                "(no Python traceback: the process ended without raising, e.g. os._exit(), "
                "a signal from outside, or the out-of-memory killer)"
            )
    elif outcome.status == "timed_out":
        lines.append(f"{launcher}: timed out after {outcome.timeout:g} s")
    else:
        lines.append(f"{launcher}: the group ended with status {outcome.status}")
    others = [rank for rank in outcome.ranks if rank is not root]
    if others:
        lines.append("other ranks:" if root is not None else "ranks:")
        lines.extend(_other_rank_line(rank, root) for rank in others)
    lines.extend(_where_they_were(others))
    if outcome.unkillable:
        pids = ", ".join(str(rank) for rank in outcome.unkillable)
        lines.append(f"{launcher}: rank(s) {pids} survived SIGKILL (stuck in the kernel?)")
    return "\n".join(lines)
