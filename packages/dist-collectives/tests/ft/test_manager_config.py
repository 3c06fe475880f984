"""A Manager's settings: checked once, the store found from the arguments or the environment."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from dist_collectives.ft import ManagerConfigError
from dist_collectives.ft.manager_config import (
    ManagerConfig,
    check_arguments,
    default_replica_id,
    resolve_store,
)

CONFIG = ManagerConfig(
    replica_id="r",
    host="host",
    port=29500,
    min_replica_size=1,
    timeout=timedelta(seconds=60),
    heartbeat_interval=timedelta(milliseconds=100),
    heartbeat_timeout=timedelta(seconds=2),
    join_timeout=timedelta(seconds=10),
    first_quorum_window=timedelta(seconds=2),
    namespace="ns",
    group_rank=0,
    group_world_size=1,
    init_sync=True,
)


def test_the_arguments_name_the_store_before_the_environment() -> None:
    env = {"MASTER_ADDR": "env-host", "MASTER_PORT": "1"}
    assert resolve_store("arg-host", 2, env) == ("arg-host", 2)
    assert resolve_store(None, None, env) == ("env-host", 1)


def test_no_store_anywhere_says_what_it_found() -> None:
    with pytest.raises(ManagerConfigError, match="MASTER_ADDR=None, MASTER_PORT=None"):
        resolve_store(None, None, {})


def test_a_port_that_is_not_an_integer_is_named() -> None:
    with pytest.raises(ManagerConfigError, match="MASTER_PORT='x'"):
        resolve_store(None, None, {"MASTER_ADDR": "h", "MASTER_PORT": "x"})


def test_replicas_without_a_name_get_different_ones() -> None:
    assert default_replica_id() != default_replica_id()


@pytest.mark.parametrize(
    ("min_replica_size", "group_rank", "group_world_size", "replica_id", "match"),
    [
        (0, 0, 1, None, "min_replica_size=0"),
        (1, 2, 2, "g", "group_rank=2 with group_world_size=2"),
        (1, 0, 0, "g", "group_world_size=0"),
        (1, 0, 2, None, "needs a replica_id"),
    ],
)
def test_bad_sizes_ranks_and_names_are_refused_with_their_values(
    min_replica_size: int,
    group_rank: int,
    group_world_size: int,
    replica_id: str | None,
    match: str,
) -> None:
    with pytest.raises(ManagerConfigError, match=match):
        check_arguments(min_replica_size, group_rank, group_world_size, replica_id)


def test_good_arguments_pass() -> None:
    check_arguments(2, 1, 2, "g")


def test_a_config_cannot_be_built_with_a_rank_outside_its_group() -> None:
    with pytest.raises(ManagerConfigError, match="group_rank=3"):
        dataclasses.replace(CONFIG, group_rank=3, group_world_size=2)


def test_the_log_names_a_grouped_rank_with_its_group_rank() -> None:
    assert CONFIG.label == "r" and not CONFIG.grouped
    grouped = dataclasses.replace(CONFIG, group_rank=1, group_world_size=2)
    assert grouped.label == "r rank 1" and grouped.grouped


@pytest.mark.parametrize(
    ("interval_ms", "timeout_s", "beat_ms"),
    [(100, 2, 500), (100, 0.2, 100), (1000, 2, 1000), (100, 60, 15000)],
)
def test_a_rank_beats_four_times_per_heartbeat_timeout_and_never_between_ticks(
    interval_ms: int, timeout_s: float, beat_ms: int
) -> None:
    config = dataclasses.replace(
        CONFIG,
        heartbeat_interval=timedelta(milliseconds=interval_ms),
        heartbeat_timeout=timedelta(seconds=timeout_s),
    )
    assert config.beat_interval == timedelta(milliseconds=beat_ms)


def test_the_watcher_beats_four_times_per_heartbeat_timeout_and_looks_every_second_tick() -> None:
    from dist_collectives.ft.replica.manager_watcher import WatchSchedule

    schedule = WatchSchedule.of(CONFIG)  # a 100 ms tick, a 2 s heartbeat timeout
    assert schedule == WatchSchedule(beat_ticks=5, registry_ticks=10, look_ticks=2)
    assert [schedule.duties(tick).beat for tick in range(1, 11)].count(True) == 2
    slow = dataclasses.replace(CONFIG, heartbeat_timeout=timedelta(milliseconds=200))
    assert WatchSchedule.of(slow).beat_ticks == 1  # never less than once a tick
