"""What every worker of a node shares: torch's flight recorder set up for the diagnostics."""

from __future__ import annotations

import pytest

from dist_launch.plan.build import build_plan
from dist_launch.workers.environment import node_environment


def env_of(script: str, flags: dict[str, str], base: dict[str, str]) -> dict[str, str]:
    plan = build_plan({"target": script, "nproc_per_node": "2", **flags}, environ={})
    return node_environment(plan, base)


@pytest.mark.parametrize(
    ("flags", "recorded"),
    [
        ({}, True),  # hang detection (auto) and the slow-rank report are on by default
        ({"hang_timeout": "off"}, True),  # the report still reads the records
        ({"slow_ranks": "off"}, True),  # so does a hang's verdict
        ({"hang_timeout": "off", "slow_ranks": "off"}, False),
    ],
)
def test_the_flight_recorder_is_sized_when_a_diagnostic_reads_it(
    script: str, flags: dict[str, str], recorded: bool
) -> None:
    env = env_of(script, flags, {})
    assert env.get("TORCH_FR_BUFFER_SIZE") == ("2000" if recorded else None)


@pytest.mark.parametrize(
    "base",
    [
        {"TORCH_FR_BUFFER_SIZE": "0"},  # the user turned it off: kept
        {"TORCH_FR_BUFFER_SIZE": "20000"},
        {"TORCH_NCCL_TRACE_BUFFER_SIZE": "500"},  # the older name counts as set
    ],
)
def test_a_users_recorder_size_is_kept(script: str, base: dict[str, str]) -> None:
    env = env_of(script, {}, base)
    for name, value in base.items():
        assert env[name] == value
    if "TORCH_FR_BUFFER_SIZE" not in base:
        assert "TORCH_FR_BUFFER_SIZE" not in env
