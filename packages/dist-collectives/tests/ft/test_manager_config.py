"""A Manager's settings: checked once, the store found from the arguments or the environment."""

from __future__ import annotations

from typing import Any

import pytest

from dist_collectives.ft import ManagerConfigError
from dist_collectives.ft.manager_config import ManagerConfig, resolve_store


def _config(**overrides: Any) -> ManagerConfig:
    arguments: dict[str, Any] = {
        "replica_id": None,
        "store_addr": None,
        "store_port": None,
        "environ": {"MASTER_ADDR": "host", "MASTER_PORT": "29500"},
        "min_replica_size": 1,
        "group_rank": 0,
        "group_world_size": 1,
    }
    return ManagerConfig.from_arguments(**{**arguments, **overrides})


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


def test_a_replica_without_a_name_gets_a_fresh_one() -> None:
    first, second = _config(), _config()
    assert first.replica_id != second.replica_id
    assert (first.host, first.port) == ("host", 29500)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"min_replica_size": 0}, "min_replica_size=0"),
        ({"group_rank": 2, "group_world_size": 2, "replica_id": "g"}, "group_rank=2"),
        ({"group_world_size": 2}, "needs a replica_id"),
    ],
)
def test_bad_sizes_and_ranks_are_refused_with_their_values(
    overrides: dict[str, Any], match: str
) -> None:
    with pytest.raises(ManagerConfigError, match=match):
        _config(**overrides)


def test_sizes_are_checked_before_the_store_is_looked_for() -> None:
    with pytest.raises(ManagerConfigError, match="min_replica_size"):
        _config(min_replica_size=0, environ={})


def test_the_log_names_a_grouped_rank_with_its_group_rank() -> None:
    assert _config(replica_id="r").label == "r"
    assert _config(replica_id="g", group_rank=1, group_world_size=2).label == "g rank 1"
