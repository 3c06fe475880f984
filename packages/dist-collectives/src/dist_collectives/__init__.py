"""dist-collectives: autograd all_to_all, collective helpers and parallel groups.

- :mod:`dist_collectives.all_to_all`: :func:`all_to_all` and :func:`all_to_all_v`,
  differentiable exchanges along dim 0.
- :mod:`dist_collectives.collectives`, :mod:`dist_collectives.sampler` and
  :mod:`dist_collectives.node_local`: Composer-style helpers that also work in a
  single process (node-local ones: local rank 0 first, file waits, signal files).
- :mod:`dist_collectives.parallel`: :func:`init_parallelism` and the model, pipeline
  and data parallel groups (layout in :mod:`dist_collectives.layout`).

Fault-tolerant process groups live in :mod:`dist_collectives.ft`, imported explicitly
(``import dist_collectives.ft``); this module does not import it.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from dist_collectives.all_to_all import all_to_all, all_to_all_v
from dist_collectives.collectives import (
    ReduceOpName,
    all_gather,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object_list,
)
from dist_collectives.errors import CollectivesError
from dist_collectives.layout import ParallelLayout
from dist_collectives.node_local import (
    get_node_signal_file_name,
    local_rank_zero_download_and_wait,
    run_local_rank_zero_first,
    write_signal_file,
)
from dist_collectives.parallel import (
    ParallelState,
    destroy_parallelism,
    get_dp_group,
    get_dp_rank,
    get_dp_ranks,
    get_dp_size,
    get_mp_group,
    get_mp_rank,
    get_mp_ranks,
    get_mp_size,
    get_parallel_state,
    get_pp_group,
    get_pp_rank,
    get_pp_ranks,
    get_pp_size,
    init_parallelism,
    is_parallelism_initialized,
)
from dist_collectives.sampler import get_sampler

try:
    __version__ = version("dist-collectives")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "CollectivesError",
    # all_to_all
    "all_to_all",
    "all_to_all_v",
    # Composer-style helpers
    "ReduceOpName",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "get_sampler",
    "get_node_signal_file_name",
    "local_rank_zero_download_and_wait",
    "run_local_rank_zero_first",
    "write_signal_file",
    # parallel groups
    "ParallelLayout",
    "ParallelState",
    "destroy_parallelism",
    "get_dp_group",
    "get_dp_rank",
    "get_dp_ranks",
    "get_dp_size",
    "get_mp_group",
    "get_mp_rank",
    "get_mp_ranks",
    "get_mp_size",
    "get_parallel_state",
    "get_pp_group",
    "get_pp_rank",
    "get_pp_ranks",
    "get_pp_size",
    "init_parallelism",
    "is_parallelism_initialized",
]
