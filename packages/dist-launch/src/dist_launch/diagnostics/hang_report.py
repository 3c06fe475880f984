"""The report of a hung group: where the ranks wait, and which ranks are elsewhere.

The report starts with the verdict of the ranks' flight records, when there is one
(:mod:`dist_launch.diagnostics.verdict`): the collective the ranks wait in and the
ranks that never entered it. Then the stacks: every rank's faulthandler dump (the
SIGQUIT machinery), grouped by place in the code
(:func:`dist_launch.diagnostics.stacks.group_stacks`). The largest group is what most
ranks do, usually wait in a collective; the ranks outside it are named as the odd ones,
since the odd rank out is usually the cause::

    dist-launch: hang: rank 3 never entered all_reduce #6 on the default group; ...
    dist-launch: hang on node n1 (node 0): no rank on this node made progress for 3 s ...
      ranks 0-2 wait in all_reduce at train.py:12; rank 3 is elsewhere: train.py:9 in <module>

Pure: a test passes stacks as text.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dist_launch.diagnostics.stacks import (
    format_rank_ranges,
    format_stacks,
    group_stacks,
    main_thread_frames,
)

if TYPE_CHECKING:
    from dist_launch.diagnostics.verdict import HangVerdict


def describe_place(stack: str) -> str:
    """``in all_reduce at train.py:12`` (waiting in a library) or ``train.py:9 in f``."""
    frames = main_thread_frames(stack)
    if not frames:
        return "(no Python stack)"
    innermost = frames[0]
    user = next((frame for frame in frames if not frame.is_library), None)
    if user is None:
        return f"in {innermost.function} at {innermost.where()}"
    if user is innermost:
        return f"{user.where()} in {user.function}"
    return f"in {innermost.function} at {user.where()}"


def _waits_in_a_library(stack: str) -> bool:
    frames = main_thread_frames(stack)
    return bool(frames) and frames[0].is_library


def _main_group(groups: Sequence[tuple[list[int], str]]) -> tuple[list[int], str]:
    """The group most ranks share (ties: the one waiting in library code, the lowest rank)."""

    def weight(group: tuple[list[int], str]) -> tuple[int, bool, int]:
        ranks, stack = group
        return (len(ranks), _waits_in_a_library(stack), -ranks[0])

    return max(groups, key=weight)


def summarize_stacks(stacks: Mapping[int, str]) -> str:
    """One line: where most ranks are, then each other place with its ranks.

    The largest group of identical stacks is the one most ranks share; between groups
    of one size, one waiting in library code (a collective) is preferred, then the one
    with the lowest rank.
    """
    groups = group_stacks(stacks)
    if not groups:
        return "no rank's stack could be read"
    main = _main_group(groups)
    parts = [f"{_ranks(main[0])} {_verb(main[0], main[1])}"]
    if len(groups) == 1:
        return parts[0]
    for ranks, stack in groups:
        if ranks is main[0]:
            continue
        parts.append(
            f"{_ranks(ranks)} {'is' if len(ranks) == 1 else 'are'} elsewhere: "
            f"{describe_place(stack).removeprefix('in ')}"
        )
    return "; ".join(parts)


def _ranks(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + format_rank_ranges(ranks)


def _verb(ranks: Sequence[int], stack: str) -> str:
    place = describe_place(stack)
    if place.startswith("in "):
        return ("waits " if len(ranks) == 1 else "wait ") + place
    return ("is at " if len(ranks) == 1 else "are at ") + place


@dataclass(frozen=True)
class HangReport:
    """A hang found on this node.

    Attributes:
        reason: Why the group counts as hung (``no rank on node n1 made progress for
            3 s (--hang-timeout 3)``, or an expired torch elastic timer).
        node: This node's host name and node rank, as the report names it.
        stacks: Each running rank's stack on this node when the hang was found.
        verdict: What the ranks' flight records say (every node's ranks, with c10d);
            None when none were collected.
        unreachable: One line per node this node could not reach
            (``node2 (10.0.0.2) unreachable from node1 since 12:00:03; ranks 2-3``).
    """

    reason: str
    node: str
    stacks: Mapping[int, str] = field(default_factory=dict)
    verdict: HangVerdict | None = None
    unreachable: tuple[str, ...] = ()

    @property
    def summary(self) -> str:
        """:func:`summarize_stacks` of the stacks."""
        return summarize_stacks(self.stacks)

    @property
    def odd_rank(self) -> int | None:
        """The lowest rank outside the group most ranks share, if any."""
        groups = group_stacks(self.stacks)
        if len(groups) < 2:
            return None
        main = _main_group(groups)
        return min(ranks[0] for ranks, _ in groups if ranks is not main[0])

    def format(self, launcher: str = "dist-launch") -> str:
        """The report: the verdict, the reason, the one-line summary, the grouped stacks."""
        lines = (
            []
            if self.verdict is None
            else [f"{launcher}: hang: {line}" for line in self.verdict.lines()]
        )
        lines += [f"{launcher}: {line}" for line in self.unreachable]
        lines += [f"{launcher}: hang on node {self.node}: {self.reason}", f"  {self.summary}"]
        if self.stacks:
            lines.append("stacks:")
            lines.append(textwrap.indent(format_stacks(self.stacks), "  "))
        return "\n".join(lines)
