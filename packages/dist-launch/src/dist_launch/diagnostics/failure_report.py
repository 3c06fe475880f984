"""The launcher's report of a failed, timed-out or interrupted group, and its exit status."""

from __future__ import annotations

import signal
import textwrap
from collections.abc import Sequence

from dist_core.supervisor import GroupOutcome, RankOutcome
from dist_launch.diagnostics.stacks import format_stacks, without_launcher_frames
from dist_launch.exit_codes import ExitCode


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
        return ExitCode.TIMEOUT
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


SUMMARY_CHARS = 240


def _short(text: str) -> str:
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 3] + "..."


def _stacks_of(ranks: Sequence[RankOutcome]) -> dict[int, str]:
    """The live stacks of the ranks that were still running when they were taken."""
    return {
        rank.rank: rank.live_stack
        for rank in ranks
        if rank.live_stack and rank.status in ("stopped", "running")
    }


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
