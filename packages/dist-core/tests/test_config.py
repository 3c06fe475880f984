"""MultiprocessConfig: the seed's fields, MISSING, resolve()."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

import dist_core
from dist_core import MISSING, MultiprocessConfig, is_missing
from dist_core.ports import release_port

SEED_FIELDS = {
    "rank",
    "local_rank",
    "world_size",
    "local_world_size",
    "master_addr",
    "master_port",
    "init_method",
    "model_parallelism",
    "pipeline_parallelism",
    "backend",
    "model_parallel_backend",
    "pipeline_parallel_backend",
    "data_parallel_backend",
    "launch_method",
}


def test_has_every_seed_field_with_seed_defaults() -> None:
    cfg = MultiprocessConfig()
    assert {field.name for field in dataclasses.fields(cfg)} == SEED_FIELDS
    assert (cfg.rank, cfg.local_rank, cfg.launch_method) == (-1, -1, "forkserver")
    assert (cfg.init_method, cfg.master_addr) == ("env://", "127.0.0.1")
    assert is_missing(cfg, "world_size") and is_missing(cfg, "master_port")
    assert not is_missing(cfg, "backend")


def test_resolve_fills_missing_fields_in_place() -> None:
    cfg = MultiprocessConfig()
    assert MultiprocessConfig.resolve(cfg) is None
    assert cfg.world_size == dist_core.device_count()  # 1 on CPU, the GPU count on CUDA
    assert cfg.local_world_size == cfg.world_size
    assert isinstance(cfg.master_port, int) and 0 < cfg.master_port < 65536
    release_port(cfg.master_port)


def test_resolve_keeps_given_fields() -> None:
    cfg = MultiprocessConfig(world_size=4, master_port=1234)
    MultiprocessConfig.resolve(cfg)
    assert (cfg.world_size, cfg.master_port) == (4, 1234)
    cfg = MultiprocessConfig(world_size=4, local_world_size=4)
    MultiprocessConfig.resolve(cfg)
    assert cfg.local_world_size == 4
    release_port(cfg.master_port)


def test_missing_survives_pickling() -> None:
    cfg = pickle.loads(pickle.dumps(MultiprocessConfig()))
    assert cfg.world_size is MISSING
    assert repr(MISSING) == "MISSING"


def test_resolve_puts_every_rank_on_this_node_unless_told_otherwise() -> None:
    # world_size=4 without local_world_size once started 1 rank that waited 30 min for
    # 3 others "on other nodes", whatever the device count.
    cfg = MultiprocessConfig(world_size=4, master_port=1234)
    MultiprocessConfig.resolve(cfg)
    assert cfg.local_world_size == 4
    cfg = MultiprocessConfig(world_size=4, local_world_size=2, master_port=1234)
    MultiprocessConfig.resolve(cfg)
    assert cfg.local_world_size == 2


def test_resolve_refuses_more_local_ranks_than_the_job_has() -> None:
    cfg = MultiprocessConfig(world_size=2, local_world_size=4, master_port=1234)
    with pytest.raises(ValueError, match=r"local_world_size=4\) is larger than world_size=2"):
        MultiprocessConfig.resolve(cfg)


def test_resolved_is_a_filled_copy_and_leaves_the_config_alone() -> None:
    from dist_core.config import MISSING, resolved

    cfg = MultiprocessConfig(world_size=4)
    filled = resolved(cfg)
    assert cfg.local_world_size is MISSING and cfg.master_port is MISSING
    assert (filled.world_size, filled.local_world_size) == (4, 4)
    assert 1 <= filled.master_port <= 65535


def test_a_resolved_config_becomes_a_rank_dist_env() -> None:
    from dist_core import DistEnv
    from dist_core.config import resolved

    cfg = resolved(MultiprocessConfig(world_size=8, local_world_size=4, master_port=29511))
    env = cfg.replace(rank=6, local_rank=2).dist_env()
    assert env == DistEnv(
        rank=6,
        local_rank=2,
        node_rank=1,
        world_size=8,
        local_world_size=4,
        master_addr=cfg.master_addr,
        master_port=29511,
    )
