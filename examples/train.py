"""A mixture-of-experts trainer on synthetic data that uses all four dist-* packages.

Run it on 4 ranks (CPU and gloo by default; CUDA and NCCL when present)::

    dist-launch -n 4 examples/train.py --steps 60 --export-dir /tmp/moe-export
    dist-workspace inspect /tmp/moe-export/workspace

- dist-launch starts one process per rank and reports the failing rank first.
- dist-core reads the environment the launcher set and picks the backend.
- dist-collectives builds the expert-parallel (its "mp") and data-parallel groups
  and routes every token to the rank that owns its expert with ``all_to_all_v``.
- dist-workspace gathers every rank's shard to rank 0, which exports one
  ``model.safetensors`` and its ``config.json``.

The experts are split over the expert-parallel group (``--expert-parallel`` ranks); the
data-parallel replicas of each expert average their gradients over the dp group; the
gate is replicated everywhere and averaged over the world.

The fault-tolerant path: ``python examples/train.py --fault-tolerant --kill-rank 3``
starts 4 replicas itself, SIGKILLs replica 3 in the middle of a step, and the three
survivors finish with bit-identical weights (``examples/train_ft.py`` does the work).
Run it directly, not under dist-launch, which stops every rank when one dies.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from moe import ExpertParallelMoE, MoEConfig, batch, digest, teacher

import dist_collectives
import dist_core
from dist_workspace import NFSWorkspace
from dist_workspace.merge import merge_workspace

logger = logging.getLogger("moe-demo")


def _average_gradients(model: ExpertParallelMoE, world_size: int, dp_group: object) -> None:
    """Averages gradients: the gate over the world, each expert over its dp replicas.

    Every parameter takes part on every rank, with a zero gradient where it got none
    (an expert that received no tokens this step): a rank that skipped a collective
    would leave its peers waiting in it.
    """
    groups = [(model.gate.parameters(), None), (model.experts.parameters(), dp_group)]
    for parameters, group in groups:
        for parameter in parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist_collectives.all_reduce(parameter.grad, "SUM", group=group)  # type: ignore[arg-type]
            parameter.grad /= world_size


def export(
    model: ExpertParallelMoE, config: MoEConfig, export_dir: Path, rank: int, dp_rank: int
) -> None:
    """Gathers every rank's shard to rank 0 through the workspace; rank 0 writes the model.

    Every tensor is written by exactly one rank: the replicated gate by rank 0, each
    expert by its data-parallel replica 0. Rank 0 then streams the shards into one
    ``model.safetensors`` (``dist_workspace.merge``) and writes ``config.json``.
    """
    workspace_dir = export_dir / "workspace"
    workspace = NFSWorkspace(str(workspace_dir))
    shards = model.named_shards() if dp_rank == 0 else {}
    if rank != 0:
        shards = {name: value for name, value in shards.items() if not name.startswith("gate.")}
    workspace.write_configs_and_weights({"model": asdict(config), "rank": rank}, shards)
    dist_collectives.barrier()
    if rank == 0:
        merge_workspace(workspace_dir, export_dir / "model.safetensors", mode=0o644)
        (export_dir / "config.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
    dist_collectives.barrier()  # nobody exits (and cleans up) before the export exists


def _fault_tolerant(options: argparse.Namespace) -> int:
    """Hands over to train_ft.py's coordinator, which starts the replicas itself."""
    if dist_core.DistEnv.from_environ().world_size > 1:
        raise SystemExit(
            "--fault-tolerant starts its own replicas: run `python examples/train.py "
            "--fault-tolerant ...` directly, not under dist-launch (which stops every rank "
            "when one dies)"
        )
    import train_ft

    return train_ft.main(
        [
            f"--replicas={options.replicas}",
            f"--steps={options.steps}",
            f"--lr={options.lr}",
            f"--kill-replica={options.kill_rank}",
            f"--kill-at-step={options.kill_at_step}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Trains, prints progress on rank 0, exports at the end."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--expert-parallel", type=int, default=0, help="0: min(world, 2)")
    parser.add_argument("--export-dir", type=Path, default=Path("moe-export"))
    parser.add_argument(
        "--report-dir",
        type=Path,
        help="each rank writes rank{r}.json: its losses and the SHA-256 of its live weights",
    )
    parser.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="run the fault-tolerant replica path of train_ft.py instead (not under dist-launch)",
    )
    parser.add_argument("--kill-rank", type=int, default=-1, help="with --fault-tolerant")
    parser.add_argument("--kill-at-step", type=int, default=15, help="with --fault-tolerant")
    parser.add_argument("--replicas", type=int, default=4, help="with --fault-tolerant")
    options = parser.parse_args(argv)
    if options.fault_tolerant:
        return _fault_tolerant(options)

    dist_core.configure_logging()
    dist_core.init_process_group_from_backend()
    world_size, rank = dist_core.get_world_size(), dist_core.get_rank()
    ep = options.expert_parallel or min(world_size, 2)
    state = dist_collectives.init_parallelism(model_parallelism=ep)
    device = torch.device(
        f"cuda:{dist_core.get_local_rank() % torch.cuda.device_count()}"
        if torch.cuda.is_available()
        else "cpu"
    )
    config = MoEConfig()
    model = ExpertParallelMoE(config, state.mp_rank, state.mp_size, state.mp_group).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=options.lr)
    logger.info(
        "training on %d ranks: expert parallel %d x data parallel %d, %s backend",
        world_size,
        state.mp_size,
        state.dp_size,
        dist.get_backend(),
    )
    losses: list[float] = []
    started = time.perf_counter()
    for step in range(1, options.steps + 1):
        tokens = batch(config, rank, step, device)
        loss = torch.nn.functional.mse_loss(model(tokens), teacher(tokens, config))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        _average_gradients(model, world_size, state.dp_group)
        optimizer.step()
        mean_loss = dist_collectives.all_reduce(loss.detach().clone(), "SUM").item() / world_size
        losses.append(mean_loss)
        if step == 1 or step % 10 == 0 or step == options.steps:
            elapsed = time.perf_counter() - started
            tokens_per_second = step * config.tokens_per_rank * world_size / elapsed
            logger.info(
                "step %d/%d loss %.5f tokens/s %.0f",
                step,
                options.steps,
                mean_loss,
                tokens_per_second,
            )
    if options.report_dir is not None:
        # Digests of the live parameters, taken before the export touches them, so a
        # test can check the exported file against what was really trained.
        live = {name: digest(value) for name, value in model.named_shards().items()}
        writes_shard = state.dp_rank == 0
        options.report_dir.mkdir(parents=True, exist_ok=True)
        (options.report_dir / f"rank{rank}.json").write_text(
            json.dumps({"losses": losses, "digests": live, "writes_shard": writes_shard})
        )
    export(model, config, options.export_dir, rank, state.dp_rank)
    if rank == 0:
        logger.info("exported %s", options.export_dir / "model.safetensors")
    dist_collectives.destroy_parallelism()
    dist_core.destroy_dist()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
