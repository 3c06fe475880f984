"""What the test scripts print or write, parsed; the batch script that runs two steps at once."""

from __future__ import annotations

import json
import re
from pathlib import Path

# Unanchored: Open MPI forwards each rank's output through a pty of its own and may
# interleave two ranks' lines ("... sum 1rank 1/2 ... sum 1\n\n").
_GROUP_LINE = re.compile(r"rank (\d+)/(\d+) port (\d+) sum (\d+)")
_ENV_LINE = re.compile(r"\{[^{}\n]*\}")  # show_env.py's flat JSON object


def groups_formed(out: str) -> list[tuple[int, int, int, int]]:
    """Each ``rank r/w port p sum s`` line of init_group.py (rank prefix or not), sorted."""
    return sorted(tuple(int(v) for v in m) for m in _GROUP_LINE.findall(out))  # type: ignore[misc]


def ranks_of(out: str) -> list[tuple[int, int]]:
    """(rank, world size) of each group line."""
    return [(rank, world) for rank, world, _, _ in groups_formed(out)]


def envs(out: str) -> list[dict[str, object]]:
    """Each show_env.py line, sorted by rank."""
    found = [json.loads(text) for text in _ENV_LINE.findall(out)]
    return sorted(found, key=lambda env: int(env["rank"]))  # type: ignore[call-overload]


def two_steps_at_once(step: str, directory: Path) -> str:
    """A batch script body running ``step`` twice at once, into ``a.txt`` and ``b.txt``.

    It exits non-zero when either step did.
    """
    return (
        f"{step} > {directory}/a.txt &\na=$!\n{step} > {directory}/b.txt &\nb=$!\n"
        "wait $a; ra=$?; wait $b; exit $((ra | $?))\n"
    )


def checkpoints(directory: Path) -> dict[int, dict[str, int]]:
    """checkpoint_on_sigterm.py's complete checkpoints in ``directory``: each one's
    signal counts, by rank."""
    done = {}
    for path in directory.glob("ckpt-*.done"):
        rank = int(path.name.split("-")[1].split(".")[0])
        assert path.stat().st_size == 16 << 16, f"{path.name} is incomplete"
        done[rank] = json.loads((directory / f"ckpt-{rank}.json").read_text())
    return done
