"""dist-core: the distributed environment, ranks, backend and process-group init.

The foundation of the dist-* packages: it depends on torch alone.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dist_core.backend import (
        BackendChoice,
        choose_backend,
        default_backend,
        destroy_dist,
        get_distributed_backend,
        get_init_method,
        init_dist,
        init_process_group_from_backend,
        set_dist,
        set_distributed_backend,
    )
    from dist_core.config import MISSING, MultiprocessConfig, is_missing
    from dist_core.devices import accelerator_type, cuda_device_count, device_count
    from dist_core.env import DistEnv
    from dist_core.errors import DistEnvError
    from dist_core.log import INFOALL, configure_logging
    from dist_core.ports import get_unused_port, port_is_free, release_port
    from dist_core.ranks import (
        get_global_rank,
        get_local_rank,
        get_local_world_size,
        get_node_rank,
        get_rank,
        get_world_size,
        is_available,
        is_initialized,
        is_rank_zero,
    )
    from dist_core.slurm import slurm_master_port

# Names are imported on first use so that `import dist_core` (and the port and
# environment helpers a launcher needs) does not pay for importing torch.
_LAZY: dict[str, str] = {
    **dict.fromkeys(
        [
            "default_backend",
            "destroy_dist",
            "get_distributed_backend",
            "get_init_method",
            "init_dist",
            "init_process_group_from_backend",
            "set_dist",
            "set_distributed_backend",
        ],
        "dist_core.backend",
    ),
    **dict.fromkeys(["MISSING", "MultiprocessConfig", "is_missing"], "dist_core.config"),
    **dict.fromkeys(["BackendChoice", "choose_backend"], "dist_core.backend"),
    **dict.fromkeys(["accelerator_type", "cuda_device_count", "device_count"], "dist_core.devices"),
    "DistEnv": "dist_core.env",
    "DistEnvError": "dist_core.errors",
    **dict.fromkeys(["INFOALL", "configure_logging"], "dist_core.log"),
    **dict.fromkeys(["get_unused_port", "port_is_free", "release_port"], "dist_core.ports"),
    "slurm_master_port": "dist_core.slurm",
    **dict.fromkeys(
        [
            "get_global_rank",
            "get_local_rank",
            "get_local_world_size",
            "get_node_rank",
            "get_rank",
            "get_world_size",
            "is_available",
            "is_initialized",
            "is_rank_zero",
        ],
        "dist_core.ranks",
    ),
}


def _version() -> str:
    # importlib.metadata costs tens of milliseconds: only a caller who asks pays it.
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version("dist-core")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value = _version()
        globals()[name] = value
        return value
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dist_core' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY, "__version__"})


__all__ = [
    "INFOALL",
    "MISSING",
    "BackendChoice",
    "DistEnv",
    "DistEnvError",
    "MultiprocessConfig",
    "__version__",
    "accelerator_type",
    "choose_backend",
    "configure_logging",
    "cuda_device_count",
    "default_backend",
    "destroy_dist",
    "device_count",
    "get_distributed_backend",
    "get_global_rank",
    "get_init_method",
    "get_local_rank",
    "get_local_world_size",
    "get_node_rank",
    "get_rank",
    "get_unused_port",
    "get_world_size",
    "init_dist",
    "init_process_group_from_backend",
    "is_available",
    "is_initialized",
    "is_missing",
    "is_rank_zero",
    "port_is_free",
    "release_port",
    "set_dist",
    "set_distributed_backend",
    "slurm_master_port",
]
