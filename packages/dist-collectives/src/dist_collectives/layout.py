"""The parallel layout: where each (dp, pp, mp) coordinate sits among global ranks.

One formula places every rank, with model-parallel ranks adjacent (as Megatron's
tensor parallel, so that the chattiest groups share a node) and data parallel
outermost::

    rank = (dp_rank * pp_size + pp_rank) * mp_size + mp_rank

Everything else (coordinates of a rank, the ranks of each group) is derived from it.
This module is pure arithmetic: no process group is touched, so the layout can be
tested and printed anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ParallelLayout"]


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the three parallel dimensions of a job; ``dp_size`` is derived."""

    world_size: int
    mp_size: int
    pp_size: int

    def __post_init__(self) -> None:
        for name, value in (
            ("world_size", self.world_size),
            ("model_parallelism", self.mp_size),
            ("pipeline_parallelism", self.pp_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.world_size % (self.mp_size * self.pp_size) != 0:
            raise ValueError(
                f"world_size={self.world_size} is not divisible by model_parallelism="
                f"{self.mp_size} * pipeline_parallelism={self.pp_size} "
                f"(= {self.mp_size * self.pp_size}); choose sizes whose product divides "
                "the number of ranks"
            )

    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas: ``world_size // (mp_size * pp_size)``."""
        return self.world_size // (self.mp_size * self.pp_size)

    def rank_of(self, dp_rank: int, pp_rank: int, mp_rank: int) -> int:
        """The global rank at coordinates ``(dp_rank, pp_rank, mp_rank)``."""
        for name, value, size in (
            ("dp_rank", dp_rank, self.dp_size),
            ("pp_rank", pp_rank, self.pp_size),
            ("mp_rank", mp_rank, self.mp_size),
        ):
            if not 0 <= value < size:
                raise ValueError(f"{name}={value} is outside 0..{size - 1}")
        return (dp_rank * self.pp_size + pp_rank) * self.mp_size + mp_rank

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(dp_rank, pp_rank, mp_rank)`` of a global rank; inverse of :meth:`rank_of`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} is outside 0..{self.world_size - 1}")
        mp_rank = rank % self.mp_size
        pp_rank = (rank // self.mp_size) % self.pp_size
        dp_rank = rank // (self.mp_size * self.pp_size)
        return dp_rank, pp_rank, mp_rank

    def mp_groups(self) -> list[list[int]]:
        """Every model-parallel group, ordered by (dp, pp); ranks in mp order."""
        return [
            [self.rank_of(dp, pp, mp) for mp in range(self.mp_size)]
            for dp in range(self.dp_size)
            for pp in range(self.pp_size)
        ]

    def pp_groups(self) -> list[list[int]]:
        """Every pipeline-parallel group, ordered by (dp, mp); ranks in pp order."""
        return [
            [self.rank_of(dp, pp, mp) for pp in range(self.pp_size)]
            for dp in range(self.dp_size)
            for mp in range(self.mp_size)
        ]

    def dp_groups(self) -> list[list[int]]:
        """Every data-parallel group, ordered by (pp, mp); ranks in dp order."""
        return [
            [self.rank_of(dp, pp, mp) for dp in range(self.dp_size)]
            for pp in range(self.pp_size)
            for mp in range(self.mp_size)
        ]

    def describe(self) -> str:
        """A table of every rank's coordinates, for logs and error messages."""
        lines = [
            f"world_size={self.world_size} = dp {self.dp_size} x pp {self.pp_size} x "
            f"mp {self.mp_size}; rank = (dp_rank * {self.pp_size} + pp_rank) * "
            f"{self.mp_size} + mp_rank"
        ]
        for rank in range(self.world_size):
            dp, pp, mp = self.coordinates(rank)
            lines.append(f"  rank {rank}: dp {dp}, pp {pp}, mp {mp}")
        return "\n".join(lines)
